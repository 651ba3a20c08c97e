"""``retromae-ds eval --rerank.model CE --rerank.depth K``: a cross-encoder reranks the top K
of a first stage (BM25 or a dense model); the reranked ranking is the top K sorted by our own
``score_pairs`` followed by the first stage's rest, its measures are the reported ones, and a
folder that is not a cross-encoder is refused before anything runs. The candidate-list
options' old spellings (``--rerank``, ``--rerank_negatives``, ``--candidates``) still work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from retromae_ds.base.options import build_config
from retromae_ds.cli import main
from retromae_ds.eval.run import EvalConfig
from retromae_ds.eval.two_stage import CrossEncoderStage, evaluate_bm25_beir, rerank_top
from retromae_ds.finetuning.cross_encoder import load_model
from retromae_ds.retrieval.beir import load_beir
from retromae_ds.retrieval.cross_encoder import score_pairs
from retromae_ds.retrieval.lexical import bm25_run
from retromae_ds.retrieval.metrics import evaluate_run, per_query_metrics, rank_run

from helpers_ance import write_synthetic_beir, write_tiny_encoder

MEASURES = ["ndcg@10", "mrr@10", "recall@20"]
POSITIONS = 128
"""The tiny encoder's position embeddings: what the scorer caps pairs at."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path, Path]:
    """(a synthetic BEIR folder, a tiny dense encoder, a tiny cross-encoder made from it: its
    classifier head random, its scores spread)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("ce_eval")
    beir = write_synthetic_beir(root / "beir", num_docs=60, num_queries=12)
    encoder = write_tiny_encoder(root / "encoder", tokenizer_dir)
    model = load_model(encoder)
    model.save_pretrained(str(root / "ce"))
    AutoTokenizer.from_pretrained(str(encoder)).save_pretrained(str(root / "ce"))
    return beir, encoder, root / "ce"


def own_ranking(data, first, ce: Path, depth: int) -> dict[str, list[str]]:
    """The top ``depth`` of each query sorted by ``score_pairs`` (trec_eval's tie rule: doc id
    descending), then the first stage's rest: written here, pair by pair."""
    from transformers import AutoTokenizer

    model, tokenizer = load_model(ce).eval(), AutoTokenizer.from_pretrained(str(ce))
    queries = dict(zip(data.query_ids, data.query_texts, strict=True))
    docs = dict(zip(data.corpus_ids, data.corpus_texts, strict=True))
    out = {}
    for qid, ranked in rank_run(first).items():
        top = ranked[:depth]
        texts = [queries[qid]] * len(top), [docs[d] for d in top]
        scores = score_pairs(model, tokenizer, *texts, max_length=POSITIONS)
        score_of = dict(zip(top, scores.tolist(), strict=True))
        by_id_desc = sorted(top, reverse=True)
        out[qid] = sorted(by_id_desc, key=lambda d: -score_of[d]) + ranked[depth:]
    return out


def test_bm25_reranked_by_a_cross_encoder_is_the_top_k_sorted_by_its_scores(folders):
    beir, _, ce = folders
    data = load_beir(beir, "train")
    stage = CrossEncoderStage(str(ce), depth=5, device="cpu", batch_size=7)
    result = evaluate_bm25_beir(data, "train", measures=MEASURES, cross_encoder=stage)

    first = bm25_run(data, 20)
    expected = own_ranking(data, first, ce, 5)
    ranking, scores = rerank_top(data, first, stage.load(), 5)
    assert ranking == expected
    assert any(
        r[:5] != f[:5] for r, f in zip(ranking.values(), rank_run(first).values(), strict=True)
    )
    assert result["per_query"] == per_query_metrics(data.qrels, expected, MEASURES)
    assert result["first_stage"] == {
        "model": "bm25",
        "metrics": evaluate_run(data.qrels, first, MEASURES)[0],
    }
    # below the depth the first stage's order stays: recall@20 is unchanged by reranking 5
    assert result["metrics"]["recall@20"] == result["first_stage"]["metrics"]["recall@20"]
    ce_record = result["cross_encoder"]
    assert ce_record["pairs"] == 5 * len(data.qrels) and ce_record["depth"] == 5
    assert ce_record["pairs_per_s"] > 0 and ce_record["device"] == "cpu"
    print(f"tiny cross-encoder (2 layers, 32 wide) on CPU: {ce_record['pairs_per_s']} pairs/s")


def test_eval_command_reranks_a_dense_first_stage_and_reports_both(folders, tmp_path, capsys):
    beir, encoder, ce = folders
    out = tmp_path / "result.json"
    args = ["eval", "--model", str(encoder), "--beir", str(beir), "--split", "train",
            "--measures", *MEASURES, "--progress", "false", "--device", "cpu",
            "--rerank.model", str(ce), "--rerank.depth", "8", "--rerank.batch_size", "16",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "first stage (" in printed and "reranked: top 8 by" in printed
    assert "pairs/s on cpu" in printed
    result = json.loads(out.read_text())
    assert result["cross_encoder"]["pairs"] == 8 * result["num_queries"]
    assert result["cross_encoder"]["model"] == str(ce)
    assert set(result["first_stage"]["metrics"]) == set(result["metrics"]) == set(MEASURES)
    dense = main(["eval", "--model", str(encoder), "--beir", str(beir), "--split", "train",
                  "--measures", *MEASURES, "--progress", "false", "--device", "cpu",
                  "--out", str(tmp_path / "dense.json")])  # fmt: skip
    assert dense == 0
    alone = json.loads((tmp_path / "dense.json").read_text())["metrics"]
    assert result["first_stage"]["metrics"] == pytest.approx(alone)


def test_a_folder_that_is_not_a_cross_encoder_is_refused_before_anything_runs(folders, capsys):
    beir, encoder, _ = folders
    for first in ("bm25", str(encoder)):
        code = main(["eval", "--model", first, "--beir", str(beir), "--split", "train",
                     "--progress", "false", "--rerank.model", str(encoder)])  # fmt: skip
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].endswith(
            f"{encoder}: not a cross-encoder (its config.json names BertModel, not a one-label "
            "...ForSequenceClassification model); train one with retromae-ds finetune "
            "--model.kind cross_encoder"
        )
        assert "Traceback" not in "\n".join(err)


def test_rerank_options_old_spellings_and_bm25_refusals():
    base = ["--model", "m", "--beir", "b"]
    old = build_config(EvalConfig, None, [*base, "--rerank", "--rerank_negatives", "4"])
    assert (old.rerank.lists, old.rerank.negatives, old.rerank.model) == (True, 4, "")
    assert old.cross_encoder() is None
    cfg = build_config(EvalConfig, None, [*base, "--rerank.model", "ce", "--rerank.depth", "7"])
    assert (cfg.rerank.lists, cfg.cross_encoder().depth, cfg.cross_encoder().model) == (
        False,
        7,
        "ce",
    )
    with pytest.raises(
        ValueError, match=r"^--pooling, --rerank.lists: a dense model's; --model bm25"
    ):
        build_config(
            EvalConfig, None, ["--model", "bm25", "--beir", "b", "--pooling", "mean", "--rerank"]
        )
    with pytest.raises(ValueError, match="rerank.depth and rerank.batch_size must be >= 1"):
        build_config(EvalConfig, None, [*base, "--rerank.depth", "0"])


def test_score_pairs_keeps_the_input_order_whatever_the_batching(folders):
    from transformers import AutoTokenizer

    _, _, ce = folders
    model, tokenizer = load_model(ce).eval(), AutoTokenizer.from_pretrained(str(ce))
    queries = ["a query", "another longer query about encoders", "q"] * 3
    passages = [f"passage {'word ' * i}" for i in range(9)]
    one = np.array(
        [
            score_pairs(model, tokenizer, [q], [p], max_length=POSITIONS)[0]
            for q, p in zip(queries, passages, strict=True)
        ]
    )
    np.testing.assert_allclose(
        score_pairs(model, tokenizer, queries, passages, batch_size=4, max_length=POSITIONS),
        one,
        atol=1e-5,
    )


def test_rerank_section_and_old_names_in_a_config_file():
    """A ``--config`` file may say ``rerank: true`` (the old field) or ``rerank: {...}`` (the
    section); old names beside the section land in it."""
    from retromae_ds.base.config import from_dict

    old = from_dict(EvalConfig, {"model": "m", "beir": "b", "rerank": True, "candidates": "f"})
    assert (old.rerank.lists, old.rerank.candidates) == (True, "f")
    new = {"model": "m", "beir": "b", "rerank": {"model": "ce", "depth": 9}, "rerank_negatives": 3}
    cfg = from_dict(EvalConfig, new)
    assert (cfg.rerank.model, cfg.rerank.depth, cfg.rerank.negatives) == ("ce", 9, 3)
    assert not cfg.rerank.lists


def test_a_cross_encoder_given_as_the_model_to_embed_is_refused(folders, capsys):
    beir, _, ce = folders
    code = main(["eval", "--model", str(ce), "--beir", str(beir), "--split", "train",
                 "--progress", "false"])  # fmt: skip
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "a cross-encoder scores (query, passage) pairs and embeds nothing" in last
    assert str(ce) in last


def test_bf16_scoring_is_autocast_close_to_fp32_and_said_in_the_record(folders):
    """``--rerank.bf16`` (and ``mine --ce_bf16``, ``refresh.teacher_bf16``: the same
    ``CrossEncoderScorer`` field) scores under bf16 autocast: the logits differ from fp32's
    (the autocast is applied) but only in the low digits, and the record says bf16."""
    from retromae_ds.retrieval.cross_encoder import CrossEncoderScorer

    beir, _, ce = folders
    cfg = build_config(EvalConfig, None, ["--model", "m", "--beir", str(beir),
                                          "--rerank.model", str(ce), "--rerank.bf16"])  # fmt: skip
    scorer = cfg.cross_encoder().load()
    assert scorer.bf16 and scorer.record()["bf16"] is True
    fp32 = CrossEncoderScorer.from_dir(ce, device="cpu")
    assert fp32.record()["bf16"] is False
    queries = ["a query", "another longer query about encoders", "q"] * 4
    passages = [f"passage {'word ' * i} about encoders" for i in range(12)]
    low, full = scorer(queries, passages), fp32(queries, passages)
    assert not np.array_equal(low, full)
    spread = float(full.max() - full.min())
    np.testing.assert_allclose(low, full, atol=0.05 * max(spread, 1.0))
