"""The training core on its own: the run layout, the one resolver of "a run folder, a
checkpoint or a Hugging Face folder", the fault-injection seam, and the shared Trainer driven
by a toy task on a real DeepSpeed engine (hook order, accumulation, task state and losses
across a stop and resume)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from retromae_ds.base import faults
from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import RunLayout

from helpers_ance import ENV, REPO


def _fake_checkpoint(run: Path, step: int) -> Path:
    folder = RunLayout(run).checkpoint(step)
    (folder / "encoder").mkdir(parents=True)
    (folder / "encoder" / "config.json").write_text("{}")
    (folder / ckpt.COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    return folder


def test_resolve_encoder_prefers_a_runs_checkpoints_over_its_training_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run_dir": str(run)}))  # the training config
    _fake_checkpoint(run, 2)
    newest = _fake_checkpoint(run, 4)
    (RunLayout(run).staging(6) / "encoder").mkdir(parents=True)  # a partial one is never used
    assert ckpt.resolve_encoder(run) == newest / "encoder"
    assert ckpt.resolve_encoder(newest) == newest / "encoder"
    assert ckpt.resolve_checkpoint(run) == newest
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert ckpt.resolve_encoder(hf) == hf
    with pytest.raises(FileNotFoundError, match="neither"):
        ckpt.resolve_encoder(tmp_path / "empty")
    empty_run = tmp_path / "empty_run"
    RunLayout(empty_run).checkpoints.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="empty_run"):
        ckpt.resolve_encoder(empty_run)


def test_run_layout_names_every_file_under_the_run_folder(tmp_path):
    layout = RunLayout(tmp_path / "r")
    paths = [
        getattr(layout, name)
        for name in dir(RunLayout)
        if isinstance(getattr(RunLayout, name), property)
    ]
    assert len(paths) >= 11 and all(p.parent == layout.root for p in paths)
    assert layout.checkpoint(7).name == "step_00000007"
    assert layout.staging(7).name == "step_00000007.partial"


def test_fault_points_are_checked(monkeypatch):
    assert faults.env(sleep_after_step_s=0.1) == {faults.ENV: '{"sleep_after_step_s": 0.1}'}
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.env(sleep_after_stp_s=0.1)
    monkeypatch.setenv(faults.ENV, '{"crash_in_save": 3}')
    faults.plan.cache_clear()
    try:
        with pytest.raises(ValueError, match="unknown fault point"):
            faults.plan()
    finally:
        monkeypatch.delenv(faults.ENV)
        faults.plan.cache_clear()
    assert faults.plan() == {}
    faults.pause("sleep_after_step_s")  # no fault set: nothing happens
    faults.crash("crash_in_save_at_step", 3)


def _toy(run: Path, *args: str, env: dict[str, str] | None = None) -> list[dict]:
    cmd = [sys.executable, str(REPO / "tests" / "trainer_toy.py"), "--run_dir", str(run),
           "--progress", "false", "--log_every", "1", *args]  # fmt: skip
    result = subprocess.run(
        cmd, cwd=run.parent, env={**ENV, **(env or {})}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_trainer_hooks_accumulation_and_exact_resume_on_a_toy_task(tmp_path):
    common = ["--max_steps", "6", "--grad_accum", "2", "--micro_batch_size", "4",
              "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "0"]  # fmt: skip
    whole = _toy(tmp_path / "whole", *common)
    assert [r["step"] for r in whole] == [1, 2, 3, 4, 5, 6]
    assert all(r["samples_per_s"] > 0 and 0 <= r["close"] <= 1 for r in whole)
    assert [r["boundaries"] for r in whole] == [0, 1, 2, 3, 4, 5]  # logged before the boundary
    events = [json.loads(x) for x in (tmp_path / "whole" / "events.jsonl").read_text().splitlines()]
    # per step: the log row, then the step boundary, then (every 2nd step) the checkpoint
    kinds = [(e["kind"], e["step"]) for e in events]
    assert kinds[:5] == [("log", 1), ("after_step", 1), ("log", 2), ("after_step", 2),
                         ("write_models", 2)]  # fmt: skip
    assert kinds.count(("write_models", 6)) == 1  # the final checkpoint, written once
    record = ckpt.read_marker(RunLayout(tmp_path / "whole").checkpoint(6))
    assert {k: record[k] for k in ("step", "world_size", "objective")} == {
        "step": 6, "world_size": 1, "objective": "toy"}  # fmt: skip
    # the record lists every file with its size and sha256, and they verify
    assert "rank_00000.pt" in record["files"] and "weights.pt" in record["files"]
    ckpt.verify(RunLayout(tmp_path / "whole").checkpoint(6))
    # micro-batches of 4, two per step: the sampler consumed 8 samples a step
    state = ckpt.read_rank_state(RunLayout(tmp_path / "whole").checkpoint(4), 0)
    assert state["sampler"]["consumed"] == 32 and state["boundaries"] == 4

    _toy(tmp_path / "split", *common, "--stop_at_step", "3")
    resumed = _toy(tmp_path / "split", *common)
    events = [json.loads(x) for x in (tmp_path / "split" / "events.jsonl").read_text().splitlines()]
    assert {"kind": "resumed", "step": 3, "boundaries": 3} in events
    for a, b in zip(whole, resumed, strict=True):
        assert (a["step"], a["loss"], a["close"], a["boundaries"]) == (
            b["step"], b["loss"], b["close"], b["boundaries"])  # fmt: skip


@pytest.mark.slow
def test_logged_rates_leave_evaluations_out_even_inside_a_log_window(tmp_path):
    """Every step sleeps 0.2 s, so a window of 4 steps takes at least 0.8 s: no logged rate can
    exceed 16 samples / 0.8 s. Evaluations (2 s each) every 2 steps land inside the windows of
    4 and before step 1; counting them would put the rate below 16 / 2.8 s. (Before the fix an
    evaluation inside a window restarted its clock: the rate was that of half the window's
    samples over the other half's time, twice the truth.)"""
    env = {**faults.env(sleep_after_step_s=0.2), "TOY_EVAL_EVERY": "2", "TOY_EVAL_SLEEP_S": "2"}
    rows = _toy(tmp_path / "run", "--max_steps", "8", "--micro_batch_size", "4",
                "--log_every", "4", env=env)  # fmt: skip
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/toy" in r]
    assert [r["step"] for r in train] == [4, 8] and [r["step"] for r in evals] == [0, 2, 4, 6, 8]
    for row in train:
        assert 16 / 2.8 < row["samples_per_s"] <= 16 / 0.8, row
