"""Denoising rules (``retromae_ds.refresher.denoise``) against a plain-Python oracle, and the
threshold fitted on labelled candidates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from retromae_ds.refresher.denoise import (
    DenoiseSettings,
    detection,
    fit_threshold,
    flagged,
    statistic,
)


def oracle(mode: str, value: float, c: float, p: float) -> bool:
    if mode == "threshold":
        return 1 / (1 + math.exp(-c)) > value
    if mode == "margin":
        return c > p - value
    return c > p - abs(p) * value


@pytest.mark.parametrize("mode, value", [("threshold", 0.1), ("threshold", 0.9),
                                         ("margin", 0.0), ("margin", 1.5),
                                         ("relative_margin", 0.2)])  # fmt: skip
def test_rules_match_the_oracle(mode, value):
    rng = np.random.default_rng(0)
    for _ in range(50):
        c = rng.normal(0, 3, size=12)
        p = float(rng.normal(2, 2))
        got = flagged(DenoiseSettings(mode=mode, value=value), c, p)
        assert got.tolist() == [oracle(mode, value, float(x), p) for x in c]


def test_defaults_and_refusals():
    assert DenoiseSettings(mode="threshold").resolved_value == 0.1
    assert DenoiseSettings(mode="margin").resolved_value == 0.0
    assert not flagged(DenoiseSettings(), np.array([9.0]), 0.0).any()
    with pytest.raises(ValueError, match="--denoise must be"):
        DenoiseSettings(mode="rocketqa")
    with pytest.raises(ValueError, match="--denoise_action"):
        DenoiseSettings(mode="margin", action="keep")
    with pytest.raises(ValueError, match="probability"):
        DenoiseSettings(mode="threshold", value=2.0)


def test_detection_counts():
    d = detection(np.array([1, 1, 0, 0, 1], bool), np.array([1, 0, 1, 0, 0], bool))
    assert (d["hits"], d["flagged"], d["labelled"]) == (1, 3, 2)
    assert d["precision"] == pytest.approx(1 / 3) and d["recall"] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["threshold", "margin"])
def test_fitted_value_separates_labelled_candidates(mode):
    """Candidates above a gap are the labelled ones: the fit finds a cut in the gap, and the
    rule it gives flags exactly them (F1 1)."""
    rng = np.random.default_rng(1)
    c = np.concatenate([rng.uniform(-6, -1, 40), rng.uniform(2, 5, 6)])
    labels = np.arange(46) >= 40
    p = 3.0
    fit = fit_threshold(mode, statistic(mode, c, p), labels)
    assert fit["f1"] == 1.0 and fit["precision"] == 1.0 and fit["recall"] == 1.0
    rule = DenoiseSettings(mode=mode, value=fit["value"])
    assert flagged(rule, c, p).tolist() == labels.tolist()
    assert len(fit["curve"]) == 11


def test_nothing_to_fit_is_refused():
    with pytest.raises(ValueError, match="holdout_positive"):
        fit_threshold("threshold", np.array([0.1, 0.2]), np.array([False, False]))
