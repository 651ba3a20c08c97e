"""Denoising mined negatives with a cross-encoder's scores (RocketQA's idea: a mined negative
the teacher scores as relevant is likely an unlabelled positive, a false negative).

A query's candidates (its mined negatives) carry cross-encoder logits ``c``; its labelled
positives carry logits too, ``p`` the lowest of them. ``DenoiseSettings.mode`` says which
candidates are false negatives:

- ``threshold``: ``sigmoid(c) > threshold`` (RocketQA drops negatives its cross-encoder scores
  above 0.9 as relevant; the issue's 0.1 is on the same probability scale: the default);
- ``margin``: ``c > p - margin`` (within ``margin`` logits of the weakest positive, or above it);
- ``relative_margin``: ``c > p - |p| * margin``.

``action`` says what happens to them: ``drop`` (the negative is removed), ``relabel`` (it
becomes a positive of the query) or ``drop_query`` (a query with any is left out).

Thresholds from data: with held-out positives (``mine --holdout_positive`` hides one labelled
positive of each query that has two or more), every candidate of such a query is labelled (the
hidden positive, or not). ``detection`` gives the precision and recall of a rule over those
candidates, and ``fit_threshold`` the rule's value with the best F1 on them (the precision is a
lower bound: a flagged candidate that is not the hidden positive may still be an unlabelled
positive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MODES = ("none", "threshold", "margin", "relative_margin")
ACTIONS = ("drop", "relabel", "drop_query")


@dataclass(kw_only=True)
class DenoiseSettings:
    mode: str = "none"
    """none, threshold (on the cross-encoder's probability), margin or relative_margin
    (against the query's weakest positive's logit)."""
    value: float | None = None
    """The threshold (default 0.1), or the margin (default 0)."""
    action: str = "drop"
    """drop the false negative, relabel it as a positive, or drop_query."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--denoise must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.action not in ACTIONS:
            raise ValueError(
                f"--denoise_action must be one of {', '.join(ACTIONS)}, not {self.action!r}"
            )
        if self.mode == "threshold" and self.value is not None and not 0 <= self.value <= 1:
            raise ValueError(f"--denoise_value for threshold is a probability, not {self.value}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def resolved_value(self) -> float:
        if self.value is not None:
            return self.value
        return 0.1 if self.mode == "threshold" else 0.0


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def statistic(mode: str, candidate: np.ndarray, weakest_positive: float) -> np.ndarray:
    """What ``mode`` compares with its value: the probability (threshold), or how far the
    candidate's logit is from the weakest positive's (margin: ``c - p``; relative_margin:
    ``(c - p) / |p|``); a candidate is flagged where it is above ``-value`` (margins) or
    ``value`` (threshold)."""
    c = np.asarray(candidate, dtype=np.float64)
    if mode == "threshold":
        return sigmoid(c)
    if mode == "margin":
        return c - weakest_positive
    return (c - weakest_positive) / max(abs(weakest_positive), 1e-12)


def flagged(s: DenoiseSettings, candidate: np.ndarray, weakest_positive: float) -> np.ndarray:
    """Bool per candidate: a false negative under ``s``."""
    if not s.enabled:
        return np.zeros(len(candidate), dtype=bool)
    stat = statistic(s.mode, candidate, weakest_positive)
    cut = s.resolved_value if s.mode == "threshold" else -s.resolved_value
    return stat > cut


def detection(flags: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """Precision, recall and F1 of ``flags`` against ``labels`` (both bool over candidates)."""
    flags, labels = np.asarray(flags, bool), np.asarray(labels, bool)
    hit = int((flags & labels).sum())
    n_flag, n_label = int(flags.sum()), int(labels.sum())
    precision = hit / n_flag if n_flag else None
    recall = hit / n_label if n_label else None
    f1 = (
        2 * precision * recall / (precision + recall)
        if precision is not None and recall is not None and precision + recall > 0
        else 0.0
    )
    return {
        "candidates": int(len(flags)), "flagged": n_flag, "labelled": n_label, "hits": hit,
        "precision": None if precision is None else round(precision, 6),
        "recall": None if recall is None else round(recall, 6), "f1": round(f1, 6),
    }  # fmt: skip


def fit_threshold(mode: str, stats: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """The value of ``mode`` with the best F1 on labelled candidates (``stats``: each
    candidate's ``statistic``), and its detection figures; ties go to the stricter rule (the
    higher cut, fewer flagged). ``curve`` samples the trade-off at up to 11 cuts."""
    stats, labels = np.asarray(stats, np.float64), np.asarray(labels, bool)
    if not labels.any():
        raise ValueError(
            "no held-out positive came back among the candidates: nothing to fit a denoising "
            "threshold on (mine with --holdout_positive on queries with two or more positives)"
        )
    cuts = np.unique(stats)[::-1]  # flag stat >= cut, i.e. > the next lower value
    best: tuple[float, float] | None = None
    for cut in cuts:
        f1 = detection(stats >= cut, labels)["f1"]
        if best is None or f1 > best[1]:
            best = (float(cut), f1)
    assert best is not None
    # as a strict ">" rule: just below the chosen cut
    below = stats[stats < best[0]]
    edge = (best[0] + below.max()) / 2 if len(below) else best[0] - 1e-6
    value = edge if mode == "threshold" else -edge
    curve = []
    for cut in np.quantile(stats, np.linspace(0, 1, 11)):
        d = detection(stats > cut, labels)
        curve.append(
            {"cut": round(float(cut), 6), "precision": d["precision"], "recall": d["recall"]}
        )
    return {"value": float(value), **detection(stats > edge, labels), "curve": curve}


# --------------------------------------------------------------------------- mine's use
@dataclass
class Judged:
    """A cross-encoder's view of mined negatives: per query, the logits of its visible
    positives and of each selected candidate (aligned with ``Selection.negatives``), the
    candidates flagged as false negatives, and the figures the manifest records."""

    positive: list[np.ndarray]
    candidate: list[np.ndarray]
    flags: list[np.ndarray]
    record: dict[str, Any]


def judge(
    scorer: Any,
    queries: list[str],
    passages: Any,
    positives: list[np.ndarray],
    candidates: list[np.ndarray],
    settings: DenoiseSettings,
    *,
    watch: np.ndarray | None = None,
    fit: bool = False,
) -> Judged:
    """Score every query's visible ``positives`` and ``candidates`` (passage indices; texts
    ``queries[q]``, ``passages[i]``) with ``scorer`` (``retrieval.cross_encoder.
    CrossEncoderScorer``), flag false negatives under ``settings`` and, with ``watch`` (the
    held-out positive of each query, or -1), measure the rule's detection of them, fitting
    its value first with ``fit``."""
    q_texts, p_texts, sizes = [], [], []
    for q, (pos, cand) in enumerate(zip(positives, candidates, strict=True)):
        rows = [*np.asarray(pos).tolist(), *np.asarray(cand).tolist()]
        q_texts += [queries[q]] * len(rows)
        p_texts += [passages[i] for i in rows]
        sizes.append(len(pos))
    flat = scorer(q_texts, p_texts)
    pos_s, cand_s, at = [], [], 0
    for n_pos, cand in zip(sizes, candidates, strict=True):
        pos_s.append(flat[at : at + n_pos])
        cand_s.append(flat[at + n_pos : at + n_pos + len(cand)])
        at += n_pos + len(cand)
    weakest = [float(p.min()) if len(p) else float("inf") for p in pos_s]
    record: dict[str, Any] = {"mode": settings.mode, "action": settings.action}
    if watch is not None and settings.enabled:
        held = [q for q in range(len(candidates)) if watch[q] >= 0]
        labels = np.concatenate(
            [np.asarray(candidates[q]) == watch[q] for q in held] or [np.zeros(0, bool)]
        )
        stats = np.concatenate(
            [statistic(settings.mode, cand_s[q], weakest[q]) for q in held] or [np.zeros(0)]
        )
        if fit:
            fitted = fit_threshold(settings.mode, stats, labels)
            record["fitted"] = fitted
            settings = DenoiseSettings(mode=settings.mode, value=fitted["value"],
                                       action=settings.action)  # fmt: skip
        cut = settings.resolved_value if settings.mode == "threshold" else -settings.resolved_value
        record["holdout_detection"] = detection(stats > cut, labels)
    flags = [flagged(settings, c, w) for c, w in zip(cand_s, weakest, strict=True)]
    record["value"] = settings.resolved_value if settings.enabled else None
    record["flagged"] = int(sum(int(f.sum()) for f in flags))
    record["queries_flagged"] = int(sum(bool(f.any()) for f in flags))
    return Judged(pos_s, cand_s, flags, record)
