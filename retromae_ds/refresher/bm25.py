"""The first negatives of a fine-tuning run: BM25's top-K (``eval.lexical``, language-aware),
one more ranking handed to the refresher's own mine-and-publish path (``refresher.publish``) with
the run's mining settings and seed. With ``refresh.mode pool`` its top K' are kept as v0's
candidate pool (``refresher.candidate_pool``)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.data import TrainingSet
from retromae_ds.refresher.candidate_pool import Plan, pool_width, prune, save_pool
from retromae_ds.refresher.config import RefreshConfig
from retromae_ds.refresher.publish import Ranking, mine_and_publish
from retromae_ds.refresher.teacher import teacher_for


def bm25_rankings(
    passages: Sequence[str], queries: Sequence[str], k: int, *, progress: bool = True
) -> np.ndarray:
    """Top-``k`` passage indices per query by BM25 (``eval.lexical.bm25_search``: English
    stop words and stemmer, or jieba words / Han characters for Chinese), ``[Q, k]``, ``-1``
    where the corpus is smaller than k."""
    from retromae_ds.retrieval.lexical import bm25_search

    ids, _, _ = bm25_search(passages, queries, k, progress=progress)
    if ids.shape[1] < k:
        ids = np.hstack([ids, np.full((len(ids), k - ids.shape[1]), -1, dtype=np.int64)])
    return ids


def publish_bm25(cfg: RefreshConfig, ts: TrainingSet, root: str | Path) -> dict[str, Any]:
    """Version 0 (or the next free one) under the negatives folder ``root``: BM25 top-K,
    positives removed, n sampled with ``cfg.mining``; returns its manifest."""
    from retromae_ds.retrieval.beir import load_corpus, load_queries

    settings = json.loads((ts.corpus.folder.parent / ance_data.READY).read_text())
    t0 = time.perf_counter()
    doc_ids, texts = load_corpus(Path(settings["beir"]) / "corpus.jsonl")
    text_of = dict(zip(doc_ids, texts, strict=True))
    queries = load_queries(Path(settings["beir"]) / "queries.jsonl")
    from retromae_ds.retrieval.lexical import choose_analyzer

    passages = [text_of[d] for d in ts.passage_ids.to_pylist()]
    # refresh.mode pool: the top K' are kept as this version's candidate pool
    pool_k = pool_width(cfg) if cfg.mode == "pool" else 0
    ranked = bm25_rankings(
        passages,
        [queries[q] for q in ts.query_ids],
        max(cfg.mining.top_k, pool_k),
        progress=cfg.progress,
    )
    version = handoff.next_version(Path(root))
    extra = {}
    if pool_k:
        save_pool(Path(root), version, ranked[:, :pool_k], ts, source="bm25", step=0)
        extra["candidate_pool"] = Plan("bm25", pool_k, version).record(0, cfg.pool_full_every)
    manifest, _ = mine_and_publish(
        root,
        version,
        Ranking(ids=ranked[:, : cfg.mining.top_k]),
        ts,
        cfg.mining,
        seed=cfg.mining.seed,
        keep_last=cfg.keep_last,
        step=0,
        source={"source": "bm25", "analyzer": choose_analyzer(passages)},
        extra=extra,
        timings={"bm25_s": time.perf_counter() - t0},
        teacher=teacher_for(cfg, ts),
    )
    if pool_k:
        prune(Path(root), version)
    return manifest
