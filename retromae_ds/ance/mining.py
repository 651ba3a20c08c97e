"""Hard negatives from a ranking: remove every positive, then sample n per query.

``mine(ranked_QK, positives, n, strategy, skip_top, seed, num_passages)`` works on any
ranking (dense search or BM25): row q of ``ranked_QK`` holds passage indices best first
(``-1`` for empty slots). All positives of the query (every qrel with relevance > 0) are
removed first; then ``strategy="random"`` draws n without replacement from the remaining
candidates past the first ``skip_top`` (the top non-positive ranks are the likeliest
unlabelled positives), and ``strategy="top"`` takes the next n after ``skip_top``. A query
with too few candidates is topped up with random passages that are not its positives, so
every query gets exactly n negatives. Deterministic for a given seed.

``bm25_rankings`` gives the initial ranking with BM25 (``eval.lexical``, language-aware); ``publish_bm25`` mines and
publishes it as the first negatives version of a fine-tuning run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from retromae_ds.ance.data import TrainingSet
    from retromae_ds.ance.refresh_config import RefreshConfig

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
) -> list[np.ndarray]:
    """``n`` negative passage indices (int32) per query; never a positive of that query."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    if n < 1 or skip_top < 0:
        raise ValueError(f"need n >= 1 and skip_top >= 0, got {n}, {skip_top}")
    if len(ranked_QK) != len(positives):
        raise ValueError(f"{len(ranked_QK)} rankings for {len(positives)} queries")
    out: list[np.ndarray] = []
    for q, (ranked, pos) in enumerate(zip(ranked_QK, positives, strict=True)):
        pos = np.asarray(pos, dtype=np.int64)
        if len(pos) >= num_passages:
            raise ValueError(f"query {q}: every passage is a positive; no negative exists")
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


def bm25_rankings(
    passages: Sequence[str], queries: Sequence[str], k: int, *, progress: bool = True
) -> np.ndarray:
    """Top-``k`` passage indices per query by BM25 (``eval.lexical.bm25_search``: English
    stop words and stemmer, or jieba words / Han characters for Chinese), ``[Q, k]``, ``-1``
    where the corpus is smaller than k."""
    from retromae_ds.eval.lexical import bm25_search

    ids, _, _ = bm25_search(passages, queries, k, progress=progress)
    if ids.shape[1] < k:
        ids = np.hstack([ids, np.full((len(ids), k - ids.shape[1]), -1, dtype=np.int64)])
    return ids


def publish_bm25(cfg: RefreshConfig, ts: TrainingSet, root: str | Path) -> dict[str, Any]:
    """Version 0 (or the next free one) under the negatives folder ``root``: BM25 top-K,
    positives removed, n sampled with ``cfg``'s mining settings; returns its manifest."""
    from retromae_ds.ance import data as ance_data
    from retromae_ds.ance import handoff
    from retromae_ds.ance.refresh_config import mining_settings
    from retromae_ds.eval.beir import load_corpus, load_queries

    settings = json.loads((ts.corpus.folder.parent / ance_data.READY).read_text())
    t0 = time.perf_counter()
    doc_ids, texts = load_corpus(Path(settings["beir"]) / "corpus.jsonl")
    text_of = dict(zip(doc_ids, texts, strict=True))
    queries = load_queries(Path(settings["beir"]) / "queries.jsonl")
    from retromae_ds.eval.lexical import choose_analyzer

    passages = [text_of[d] for d in ts.passage_ids]
    ranked = bm25_rankings(
        passages, [queries[q] for q in ts.query_ids], cfg.top_k, progress=cfg.progress
    )
    negatives = mine(
        ranked,
        ts.positives,
        cfg.num_negatives,
        strategy=cfg.strategy,
        skip_top=cfg.skip_top,
        seed=cfg.seed,
        num_passages=ts.num_passages,
    )
    root = Path(root)
    version = handoff.next_version(root)
    handoff.publish(
        root,
        version,
        negatives,
        step=0,
        meta={
            "source": "bm25",
            "analyzer": choose_analyzer(passages),
            "data": ts.fingerprint(),
            "settings": mining_settings(cfg),
            "timings": {"bm25_s": round(time.perf_counter() - t0, 3)},
        },
        keep_last=cfg.keep_last,
    )
    return json.loads(handoff.manifest_file(root, version).read_text())
