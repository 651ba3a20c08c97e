"""Ranking metrics against hand-computed values, a straightforward reference written here, and
(when installed) ir-measures, whose nDCG/RR/R come from trec_eval via pytrec_eval."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.retrieval.metrics import (
    evaluate_run,
    max_cutoff,
    mrr_at_k,
    ndcg_at_k,
    parse_measure,
    rank_run,
    recall_at_k,
)

MEASURES = ("ndcg@1", "ndcg@3", "ndcg@10", "mrr@1", "mrr@3", "mrr@10", "recall@1", "recall@5")


# --- a reference implementation, written from the definitions --------------------------------


def reference_metrics(qrels, run, measures):
    """Per-query values, every query of qrels with a relevant document (level > 0)."""
    out = {}
    for qid in qrels:
        judged = qrels[qid]
        n_relevant = len([d for d in judged if judged[d] > 0])
        if n_relevant == 0:
            continue
        # trec_eval: score descending, ties by document id descending
        pairs = [(score, doc) for doc, score in run.get(qid, {}).items()]
        pairs.sort(reverse=True)
        ranked = [doc for _, doc in pairs]
        values = {}
        for measure in measures:
            name, k = measure.split("@")
            k = int(k)
            top = ranked[:k]
            if name == "ndcg":
                got = 0.0
                for i in range(len(top)):
                    level = judged.get(top[i], 0)
                    if level > 0:
                        got += level / math.log2(i + 2)
                levels = sorted([v for v in judged.values() if v > 0], reverse=True)[:k]
                best = 0.0
                for i in range(len(levels)):
                    best += levels[i] / math.log2(i + 2)
                values[measure] = got / best
            elif name == "mrr":
                values[measure] = 0.0
                for i in range(len(top)):
                    if judged.get(top[i], 0) > 0:
                        values[measure] = 1 / (i + 1)
                        break
            else:
                found = len([d for d in top if judged.get(d, 0) > 0])
                values[measure] = found / n_relevant
        out[qid] = values
    return out


DOC_IDS = [f"d{i}" for i in range(12)]


@st.composite
def qrels_and_run(draw, ties: bool = True):
    """Graded judgments (levels -1..3) and runs (with many tied scores unless ``ties=False``);
    every qrels query is ranked."""
    qrels, run = {}, {}
    for q in range(draw(st.integers(1, 6))):
        qid = f"q{q}"
        judged = draw(st.dictionaries(st.sampled_from(DOC_IDS), st.integers(-1, 3), max_size=8))
        if judged:
            qrels[qid] = judged
        retrieved = draw(st.lists(st.sampled_from(DOC_IDS), min_size=1, max_size=12, unique=True))
        if ties:
            run[qid] = {doc: float(draw(st.integers(0, 4))) for doc in retrieved}
        else:
            run[qid] = {doc: 0.5 * i for i, doc in enumerate(retrieved)}
    run["unjudged"] = {"d0": 1.0}  # a run query without qrels is ignored
    return qrels, run


# --- hand-computed values ------------------------------------------------------------------------


def test_hand_computed_values():
    judged = {"a": 2, "b": 1, "c": 0}
    ranked = ["x", "b", "a", "c"]
    # DCG@3 = 0 + 1/log2(3) + 2/log2(4) = 1.6309; ideal = 2 + 1/log2(3) = 2.6309
    assert ndcg_at_k(ranked, judged, 3) == pytest.approx(
        (1 / math.log2(3) + 1) / (2 + 1 / math.log2(3))
    )
    assert ndcg_at_k(ranked, judged, 1) == 0.0
    assert ndcg_at_k(["a", "b"], judged, 10) == pytest.approx(1.0)
    assert mrr_at_k(ranked, judged, 10) == pytest.approx(0.5)
    assert mrr_at_k(ranked, judged, 1) == 0.0
    assert recall_at_k(ranked, judged, 2) == pytest.approx(0.5)
    assert recall_at_k(ranked, judged, 3) == pytest.approx(1.0)
    assert ndcg_at_k(ranked, {"x": 0}, 10) == 0.0
    assert recall_at_k(ranked, {}, 10) == 0.0


def test_ties_follow_trec_eval_doc_id_descending():
    assert rank_run({"q": {"a": 1.0, "c": 1.0, "b": 1.0, "z": 2.0, "d": 0.5}})["q"] == [
        "z",
        "c",
        "b",
        "a",
        "d",
    ]


def test_queries_without_relevant_documents_are_skipped_or_zero():
    qrels = {"q1": {"a": 1}, "q2": {"a": 0}, "q3": {"b": 1}}
    run = {"q1": {"a": 1.0}, "q2": {"a": 1.0}}  # q3 is not ranked at all: scores 0
    mean, per_query = evaluate_run(qrels, run, ["ndcg@10"], skip_queries_without_relevant=True)
    assert set(per_query) == {"q1", "q3"} and mean["ndcg@10"] == pytest.approx(0.5)
    mean, per_query = evaluate_run(qrels, run, ["ndcg@10"])  # BEIR's averaging, the default
    assert set(per_query) == {"q1", "q2", "q3"} and mean["ndcg@10"] == pytest.approx(1 / 3)


def test_measure_names():
    assert parse_measure("nDCG@10") == ("ndcg", 10)
    assert max_cutoff(["mrr@10", "recall@1000"]) == 1000
    for bad in ("ndcg", "map", "err@10", "ndcg@0", "ndcg@x"):
        with pytest.raises(ValueError, match="unknown measure"):
            parse_measure(bad)


# --- against the reference and ir-measures --------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(qrels_and_run())
def test_matches_reference_implementation(data):
    qrels, run = data
    mean, per_query = evaluate_run(qrels, run, MEASURES, skip_queries_without_relevant=True)
    expected = reference_metrics(qrels, run, MEASURES)
    assert per_query.keys() == expected.keys()
    for qid, values in expected.items():
        assert per_query[qid] == pytest.approx(values, abs=1e-12), qid
    for m in MEASURES:
        n = len(expected)
        assert mean[m] == pytest.approx(sum(v[m] for v in expected.values()) / n if n else 0.0)


def _ir_measure(ir_measures, name):
    kind, k = parse_measure(name)
    return {"ndcg": ir_measures.nDCG, "mrr": ir_measures.RR, "recall": ir_measures.R}[kind] @ k


@settings(max_examples=200, deadline=None)
@given(qrels_and_run(ties=False))
def test_matches_ir_measures(data):
    # ir-measures ranks ties differently for RR@k (not by trec_eval's rule) than for nDCG and R
    # (pytrec_eval), so it is compared on runs without ties; ties are checked against
    # pytrec_eval below.
    ir_measures = pytest.importorskip(
        "ir_measures",
        reason="ir-measures not installed (pip install ir-measures): parity unchecked",
    )
    qrels, run = data
    measures = {name: _ir_measure(ir_measures, name) for name in MEASURES}
    theirs: dict[str, dict[str, float]] = {}
    for metric in ir_measures.iter_calc(list(measures.values()), qrels, run):
        theirs.setdefault(metric.query_id, {})[str(metric.measure)] = metric.value
    # ir-measures (like pytrec_eval and BEIR) also scores queries without relevant documents
    mean, per_query = evaluate_run(qrels, run, MEASURES, skip_queries_without_relevant=False)
    assert per_query.keys() == theirs.keys()
    for qid, values in per_query.items():
        for name, measure in measures.items():
            assert values[name] == pytest.approx(theirs[qid][str(measure)], abs=1e-9), (qid, name)
    if per_query:
        aggregate = ir_measures.calc_aggregate(list(measures.values()), qrels, run)
        for name, measure in measures.items():
            assert mean[name] == pytest.approx(aggregate[measure], abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(qrels_and_run(ties=True))
def test_matches_pytrec_eval_with_ties(data):
    pytrec_eval = pytest.importorskip(
        "pytrec_eval",
        reason="pytrec_eval not installed (pip install ir-measures): trec_eval parity unchecked",
    )
    qrels, run = data
    # runs hold at most 12 documents, so mrr@100 is trec_eval's uncut recip_rank
    ours = ("ndcg@1", "ndcg@3", "ndcg@10", "recall@1", "recall@5", "mrr@100", "map@3", "map@100")
    names = ("ndcg_cut_1", "ndcg_cut_3", "ndcg_cut_10", "recall_1", "recall_5", "recip_rank")
    names += ("map_cut_3", "map")  # map: uncut, as mrr@100
    evaluator = pytrec_eval.RelevanceEvaluator(
        qrels, {"ndcg_cut.1,3,10", "recall.1,5", "recip_rank", "map_cut.3", "map"}
    )
    theirs = evaluator.evaluate(run)
    _, per_query = evaluate_run(qrels, run, ours, skip_queries_without_relevant=False)
    assert per_query.keys() == theirs.keys()
    for qid, values in per_query.items():
        for mine, name in zip(ours, names, strict=True):
            assert values[mine] == pytest.approx(theirs[qid][name], abs=1e-9), (qid, mine)
