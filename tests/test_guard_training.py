"""Issue 27's training-side defects, each on the real trainer: a full disk while saving a
checkpoint (a real tmpfs), a rerun that repeats no metrics row, a read-only run folder refused
before the engine starts, config files and ``RETROMAE_DS_DEBUG`` as a user meets them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers_disk import fill, small_disk
from helpers_train import ENV, REPO, metrics, pretrain
from helpers_train import synthetic_shards as make_shards

from retromae_ds.components import checkpoint as ckpt


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_dir):
    return make_shards(tmp_path_factory.mktemp("guard_shards"), tokenizer_dir, 300, seed=4)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


def _steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "loss" in r]


@pytest.mark.slow
def test_disk_full_while_saving_a_checkpoint_is_one_line_and_the_rerun_repeats_no_row(shards):
    every = ("--checkpoint.every_steps", "2", "--log_every", "1")
    with small_disk("96m") as disk:
        run = disk / "run"
        pretrain(run, shards, "--max_steps", "4", *every)
        record = ckpt.read_marker(run / "checkpoints" / "step_00000004")
        size = sum(f["bytes"] for f in record["files"].values())
        ballast = fill(disk, leave=size // 2)  # room for the rows of steps 5-6, not a checkpoint

        full = pretrain(run, shards, "--max_steps", "8", *every, check=False)
        assert full.returncode == 1, full.stderr[-3000:]
        assert "Traceback" not in full.stderr, full.stderr[-3000:]
        (line,) = _error_lines(full.stderr)
        assert line.startswith(f"retromae-ds pretrain: error: {run / 'checkpoints'}: no space")
        assert "checkpoint of step 6" in line and "MB free" in line and "needs about" in line
        assert "step 4) is intact" in line
        assert not (run / "checkpoints" / "step_00000006.partial").exists()  # space given back
        newest = ckpt.latest_complete(run / "checkpoints")
        assert newest.name == "step_00000004"
        ckpt.verify(newest)
        assert _steps(metrics(run)) == [1, 2, 3, 4, 5, 6]  # the failed run logged 5 and 6

        ballast.unlink()
        pretrain(run, shards, "--max_steps", "8", *every)
        rows = metrics(run)
        assert _steps(rows) == list(range(1, 9))  # no step twice
        superseded = [
            json.loads(x) for x in (run / "metrics.superseded.jsonl").read_text().splitlines()
        ]
        assert _steps(superseded) == [5, 6]
        # nothing lost: the resumed steps compute what the failed run computed
        again = {r["step"]: r["loss"] for r in rows}
        assert [again[r["step"]] for r in superseded] == [r["loss"] for r in superseded]
        assert ckpt.latest_complete(run / "checkpoints").name == "step_00000008"


def _train(run, shards) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "retromae_ds.pretrain", "--data.shards", str(shards),
           "--run_dir", str(run), "--max_steps", "4", "--progress", "false",
           "--model.encoder.name", "tiny", "--model.encoder.max_position_embeddings", "64"]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_read_only_run_folder_is_refused_before_the_engine_starts(tmp_path, shards):
    import os

    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    run = tmp_path / "run"
    pretrain(run, shards, "--max_steps", "2")
    before = sorted(p.name for p in run.iterdir())
    subprocess.run(["mount", "--bind", str(run), str(run)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(run)], check=True)
        result = _train(run, shards)
    finally:
        subprocess.run(["umount", str(run)], check=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = _error_lines(result.stderr)
    assert str(run) in line and "cannot be written" in line and "Read-only" in line
    assert sorted(p.name for p in run.iterdir()) == before

    # a run folder that cannot even be created: its parent is read-only
    parent = tmp_path / "ro_parent"
    parent.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(parent)], check=True)
    try:
        bad = _train(parent / "run", shards)
    finally:
        subprocess.run(["umount", str(parent)], check=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    (line,) = _error_lines(bad.stderr)
    assert str(parent / "run") in line and "cannot be written" in line


def test_a_malformed_config_file_is_named_with_its_line(tmp_path):
    cases = {
        "job.json": ('{"max_steps": 2,\n "optim": {"lr": 1e-3,}\n}', ":2:", "not valid JSON"),
        "job.yaml": ("max_steps: 2\noptim: [1\nlr: 3", ":3:", "not valid YAML"),
        "job.yml": ("max_steps: 2\n\xff", "", "not UTF-8"),
    }
    for name, (text, where, what) in cases.items():
        path = tmp_path / name
        path.write_bytes(text.encode("latin-1"))
        for prog in ("pretrain", "finetune"):
            result = subprocess.run(
                [sys.executable, "-m", "retromae_ds.cli", prog, "--config", str(path)],
                cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert result.returncode == 2, result.stderr[-2000:]
            (line,) = result.stderr.strip().splitlines()
            assert line.startswith(f"retromae-ds {prog}: error: {path}{where}"), line
            assert what in line


@pytest.mark.parametrize("value", ["0", "off"])
def test_debug_zero_means_off(tmp_path, value):
    cmd = [sys.executable, "-m", "retromae_ds.cli", "pretrain", "--run_dir", str(tmp_path),
           "--optim.lrr", "1"]  # fmt: skip
    result = subprocess.run(
        cmd, cwd=REPO, env={**ENV, "RETROMAE_DS_DEBUG": value}, capture_output=True, text=True
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "retromae-ds pretrain: error: unknown config field(s): optim.lrr"
    ]
    others = (["export", str(tmp_path / "nothing"), str(tmp_path / "out")],
              ["refresh", "--run_dir", ""])  # fmt: skip
    module = ["-m", "retromae_ds.cli"]
    # the local refresher and slurm/finetune.sh run the refresher as its own module
    refresher = (["-m", "retromae_ds.refresh"], ["--run_dir", ""])
    runs = [(module, c) for c in others] + [refresher]
    for launcher, command in runs if value == "0" else ():
        other = subprocess.run(
            [sys.executable, *launcher, *command],
            cwd=REPO, env={**ENV, "RETROMAE_DS_DEBUG": value}, capture_output=True, text=True,
        )  # fmt: skip
        assert other.returncode != 0 and "Traceback" not in other.stderr, other.stderr
        assert len(_error_lines(other.stderr)) == 1
    shown = subprocess.run(
        cmd, cwd=REPO, env={**ENV, "RETROMAE_DS_DEBUG": "1"}, capture_output=True, text=True
    )
    assert shown.returncode != 0 and "Traceback" in shown.stderr
