"""The ``Measure`` extension point (issue 56): one registry of ranking measures
(``retromae_ds.retrieval.metrics.MEASURES``) read by ``retromae-ds eval --measures``, by the
evaluation during pre-training (``--eval.measures``) and, through its first measure, by the
trainer's progress line. A non-default list gives exactly those keys, with the values
pytrec_eval (trec_eval) computes on the same run; an unknown name is refused in one line before
anything loads; a measure registered from outside the library, in process or through the
``retromae_ds.measures`` entry point of an installed package, is usable by ``eval`` as is."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from helpers_plugins import install_package

from retromae_ds.base.options import build_config
from retromae_ds.cli import main as cli_main
from retromae_ds.eval.periodic import PeriodicEval, PeriodicEvalConfig
from retromae_ds.eval.run import EvalConfig
from retromae_ds.retrieval import metrics
from retromae_ds.retrieval.encode import HFEncoder

from helpers_model import tiny_bert_dir
from synthetic import synthetic_texts

CHOSEN = ["ndcg@3", "map@5", "recall@2", "mrr@100"]
"""Not the default list; mrr@100 on 9 documents is trec_eval's uncut recip_rank."""
TREC = {
    "ndcg@3": "ndcg_cut_3",
    "map@5": "map_cut_5",
    "recall@2": "recall_2",
    "mrr@100": "recip_rank",
}


def write_beir(folder: Path) -> Path:
    """Nine documents and four queries of synthetic text, each query with graded judgments
    (every query has a relevant document, so every averaging agrees); no id is shared."""
    texts = synthetic_texts(13, seed=11)
    (folder / "qrels").mkdir(parents=True)
    corpus = [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(texts[:9])]
    queries = [{"_id": f"q{i}", "text": t[:60]} for i, t in enumerate(texts[9:])]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
    qrels = ["query-id\tcorpus-id\tscore", "q0\td0\t2", "q0\td5\t1", "q1\td2\t1", "q1\td7\t1"]
    qrels += ["q1\td8\t0", "q2\td4\t1", "q3\td1\t2", "q3\td3\t1", "q3\td6\t1"]
    (folder / "qrels" / "test.tsv").write_text("\n".join(qrels) + "\n")
    return folder


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return tiny_bert_dir(tmp_path_factory.mktemp("tiny_bert"), tokenizer_dir)


def eval_argv(model: Path, beir: Path, *more: str) -> list[str]:
    return ["eval", "--model", str(model), "--beir", str(beir), "--pooling", "mean",
            "--max_length", "32", "--device", "cpu", "--progress", "false", *more]  # fmt: skip


def reference_run(model: Path, beir: Path) -> dict[str, dict[str, float]]:
    """Every document scored for every query: the encoder's vectors, numpy inner products."""
    encoder = HFEncoder.from_dir(model, pooling="mean", max_length=32, device="cpu", progress=False)
    corpus = [json.loads(line) for line in (beir / "corpus.jsonl").read_text().splitlines()]
    queries = [json.loads(line) for line in (beir / "queries.jsonl").read_text().splitlines()]
    scores_QN = encoder([q["text"] for q in queries]) @ encoder([d["text"] for d in corpus]).T
    return {
        q["_id"]: {d["_id"]: float(s) for d, s in zip(corpus, row, strict=True)}
        for q, row in zip(queries, scores_QN, strict=True)
    }


def qrels_of(beir: Path) -> dict[str, dict[str, int]]:
    qrels: dict[str, dict[str, int]] = {}
    for line in (beir / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        qid, doc, level = line.split("\t")
        qrels.setdefault(qid, {})[doc] = int(level)
    return qrels


def test_eval_measures_reports_exactly_those_measures_as_trec_eval_computes_them(
    tiny_model_dir, tmp_path
):
    pytrec_eval = pytest.importorskip("pytrec_eval", reason="pytrec_eval (dev extra)")
    beir = write_beir(tmp_path / "ds")
    out = tmp_path / "result.json"
    assert cli_main(eval_argv(tiny_model_dir, beir, "--measures", *CHOSEN, "--out", str(out))) == 0
    result = json.loads(out.read_text())
    assert list(result["metrics"]) == CHOSEN
    assert all(list(values) == CHOSEN for values in result["per_query"].values())

    qrels = qrels_of(beir)
    evaluator = pytrec_eval.RelevanceEvaluator(
        qrels, {"ndcg_cut.3", "map_cut.5", "recall.2", "recip_rank"}
    )
    theirs = evaluator.evaluate(reference_run(tiny_model_dir, beir))
    assert set(theirs) == set(result["per_query"]) == set(qrels)
    for qid, values in result["per_query"].items():
        for name in CHOSEN:
            assert values[name] == pytest.approx(theirs[qid][TREC[name]], abs=1e-9), (qid, name)
    for name in CHOSEN:
        mean = sum(theirs[q][TREC[name]] for q in theirs) / len(theirs)
        assert result["metrics"][name] == pytest.approx(mean, abs=1e-9), name
    assert 0 < result["metrics"]["recall@2"] < 1  # a measure that could fail, not all 0 or 1


def test_the_default_list_is_unchanged():
    assert EvalConfig(model="m", beir="b").measures == [
        "ndcg@10",
        "mrr@10",
        "recall@100",
        "recall@1000",
    ]
    assert PeriodicEvalConfig().measures == ["ndcg@10", "mrr@10", "recall@100"]
    # names are spelt one way once the config is built: the result's keys
    assert EvalConfig(model="m", beir="b", measures=["nDCG@010"]).measures == ["ndcg@10"]


def test_an_unknown_measure_is_one_line_before_anything_loads(tmp_path, capsys):
    missing = tmp_path / "no_model"  # never opened: the measure is refused first
    assert cli_main(eval_argv(missing, tmp_path, "--measures", "ndcg@10", "bleu@4")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("retromae-ds eval: error: --measures: unknown measure 'bleu@4'")
    assert "ndcg@k, mrr@k, recall@k, map@k" in err
    for bad in (["ndcg"], ["mrr@0"], []):
        with pytest.raises(ValueError, match=r"^eval\.measures: "):
            PeriodicEvalConfig(measures=bad)
    with pytest.raises(ValueError, match=r"^eval\.measures: unknown measure 'err@20'"):
        from retromae_ds.pretrain import PretrainConfig

        build_config(PretrainConfig, None, ["--data.shards", "x", "--eval.measures", "err@20"])


def test_the_evaluation_during_pretraining_takes_the_same_list(tiny_model_dir, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    beir = write_beir(tmp_path / "ds")
    out = tmp_path / "result.json"
    assert cli_main(eval_argv(tiny_model_dir, beir, "--measures", *CHOSEN, "--out", str(out))) == 0
    expected = json.loads(out.read_text())["metrics"]
    cfg = PeriodicEvalConfig(
        beir=str(beir), measures=CHOSEN, poolings=["mean"], max_queries=0, max_docs=0, max_length=32
    )
    model = AutoModel.from_pretrained(tiny_model_dir, local_files_only=True)
    row = PeriodicEval(cfg)(
        model, AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    )
    assert set(row) == {f"eval/ds/mean/{m}" for m in CHOSEN} | {"eval_seconds"}
    for name in CHOSEN:
        assert row[f"eval/ds/mean/{name}"] == pytest.approx(expected[name], abs=1e-6), name


def precision_at_k(ranked: Sequence[str], judgments: Mapping[str, int], k: int, /) -> float:
    """Relevant documents in the top k over k (trec_eval's P_k: missing ranks count as misses)."""
    return sum(1 for doc in ranked[:k] if judgments.get(doc, 0) > 0) / k


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test (registrations do not leak)."""
    monkeypatch.setattr(metrics, "MEASURES", metrics.MEASURES.copy())
    return metrics.MEASURES


def test_a_measure_registered_from_outside_is_usable_by_eval(registry, tiny_model_dir, tmp_path):
    pytrec_eval = pytest.importorskip("pytrec_eval", reason="pytrec_eval (dev extra)")
    beir = write_beir(tmp_path / "ds")
    out = tmp_path / "result.json"
    assert "precision" not in registry
    with pytest.raises(ValueError, match="unknown measure 'precision@3'"):
        EvalConfig(model="m", beir="b", measures=["precision@3"])

    metrics.register_measure("precision", precision_at_k)
    argv = eval_argv(tiny_model_dir, beir, "--measures", "precision@3", "ndcg@3", "--out", str(out))
    assert cli_main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["metrics"]) == ["precision@3", "ndcg@3"]
    theirs = pytrec_eval.RelevanceEvaluator(qrels_of(beir), {"P.3"}).evaluate(
        reference_run(tiny_model_dir, beir)
    )
    for qid, values in result["per_query"].items():
        assert values["precision@3"] == pytest.approx(theirs[qid]["P_3"], abs=1e-12), qid
    # and the evaluation during pre-training reads the same registry
    assert PeriodicEvalConfig(measures=["precision@5"]).measures == ["precision@5"]
    with pytest.raises(ValueError, match="already registered"):
        metrics.register_measure("precision", lambda ranked, judgments, k: 0.0)


def test_a_package_adds_a_measure_through_its_entry_point(registry, monkeypatch, tmp_path):
    """An installed package (a dist-info with an entry point, on ``sys.path``) names a measure
    that ``eval --measures`` then accepts: nothing in the library or the test registers it."""
    site = install_package(
        tmp_path / "site",
        "extra_measures",
        """
        def hits_at_k(ranked, judgments, k, /):
            return float(sum(1 for doc in ranked[:k] if judgments.get(doc, 0) > 0))
        """,
        {"retromae_ds.measures": {"hits": "extra_measures:hits_at_k"}},
    )
    monkeypatch.syspath_prepend(str(site))
    assert "hits" not in registry.names()
    assert EvalConfig(model="m", beir="b", measures=["hits@10"]).measures == ["hits@10"]
    mean, _ = metrics.evaluate_run({"q": {"a": 1, "b": 1}}, {"q": {"a": 2.0, "c": 1.0}}, ["hits@2"])
    assert mean == {"hits@2": 1.0}


def test_pretraining_logs_the_listed_measures_and_its_line_shows_the_first(tokenizer_dir, tmp_path):
    """Real pre-training (DeepSpeed on CPU, one step) with ``--eval.measures``: its eval rows
    hold exactly those measures per pooling, and the trainer's progress line, which knows no
    measure name, shows the first of them."""
    from helpers_train import metrics as logged
    from helpers_train import pretrain, synthetic_shards

    beir = write_beir(tmp_path / "ds")
    shards = synthetic_shards(tmp_path, tokenizer_dir, docs=64, seed=5)
    run = tmp_path / "run"
    result = pretrain(
        run, shards, "--max_steps", "1", "--eval.beir", str(beir), "--eval.max_length", "32",
        "--eval.measures", "mrr@5", "ndcg@3",
    )  # fmt: skip
    rows = [r for r in logged(run) if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in rows] == [0, 1]
    expected = {f"eval/ds/{p}/{m}" for p in ("cls", "mean") for m in ("mrr@5", "ndcg@3")}
    assert all({k for k in r if k.startswith("eval/")} == expected for r in rows)
    lines = [x for x in (result.stdout + result.stderr).splitlines() if "eval at step 1:" in x]
    assert len(lines) == 1 and lines[0].endswith(
        f"eval at step 1: cls/mrr@5 {rows[1]['eval/ds/cls/mrr@5']:.4f}, "
        f"mean/mrr@5 {rows[1]['eval/ds/mean/mrr@5']:.4f}"
    ), lines
