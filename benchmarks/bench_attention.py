"""Attention backends side by side: time and peak memory of forward+backward vs the reference.

Each (backend, L) runs in a fresh subprocess so that its peak resident memory (ru_maxrss,
minus the process's baseline) is its own. Reported as ratios reference / backend.

    python benchmarks/bench_attention.py [--lengths 512 2048 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time, torch
sys.path.insert(0, {repo!r})
from retromae_ds.attention import WindowSpec, attend
B, H, L, D, window, backend, repeats = {B}, {H}, {L}, {D}, {window}, {backend!r}, {repeats}
torch.manual_seed(0)
q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
lengths = torch.full((B,), L - 3)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
best = float("inf")
for _ in range(repeats):
    t = time.perf_counter()
    out = attend(q, k, v, WindowSpec(lengths, window), backend)
    out.sum().backward()
    best = min(best, time.perf_counter() - t)
    q.grad = k.grad = v.grad = None
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps({{"seconds": best, "peak_kib": peak}}))
"""


def run(backend: str, L: int, args) -> dict:
    code = CHILD.format(
        repo=str(REPO),
        B=args.batch,
        H=args.heads,
        L=L,
        D=args.dim,
        window=args.window,
        backend=backend,
        repeats=args.repeats,
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for L in args.lengths:
        ref, win = run("reference", L, args), run("window", L, args)
        rows.append({"L": L, "reference": ref, "window": win})
        print(json.dumps(rows[-1]), flush=True)
    print(
        f"\nSEED-Encoder window k={args.window}, B={args.batch} H={args.heads} D={args.dim}, forward+backward, "
        f"best of {args.repeats}, CPU; peak = max RSS growth of a fresh process"
    )
    print(
        "| L | reference s | window s | time ref/window | reference peak MiB | window peak MiB | memory ref/window |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["reference"], r["window"]
        if "error" in a or "error" in b:
            print(f"| {r['L']} | {a.get('error', '')} | {b.get('error', '')} | | | | |")
            continue
        print(
            f"| {r['L']} | {a['seconds']:.4f} | {b['seconds']:.4f} | {a['seconds'] / b['seconds']:.1f}x | "
            f"{a['peak_kib'] / 1024:.1f} | {b['peak_kib'] / 1024:.1f} | {a['peak_kib'] / max(b['peak_kib'], 1):.1f}x |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    _ = resource, time
    main()
