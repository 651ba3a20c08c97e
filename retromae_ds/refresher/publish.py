"""The one path from a ranking to a published negatives version: BM25's first ranking
(``refresher.bm25``) and every dense search of the refresher (``refresher.process``) end here.

``Ranking`` is what a search stage hands over (``[Q, K]`` passage indices best first, and for
a dense search their scores and the score of each query's lowest-scoring positive, which the
false-negative filter needs). ``mine_and_publish`` drops each query's own document first
(``mining.ignore_identical_ids``, as ``eval`` does; counted in the manifest's
``identical_ids``), applies that filter when it can (``max_score_ratio`` > 0 and scores
present), removes every positive and samples the negatives (``mining.mine``), then
publishes the version atomically (``handoff.publish``: ``vN.arrow`` + ``vN.json`` +
``CURRENT``), recording the mining settings and timings in its manifest.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.data import TrainingSet
from retromae_ds.refresher.config import SCORE_FILTERS, MiningConfig, mining_settings
from retromae_ds.refresher.filters import drop_by_scores
from retromae_ds.refresher.mining import (
    drop_identical,
    drop_likely_positives,
    identical_passages,
    min_per_query,
    mine,
)
from retromae_ds.refresher.teacher import OnlineTeacher


@dataclass(frozen=True)
class Ranking:
    """Candidates per training query, best first (``-1`` in empty slots)."""

    ids: np.ndarray
    """``[Q, K]`` int64 passage indices."""
    scores: np.ndarray | None = None
    """``[Q, K]`` similarity of each candidate (dense search only)."""
    positives: np.ndarray | None = None
    """Per (query, positive) pair, its score (dense search only; see ``mining.min_per_query``)."""

    def save(self, path: Path) -> None:
        """Write to ``path`` (``.npz``) atomically: a hidden temporary renamed into place."""
        hidden = path.with_name(f".{path.name}")
        arrays = {"ids": self.ids}
        arrays.update({} if self.scores is None else {"scores": self.scores})
        arrays.update({} if self.positives is None else {"positives": self.positives})
        with open(hidden, "wb") as f:
            np.savez(f, **arrays)
        os.replace(hidden, path)

    def head(self, k: int) -> Ranking:
        """The best ``k`` candidates of each query (itself when it holds no more)."""
        if self.ids.shape[1] <= k:
            return self
        scores = None if self.scores is None else self.scores[:, :k]
        return Ranking(ids=self.ids[:, :k], scores=scores, positives=self.positives)

    @classmethod
    def load(cls, path: Path) -> Ranking:
        with np.load(path) as z:
            return cls(
                ids=z["ids"],
                scores=z.get("scores"),
                positives=z.get("positives"),
            )


def mine_and_publish(
    root: str | Path,
    version: int,
    ranking: Ranking,
    ts: TrainingSet,
    cfg: MiningConfig,
    *,
    seed: int,
    keep_last: int,
    step: int,
    source: dict[str, Any],
    extra: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    teacher: OnlineTeacher | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Mine ``ranking`` with ``cfg``'s settings and ``seed`` and publish it as ``version``
    under the negatives folder ``root`` (trained on from ``step``; the newest ``keep_last``
    versions kept, 0: all). The manifest's meta is
    ``source`` (e.g. ``{"source": "bm25", "analyzer": ...}``), the data's fingerprint, the
    mining settings, the false-negative filter's counts (a ranking with scores), the own
    documents dropped (``identical_ids``: the flag, training queries whose id is a passage's,
    queries whose ranking held it), ``extra`` and the timings (``mine_s`` added). Returns
    (manifest, filter counts or None). With ``teacher`` (the online teacher) the version
    carries its scores of every query's positives and negatives."""
    timings = dict(timings or {})
    t0 = time.perf_counter()
    ids, filtered = ranking.ids, None
    own, identical = None, {"ignore_identical_ids": cfg.ignore_identical_ids}
    if cfg.ignore_identical_ids:  # eval's rule: a query's own document is never retrieved
        own = identical_passages(ts.query_ids, ts.passage_ids)
        ids, dropped_own = drop_identical(ids, own)
        identical.update(queries_in_corpus=int((own >= 0).sum()), dropped=dropped_own)
    if cfg.max_score_ratio > 0 and ranking.scores is not None and ranking.positives is not None:
        ids, dropped = drop_likely_positives(
            ids,
            ranking.scores,
            min_per_query(ranking.positives, ts.positives),
            cfg.max_score_ratio,
        )
        filtered = {
            "dropped": int(dropped.sum()),
            "queries_with_drops": int((dropped > 0).sum()),
            "mean_per_query": round(float(dropped.mean()), 3),
        }
    score_filters = _score_filters(cfg)
    if score_filters and ranking.scores is not None and ranking.positives is not None:
        ids, filtered_by = drop_by_scores(
            ids, ranking.scores, min_per_query(ranking.positives, ts.positives), **score_filters
        )
        filtered = {**(filtered or {}), "score_filters": filtered_by}
    negatives = mine(
        ids,
        ts.positives,
        cfg.num_negatives,
        strategy=cfg.strategy,
        skip_top=cfg.skip_top,
        seed=seed,
        num_passages=ts.num_passages,
        excluded=own,
    )
    timings["mine_s"] = timings.get("mine_s", 0.0) + time.perf_counter() - t0
    meta: dict[str, Any] = {**source, "data": ts.fingerprint(), "settings": mining_settings(cfg)}
    scores = None
    if teacher is not None:
        scores = teacher.scores(negatives)
        timings["teacher_s"] = teacher.seconds
        meta["teacher"] = teacher.record()
    if ranking.scores is not None:
        meta["false_negative_filter"] = filtered
    meta["identical_ids"] = identical
    meta.update(extra or {})
    meta["timings"] = {k: round(v, 3) for k, v in timings.items()}
    handoff.publish(
        root, version, negatives, step=step, meta=meta, keep_last=keep_last, scores=scores
    )
    manifest = json.loads(handoff.manifest_file(Path(root), version).read_text())
    return manifest, filtered


def _score_filters(cfg: MiningConfig) -> dict[str, float]:
    """The sentence-transformers filters ``cfg`` sets (``absolute_margin``, ``max_score``,
    ``min_score``; none by default)."""
    return {n: getattr(cfg, n) for n in SCORE_FILTERS if getattr(cfg, n) is not None}
