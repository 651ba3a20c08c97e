"""The Slurm scripts' submitting side, without a cluster: time-limit parsing and the refusal
of a time limit shorter than the stop-signal lead (which would make a job stop and requeue
itself in a loop). The jobs themselves run on a real cluster in tests/test_slurm.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SLURM = Path(__file__).resolve().parents[1] / "slurm"


@pytest.mark.parametrize(
    "spec,seconds",
    [("5", 300), ("5:30", 330), ("1:00:00", 3600), ("2-0", 172800), ("1-2:03", 93780),
     ("1-02:03:04", 93784), ("08", 480), ("UNLIMITED", None)],
)  # fmt: skip
def test_slurm_time_specs_in_seconds(spec, seconds):
    out = subprocess.run(
        ["bash", "-c", f'. "{SLURM}/lib.sh"; slurm_seconds "$1"', "_", spec],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == ("" if seconds is None else str(seconds))


@pytest.mark.parametrize("script", ["pretrain.sh", "finetune.sh"])
def test_a_time_limit_inside_the_signal_lead_is_refused(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = "/usr/bin:/bin"  # no sbatch needed: the script must stop before submitting
    args = ["--time", "4", "--run-dir", str(tmp_path / "run")]
    if script == "finetune.sh":
        args += ["--config", str(tmp_path / "ft.yaml")]
        (tmp_path / "ft.yaml").write_text("max_steps: 1\n")
    result = subprocess.run(
        ["bash", str(SLURM / script), *args], capture_output=True, text=True, env=env, timeout=30
    )
    assert result.returncode == 2, result.stderr
    assert "not longer than the stop-signal lead" in result.stderr
