"""Ranking metrics as trec_eval (and so pytrec_eval, BEIR, ir-measures) computes them.

Measures are named ``"ndcg@10"``, ``"mrr@10"``, ``"recall@100"``: ``name@k``. ``MEASURES`` is
the one registry of the names: every place that takes a measure (``retromae-ds eval
--measures``, the evaluation during pre-training ``--eval.measures``, ``evaluate_beir``) reads
it, so a new measure is one function of the ``Measure`` protocol and one
``register_measure(name, function)`` call, from this module or from outside the package (in
process, or for the command line through the ``retromae_ds.measures`` entry-point group:
``precision = "mypkg.measures:precision_at_k"``).

- **nDCG@k**: graded gain = the judged relevance level (levels <= 0 and unjudged documents
  gain 0), discount ``log2(rank + 1)`` with ranks from 1 (the first document is undiscounted),
  divided by the DCG of the ideal ranking of all judged relevant documents, also cut at k
  (trec_eval's ``ndcg_cut``: linear gain, not ``2**rel - 1``).
- **MRR@k**: 1 / rank of the first relevant document (level > 0) within the top k, else 0.
- **Recall@k**: relevant documents in the top k / all judged relevant documents.
- **MAP@k** (``map@k``): average precision, the sum of precision@rank over the relevant
  documents within the top k, divided by the number of judged relevant documents
  (trec_eval's ``map_cut``; with k at least the ranking's length, its ``map``).

Which queries count: by default every query of the qrels, as BEIR averages (pytrec_eval over
every qrels query), so a query whose judgments are all non-relevant scores 0; pass
``skip_queries_without_relevant=True`` to leave those out (their number is reported). A query
with relevant documents but no ranking scores 0 (trec_eval ``-c``; pytrec_eval drops it).

Ties: a run given as scores (``{qid: {docid: score}}``) is ranked by score descending, then
document id descending as a string, trec_eval's rule, so values equal pytrec_eval's even when
scores tie. Rankings given as lists are taken in their order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from retromae_ds.base.registry import Registry

Qrels = Mapping[str, Mapping[str, int]]
Run = Mapping[str, Mapping[str, float]]


class Measure(Protocol):
    """A ranking measure of one query: the ranked document ids (best first), the query's
    judgments ``{doc id: level}`` and the cutoff k -> its value."""

    def __call__(self, ranked: Sequence[str], judgments: Mapping[str, int], k: int, /) -> float: ...


MEASURES: Registry[Measure] = Registry("measure", "retromae_ds.measures")
"""The registry: measure name (``ndcg``) -> its function; ``name@k`` names one of them at k.
Other packages add measures through its entry-point group, ``retromae_ds.measures``."""
ADDED = MEASURES.group

DEFAULT_MEASURES = ("ndcg@10", "mrr@10", "recall@100", "recall@1000")
"""What ``retromae-ds eval`` reports unless ``--measures`` says otherwise."""
TRAINING_MEASURES = ("ndcg@10", "mrr@10", "recall@100")
"""What the evaluation during pre-training logs unless ``--eval.measures`` says otherwise."""


def register_measure(name: str, function: Measure) -> Measure:
    """Make ``name@k`` a measure everywhere one is named; returns ``function``. A name is
    registered once: a second, different function under it is a ``ValueError``."""
    if not name.strip().isidentifier():
        raise ValueError(f"measure name {name!r}: expected a word such as 'ndcg' (used as name@k)")
    return MEASURES.register(name, function)


def parse_measure(name: str) -> tuple[str, int]:
    """``"ndcg@10"`` -> ``("ndcg", 10)``; one line listing the registered measures for
    anything else."""
    kind, sep, cutoff = name.strip().lower().partition("@")
    if not sep or kind not in MEASURES or not cutoff.isdigit() or int(cutoff) < 1:
        known = ", ".join(f"{m}@k" for m in MEASURES)
        raise ValueError(f"unknown measure {name!r}; expected one of {known} (k >= 1)")
    return kind, int(cutoff)


def check_measures(names: Sequence[str], where: str) -> list[str]:
    """The configured measure list ``names`` in canonical spelling (``nDCG@10`` ->
    ``ndcg@10``), checked where the config is built; one line naming ``where`` (the option)
    for an empty list or an unknown name."""
    if isinstance(names, str) or not names:
        raise ValueError(f"{where}: expected a list of measures name@k, got {names!r}")
    canonical = []
    for name in names:
        try:
            kind, k = parse_measure(str(name))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        canonical.append(f"{kind}@{k}")
    return canonical


def max_cutoff(measures: Iterable[str]) -> int:
    """The deepest ranking the measures look at."""
    return max(parse_measure(m)[1] for m in measures)


def rank_run(run: Run) -> dict[str, list[str]]:
    """Document ids per query, best first: score descending, then doc id descending (trec_eval)."""
    ranking = {}
    for qid, doc_scores in run.items():
        by_id_desc = sorted(doc_scores, reverse=True)
        ranking[qid] = sorted(by_id_desc, key=lambda d: doc_scores[d], reverse=True)  # stable
    return ranking


def _relevant(judgments: Mapping[str, int]) -> dict[str, int]:
    return {doc: rel for doc, rel in judgments.items() if rel > 0}


def dcg(gains: Iterable[float]) -> float:
    """Discounted cumulative gain of gains listed best rank first (rank 1 undiscounted)."""
    return sum(g / math.log2(rank + 1) for rank, g in enumerate(gains, start=1) if g)


def ndcg_at_k(ranked: Sequence[str], judgments: Mapping[str, int], k: int) -> float:
    """nDCG@k of one ranking; 0 when no judged document is relevant."""
    relevant = _relevant(judgments)
    ideal = dcg(sorted(relevant.values(), reverse=True)[:k])
    if ideal == 0:
        return 0.0
    return dcg(relevant.get(doc, 0) for doc in ranked[:k]) / ideal


def mrr_at_k(ranked: Sequence[str], judgments: Mapping[str, int], k: int) -> float:
    """Reciprocal rank of the first relevant document in the top k, else 0."""
    for rank, doc in enumerate(ranked[:k], start=1):
        if judgments.get(doc, 0) > 0:
            return 1.0 / rank
    return 0.0


def recall_at_k(ranked: Sequence[str], judgments: Mapping[str, int], k: int) -> float:
    """Share of the judged relevant documents found in the top k; 0 when there are none."""
    relevant = _relevant(judgments)
    if not relevant:
        return 0.0
    return sum(1 for doc in set(ranked[:k]) if doc in relevant) / len(relevant)


def map_at_k(ranked: Sequence[str], judgments: Mapping[str, int], k: int) -> float:
    """Average precision within the top k; 0 when no judged document is relevant."""
    relevant = _relevant(judgments)
    if not relevant:
        return 0.0
    hits, total = 0, 0.0
    for rank, doc in enumerate(ranked[:k], start=1):
        if doc in relevant:
            hits += 1
            total += hits / rank
    return total / len(relevant)


register_measure("ndcg", ndcg_at_k)
register_measure("mrr", mrr_at_k)
register_measure("recall", recall_at_k)
register_measure("map", map_at_k)


def per_query_metrics(
    qrels: Qrels,
    ranking: Mapping[str, Sequence[str]],
    measures: Sequence[str] = DEFAULT_MEASURES,
    *,
    skip_queries_without_relevant: bool = False,
) -> dict[str, dict[str, float]]:
    """``{qid: {measure: value}}`` for every qrels query that counts (see the module doc).

    Queries of ``ranking`` that are absent from ``qrels`` are ignored.
    """
    parsed = [(m, *parse_measure(m)) for m in measures]
    results = {}
    for qid, judgments in qrels.items():
        if skip_queries_without_relevant and not _relevant(judgments):
            continue
        ranked = ranking.get(qid, ())
        results[qid] = {name: MEASURES[kind](ranked, judgments, k) for name, kind, k in parsed}
    return results


def mean_metrics(
    per_query: Mapping[str, Mapping[str, float]], measures: Sequence[str] = DEFAULT_MEASURES
) -> dict[str, float]:
    """Arithmetic mean over queries of each measure (0.0 when there are no queries)."""
    n = len(per_query)
    return {m: (sum(v[m] for v in per_query.values()) / n if n else 0.0) for m in measures}


def evaluate_run(
    qrels: Qrels,
    run: Run,
    measures: Sequence[str] = DEFAULT_MEASURES,
    *,
    skip_queries_without_relevant: bool = False,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(mean, per-query) metrics of a scored run, ranked with trec_eval's tie rule."""
    per_query = per_query_metrics(
        qrels,
        rank_run(run),
        measures,
        skip_queries_without_relevant=skip_queries_without_relevant,
    )
    return mean_metrics(per_query, measures), per_query
