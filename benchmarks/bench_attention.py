"""Attention backends side by side: time and peak memory vs the reference path.

For each decoder rule (RetroMAE two-stream, SEED-Encoder window k) and sequence length L, every
backend runs the same q/k/v in its own fresh subprocess. After a warm-up call (which also
compiles FlexAttention), the process's peak-RSS counter is reset (``/proc/self/clear_refs``)
and the best of ``--repeats`` timed calls is kept. Peak memory comes from a second fresh
process: high-water RSS minus the RSS before the measured call (CPU, with glibc's mmap
threshold fixed so freed tensors leave the RSS), or ``torch.cuda.max_memory_allocated`` growth (CUDA). Reported as
ratios reference / backend. Training (forward + backward) for every backend that has a
backward on the device; forward only (``--mode forward``, or FlexAttention on CPU, which has
no backward in torch 2.13) compared with the reference's forward.

    python benchmarks/bench_attention.py [--lengths 512 2048 8192] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time, torch
sys.path.insert(0, {repo!r})
from retromae_ds.attention import TwoStreamSpec, WindowSpec, attend
B, H, L, D = {B}, {H}, {L}, {D}
rule, backend, mode, device, repeats = {rule!r}, {backend!r}, {mode!r}, {device!r}, {repeats}
dtype = getattr(torch, {dtype!r})
torch.manual_seed(0)
grad = mode == "train"
q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
lengths = torch.full((B,), L - 3, device=device)
if rule == "two_stream":
    words = torch.cumsum(torch.rand(B, L, device=device) < 0.75, dim=1) - 1
    seeds = torch.randint(0, 2**32, (B,), device=device)
    make = lambda: TwoStreamSpec(words, lengths, seeds, 0.5)
else:
    make = lambda: WindowSpec(lengths, {window})

def step():
    with torch.set_grad_enabled(grad):
        out = attend(q, k, v, make(), backend)  # a new spec per call: masks built per batch
        if grad:
            out.float().sum().backward()
            q.grad = k.grad = v.grad = None
    if device == "cuda":
        torch.cuda.synchronize()

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

step()
if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
else:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = rss("VmRSS:") * 1024
best = float("inf")
for _ in range(repeats):
    t = time.perf_counter()
    step()
    best = min(best, time.perf_counter() - t)
peak = (torch.cuda.max_memory_allocated() if device == "cuda" else rss("VmHWM:") * 1024) - base
print(json.dumps({{"seconds": best, "peak_bytes": peak}}))
"""

# A fixed mmap threshold makes glibc return every large freed block to the OS at once, so
# the high-water RSS tracks the tensors alive at the peak, not the allocator's heap reuse.
CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}

BACKENDS = {
    "two_stream": ["reference", "chunked", "flex"],
    "window": ["reference", "window", "flex"],
}


def run(rule: str, backend: str, L: int, mode: str, args) -> dict:
    """Time in one fresh process (the default allocator), peak memory in another (a fixed
    mmap threshold, which would slow allocation-heavy paths down if it were timed). On CUDA
    one process gives both: ``torch.cuda.max_memory_allocated`` does not depend on timing."""
    timed = _child(rule, backend, L, mode, args, args.repeats, dict(os.environ))
    if "error" in timed or args.device == "cuda":
        return timed  # CUDA: the caching allocator's peak counter is exact in the timed process
    sized = _child(rule, backend, L, mode, args, 1, CHILD_ENV)
    if "error" in sized:
        return sized
    return {"seconds": timed["seconds"], "peak_bytes": sized["peak_bytes"]}


def _child(rule: str, backend: str, L: int, mode: str, args, repeats: int, env) -> dict:
    code = CHILD.format(
        repo=str(REPO),
        B=args.batch,
        H=args.heads,
        L=L,
        D=args.dim,
        window=args.window,
        rule=rule,
        backend=backend,
        mode=mode,
        device=args.device,
        dtype=args.dtype,
        repeats=repeats,
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=args.timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if result.returncode != 0:
        lines = [x for x in result.stderr.strip().splitlines() if x.strip()]
        return {"error": lines[-1][:160] if lines else f"exit {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def modes_for(backend: str, args) -> list[str]:
    if args.mode != "both":
        return [args.mode]
    if backend == "flex" and args.device == "cpu":
        return ["forward"]  # FlexAttention has no CPU backward in torch 2.13
    return ["train", "forward"] if backend == "reference" else ["train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--rules", nargs="+", default=["two_stream", "window"], choices=BACKENDS)
    p.add_argument("--backends", nargs="+", default=None, help="subset of backends to run")
    p.add_argument("--mode", default="both", choices=["both", "train", "forward"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per backend, interleaved")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    rows = []
    for rule in args.rules:
        for L in args.lengths:
            results: dict[tuple[str, str], dict] = {}
            # rounds interleave the backends, so slow phases of a busy machine hit all of them
            for _ in range(args.rounds):
                for backend in BACKENDS[rule]:
                    if args.backends and backend not in args.backends and backend != "reference":
                        continue
                    for mode in modes_for(backend, args):
                        r = run(rule, backend, L, mode, args)
                        prev = results.get((backend, mode))
                        if prev is None or "error" in prev:
                            results[(backend, mode)] = r
                        elif "error" not in r:
                            prev["seconds"] = min(prev["seconds"], r["seconds"])
                            prev["peak_bytes"] = max(prev["peak_bytes"], r["peak_bytes"])
            for (backend, mode), r in results.items():
                ref = results.get(("reference", mode), {})
                row = {"rule": rule, "L": L, "backend": backend, "mode": mode, **r}
                if "error" not in r and "error" not in ref and backend != "reference":
                    row["time_ratio"] = ref["seconds"] / r["seconds"]
                    row["memory_ratio"] = ref["peak_bytes"] / max(r["peak_bytes"], 1)
                rows.append(row)
                print(json.dumps(row), flush=True)

    print(
        f"\nB={args.batch} H={args.heads} D={args.dim} {args.dtype} on {args.device}, "
        f"window k={args.window}, decoder ratio 0.5, best of {args.repeats} calls x "
        f"{args.rounds} interleaved processes (peak: the largest); "
        "ratios = reference / backend in the same mode (higher is better)\n"
    )
    print("| rule | L | backend | mode | seconds | peak MiB | time ref/x | memory ref/x |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['rule']} | {r['L']} | {r['backend']} | {r['mode']} | {r['error']} | | | |")
            continue
        tr = f"{r['time_ratio']:.1f}×" if "time_ratio" in r else "1"
        mr = f"{r['memory_ratio']:.1f}×" if "memory_ratio" in r else "1"
        print(
            f"| {r['rule']} | {r['L']} | {r['backend']} | {r['mode']} | {r['seconds']:.4f} | "
            f"{r['peak_bytes'] / 2**20:.1f} | {tr} | {mr} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
