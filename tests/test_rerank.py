"""Reranking evaluation (C-MTEB style): MAP and MRR@10 over candidate lists, checked against
ir-measures (trec_eval) on a hand-built case; candidate files; BM25 candidate mining."""

from __future__ import annotations

import json

import numpy as np
import pytest

from retromae_ds.eval.rerank import (
    bm25_candidates,
    evaluate_rerank,
    load_candidates,
    rerank_run,
)
from retromae_ds.retrieval.beir import BeirData
from retromae_ds.retrieval.metrics import evaluate_run

ir_measures = pytest.importorskip("ir_measures", reason="ir-measures (dev extra) not installed")
# q1's positive d0 ties the negative d3 (score 0): trec_eval ranks ties by id descending


def _data() -> BeirData:
    docs = [f"d{i}" for i in range(8)]
    return BeirData(
        corpus_ids=docs,
        corpus_texts=[f"text {i}" for i in range(8)],
        query_ids=["q0", "q1", "q2"],
        query_texts=["a", "b", "c"],
        qrels={"q0": {"d1": 1, "d4": 2, "d7": 0}, "q1": {"d0": 1}, "q2": {"d5": 1}},
    )


# 2-d embeddings: scores are easy to read, with a tie in q1's list
CORPUS = np.array(
    [[1, 0], [0, 1], [1, 1], [2, 0], [0, 3], [1, 2], [3, 3], [0, 0]], dtype=np.float32
)
QUERIES = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
CANDIDATES = {
    "q0": {"positive": ["d1", "d4"], "negative": ["d0", "d3", "d6", "d2"]},
    "q1": {"positive": ["d0"], "negative": ["d1", "d2", "d5", "d3"]},  # d0 ties d3 (0)
    "q2": {"positive": ["d5"], "negative": ["d6", "d7"]},
}


def test_map_and_mrr_equal_trec_eval_on_a_hand_built_case():
    pytrec_eval = pytest.importorskip("pytrec_eval", reason="pytrec-eval (dev extra) missing")
    data = _data()
    mean, per_query = evaluate_rerank(data, CANDIDATES, QUERIES, CORPUS)
    run = rerank_run(CANDIDATES, QUERIES, CORPUS, data.query_ids, data.corpus_ids)
    assert run["q0"] == {"d1": 0.0, "d4": 0.0, "d0": 1.0, "d3": 2.0, "d6": 3.0, "d2": 1.0}
    qrels = {q: {d: 1 for d in v["positive"]} for q, v in CANDIDATES.items()}
    # trec_eval itself (ir-measures' RR breaks ties by another rule; lists are < 10 long, so
    # recip_rank is MRR@10)
    theirs = pytrec_eval.RelevanceEvaluator(qrels, {"map", "recip_rank"}).evaluate(run)
    expected = {q: {"map": v["map"], "mrr@10": v["recip_rank"]} for q, v in theirs.items()}
    for q in CANDIDATES:
        assert per_query[q] == pytest.approx(expected[q], abs=1e-9)
    # by hand: q0 ranks d6 d3 d0|d2 ... positives (0, 0) last of 6 -> ranks 5, 6 (tie by id
    # descending: d4 before d1): AP = (1/5 + 2/6) / 2
    assert per_query["q0"]["map"] == pytest.approx((1 / 5 + 2 / 6) / 2)
    assert per_query["q0"]["mrr@10"] == pytest.approx(1 / 5)
    assert per_query["q2"] == {"map": 1 / 2, "mrr@10": 1 / 2}  # d6 (6) > d5 (3) > d7 (0)
    assert mean["map"] == pytest.approx(np.mean([expected[q]["map"] for q in CANDIDATES]))


def test_map_at_k_equals_trec_eval_map_cut():
    qrels = {"q": {"a": 1, "b": 1, "c": 1}}
    run = {"q": {"x": 5.0, "a": 4.0, "y": 3.0, "b": 2.0, "z": 1.0}}
    mean, _ = evaluate_run(qrels, run, ["map@3", "map@10"])
    ref = ir_measures.calc_aggregate(
        [ir_measures.AP @ 3, ir_measures.AP @ 10],
        [ir_measures.Qrel("q", d, 1) for d in "abc"],
        [ir_measures.ScoredDoc("q", d, s) for d, s in run["q"].items()],
    )
    assert mean["map@3"] == pytest.approx(ref[ir_measures.AP @ 3]) == pytest.approx(0.5 / 3)
    assert mean["map@10"] == pytest.approx(ref[ir_measures.AP @ 10])


def test_bm25_candidates_hold_every_positive_and_only_non_positive_negatives(shared_data):
    from retromae_ds.retrieval.beir import load_beir

    data = load_beir(shared_data / "scifact", "test")
    lists = bm25_candidates(data, negatives=9)
    assert set(lists) == {q for q, j in data.qrels.items() if any(r > 0 for r in j.values())}
    for q, v in lists.items():
        assert set(v["positive"]) == {d for d, r in data.qrels[q].items() if r > 0}
        assert len(v["negative"]) == 9 and not set(v["negative"]) & set(v["positive"])


def test_candidates_file_and_its_errors(tmp_path):
    data = _data()
    path = tmp_path / "cands.jsonl"
    path.write_text(
        json.dumps({"query_id": "q0", "negative": ["d0", "d3"]})
        + "\n\n"
        + json.dumps({"query_id": "q1", "negative": ["d2"], "positive": ["d0", "d5"]})
        + "\n"
    )
    lists = load_candidates(path, data)
    assert lists == {
        "q0": {"positive": ["d1", "d4"], "negative": ["d0", "d3"]},
        "q1": {"positive": ["d0", "d5"], "negative": ["d2"]},
    }
    bad = {
        "not json\n": r"cands.jsonl:1: not JSON",
        '{"negative": []}\n': r":1: needs a string field 'query_id'",
        '{"query_id": "qx", "negative": []}\n': r":1: query 'qx' is not in the queries file",
        '{"query_id": "q0", "negative": ["d9"]}\n': r":1: negative id\(s\) not in the corpus",
        '{"query_id": "q0", "negative": ["d1"]}\n': r":1: id\(s\) both positive and negative",
        '{"query_id": "q0", "negative": "d2"}\n': r":1: field 'negative' must be a list",
        '{"query_id": "q0", "negative": []}\n{"query_id": "q0", "negative": []}\n': r":2: .*twice",
    }
    for text, message in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_candidates(path, data)


def test_eval_job_reranks_from_a_candidates_file(tmp_path):
    """``evaluate_beir(..., candidates=FILE)`` (``retromae-ds eval --candidates``) reports
    the same reranking figures as ``evaluate_rerank`` on the same embeddings."""
    from retromae_ds.eval.run import evaluate_beir

    data = _data()
    table = dict(zip(data.corpus_texts + data.query_texts, [*CORPUS, *QUERIES], strict=True))

    def encoder(texts):
        return np.stack([table[t] for t in texts])

    path = tmp_path / "cands.jsonl"
    path.write_text("".join(json.dumps({"query_id": q, **v}) + "\n" for q, v in CANDIDATES.items()))
    result = evaluate_beir(
        encoder, data, candidates=path, verbose=False, ignore_identical_ids=False
    )
    expected, _ = evaluate_rerank(data, CANDIDATES, QUERIES, CORPUS)
    assert result["rerank"]["metrics"] == pytest.approx(expected)
    assert result["rerank"]["candidates"] == str(path) and result["rerank"]["num_queries"] == 3
