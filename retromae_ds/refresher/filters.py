"""Hard-negative filters and selection with sentence-transformers' names and meanings: the
one filter module behind ``retromae-ds mine`` and the refresher (``mining`` builds its
``max_score_ratio`` filter on ``relative_margin_drop``).

``select(ids_QK, scores_QK, positives, settings, ...)`` takes a dense ranking (row q: passage
indices best first, -1 in empty slots, and their scores) and, per query, in this order
(``mine_hard_negatives`` in ``sentence_transformers/util/hard_negatives.py``):

1. the candidates: the first ``depth`` ranks (``range_max`` + the most positives a query has
   + 1, ST's ``candidate_count``), or with ``range_for_sampling A-B`` (FlagEmbedding's, raw
   ranks) exactly ranks ``A .. B-1`` of the retrieved list (0-based, as FE slices it);
2. removed: empty slots, the query's own document (``excluded``), every positive (unless
   ``include_positives``, where positives keep their slots but are never written as
   negatives);
3. the score filters, each on what the previous ones left: ``absolute_margin`` drops a
   candidate whose score + margin exceeds the query's lowest positive score;
   ``relative_margin`` one above ``p - |p| · margin`` (p that lowest positive score);
   ``max_score`` one above the bound; ``min_score`` one below it;
4. the range: of the survivors, in rank order, the first ``range_max`` are kept and the first
   ``range_min`` of those skipped (ST's ranks count survivors; FE's raw range was step 1);
5. ``sampling_strategy top``: the next ``num_negatives``; ``random``: that many drawn without
   replacement (``numpy.random.default_rng([seed, q])``) and put back in rank order.

A query left with fewer than ``num_negatives`` is a shortfall: counted, never padded.
``Selection.removed`` counts the candidates each step removed; ``watch`` (a passage per query,
``--holdout_positive``'s hidden positive) is followed through every step (``Selection.watched``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SAMPLING = ("top", "random")
SCORE_FILTERS = ("absolute_margin", "relative_margin", "max_score", "min_score")
STEPS = ("empty", "identical_id", "positive", *SCORE_FILTERS, "range")
"""What removes a candidate, in the order ``select`` applies it."""


# --------------------------------------------------------------------------- the filters
def absolute_margin_drop(scores_QK: np.ndarray, positive_Q: np.ndarray, margin: float):
    """True where ``score + margin > p`` (p: the query's lowest positive score; NaN: never)."""
    return scores_QK + margin > np.asarray(positive_Q, dtype=np.float64)[:, None]


def relative_margin_drop(scores_QK: np.ndarray, positive_Q: np.ndarray, margin: float):
    """True where ``score > p - |p| · margin`` (sign-safe, as ST since its #3819; NaN p:
    never). The refresher's ``max_score_ratio`` r is margin ``1 - r``."""
    pos = np.asarray(positive_Q, dtype=np.float64)[:, None]
    return scores_QK > pos - margin * np.abs(pos)


def max_score_drop(scores_QK: np.ndarray, bound: float) -> np.ndarray:
    return scores_QK > bound


def min_score_drop(scores_QK: np.ndarray, bound: float) -> np.ndarray:
    return scores_QK < bound


def drop_by_scores(
    ranked_QK: np.ndarray,
    scores_QK: np.ndarray,
    positive_Q: np.ndarray,
    *,
    absolute_margin: float | None = None,
    max_score: float | None = None,
    min_score: float | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """``(ranked with -1 in place of every candidate a filter drops, candidates each
    dropped)``: the refresher's use of ``absolute_margin_drop``, ``max_score_drop`` and
    ``min_score_drop``, in ``select``'s order, each on what the previous ones left."""
    alive = ranked_QK >= 0
    counts = {}
    with np.errstate(invalid="ignore"):
        for name, value, mask in (
            (
                "absolute_margin",
                absolute_margin,
                lambda v: absolute_margin_drop(scores_QK, positive_Q, v),
            ),
            ("max_score", max_score, lambda v: max_score_drop(scores_QK, v)),
            ("min_score", min_score, lambda v: min_score_drop(scores_QK, v)),
        ):
            if value is not None:
                drop = alive & mask(value)
                counts[name] = int(drop.sum())
                alive &= ~drop
    return np.where(alive, ranked_QK, -1), counts


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class FilterSettings:
    """What ``select`` keeps (sentence-transformers' option names; errors name them as
    ``--name``)."""

    num_negatives: int = 3
    range_min: int = 0
    range_max: int | None = None
    sampling_strategy: str = "top"
    absolute_margin: float | None = None
    relative_margin: float | None = None
    max_score: float | None = None
    min_score: float | None = None
    include_positives: bool = False
    range_for_sampling: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_negatives < 1:
            raise ValueError(f"--num_negatives must be >= 1, not {self.num_negatives}")
        if self.sampling_strategy not in SAMPLING:
            raise ValueError(
                f"--sampling_strategy must be one of {SAMPLING}, not {self.sampling_strategy!r}"
            )
        if self.range_min < 0:
            raise ValueError(f"--range_min must be >= 0, not {self.range_min}")
        if self.range_max is not None and self.range_max <= self.range_min:
            raise ValueError(
                f"--range_max {self.range_max} must be above --range_min {self.range_min}"
            )
        if self.range_for_sampling:
            self.raw_range()  # checked here, once
            if self.range_min or self.range_max is not None:
                raise ValueError(
                    "--range_for_sampling (raw ranks, FlagEmbedding's) replaces --range_min "
                    "and --range_max (ranks among the candidates left, ST's): give one of them"
                )

    def raw_range(self) -> tuple[int, int] | None:
        """``range_for_sampling`` ``A-B`` as (A, B), or None."""
        if not self.range_for_sampling:
            return None
        try:
            a, b = (int(x) for x in self.range_for_sampling.split("-"))
        except ValueError:
            a = b = -1
        if not 0 <= a < b:
            raise ValueError(
                f"--range_for_sampling must be A-B with 0 <= A < B (raw ranks), not "
                f"{self.range_for_sampling!r}"
            )
        return a, b

    @property
    def score_filtered(self) -> bool:
        return any(getattr(self, name) is not None for name in SCORE_FILTERS)

    def resolved_range_max(self, max_positives: int) -> int:
        """``range_max``, or ST's default: ``range_min`` + n (10 n with a margin or
        ``max_score``) + the most positives a query has."""
        if self.range_max is not None:
            return self.range_max
        wide = any(
            getattr(self, name) is not None
            for name in ("absolute_margin", "relative_margin", "max_score")
        )
        return self.range_min + self.num_negatives * (10 if wide else 1) + max_positives

    def depth(self, max_positives: int) -> int:
        """Ranks retrieved per query: FE's B, or ST's ``range_max + max_positives + 1``."""
        raw = self.raw_range()
        if raw is not None:
            return raw[1]
        return self.resolved_range_max(max_positives) + max_positives + 1


# --------------------------------------------------------------------------- selection
@dataclass
class Selection:
    """Per query the negatives chosen (passage indices, their 1-based raw ranks and scores,
    best first), and what every step removed."""

    negatives: list[np.ndarray]
    ranks: list[np.ndarray]
    scores: list[np.ndarray]
    removed: dict[str, int]
    shortfall: int
    """Queries left with fewer than ``num_negatives``."""
    positives_selected: int = 0
    """``include_positives``: positives that took a slot (not written as negatives)."""
    watched: dict[str, int] = field(default_factory=dict)
    """For ``watch``: queries with one, how many were retrieved in the depth, removed by each
    step, and mined as a negative."""


def _positive_mask(ids_QK: np.ndarray, positives: Sequence[np.ndarray]) -> np.ndarray:
    """True where ``ids_QK[q, k]`` is a positive of query q (sorted keys, no Python loop over K)."""
    stride = (
        int(
            max(ids_QK.max(initial=-1), max((int(p.max()) for p in positives if len(p)), default=0))
        )
        + 2
    )
    keys = np.concatenate(
        [q * stride + np.asarray(p, dtype=np.int64) + 1 for q, p in enumerate(positives)]
        or [np.zeros(0, np.int64)]
    )
    keys = np.sort(keys)
    cand = np.arange(len(ids_QK), dtype=np.int64)[:, None] * stride + ids_QK + 1
    if not len(keys):
        return np.zeros(ids_QK.shape, dtype=bool)
    where = np.searchsorted(keys, cand).clip(max=len(keys) - 1)
    return keys[where] == cand


def select(
    ids_QK: np.ndarray,
    scores_QK: np.ndarray,
    positives: Sequence[np.ndarray],
    settings: FilterSettings,
    *,
    positive_min_Q: np.ndarray | None = None,
    excluded_Q: np.ndarray | None = None,
    watch_Q: np.ndarray | None = None,
) -> Selection:
    """The negatives of every query (see the module docstring). ``positive_min_Q``: the
    lowest positive score per query (NaN: unknown; the margins need it); ``excluded_Q``: its
    own document (-1: none); ``watch_Q``: a passage to follow per query (-1: none)."""
    s = settings
    if ids_QK.shape != scores_QK.shape or len(ids_QK) != len(positives):
        raise ValueError(
            f"ranking {ids_QK.shape}, scores {scores_QK.shape}, {len(positives)} queries"
        )
    max_pos = max((len(p) for p in positives), default=0)
    raw = s.raw_range()
    lo, hi = raw if raw else (0, s.depth(max_pos))
    ids = np.asarray(ids_QK[:, lo:hi], dtype=np.int64)
    scores = np.asarray(scores_QK[:, lo:hi])
    alive = np.ones(ids.shape, dtype=bool)
    removed = dict.fromkeys(STEPS, 0)
    gone_at = np.full(ids.shape, -1, dtype=np.int8)  # the step that removed each slot

    def drop(step: str, mask: np.ndarray) -> None:
        mask = mask & alive
        removed[step] += int(mask.sum())
        gone_at[mask] = STEPS.index(step)
        alive[mask] = False

    drop("empty", ids < 0)
    if excluded_Q is not None:
        drop("identical_id", (ids == np.asarray(excluded_Q)[:, None]) & (ids >= 0))
    is_pos = _positive_mask(ids, positives)
    if not s.include_positives:
        drop("positive", is_pos)
    margins = s.absolute_margin is not None or s.relative_margin is not None
    if margins and positive_min_Q is None:
        raise ValueError("the margins need the positives' scores")
    with np.errstate(invalid="ignore"):
        if s.absolute_margin is not None:
            drop("absolute_margin", absolute_margin_drop(scores, positive_min_Q, s.absolute_margin))
        if s.relative_margin is not None:
            drop("relative_margin", relative_margin_drop(scores, positive_min_Q, s.relative_margin))
        if s.max_score is not None:
            drop("max_score", max_score_drop(scores, s.max_score))
        if s.min_score is not None:
            drop("min_score", min_score_drop(scores, s.min_score))
    if raw is None:  # ST's range counts the candidates left
        rank_left = np.cumsum(alive, axis=1) - 1
        drop("range", (rank_left < s.range_min) | (rank_left >= s.resolved_range_max(max_pos)))
    return _sample(ids, scores, alive, is_pos, gone_at, lo, removed, s, watch_Q)


def _sample(
    ids: np.ndarray,
    scores: np.ndarray,
    alive: np.ndarray,
    is_pos: np.ndarray,
    gone_at: np.ndarray,
    lo: int,
    removed: dict[str, int],
    s: FilterSettings,
    watch_Q: np.ndarray | None,
) -> Selection:
    """Step 5 per query, and the watched passages' fate."""
    n = s.num_negatives
    out = Selection([], [], [], removed, 0)
    watched = {"queries": 0, "retrieved": 0, **{f"removed_by_{k}": 0 for k in STEPS}, "mined": 0}
    for q in range(len(ids)):
        cols = np.flatnonzero(alive[q])
        if s.sampling_strategy == "top":
            cols = cols[:n]
        elif len(cols) > n:
            rng = np.random.default_rng([s.seed, q])
            cols = np.sort(rng.choice(cols, size=n, replace=False))
        if s.include_positives:
            out.positives_selected += int(is_pos[q, cols].sum())
            cols = cols[~is_pos[q, cols]]
        out.negatives.append(ids[q, cols])
        out.ranks.append(cols + lo + 1)
        out.scores.append(scores[q, cols])
        out.shortfall += len(cols) < n
        if watch_Q is not None and watch_Q[q] >= 0:
            watched["queries"] += 1
            hit = np.flatnonzero(ids[q] == watch_Q[q])
            if len(hit):
                watched["retrieved"] += 1
                step = gone_at[q, hit[0]]
                if step >= 0:
                    watched[f"removed_by_{STEPS[step]}"] += 1
                elif hit[0] in cols:
                    watched["mined"] += 1
    if watch_Q is not None:
        out.watched = watched
    return out
