"""The ``Index`` extension point (issue 56): exact and approximate search keep one protocol
(``retromae_ds.search.index.Index``); an ``index`` setting is checked once, where the command
reads it (``kinds.index_setting``), sized to the corpus and built once (``IndexSetting.build``);
``retromae_ds.search`` names its settings bare and each command re-raises its errors with its
own option names (``refresh.index``, ``eval --index``); and ``retromae-ds eval --index`` takes
the refresher's settings, ``flat`` (the default) giving today's exact results."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from retromae_ds.base.options import build_config
from retromae_ds.cli import main as cli_main
from retromae_ds.eval.run import EvalConfig
from retromae_ds.refresher import config as refresh_config
from retromae_ds.refresher.config import RefreshConfig, RefresherConfig
from retromae_ds.search.build import build
from retromae_ds.search.exact import ExactIndex
from retromae_ds.search.index import Index, SettingError
from retromae_ds.search.kinds import index_setting

from helpers_model import tiny_bert_dir
from synthetic import WORDS

SEARCH = Path(__file__).resolve().parent.parent / "retromae_ds" / "search"


def vectors(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


@pytest.mark.parametrize(
    "setting",
    [
        dict(index="flat"),
        dict(index="IVF8,Flat", nprobe=8),  # every list probed: exhaustive
        dict(index="hnsw", ef_search=2000),  # a candidate list as long as the corpus
        dict(index="ivf"),  # sized to the corpus, every list probed below
    ],
)
def test_both_kinds_keep_the_protocol_and_exhaustive_settings_give_the_exact_top_k(setting):
    corpus, queries = vectors(600), vectors(40, seed=1)
    index = build(index_setting(**setting), n=len(corpus), dim=16, k=10)
    assert isinstance(index, Index) and index.ntotal == 0 and index.choice is not None
    if setting["index"] == "ivf":
        index.nprobe = index.layout.nlist
    assert index.exact == (setting["index"] == "flat")
    assert index.training_vectors(len(corpus)) == index.choice.train_size
    index.add(corpus)
    assert index.ntotal == len(corpus)
    scores, ids = index.search(queries, 10)
    ref_scores, ref_ids = ExactIndex.build(corpus).search(queries, 10)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    # the same top-k from parts given one at a time (the refresher's shards)
    fresh = build(index_setting(**setting), n=len(corpus), dim=16, k=10)
    if setting["index"] == "ivf":
        fresh.nprobe = fresh.layout.nlist
    fresh.train(corpus)
    filled: list[bool] = []
    parts = (corpus[i : i + 250] for i in range(0, len(corpus), 250))
    part_scores, part_ids = fresh.search_parts(
        queries, parts, 10, query_batch=7, filled=lambda: filled.append(True)
    )
    np.testing.assert_array_equal(part_ids, ref_ids)
    assert filled == ([] if fresh.exact else [True])  # exact search never holds the parts


def test_search_names_no_option_of_its_callers():
    """``retromae_ds.search`` knows its own parameters only: no ``refresh.`` spelling, no
    ``prefix`` / ``label`` carried down from a command."""
    for path in sorted(SEARCH.glob("*.py")):
        text = path.read_text()
        assert "refresh." not in text, path
        assert not re.search(r"\b(prefix|label)\s*[:=]", text), path  # no such parameter


def test_an_error_names_the_setting_bare_and_each_caller_spells_it():
    with pytest.raises(SettingError, match=r"^nprobe 99 exceeds the 8 lists of index 'IVF8,Flat'"):
        build(index_setting("IVF8,Flat", nprobe=99), n=1000, dim=16)
    bad = "IVF64,Flat"  # 2,496 training vectors wanted, 100 passages
    for cfg, line in (
        (RefreshConfig(index=bad), r"^refresh\.index 'IVF64,Flat' needs at least 2496"),
        (RefresherConfig(index=bad), r"^index 'IVF64,Flat' needs at least 2496"),
    ):
        with pytest.raises(ValueError, match=line):
            cfg.build_index(100, 8)
    for make, line in (
        (lambda: RefreshConfig(index="IVF8;PQ"), r"^refresh\.index must be auto, flat"),
        (lambda: RefresherConfig(index="IVF8;PQ"), r"^index must be auto, flat"),
        (lambda: RefreshConfig(index="flat", ef_search=9), r"^refresh\.ef_search applies to"),
        (lambda: EvalConfig(model="m", beir="b", index="IVF8;PQ"), r"^--index must be auto"),
        (lambda: EvalConfig(model="m", beir="b", nprobe=-1), r"^--nprobe must be >= 0"),
    ):
        with pytest.raises(ValueError, match=line):
            make()


def test_the_refreshers_setting_is_checked_once(monkeypatch):
    """Read once into an ``IndexSetting``: building the rank's index (and what it resolved
    to) checks nothing again."""
    calls: list[str] = []

    def counting(index, **settings):
        calls.append(index)
        return index_setting(index, **settings)

    monkeypatch.setattr(refresh_config, "index_setting", counting)
    cfg = build_config(RefreshConfig, None, ["--index", "ivf", "--nprobe", "2"])
    assert calls == ["ivf"]
    index = cfg.build_index(2000, 8, k=10)
    assert index.choice.record() == cfg.index_choice(2000, 8, 10).record()
    assert (index.choice.factory, index.choice.nprobe) == (
        "IVF32,Flat",
        2,
    )  # 4·√2000 -> 128, at most 2000 / 39
    assert calls == ["ivf"]


def write_beir(folder: Path, docs: int = 200, queries: int = 12) -> Path:
    """``docs`` distinct documents of eight words, ``queries`` queries each judging two."""
    rng = random.Random(5)
    texts = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(docs + queries)]
    assert len(set(texts)) == len(texts)  # no tie between equal texts
    (folder / "qrels").mkdir(parents=True)
    corpus = [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(texts[:docs])]
    asked = [{"_id": f"q{i}", "text": t} for i, t in enumerate(texts[docs:])]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in asked))
    qrels = ["query-id\tcorpus-id\tscore"]
    qrels += [f"q{q}\td{(q * 17 + j * 5) % docs}\t1" for q in range(queries) for j in range(2)]
    (folder / "qrels" / "test.tsv").write_text("\n".join(qrels) + "\n")
    return folder


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return tiny_bert_dir(tmp_path_factory.mktemp("tiny_bert"), tokenizer_dir)


def run_eval(model: Path, beir: Path, out: Path, *more: str) -> dict:
    argv = ["eval", "--model", str(model), "--beir", str(beir), "--pooling", "mean",
            "--max_length", "32", "--device", "cpu", "--progress", "false",
            "--measures", "ndcg@10", "recall@20", "--out", str(out), *more]  # fmt: skip
    assert cli_main(argv) == 0
    return json.loads(out.read_text())


def test_eval_takes_the_refreshers_index_settings(tiny_model_dir, tmp_path, capsys):
    beir = write_beir(tmp_path / "ds")
    default = run_eval(tiny_model_dir, beir, tmp_path / "default.json")
    flat = run_eval(tiny_model_dir, beir, tmp_path / "flat.json", "--index", "flat")
    assert (flat["metrics"], flat["per_query"]) == (default["metrics"], default["per_query"])
    assert default["settings"]["index"]["factory"] == "Flat"
    # every list probed: the exact ranking, written as the exact one is
    ivf = run_eval(
        tiny_model_dir, beir, tmp_path / "ivf.json", "--index", "IVF4,Flat", "--nprobe", "4"
    )
    assert ivf["settings"]["index"] == {
        "index": "IVF4,Flat", "factory": "IVF4,Flat", "backend": "faiss", "nprobe": 4,
        "ef_search": 0, "train_size": 200,
    }  # fmt: skip
    assert set(ivf) == set(default) and ivf["per_query"].keys() == default["per_query"].keys()
    for name, value in default["metrics"].items():
        assert ivf["metrics"][name] == pytest.approx(value, abs=1e-6), name
    assert 0 < default["metrics"]["recall@20"] < 1  # a measure that could differ
    # a setting this corpus cannot satisfy: one line naming eval's option
    capsys.readouterr()
    argv = ["eval", "--model", str(tiny_model_dir), "--beir", str(beir), "--device", "cpu",
            "--progress", "false", "--index", "IVF64,Flat"]  # fmt: skip
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "retromae-ds eval: error: --index 'IVF64,Flat' needs at least 2496 training vectors"
    ), err
