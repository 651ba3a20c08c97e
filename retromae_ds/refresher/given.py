"""The first negatives of a run trained on a pairs file (``data.pairs``): the file's own
negatives, published as the run's v0 instead of BM25's (``finetuning.pairs_data``). A query the
file gives no negative (an ST pair, a query ``retromae-ds mine`` fell short on) gets BM25's,
mined with the run's settings exactly as a BEIR run's v0 is; the manifest counts them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.data import TrainingSet
from retromae_ds.finetuning.pairs_data import given_negatives, staged_record
from retromae_ds.refresher.bm25 import bm25_rankings
from retromae_ds.refresher.config import RefreshConfig, mining_settings
from retromae_ds.refresher.mining import mine


def staged_folder(ts: TrainingSet) -> Path:
    """The BEIR folder ``ts`` was tokenized from."""
    return Path(json.loads((ts.corpus.folder.parent / ance_data.READY).read_text())["beir"])


def _bm25_for(cfg: RefreshConfig, ts: TrainingSet, lacking: list[int]) -> list[np.ndarray]:
    """BM25 negatives (``cfg.mining``) for the training queries ``lacking``."""
    from retromae_ds.retrieval.beir import load_corpus, load_queries

    beir = staged_folder(ts)
    doc_ids, texts = load_corpus(beir / "corpus.jsonl")
    text_of = dict(zip(doc_ids, texts, strict=True))
    queries = load_queries(beir / "queries.jsonl")
    passages = [text_of[d] for d in ts.passage_ids.to_pylist()]
    ranked = bm25_rankings(
        passages, [queries[ts.query_ids[q]] for q in lacking], cfg.mining.top_k,
        progress=cfg.progress,
    )  # fmt: skip
    return mine(
        ranked,
        [ts.positives[q] for q in lacking],
        cfg.mining.num_negatives,
        strategy=cfg.mining.strategy,
        skip_top=cfg.mining.skip_top,
        seed=cfg.mining.seed,
        num_passages=ts.num_passages,
    )


def publish_given(cfg: RefreshConfig, ts: TrainingSet, root: str | Path) -> dict[str, Any]:
    """Version 0 (or the next free one) under ``root``: the staged file's negatives, BM25's
    for the queries it gives none; returns its manifest."""
    t0 = time.perf_counter()
    staged = staged_folder(ts)
    negatives, lacking = given_negatives(staged, ts.query_ids, ts.passage_ids.to_pylist())
    if lacking:
        for q, found in zip(lacking, _bm25_for(cfg, ts, lacking), strict=True):
            negatives[q] = found
    record = staged_record(staged) or {}
    version = handoff.next_version(Path(root))
    meta = {
        "source": "file",
        "pairs": record.get("source"),
        "pairs_sha256": record.get("source_sha256"),
        "queries_from_bm25": len(lacking),
        "data": ts.fingerprint(),
        "settings": mining_settings(cfg.mining),
        "timings": {"given_s": round(time.perf_counter() - t0, 3)},
    }
    handoff.publish(
        Path(root),
        version,
        [np.asarray(n, dtype=np.int32) for n in negatives],
        step=0,
        meta=meta,
        keep_last=cfg.keep_last,
    )
    return json.loads(handoff.manifest_file(Path(root), version).read_text())
