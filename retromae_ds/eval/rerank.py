"""Reranking evaluation, as C-MTEB's reranking tasks: each query's candidate list (its
positives and some negatives) ranked by embedding similarity; MAP and MRR@10.

Candidates come from a BEIR split: the judged positives of each query (relevance > 0) plus
``negatives`` BM25-mined non-positive documents (``eval.lexical``: language-aware, jieba words
for Chinese), or from a JSONL file, one query a line::

    {"query_id": "q1", "negative": ["d7", "d9"], "positive": ["d1"]}

(``positive`` optional: the qrels' positives by default; ids must be in the corpus). Scores
are inner products of the same embeddings the retrieval evaluation uses (cosine with
``--normalize``); ties are broken as trec_eval does. MAP is over the whole list (trec_eval's
``map``), MRR@10 the reciprocal rank of the first positive within the top 10. Command line:
``retromae-ds eval --rerank.lists [--rerank.negatives N | --rerank.candidates FILE]`` (formerly
``--rerank``, ``--rerank_negatives``, ``--candidates``). A cross-encoder reranking a first
stage's top K is ``eval.two_stage``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from retromae_ds.data.sources import text_lines
from retromae_ds.retrieval.beir import BeirData
from retromae_ds.retrieval.metrics import evaluate_run

RERANK_MEASURES = ("map", "mrr@10")
DEFAULT_NEGATIVES = 19
"""BM25 negatives per query (with one positive: 20 candidates)."""


def _positives(judgments: Mapping[str, int]) -> list[str]:
    return sorted(d for d, rel in judgments.items() if rel > 0)


Candidates = dict[str, dict[str, list[str]]]
"""``{qid: {"positive": [doc ids], "negative": [doc ids]}}``."""


def bm25_candidates(data: BeirData, negatives: int = DEFAULT_NEGATIVES) -> Candidates:
    """Every judged query with a positive: its positives, and as negatives the top
    ``negatives`` BM25 documents that are not positives."""
    from retromae_ds.retrieval.lexical import bm25_search

    text_of = dict(zip(data.query_ids, data.query_texts, strict=True))
    qids = [q for q in data.qrels if _positives(data.qrels[q]) and q in text_of]
    depth = negatives + max(len(_positives(data.qrels[q])) for q in qids) + 1 if qids else 1
    ids, _, _ = bm25_search(data.corpus_texts, [text_of[q] for q in qids], depth)
    out = {}
    for qid, rows in zip(qids, ids.tolist(), strict=True):
        pos = _positives(data.qrels[qid])
        banned = set(pos) | {qid}
        neg = [data.corpus_ids[r] for r in rows if r >= 0 and data.corpus_ids[r] not in banned]
        out[qid] = {"positive": pos, "negative": neg[:negatives]}
    return out


def load_candidates(path: str | Path, data: BeirData) -> Candidates:
    """Candidate lists from a JSONL file (module doc); errors name the file and line."""
    corpus = set(data.corpus_ids)
    queries = set(data.query_ids)
    out: Candidates = {}
    for n, line in text_lines(path):  # a bad byte is named by file:line
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from exc
        if not isinstance(rec, dict) or not isinstance(rec.get("query_id"), str):
            raise ValueError(f"{where}: needs a string field 'query_id'")
        qid = rec["query_id"]
        if qid not in queries:
            raise ValueError(f"{where}: query {qid!r} is not in the queries file")
        pos = rec.get("positive", _positives(data.qrels.get(qid, {})))
        neg = rec.get("negative")
        for name, ids in (("positive", pos), ("negative", neg)):
            if not isinstance(ids, list) or not all(isinstance(d, str) for d in ids):
                raise ValueError(f"{where}: field {name!r} must be a list of document ids")
            unknown = [d for d in ids if d not in corpus]
            if unknown:
                raise ValueError(f"{where}: {name} id(s) not in the corpus: {unknown[:5]}")
        if not pos:
            raise ValueError(f"{where}: query {qid!r} has no positive")
        if qid in out:
            raise ValueError(f"{where}: query {qid!r} listed twice")
        both = set(pos) & set(neg)
        if both:
            raise ValueError(f"{where}: id(s) both positive and negative: {sorted(both)[:5]}")
        out[qid] = {"positive": list(dict.fromkeys(pos)), "negative": list(dict.fromkeys(neg))}
    if not out:
        raise ValueError(f"{path}: no candidate lists")
    return out


def rerank_run(
    candidates: Candidates,
    query_emb_QD: np.ndarray,
    corpus_emb_ND: np.ndarray,
    query_ids: Sequence[str],
    corpus_ids: Sequence[str],
) -> dict[str, dict[str, float]]:
    """``{qid: {doc: similarity}}`` over each query's candidates."""
    qrow = {q: i for i, q in enumerate(query_ids)}
    drow = {d: i for i, d in enumerate(corpus_ids)}
    run = {}
    for qid, lists in candidates.items():
        docs = [*lists["positive"], *lists["negative"]]
        rows = np.fromiter((drow[d] for d in docs), dtype=np.int64, count=len(docs))
        scores = corpus_emb_ND[rows].astype(np.float64) @ query_emb_QD[qrow[qid]].astype(np.float64)
        run[qid] = dict(zip(docs, scores.tolist(), strict=True))
    return run


def evaluate_rerank(
    data: BeirData,
    candidates: Candidates,
    query_emb_QD: np.ndarray,
    corpus_emb_ND: np.ndarray,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(mean, per-query) ``{"map", "mrr@10"}`` of the candidates ranked by similarity."""
    run = rerank_run(candidates, query_emb_QD, corpus_emb_ND, data.query_ids, data.corpus_ids)
    depth = max(len(v["positive"]) + len(v["negative"]) for v in candidates.values())
    measures = [f"map@{depth}", "mrr@10"]
    qrels = {q: {d: 1 for d in v["positive"]} for q, v in candidates.items()}
    mean, per_query = evaluate_run(qrels, run, measures)
    rename = {f"map@{depth}": "map", "mrr@10": "mrr@10"}
    return (
        {rename[m]: v for m, v in mean.items()},
        {q: {rename[m]: v for m, v in vals.items()} for q, vals in per_query.items()},
    )
