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
from retromae_ds.refresher.teacher import teacher_for


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
    negatives = [np.asarray(n, dtype=np.int32) for n in negatives]
    teacher = teacher_for(cfg, ts)
    scores = None if teacher is None else teacher.scores(negatives)
    if teacher is not None:
        meta["teacher"] = teacher.record()
        meta["timings"]["teacher_s"] = round(teacher.seconds, 3)
    handoff.publish(
        Path(root), version, negatives, step=0, meta=meta, keep_last=cfg.keep_last,
        scores=scores,
    )  # fmt: skip
    return json.loads(handoff.manifest_file(Path(root), version).read_text())


def publish_scored(
    cfg: RefreshConfig,
    ts: TrainingSet,
    root: str | Path,
    scored: dict[str, dict[str, float]],
    where: str,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Version 0 (or the next free one) under ``root`` for distillation: per training query,
    its negatives are the passages ``scored[query id]`` scores that are not its positives
    (best teacher score first), with their teacher scores, and its positives' scores; returns
    its manifest. ``where`` (the scores' file) names the source in the one-line errors: a
    training query without scores, a positive without one, a query left with no scored
    negative, a score for a passage outside the training corpus, a score that is not finite."""
    t0 = time.perf_counter()
    passage_ids = ts.passage_ids.to_pylist()
    row = {pid: i for i, pid in enumerate(passage_ids)}
    negatives, neg_scores, pos_scores = [], [], []
    lacking = [qid for qid in ts.query_ids if not scored.get(qid)]
    if lacking:
        raise ValueError(
            f"{where}: {len(lacking)} of {ts.num_queries} training queries have no teacher "
            f"scores (first: {lacking[0]!r}); every query distils, so each needs its positive's "
            "and its negatives' scores"
        )
    for q, qid in enumerate(ts.query_ids):
        given = scored[qid]
        for did, score in given.items():
            if did not in row:
                raise ValueError(f"{where}: query {qid!r}: passage {did!r} is not in the corpus")
            if not np.isfinite(score):
                raise ValueError(f"{where}: query {qid!r}, passage {did!r}: score {score}")
        positives = [passage_ids[i] for i in ts.positives[q]]
        missing = [did for did in positives if did not in given]
        if missing:
            raise ValueError(
                f"{where}: query {qid!r}: its positive {missing[0]!r} has no teacher score"
            )
        skip = set(positives)
        ranked = sorted(((-s, row[d]) for d, s in given.items() if d not in skip))
        if not ranked:
            raise ValueError(
                f"{where}: query {qid!r} has teacher scores for its positives only: no "
                "negative to distil against"
            )
        negatives.append(np.asarray([i for _, i in ranked], dtype=np.int32))
        neg_scores.append(np.asarray([-s for s, _ in ranked], dtype=np.float32))
        pos_scores.append(np.asarray([given[d] for d in positives], dtype=np.float32))
    version = handoff.next_version(Path(root))
    meta = {
        **meta,
        "data": ts.fingerprint(),
        "timings": {"given_s": round(time.perf_counter() - t0, 3)},
    }
    handoff.publish(
        Path(root),
        version,
        negatives,
        step=0,
        meta=meta,
        keep_last=cfg.keep_last,
        scores=handoff.Scores(neg_scores, pos_scores),
    )
    return json.loads(handoff.manifest_file(Path(root), version).read_text())
