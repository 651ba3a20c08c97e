"""Training throughput on this machine: tokens/s of a pre-training step, side by side.

For each encoder size (``tiny``, ``small``) and objective (RetroMAE, MLM) it times the same
batches through

- ``torch``: a plain PyTorch loop (forward, backward, AdamW step): the baseline;
- ``deepspeed``: the project's DeepSpeed engine (one process, ZeRO-2, fp32 on CPU),

and reports tokens/s and the ratio DeepSpeed / plain torch (the engine's overhead), plus the
cost of RetroMAE's decoder as the ratio RetroMAE / MLM. Best of ``--repeats`` timed windows.

    python benchmarks/bench_train.py [--sizes tiny small] [--steps 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from retromae_ds import engine as eng  # noqa: E402
from retromae_ds.data.collate import MaskingConfig, PretrainCollator, SpecialIds  # noqa: E402
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder  # noqa: E402
from retromae_ds.modeling.pretrain import ObjectiveConfig, PretrainModel  # noqa: E402
from retromae_ds.train import OptimConfig, build_optimizer  # noqa: E402

VOCAB = 8000
SPECIAL = SpecialIds(cls=2, sep=3, pad=0, mask=4, all=(0, 1, 2, 3, 4), vocab_size=VOCAB)


def make_batches(n: int, batch: int, length: int, decoder: bool) -> list[dict[str, torch.Tensor]]:
    """Full-length rows of Zipf-distributed ids with realistic word starts."""
    rng = np.random.default_rng(0)
    collator = PretrainCollator(SPECIAL, MaskingConfig(), length, decoder=decoder)
    out = []
    for b in range(n):
        items = []
        for r in range(batch):
            ids = (rng.zipf(1.3, length - 2) % (VOCAB - 5) + 5).astype(np.int32)
            starts = (rng.random(length - 2) < 0.75).astype(np.uint8)
            items.append((b * batch + r, ids, starts))
        out.append(collator(items))
    return out


def build(size: str, objective: str, length: int) -> PretrainModel:
    torch.manual_seed(0)
    encoder = build_encoder(EncoderConfig(name=size, max_position_embeddings=length), VOCAB, 0)
    return PretrainModel(encoder, ObjectiveConfig(name=objective), 0.5)


def time_torch(model, batches, steps: int, repeats: int) -> float:
    opt = build_optimizer(model, OptimConfig())
    best = float("inf")
    for rep in range(repeats + 1):  # the first window warms up
        t = time.perf_counter()
        for i in range(steps):
            out = model(batches[i % len(batches)])
            out["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rep:
            best = min(best, time.perf_counter() - t)
    return best


def time_deepspeed(model, batches, steps: int, repeats: int, micro: int) -> float:
    opt = build_optimizer(model, OptimConfig())
    ds = eng.build_ds_config(
        ["ds_configs/zero2.json", "ds_configs/fp32.json"],
        micro_batch=micro,
        grad_accum=1,
        world_size=1,
        grad_clip=1.0,
        cuda=False,
    )
    engine = eng.initialize(model, opt, None, ds)
    best = float("inf")
    for rep in range(repeats + 1):
        t = time.perf_counter()
        for i in range(steps):
            out = engine(batches[i % len(batches)])
            engine.backward(out["loss"])
            engine.step()
        if rep:
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    eng.setup_distributed()
    rows = []
    for size in args.sizes:
        for objective in ("retromae", "mlm"):
            batches = make_batches(4, args.batch, args.length, decoder=objective == "retromae")
            tokens = (
                sum(int(b["attention_mask"].sum()) for b in batches) / len(batches) * args.steps
            )
            t_torch = time_torch(
                build(size, objective, args.length), batches, args.steps, args.repeats
            )
            t_ds = time_deepspeed(
                build(size, objective, args.length), batches, args.steps, args.repeats, args.batch
            )
            rows.append(
                {
                    "size": size,
                    "objective": objective,
                    "torch_tokens_per_s": tokens / t_torch,
                    "deepspeed_tokens_per_s": tokens / t_ds,
                    "deepspeed_over_torch": t_torch / t_ds,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\nbatch {args.batch} x length {args.length}, {args.steps} steps per window, best of {args.repeats}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        "| size | objective | plain torch tok/s | DeepSpeed tok/s | DeepSpeed / torch | RetroMAE / MLM (DeepSpeed) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        mlm = next(x for x in rows if x["size"] == r["size"] and x["objective"] == "mlm")
        rel = r["deepspeed_tokens_per_s"] / mlm["deepspeed_tokens_per_s"]
        print(
            f"| {r['size']} | {r['objective']} | {r['torch_tokens_per_s']:,.0f} | {r['deepspeed_tokens_per_s']:,.0f} "
            f"| {r['deepspeed_over_torch']:.2f} | {rel:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
