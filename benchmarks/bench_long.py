"""Long inputs: peak memory and tokens/s of a pre-training step at L = 512 ... 8,192.

One training step (forward, backward, AdamW) of a small encoder (the ``tiny`` preset: 2 layers,
128 wide; BERT's 30,522-entry vocabulary) extended to L positions, with its decoder, run in a
fresh process per (L, variant) so each peak is its own (``ru_maxrss``):

- ``ours``: the long-input path: chunked vocabulary loss, the decoder's ``auto`` attention
  (window / chunked two-stream on CPU, FlexAttention on CUDA), the encoder's broadcast padding
  mask, attention dropout 0 (fused SDPA kernels);
- baselines, the same model with one part switched back: ``plain-head`` (B×L×V logits),
  ``reference-decoder`` (dense L×L decoder mask), ``attn-dropout`` (0.1: SDPA's math path).

Two measurements per L:

- memory: one sample of L tokens (B = 1); the step's peak RSS above the process's RSS before
  the step (activations, logits, gradients, optimizer state), against ``L / 512`` times the
  figure at 512 (linear);
- speed: ``tokens`` tokens per step (B = tokens / L), tokens/s against the same model at 512.

    python benchmarks/bench_long.py [--lengths 512 1024 2048 4096 8192] [--objectives retromae seed]
        [--device cuda --dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 30522
VARIANTS = {
    "ours": {},
    "plain-head": {"head": "plain"},
    "reference-decoder": {"attention": "reference"},
    "attn-dropout": {"attention_dropout": 0.1},
}


def _one(args: argparse.Namespace) -> dict:
    """Runs in the child: build, one warm-up step, ``--steps`` timed steps; report."""
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(REPO))
    import numpy as np
    import torch

    from retromae_ds.base.special_tokens import SpecialIds
    from retromae_ds.data.collate import MaskingConfig, PretrainCollator
    from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
    from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

    variant = VARIANTS[args.variant]
    device = torch.device(args.device)
    torch.manual_seed(0)
    special = SpecialIds(cls=2, sep=3, pad=0, mask=4, all=(0, 1, 2, 3, 4), vocab_size=VOCAB)
    encoder = build_encoder(
        EncoderConfig(
            name=args.size,
            max_positions=args.length,
            attention_dropout=variant.get("attention_dropout", 0.0),
        ),
        VOCAB,
        special.pad,
    )
    objective = ObjectiveConfig(
        name=args.objective,
        head=variant.get("head", "chunked"),
        attention=variant.get("attention", "auto"),
        decoder_ratio=0.5,
    )
    model = PretrainModel(encoder, objective).to(device).train()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    collator = PretrainCollator(
        special, MaskingConfig(), args.length, decoder=args.objective != "mlm"
    )

    def batch():
        items = []
        for r in range(args.batch):
            ids = (rng.zipf(1.3, args.length - 2) % (VOCAB - 5) + 5).astype(np.int32)
            starts = (rng.random(args.length - 2) < 0.75).astype(np.uint8)
            items.append((r, ids, starts))
        return {k: v.to(device) for k, v in collator(items).items()}

    batches = [batch() for _ in range(args.steps + 1)]

    def step(b):
        optimizer.zero_grad(set_to_none=True)
        out = model(b)
        out["loss"].backward()
        optimizer.step()
        return float(out["loss"])

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_kb() * 1024
    loss = step(batches[0])  # warm-up: allocates optimizer state; counted in the peak
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for b in batches[1:]:
        loss = step(b)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    seconds = (time.perf_counter() - start) / args.steps
    return {
        "length": args.length,
        "batch": args.batch,
        "variant": args.variant,
        "objective": args.objective,
        "peak_mib": peak / 2**20,
        "step_s": seconds,
        "tokens_per_s": args.batch * args.length / seconds,
        "loss": loss,
    }


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _child(length, batch, variant, objective, args) -> dict | None:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--length",
        str(length),
        "--batch",
        str(batch),
        "--variant",
        variant,
        "--objective",
        objective,
        "--size",
        args.size,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--steps",
        str(args.steps),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(
            f"  {variant} {objective} L={length} B={batch}: over {args.timeout} s, skipped",
            flush=True,
        )
        return None
    if proc.returncode != 0:
        print(f"  {variant} {objective} L={length}: failed\n{proc.stderr[-2000:]}", flush=True)
        return None
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"  {variant:18s} {objective:8s} L={length:5d} B={batch:3d}  peak {row['peak_mib']:8.0f} MiB"
        f"  {row['tokens_per_s']:9.0f} tok/s  ({row['step_s']:.2f} s/step)",
        flush=True,
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--variant", default="ours", help=argparse.SUPPRESS)
    p.add_argument("--objective", default="retromae", help=argparse.SUPPRESS)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--objectives", nargs="+", default=["mlm", "retromae", "seed"])
    p.add_argument(
        "--baselines", nargs="*", default=["plain-head", "reference-decoder", "attn-dropout"]
    )
    p.add_argument("--baseline-lengths", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step of the speed runs")
    p.add_argument("--size", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_one(args)))
        return

    rows = []
    print(f"== {args.size} encoder, {args.device} {args.dtype}, vocabulary {VOCAB}")
    for objective in args.objectives:
        for variant in ["ours", *args.baselines]:
            lengths = args.lengths if variant == "ours" else args.baseline_lengths
            for length in lengths:
                if variant == "reference-decoder" and objective == "mlm":
                    continue
                for mode, batch in (("memory", 1), ("speed", max(1, args.tokens // length))):
                    if mode == "speed" and variant != "ours":
                        continue
                    row = _child(length, batch, variant, objective, args)
                    if row:
                        rows.append({**row, "mode": mode})

    print(
        "\n| objective | L | peak MiB (B=1) | vs linear from 512 | MiB per 1k more tokens "
        f"| tokens/s (B×L = {args.tokens}) | vs 512 |"
    )
    print("|---|---|---|---|---|---|---|")
    for objective in args.objectives:
        mem = {
            r["length"]: r
            for r in rows
            if r["objective"] == objective and r["variant"] == "ours" and r["mode"] == "memory"
        }
        spd = {
            r["length"]: r
            for r in rows
            if r["objective"] == objective and r["variant"] == "ours" and r["mode"] == "speed"
        }
        base_m, base_s = mem.get(min(args.lengths)), spd.get(min(args.lengths))
        previous = None
        for length in args.lengths:
            m, s = mem.get(length), spd.get(length)
            if not (m and s and base_m and base_s):
                print(f"| {objective} | {length} | - | - | - | - | - |")
                continue
            lin = m["peak_mib"] / (base_m["peak_mib"] * length / base_m["length"])
            ratio = s["tokens_per_s"] / base_s["tokens_per_s"]
            # the marginal cost: constant when memory grows linearly, rising when quadratically
            slope = (
                f"{(m['peak_mib'] - previous['peak_mib']) * 1000 / (length - previous['length']):.0f}"
                if previous
                else "-"
            )
            print(
                f"| {objective} | {length} | {m['peak_mib']:.0f} | {lin:.2f}× | {slope} | "
                f"{s['tokens_per_s']:.0f} | {ratio:.2f}× |"
            )
            previous = m
    if args.baselines:
        print("\n| objective | L | variant | peak MiB (B=1) | vs ours |")
        print("|---|---|---|---|---|")
        for r in rows:
            if r["variant"] == "ours" or r["mode"] != "memory":
                continue
            ours = next(
                (
                    o
                    for o in rows
                    if o["variant"] == "ours"
                    and o["mode"] == "memory"
                    and o["objective"] == r["objective"]
                    and o["length"] == r["length"]
                ),
                None,
            )
            vs = f"{r['peak_mib'] / ours['peak_mib']:.2f}×" if ours else "-"
            print(
                f"| {r['objective']} | {r['length']} | {r['variant']} | {r['peak_mib']:.0f} | {vs} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
