"""GPU check, end-to-end step (a): pre-training through the ``deepspeed`` launcher, stopped
after a checkpoint and resumed exactly.

``retromae-ds preprocess`` turns the first documents of the built-in corpus (the standard
library's docstrings: real text on every machine, offline) into shards with a WordPiece it
trains; then ``deepspeed --num_gpus 1 --module retromae_ds.pretrain`` runs RetroMAE twice at
once on the one device: straight to ``steps``, and with ``--stop_at_step`` (the time-boxed job's
stop: a complete checkpoint, then exit); a third launch resumes the stopped run with
``--checkpoint.resume auto``. Passes when the resumed run took up its checkpoint and its metrics rows
after it equal the straight run's: bit for bit on CPU (as tests/test_train.py demands), within
``loss_tol`` on CUDA, where bf16 kernels need not be deterministic (the largest difference and
whether the rows were bit-identical are recorded either way).

    python scripts/gpu_e2e/pretrain_resume.py --device cuda --work /tmp/w --results results/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import (
    REPO,
    CheckFailed,
    Runner,
    cli,
    deepspeed_launcher,
    free_port,
    main,
    read_jsonl,
)

# cpu: the smoke mode's toy sizes (about 30 s on 2 cores); cuda: a real model on real batches
# that still fits the step's time limit with FlexAttention compiled in each fresh process
SIZES = {
    "cpu": dict(
        docs=300, vocab=2000, length=64, encoder="tiny", batch=8, steps=6, stop_at=3,
        precision="fp32", autocast="", loss_tol=0.0,
    ),
    "cuda": dict(
        docs=1000, vocab=8000, length=128, encoder="small", batch=32, steps=30, stop_at=15,
        precision="fp32", autocast="bf16", loss_tol=5e-3,
    ),
}  # fmt: skip
COMPARED = ("loss", "mlm_loss", "decoder_loss", "mlm_accuracy", "decoder_accuracy", "lr")
"""The metrics row fields a resumed step must reproduce (speed fields are wall-clock)."""


def step(args: argparse.Namespace, runner: Runner) -> tuple[str, dict]:
    size = SIZES[args.device]
    work = runner.work
    sys.path.insert(0, str(REPO))
    from retromae_ds.data.builtin_corpus import write_corpus

    docs = write_corpus(work / "corpus.jsonl", size["docs"])
    shards = work / "shards"
    runner.run(
        "preprocess",
        cli(
            "preprocess", str(work / "corpus.jsonl"), "--source.title_field", "title",
            "--train_tokenizer", str(size["vocab"]), "--max_length", str(size["length"]),
            "--out", str(shards), "--progress", "false",
        ),
    )  # fmt: skip
    common = [
        "--data.shards", str(shards), "--progress", "false", "--log_every", "1",
        "--model.encoder.name", size["encoder"],
        "--model.encoder.max_position_embeddings", str(size["length"]),
        "--micro_batch_size", str(size["batch"]), "--max_steps", str(size["steps"]),
        "--optim.lr", "1e-3", "--optim.warmup_steps", "2",
        "--checkpoint.every_steps", str(size["stop_at"]),
        "--deepspeed.config",
        json.dumps(["ds_configs/zero2.json", f"ds_configs/{size['precision']}.json"]),
        "--autocast", size["autocast"],
    ]  # fmt: skip

    def launch(name: str, run_dir: Path, *extra: str) -> None:
        runner.start(
            name,
            deepspeed_launcher(
                "--num_gpus", "1", "--master_port", str(free_port()),
                "--module", "retromae_ds.pretrain", "--run_dir", str(run_dir), *common, *extra,
            ),
        )  # fmt: skip

    straight, resumed = work / "straight", work / "resumed"
    # the straight run and the run to be stopped are independent: both at once on the device
    launch("straight", straight)
    launch("stopped", resumed, "--stop_at_step", str(size["stop_at"]))
    runner.wait("straight")
    runner.wait("stopped")
    checkpoint = resumed / "checkpoints" / f"step_{size['stop_at']:08d}"
    if not (checkpoint / "COMPLETE").is_file():
        raise CheckFailed(f"the stopped run left no complete checkpoint {checkpoint}")
    stopped_rows = read_jsonl(resumed / "metrics.jsonl")
    if [r["step"] for r in stopped_rows] != list(range(1, size["stop_at"] + 1)):
        raise CheckFailed(f"the stopped run logged steps {[r['step'] for r in stopped_rows]}")
    launch("resume", resumed)
    runner.wait("resume")
    took_up = f"resumed from {checkpoint} at step {size['stop_at']}"
    if took_up not in runner.log("resume").read_text(errors="replace"):
        raise CheckFailed(f"the resumed run does not say '{took_up}': {runner.log('resume')}")

    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    steps = list(range(1, size["steps"] + 1))
    if [r["step"] for r in a] != steps or [r["step"] for r in b] != steps:
        logged = {"straight": [r["step"] for r in a], "resumed": [r["step"] for r in b]}
        raise CheckFailed(f"logged steps {logged}, want each of 1..{size['steps']} once")
    after = [(x, y) for x, y in zip(a, b, strict=True) if x["step"] > size["stop_at"]]
    diffs = [abs(x[k] - y[k]) for x, y in after for k in COMPARED]
    max_diff = max(diffs)
    identical = all(x[k] == y[k] for x, y in after for k in COMPARED)
    figures = {
        "docs": docs,
        "sizes": size,
        "checkpoint": str(checkpoint),
        "steps_compared": [x["step"] for x, _ in after],
        "fields_compared": list(COMPARED),
        "bit_identical": identical,
        "max_abs_diff": max_diff,
        "loss_tol": size["loss_tol"],
        "losses_straight": [x["loss"] for x, _ in after],
        "losses_resumed": [y["loss"] for _, y in after],
        "first_loss": a[0]["loss"],
        "last_loss": a[-1]["loss"],
    }
    verdict = (
        f"resumed at step {size['stop_at']} of {size['steps']} ({size['encoder']}, "
        f"{size['precision']}, deepspeed launcher): steps {after[0][0]['step']}-"
        f"{after[-1][0]['step']} {'bit-identical' if identical else 'differ'} to the straight "
        f"run, max |diff| {max_diff:.3g} (tolerance {size['loss_tol']:g}); loss "
        f"{a[0]['loss']:.3f} -> {a[-1]['loss']:.3f}"
    )
    if max_diff > size["loss_tol"]:
        raise CheckFailed(verdict, figures)
    return verdict, figures


if __name__ == "__main__":
    sys.exit(main("pretrain", step))
