"""Hard negatives from a ranking: remove every positive, then sample n per query.

``mine(ranked_QK, positives, n, strategy, skip_top, seed, num_passages)`` works on any
ranking (dense search or BM25): row q of ``ranked_QK`` holds passage indices best first
(``-1`` for empty slots). All positives of the query (every qrel with relevance > 0) are
removed first; then ``strategy="random"`` draws n without replacement from the remaining
candidates past the first ``skip_top`` (the top non-positive ranks are the likeliest
unlabelled positives), and ``strategy="top"`` takes the next n after ``skip_top``. A query
with too few candidates is topped up with random passages that are not its positives, so
every query gets exactly n negatives. Deterministic for a given seed.

False negatives: on a corpus labelled sparsely, the candidates ranked above or near a
query's positive are often unlabelled positives; trained on as negatives they teach the model
to push relevant passages away. Two controls: ``skip_top`` (above), and
``drop_likely_positives``, which removes every candidate scoring above ``ratio`` times the
score of the query's lowest-scoring labelled positive (NV-Retriever's "TopK-PercPos",
Moreira et al. 2024; the refresher's ``max_score_ratio``, applied to model-mined versions,
where the positives' scores come from the same embeddings).

A query's own document: in BEIR sets whose queries sit in the corpus under their own id
(ArguAna, Quora), the query's own passage tops its ranking. ``eval`` drops a retrieved
document whose id is the query's (BEIR's ``ignore_identical_ids``); mining follows the same
rule under the same name (``mining.ignore_identical_ids``): ``identical_passages`` finds each
query's own passage, ``mine`` never takes it as a negative (``excluded``), and the version's
manifest counts the drops (``publish.mine_and_publish``).

The first ranking of a fine-tuning run, BM25's, is mined here too (``refresher.bm25``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from retromae_ds.refresher.filters import relative_margin_drop

STRATEGIES = ("random", "top")


def mine(
    ranked_QK: np.ndarray,
    positives: Sequence[np.ndarray],
    n: int,
    *,
    strategy: str = "random",
    skip_top: int = 0,
    seed: int = 0,
    num_passages: int,
    excluded: np.ndarray | None = None,
) -> list[np.ndarray]:
    """``n`` negative passage indices (int32) per query; never a positive of that query, nor
    its ``excluded[q]`` passage (``[Q]`` int64, -1: none; its own document, which
    ``identical_passages`` finds), neither from the ranking nor as a random top-up."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    if n < 1 or skip_top < 0:
        raise ValueError(f"need n >= 1 and skip_top >= 0, got {n}, {skip_top}")
    if len(ranked_QK) != len(positives):
        raise ValueError(f"{len(ranked_QK)} rankings for {len(positives)} queries")
    if excluded is not None and len(excluded) != len(positives):
        raise ValueError(f"{len(excluded)} excluded passages for {len(positives)} queries")
    out: list[np.ndarray] = []
    for q, (ranked, pos) in enumerate(zip(ranked_QK, positives, strict=True)):
        pos = np.asarray(pos, dtype=np.int64)
        if excluded is not None and excluded[q] >= 0:  # never a negative, like a positive
            pos = np.union1d(pos, [int(excluded[q])])
        if len(pos) >= num_passages:
            raise ValueError(
                f"query {q}: every passage is a positive (or its own document); no negative exists"
            )
        rng = np.random.default_rng([seed, q])
        ranked = np.asarray(ranked, dtype=np.int64)
        ranked = ranked[ranked >= 0]
        _, first = np.unique(ranked, return_index=True)  # a ranking may repeat a passage
        ranked = ranked[np.sort(first)]
        candidates = ranked[~np.isin(ranked, pos)][skip_top:]
        if strategy == "top":
            chosen = candidates[:n]
        else:
            chosen = rng.choice(candidates, size=min(n, len(candidates)), replace=False)
        if len(chosen) < n:
            chosen = np.concatenate(
                [chosen, _random_fill(rng, n - len(chosen), pos, chosen, num_passages)]
            )
        out.append(chosen.astype(np.int32))
    return out


def identical_passages(query_ids: Sequence[str], passage_ids: Any) -> np.ndarray:
    """``[Q]`` int64: the passage whose document id is query q's own id, -1 where none (BEIR's
    ``ignore_identical_ids`` rule: such a document is the query itself, never a negative).
    ``passage_ids``: the passage table's ids (an Arrow array, as ``TrainingSet`` holds them,
    or a sequence of str)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(passage_ids, pa.ChunkedArray):
        passage_ids = passage_ids.combine_chunks()
    if not isinstance(passage_ids, pa.Array):
        passage_ids = pa.array(list(passage_ids), pa.string())
    queries = pa.array(list(query_ids), pa.string()).cast(passage_ids.type)
    found = pc.index_in(queries, value_set=passage_ids)
    return found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def drop_identical(ranked_QK: np.ndarray, identical_Q: np.ndarray) -> tuple[np.ndarray, int]:
    """``(ranked with -1 in place of each query's own passage, queries it was dropped from)``;
    ``identical_Q`` is ``identical_passages``'s answer (-1: the query has no own passage)."""
    rows = np.flatnonzero(identical_Q >= 0)  # only queries that have an own document
    row, col = np.nonzero(ranked_QK[rows] == identical_Q[rows, None])
    if not len(row):
        return ranked_QK, 0
    out = ranked_QK.copy()
    out[rows[row], col] = -1
    return out, len(np.unique(row))


def drop_likely_positives(
    ranked_QK: np.ndarray,
    scores_QK: np.ndarray,
    positive_score_Q: np.ndarray,
    ratio: float,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ranked with -1 in place of every dropped candidate, count dropped per query)``.

    A candidate is dropped when its score exceeds ``ratio`` times the query's positive score
    ``p`` (``p - (1 - ratio) * |p|``, the same for ``p > 0`` and meaningful below 0);
    ``positive_score_Q`` is the lowest score among the query's labelled positives (NaN: not
    known, nothing dropped). Empty slots (-1) stay empty. Positives themselves are never
    touched here: ``mine`` removes them from the candidates in any case.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if ranked_QK.shape != scores_QK.shape or len(positive_score_Q) != len(ranked_QK):
        raise ValueError(
            f"shapes differ: ranked {ranked_QK.shape}, scores {scores_QK.shape}, "
            f"positive scores {np.shape(positive_score_Q)}"
        )
    # ST's relative margin 1 - ratio, the same function ``retromae-ds mine`` filters with
    drop = (ranked_QK >= 0) & relative_margin_drop(scores_QK, positive_score_Q, 1.0 - ratio)
    return np.where(drop, -1, ranked_QK), drop.sum(1)


def positive_pairs(positives: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(query index, passage index) int64 of every (query, positive) pair, in the order of
    ``positives`` (query by query): the order ``positive_scores`` and ``min_per_query`` use."""
    q_idx = np.concatenate([np.full(len(p), q, dtype=np.int64) for q, p in enumerate(positives)])
    p_idx = np.concatenate([np.asarray(p, dtype=np.int64) for p in positives])
    return q_idx, p_idx


def positive_scores(
    query_QD: np.ndarray, passages_ND: np.ndarray, offset: int, positives: Sequence[np.ndarray]
) -> np.ndarray:
    """Score (inner product) of every (query, positive) pair whose passage lies in
    ``passages_ND`` (rows ``offset .. offset + N``), NaN for the others; flattened in the
    order of ``positives`` (query by query). ``min_per_query`` folds parts and queries."""
    q_idx, p_idx = positive_pairs(positives)
    out = np.full(len(p_idx), np.nan, dtype=np.float64)
    here = (p_idx >= offset) & (p_idx < offset + len(passages_ND))
    rows_q, rows_p = query_QD[q_idx[here]], passages_ND[p_idx[here] - offset]
    out[here] = np.einsum("nd,nd->n", rows_q.astype(np.float64), rows_p.astype(np.float64))
    return out


def min_per_query(pair_scores: np.ndarray, positives: Sequence[np.ndarray]) -> np.ndarray:
    """The lowest score among each query's positives (NaN ignored; NaN if none is known)."""
    counts = np.asarray([len(p) for p in positives], dtype=np.int64)
    if (counts < 1).any():
        raise ValueError("every query needs at least one positive")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    filled = np.where(np.isnan(pair_scores), np.inf, pair_scores)
    low = np.minimum.reduceat(filled, starts)
    return np.where(np.isinf(low), np.nan, low)


def _random_fill(
    rng: np.random.Generator, count: int, pos: np.ndarray, taken: np.ndarray, num_passages: int
) -> np.ndarray:
    """``count`` random passages that are not positives, distinct from each other and from
    ``taken`` while the corpus has enough non-positives (repeats only in a tiny corpus)."""
    banned = {int(p) for p in pos if 0 <= p < num_passages}
    distinct = num_passages - len(banned) - len(taken) >= count
    if distinct:
        banned |= {int(p) for p in taken}
    fill: list[int] = []
    while len(fill) < count:
        p = int(rng.integers(num_passages))
        if p not in banned:
            fill.append(p)
            if distinct:
                banned.add(p)
    return np.asarray(fill, dtype=np.int64)
