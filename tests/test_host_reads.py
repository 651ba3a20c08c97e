"""No host synchronisation per step: ``Trainer.fit`` reads nothing back from the device except
at its sync steps (log rows, checkpoints, the last step).

Each run goes through tests/host_reads.py, which counts every tensor method that hands a value
to Python (on a GPU each one waits for the queued work) inside ``Trainer.fit``, outside the
batch iterator, per optimizer step. 20 steps with a log row every 10: reads may happen at
steps 10 and 20 only. Pre-training (RetroMAE and MLM) and fine-tuning run on DeepSpeed's
ZeRO-0 fp32 engine (its optimizer step reads nothing; bf16 and ZeRO-1/2 read per step inside
DeepSpeed, which the last test pins down so a change there is seen).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_train import ENV, REPO, synthetic_shards

from helpers_ance import write_synthetic_beir, write_tiny_encoder

pytestmark = pytest.mark.slow

ZERO0 = '["ds_configs/zero0.json", "ds_configs/fp32.json"]'
SYNC_STEPS = {10, 20}


def _reads(tmp_path: Path, job: str, *args: str) -> tuple[int, list[tuple[int, str, str]]]:
    out = tmp_path / f"{job}_reads.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "host_reads.py"), str(out), job, *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    return data["steps"], [tuple(r) for r in data["reads"]]


def _between_sync_steps(reads):
    return collections.Counter((op, where) for step, op, where in reads if step not in SYNC_STEPS)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_dir) -> Path:
    return synthetic_shards(tmp_path_factory.mktemp("reads"), tokenizer_dir, 120, seed=0)


def _pretrain_args(run: Path, shards: Path, *extra: str) -> list[str]:
    return [
        "--data.shards", str(shards), "--run_dir", str(run), "--progress", "false",
        "--model.encoder.name", "tiny", "--model.encoder.max_position_embeddings", "64",
        "--micro_batch_size", "8", "--max_steps", "20", "--log_every", "10",
        "--checkpoint.every_steps", "10", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "objective, precision",
    [
        ("retromae", []),
        ("mlm", []),
        ("retromae", ["--autocast", "bf16"]),
        ("retromae", ["--data.packing", "true"]),
        ("seed", ["--data.packing", "true"]),
        ("dupmae", ["--data.packing", "true"]),
    ],
    ids=[
        "retromae",
        "mlm",
        "retromae-autocast-bf16",
        "retromae-packed",
        "seed-packed",
        "dupmae-packed",
    ],
)
def test_pretraining_reads_from_the_device_only_at_log_rows_and_checkpoints(
    tmp_path, shards, objective, precision
):
    steps, reads = _reads(
        tmp_path,
        "pretrain",
        *_pretrain_args(
            tmp_path / "run",
            shards,
            "--model.objective.name",
            objective,
            "--deepspeed.config",
            ZERO0,
            "--grad_accum",
            "2",
            *precision,
        ),  # fmt: skip
    )
    assert steps == 20
    assert not _between_sync_steps(reads), _between_sync_steps(reads)
    ours = [r for r in reads if "retromae_ds" in r[2]]
    per_row = collections.Counter(step for step, _, _ in ours)
    # the checks (one read), the counts, the means, the rates, the token totals
    assert set(per_row) == SYNC_STEPS and max(per_row.values()) <= 5, per_row
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [10, 20]
    for row in train_rows:  # the padding share of what was computed, reported per row
        assert 0.0 < row["pad_fraction"] < 1.0
        assert row["tokens_per_s"] == pytest.approx(row["slots_per_s"] * (1 - row["pad_fraction"]))
    assert train_rows[-1]["tokens_seen"] < train_rows[-1]["slots_seen"]


def test_finetuning_reads_from_the_device_only_at_log_rows_and_checkpoints(tmp_path, tokenizer_dir):
    beir = write_synthetic_beir(tmp_path / "beir", num_docs=90, num_queries=28)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    steps, reads = _reads(
        tmp_path,
        "finetune",
        "--run_dir", str(tmp_path / "run"), "--progress", "false",
        "--data.beir", str(beir), "--model.init", str(encoder),
        "--data.q_max_len", "16", "--data.p_max_len", "32", "--micro_batch_size", "3",
        "--negatives.n_hard", "2", "--refresh.mining.num_negatives", "3",
        "--max_steps", "20", "--log_every", "10", "--checkpoint.every_steps", "10",
        "--negatives.refresh_every", "5", "--deepspeed.config", ZERO0,
    )  # fmt: skip
    assert steps == 20
    assert not _between_sync_steps(reads), _between_sync_steps(reads)


def test_a_non_finite_loss_between_log_rows_still_never_reaches_a_checkpoint(tmp_path, shards):
    """The loss check runs at sync steps only (here: checkpoints every 3 steps, a log row
    every 10): a loss that turns non-finite between them is found at the next one, named
    with the step it happened at, and no checkpoint holds that state."""
    from retromae_ds.components import checkpoint as ckpt

    run = tmp_path / "run"
    args = _pretrain_args(
        run, shards, "--deepspeed.config", ZERO0, "--checkpoint.every_steps", "3",
        "--optim.lr", "1e30", "--optim.warmup_steps", "4",
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "retromae_ds.pretrain", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    line = [x for x in result.stderr.splitlines() if "error:" in x][-1]
    bad = int(line.split("non-finite loss at step ")[1].split()[0])
    found = int(line.split("found at step ")[1].split(")")[0])
    assert found >= bad and (found % 3 == 0 or found == 20), line
    saved = [int(p.name[5:]) for p in ckpt.complete_checkpoints(run / "checkpoints")]
    assert all(step < bad for step in saved), (saved, line)


def test_deepspeeds_own_reads_per_step_are_known(tmp_path, shards):
    """ZeRO-2 (the default config) reads inside DeepSpeed's optimizer step (the gradient
    norm's finiteness for the overflow check and clipping): a GPU waits there every step. None
    of those reads is this project's; the count is pinned so a DeepSpeed change is seen."""
    _, reads = _reads(
        tmp_path, "pretrain", *_pretrain_args(tmp_path / "run", shards, "--max_steps", "3")
    )
    per_step = _between_sync_steps([r for r in reads if r[0] == 1])
    assert per_step and all("deepspeed" in where for _, where in per_step), per_step
    assert not any("retromae_ds" in where for _, where in per_step)
    # each Python-level read also shows as the aten._local_scalar_dense beneath it
    python_level = {k: n for k, n in per_step.items() if not k[0].startswith("aten.")}
    assert 1 <= sum(python_level.values()) <= 4, per_step


def test_autocast_refuses_a_deepspeed_config_that_casts_the_weights(tmp_path, shards):
    bf16 = '["ds_configs/zero0.json", "ds_configs/bf16.json"]'
    args = _pretrain_args(
        tmp_path / "run", shards, "--autocast", "bf16", "--deepspeed.config", bf16
    )
    result = subprocess.run(
        [sys.executable, "-m", "retromae_ds.pretrain", *args],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "autocast bf16 keeps fp32 weights" in result.stderr.splitlines()[-1]


@pytest.mark.parametrize("objective", ["retromae", "dupmae", "seed", "mlm"])
def test_gathering_predictions_by_position_equals_the_boolean_mask(objective):
    """The collator's flat label positions (a gather whose size the host knows) give the same
    losses and gradients, bit for bit, as the boolean mask they replace (whose nonzero makes
    a GPU wait)."""
    import torch

    from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
    from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

    from helpers_model import SPECIAL, batch_of

    batch = batch_of([9, 40, 17, 3])
    assert batch["label_positions"].numel() == int((batch["labels"] != -100).sum())
    results = []
    for keep in (True, False):
        torch.manual_seed(0)
        encoder = build_encoder(
            EncoderConfig(name="tiny", dropout=0.0), SPECIAL.vocab_size, SPECIAL.pad
        )
        model = PretrainModel(encoder, ObjectiveConfig(name=objective))
        given = {k: v for k, v in batch.items() if keep or not k.endswith("label_positions")}
        out = model(given)
        out["loss"].backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((out["loss"].detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) and all(
        torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True)
    )
