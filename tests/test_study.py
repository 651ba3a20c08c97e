"""The study's bookkeeping (aggregation, verdicts, report, plot) on hand-made rows, and its
configuration checks. The protocol itself runs real training; its quick mode is exercised by
``scripts/study.py --quick`` (docs/results.md), not in the unit tests."""

from __future__ import annotations

import json

import pytest

from retromae_ds.study import StudyConfig, aggregate, quick_config, report, table, verdicts


def _row(objective, stage, seed, ndcg, start="scratch"):
    return {
        "start": start,
        "objective": objective,
        "seed": seed,
        "stage": stage,
        "metrics": {"ndcg@10": ndcg, "mrr@10": ndcg / 2, "recall@100": ndcg * 2},
    }


ROWS = (
    [_row("mlm", "zero_shot", s, x) for s, x in enumerate([0.10, 0.11, 0.12])]
    + [_row("retromae", "zero_shot", s, x) for s, x in enumerate([0.30, 0.31, 0.29])]
    + [_row("seed", "zero_shot", s, x) for s, x in enumerate([0.10, 0.13, 0.09])]
    + [_row("retromae", "bm25", s, x) for s, x in enumerate([0.40, 0.41, 0.42])]
    + [_row("retromae", "ance", s, x) for s, x in enumerate([0.35, 0.36, 0.34])]
)


def test_aggregate_is_mean_and_sample_std_over_seeds():
    agg = {(a["objective"], a["stage"]): a for a in aggregate(ROWS)}
    a = agg[("mlm", "zero_shot")]
    assert a["n"] == 3
    assert a["ndcg@10"] == pytest.approx(0.11)
    assert a["ndcg@10_std"] == pytest.approx(0.01)
    assert a["recall@100"] == pytest.approx(0.22)


def test_verdicts_state_agreement_and_disagreement_plainly():
    text = "\n".join(verdicts(aggregate(ROWS)))
    assert (
        "zero_shot: retromae 0.3000 vs mlm 0.1100 nDCG@10: higher (paper: retromae > mlm)" in text
    )
    assert "zero_shot: seed 0.1067 vs mlm 0.1100 nDCG@10: no clear difference" in text
    assert "retromae: ANCE 0.3500 vs BM25 negatives 0.4100: lower" in text


def test_report_writes_table_plot_and_json(tmp_path):
    body = report(ROWS, tmp_path, "t", "python scripts/study.py --quick")
    assert "| scratch | retromae | zero_shot | 3 | 0.3000 ± 0.0100" in body
    assert (tmp_path / "study.md").read_text() == body
    assert json.loads((tmp_path / "study_results.json").read_text())["rows"] == ROWS
    png = tmp_path / "study.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "study.png" in body
    assert table(aggregate(ROWS)).count("\n") == 2 + len(aggregate(ROWS)) - 1


def test_config_rejects_unknown_settings_and_quick_is_smaller():
    with pytest.raises(ValueError, match="unknown study settings"):
        StudyConfig(objectives=["mlm", "electra"])
    quick, full = quick_config("q"), StudyConfig()
    assert len(quick.seeds) >= 3
    assert quick.pretrain_steps["scratch"] < full.pretrain_steps["scratch"]
    assert set(quick.objectives) >= {"mlm", "retromae", "seed"}


def test_a_single_seed_gets_no_verdict():
    rows = [_row("mlm", "zero_shot", 0, 0.1), _row("retromae", "zero_shot", 0, 0.3)]
    (line,) = [v for v in verdicts(aggregate(rows)) if "retromae" in v and "mlm" in v]
    assert line.endswith("one seed, no error estimate: no verdict (paper: retromae > mlm)")
