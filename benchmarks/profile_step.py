"""Where a pre-training step's time goes: the phases and the top operators of this project's
RetroMAE step, on the inputs ``bench_peer.py`` made (its ``--work`` folder: the shared
initialisation and the shards), at the same settings (batch 32, fp32, AdamW).

Phases (wall time per step, ``torch.profiler`` off): reading and collating the batch, the
forward pass, the backward pass, and clipping plus the optimizer step, in a plain loop (the
DeepSpeed engine's overhead over such a loop is ``bench_train.py``'s). Then one profiled
window lists the operators by self CPU time.

    python benchmarks/profile_step.py --work WORK [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import machine, write_json  # noqa: E402


def build(work: Path, shape: str, seed: int = 0):
    import numpy as np
    import torch

    from retromae_ds.base.special_tokens import SpecialIds
    from retromae_ds.components.optim import build_optimizer
    from retromae_ds.data.collate import MaskingConfig, PretrainCollator
    from retromae_ds.data.dataset import ShardDataset
    from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
    from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel
    from retromae_ds.training.config import OptimConfig

    torch.manual_seed(seed)
    ds = ShardDataset(work / "shards")
    special = SpecialIds.from_fingerprint(ds.manifest["tokenizer"])
    collator = PretrainCollator(special, MaskingConfig(encoder_ratio=0.3), 128, seed=seed)
    encoder = build_encoder(
        EncoderConfig(name=str(work / f"init-{shape}")), special.vocab_size, special.pad
    )
    model = PretrainModel(encoder, ObjectiveConfig(name="retromae", decoder_ratio=0.5))
    model.train()
    opt = build_optimizer(model, OptimConfig(lr=1e-4, weight_decay=0.01))
    rng = np.random.default_rng(seed)

    def batch(b: int = 32):
        idx = rng.integers(0, len(ds), b)
        return collator([(int(i), ds[int(i)].input_ids, ds[int(i)].word_starts) for i in idx])

    return model, opt, batch


def phases(model, opt, batch, steps: int) -> dict[str, float]:
    import torch

    times: dict[str, list[float]] = {k: [] for k in ("data", "forward", "backward", "optimizer")}
    for _ in range(steps):
        t0 = time.perf_counter()
        b = batch()
        t1 = time.perf_counter()
        out = model(b)
        t2 = time.perf_counter()
        out["loss"].backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[k].append(v)
    return {k: statistics.median(v) for k, v in times.items()}


def top_ops(model, opt, batch, steps: int, n: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            out = model(batch())
            out["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    rows = []
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]:
        rows.append(
            {
                "op": e.key,
                "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
                "share": e.self_cpu_time_total / total,
                "calls_per_step": e.count / steps,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="bench_peer.py's --work folder")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = Path(args.work)
    model, opt, batch = build(work, args.shape)
    phases(model, opt, batch, 3)  # warm-up
    ph = phases(model, opt, batch, args.steps)
    step = sum(ph.values())
    print(f"phases, median seconds per step ({args.steps} steps):")
    for k, v in ph.items():
        print(f"  {k:<10} {v:.3f} s  {100 * v / step:5.1f} %")
    ops = top_ops(model, opt, batch, max(3, args.steps // 4), args.top)
    print("\n| operator | self ms/step | share | calls/step |\n|---|---|---|---|")
    for r in ops:
        print(
            f"| {r['op']} | {r['self_ms_per_step']:.1f} | {100 * r['share']:.1f} % "
            f"| {r['calls_per_step']:.0f} |"
        )
    write_json(args.json, {"machine": machine(), "phases_s": ph, "top_ops": ops})


if __name__ == "__main__":
    main()
