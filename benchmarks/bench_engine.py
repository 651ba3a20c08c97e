"""DeepSpeed settings against the plain loop, at equal precision semantics: which engine
configuration trains as fast as a plain PyTorch loop.

Every arm computes in bf16 (``--dtype bf16``: ``torch.autocast``) or fp32 with fp32 weights,
gradients and AdamW state, on the same batches of one pre-training objective:

- ``plain``: forward, backward, gradient clipping, ``torch.optim.AdamW`` (the baseline);
- ``plain-fused``: the same with ``AdamW(fused=True)`` (CUDA only);
- ``zero0`` / ``zero1`` / ``zero2``: the project's DeepSpeed engine with the packaged
  ``ds_configs/zeroN.json`` + ``fp32.json`` and the run's ``--autocast`` (bf16 compute, fp32
  master state), client AdamW (``fused=True`` on CUDA);
- ``zero2-ds-bf16``: ZeRO-2 with ``ds_configs/bf16.json`` (DeepSpeed's own bf16 mode: bf16
  weights, fp32 master copy), the setting the first GPU run measured at 0.41-0.74x;
- ``zero0-ds-bf16``: ZeRO-0 with ``bf16.json`` (DeepSpeed's BF16_Optimizer).

Per arm: tokens/s (best window of ``--repeats``, after a warm-up window), the ratio to
``plain``, peak device memory (CUDA) and the device reads per optimizer step (tensor methods
that hand a value to Python, counted inside the timed steps: on a GPU each waits for the
queue). Arms run in one process, one after another, on fresh copies of one initial model.

    python benchmarks/bench_engine.py [--device cuda] [--dtype bf16] [--size base] \
        [--batch 32] [--length 512] [--grad-accum 1] [--compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_train import _imports, build, encoder_flops_per_token, make_batches  # noqa: E402

ARMS = ("plain", "plain-fused", "zero0", "zero1", "zero2", "zero2-ds-bf16", "zero0-ds-bf16")
READ_OPS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class ReadCounter:
    """Counts tensor -> Python reads while ``active``: of device tensors on a GPU; on the CPU
    every read except those of torch's optimizers (their ``step`` counters are host tensors
    on a GPU too)."""

    def __init__(self, device: str) -> None:
        self.active, self.reads = False, 0
        for name in READ_OPS:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                if self.active:
                    if device != "cpu":
                        self.reads += t.device.type != "cpu"
                    elif "torch/optim/" not in sys._getframe(1).f_code.co_filename:
                        self.reads += 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, counted)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _optimizer(model, fused: bool, M):
    OptimConfig, build_optimizer = M[6][2], M[6][3]
    opt = build_optimizer(model, OptimConfig())
    if fused:  # same groups and hyper-parameters, the fused CUDA kernel
        opt = torch.optim.AdamW(opt.param_groups, fused=True)
    return opt


def _plain_step(model, opt, args):
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def step(micro_batches):
        for batch in micro_batches:
            with autocast:
                out = model(batch)
            (out["loss"] / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _engine_step(model, opt, args, arm, M):
    eng = M[0]
    stage, ds_bf16 = arm.split("-")[0], arm.endswith("ds-bf16")
    files = [
        f"ds_configs/{stage}.json",
        "ds_configs/bf16.json" if ds_bf16 else "ds_configs/fp32.json",
    ]
    ds = eng.build_ds_config(
        files,
        micro_batch=args.batch,
        grad_accum=args.grad_accum,
        world_size=1,
        grad_clip=1.0,
        cuda=args.device == "cuda",
    )
    engine = eng.initialize(model, opt, None, ds)
    use_autocast = args.dtype == "bf16" and not ds_bf16
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=use_autocast)

    def step(micro_batches):
        for batch in micro_batches:
            with autocast:
                out = engine(batch)
            engine.backward(out["loss"])
            engine.step()

    return step


def run_arm(arm, base_model, batches, args, M, counter) -> dict:
    model = copy.deepcopy(base_model).to(args.device)
    if args.compile:
        model.compile_parts(backend=args.compile_backend, device_type=args.device)
    opt = _optimizer(
        model, fused=arm == "plain-fused" or (arm.startswith("zero") and args.device == "cuda"), M=M
    )
    step = (
        _plain_step(model, opt, args)
        if arm.startswith("plain")
        else _engine_step(model, opt, args, arm, M)
    )
    groups = [batches[i : i + args.grad_accum] for i in range(0, len(batches), args.grad_accum)]
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    best, reads = float("inf"), 0
    for rep in range(args.repeats + 1):  # the first window warms up (and compiles)
        _sync(args.device)
        counter.active, counter.reads = rep > 0, 0
        t = time.perf_counter()
        for i in range(args.steps):
            step(groups[i % len(groups)])
        _sync(args.device)
        counter.active = False
        if rep:
            best = min(best, time.perf_counter() - t)
            reads = counter.reads
    row = {"arm": arm, "seconds": best, "reads_per_step": reads / args.steps}
    if args.device == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--objective", default="retromae")
    p.add_argument("--arms", nargs="+", default=list(ARMS))
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible to torch")
    arms = [a for a in args.arms if not (a == "plain-fused" and args.device != "cuda")]
    M = _imports(args.device)
    M[0].setup_distributed()
    n_batches = 4 * args.grad_accum
    batches = make_batches(
        n_batches, args.batch, args.length, args.objective != "mlm", args.device, M
    )
    attention = "auto" if args.objective != "mlm" else "reference"
    base = build(args.size, args.objective, attention, args.length, "cpu", M)
    flops_tok = encoder_flops_per_token(base, args.length)
    real = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)
    tokens = real * args.grad_accum * args.steps
    counter = ReadCounter(args.device)
    rows = []
    for arm in arms:
        try:
            row = run_arm(arm, base, batches, args, M, counter)
        except Exception as e:  # noqa: BLE001 - the row says why; the other arms still run
            row = {"arm": arm, "error": f"{type(e).__name__}: {e}"[:300]}
        if "seconds" in row:
            row["tokens_per_s"] = tokens / row["seconds"]
            if args.peak_tflops:
                row["encoder_mfu"] = row["tokens_per_s"] * flops_tok / (args.peak_tflops * 1e12)
        rows.append(row)
        print(json.dumps(row), flush=True)
    plain = next((r for r in rows if r["arm"] == "plain" and "tokens_per_s" in r), None)
    print(
        f"\n{args.device} {args.dtype}{' compiled' if args.compile else ''}, {args.size} "
        f"{args.objective}, batch {args.batch} x {args.length} x accumulation {args.grad_accum}, "
        f"{args.steps} steps per window, best of {args.repeats}"
    )
    print("| arm | tokens/s | / plain | device reads per step | peak MiB | encoder MFU |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['arm']} | failed: {r['error']} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}" if plain else ""
        mfu = f"{100 * r['encoder_mfu']:.1f} %" if "encoder_mfu" in r else ""
        peak = f"{r['peak_mib']:,.0f}" if "peak_mib" in r else ""
        print(
            f"| {r['arm']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['reads_per_step']:.1f} "
            f"| {peak} | {mfu} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
