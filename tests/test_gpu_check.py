"""The GPU check's end-to-end steps still run: ``scripts/gpu_check.sh --cpu-smoke`` end to end.

The GPU check runs only where a GPU is lent (rarely), so its end-to-end steps would rot
unseen between sessions, as its benchmarks once did (tests/test_benchmarks.py). The smoke mode
runs the same commands on CPU at toy sizes: pre-training through the deepspeed launcher,
stopped at a checkpoint and resumed; ANCE fine-tuning with the local refresher mining from the
model; eval on two devices (here both the CPU). Each must report PASS with figures that say
so: the resumed losses bit-identical, a model-mined negatives version trained on, the two
nDCG@10 present and equal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
STEPS = ("pretrain", "finetune", "eval")


def test_gpu_time_limits_fit_one_device_call():
    """The GPU mode's step limits sum to at most 540 s, so a 10-minute device call returns."""
    line = next(line.strip() for line in SCRIPT.read_text().splitlines() if "T_TESTS=" in line)
    limits = dict(re.findall(r"(T_\w+)=(\d+)", line))
    assert set(limits) == {
        "T_TESTS",
        "T_PRETRAIN",
        "T_FINETUNE",
        "T_EVAL",
        "T_LONG",
        "T_ATTN",
        "T_TRAIN",
        "T_GC",
    }
    assert sum(map(int, limits.values())) <= 540, limits


@pytest.mark.slow
def test_cpu_smoke_runs_every_e2e_step_and_each_passes(tmp_path, shared_data, minilm_dir):
    if not (shared_data / "scifact" / "qrels" / "test.tsv").is_file():
        pytest.skip(f"SciFact is absent from {shared_data} (the finetune and eval steps need it)")
    results = tmp_path / "results"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "RETROMAE_DS_SHARED_DATA": str(shared_data),
        "GPU_CHECK_MINILM": str(minilm_dir),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "GPU_CHECK_BUNDLE": str(tmp_path / "results.tgz"),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpu-smoke", str(results)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = (results / "steps.txt").read_text().splitlines()
    for step in STEPS:
        assert any(line.startswith(f"PASS e2e_{step} ") for line in lines), lines
        assert (results / f"e2e_{step}.log").stat().st_size > 0
    assert "passed" in (results / "summary.txt").read_text().splitlines()[0]
    assert (tmp_path / "results.tgz").stat().st_size > 0
    result = {s: json.loads((results / f"e2e_{s}.json").read_text()) for s in STEPS}
    assert all(r["status"] == "PASS" for r in result.values()), result

    pretrain = result["pretrain"]
    assert pretrain["steps_compared"] == [4, 5, 6]
    assert pretrain["bit_identical"] and pretrain["max_abs_diff"] == 0.0
    assert pretrain["losses_resumed"] == pretrain["losses_straight"]
    assert Path(pretrain["checkpoint"], "COMPLETE").is_file()

    finetune = result["finetune"]
    mined = {int(v) for v, source in finetune["versions_published"].items() if source == "model"}
    assert finetune["versions_published"]["0"] == "bm25"
    # mine_first: the first step already trains on negatives the model mined at step 0
    assert mined & set(finetune["versions_used"]), finetune
    assert finetune["first_mined"]["step"] == 0
    assert (finetune["refresh_device"], finetune["refresh_search_backend"]) == ("cpu", "torch")
    assert finetune["first_mined"]["search_backend"] == "torch"

    evaluation = result["eval"]
    ndcg = evaluation["ndcg@10"]
    assert set(ndcg) == {"device", "cpu"} and all(0.3 < v <= 1 for v in ndcg.values()), ndcg
    assert evaluation["abs_diff"] == abs(ndcg["device"] - ndcg["cpu"]) <= 0.01
    assert evaluation["num_queries"] == 10
