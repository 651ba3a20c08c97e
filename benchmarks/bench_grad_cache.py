"""GradCache's memory and time: peak RSS and seconds per fine-tuning step at several global
batches, with and without ``--grad_cache``, on CPU (or peak CUDA memory on a GPU).

``python benchmarks/bench_grad_cache.py --batches 64 256 1024 4096 --json out.json``
``python benchmarks/bench_grad_cache.py --device cuda --hidden 384 --batches 64 256 1024 4096``

On CUDA (``--device cuda``: what ``scripts/gpu_check.sh`` runs) every (batch, arm) runs in one
child process, one engine after another, and each row's ``peak_mb`` is
``torch.cuda.max_memory_allocated`` over its steps (reset after its engine is built; the
model and optimizer state are in ``base_mb``); bf16 autocast with ``--bf16``.

Each (batch, arm) runs in a process of its own (one rank, the DeepSpeed engine with the
default ZeRO-2 fp32 config, a random tiny BERT: ``--hidden`` wide, 2 layers), so its peak
resident memory is its own: ``os.wait4`` returns the child's ``ru_maxrss``. A step is the
trainer's: queries of ``--q-len`` tokens, each with its positive and one hard negative of
``--p-len`` tokens, the contrastive loss over every passage of the batch; with the cache,
chunks of ``--chunk`` queries and ``--chunk`` passages, the loss ``--loss-chunk`` queries at a
time; ``--threads`` torch threads (1: the timings suffer least from a shared machine). The
child reports its RSS after the
engine is built (``base``) and the time of each step after a first, warm-up one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from retromae_ds.components import engine as eng

    eng.setup_distributed()
    torch.set_num_threads(args.threads)
    arms = [(args.batch, args.chunk)]
    if args.arms:
        arms = [tuple(int(x) for x in arm.split(":")) for arm in args.arms.split(",")]
    for batch, chunk in arms:
        print(json.dumps({"batch": batch, "chunk": chunk, **_arm(args, batch, chunk)}), flush=True)


def _arm(args: argparse.Namespace, batch: int, chunk: int) -> dict:
    """One (batch, arm): a fresh engine, a warm-up step, then ``args.steps`` timed ones."""
    import resource

    import torch
    from transformers import BertConfig, BertModel

    from retromae_ds.components import engine as eng
    from retromae_ds.finetuning.grad_cache import GradCache, GradCacheConfig
    from retromae_ds.finetuning.model import DualEncoder

    cuda = args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=8000, hidden_size=args.hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=4 * args.hidden, max_position_embeddings=max(args.q_len, args.p_len),
    )  # fmt: skip
    model = DualEncoder(BertModel(config, add_pooling_layer=False), temperature=0.5).to(device)
    ds = eng.build_ds_config(
        ["ds_configs/zero2.json", "ds_configs/fp32.json"],
        micro_batch=batch, grad_accum=1, world_size=1, grad_clip=1.0, cuda=cuda,
    )  # fmt: skip
    engine = eng.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), None, ds)
    chunks = GradCacheConfig(query_chunk=chunk, passage_chunk=chunk, loss_chunk=args.loss_chunk)
    cache = GradCache(chunks, model.loss_grads) if chunk else None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    if cuda:
        torch.cuda.synchronize()
        base_mb = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    for step in range(args.steps + 1):
        g = torch.Generator().manual_seed(step)
        data = {
            "q_ids": torch.randint(5, 8000, (batch, args.q_len), generator=g),
            "q_mask": torch.ones(batch, args.q_len, dtype=torch.long),
            "p_ids": torch.randint(5, 8000, (2 * batch, args.p_len), generator=g),
            "p_mask": torch.ones(2 * batch, args.p_len, dtype=torch.long),
            "p_index": torch.arange(2 * batch),
            "positives": torch.arange(0, 2 * batch, 2)[:, None],
        }
        data = {k: v.to(device) for k, v in data.items()}
        start = time.perf_counter()
        if chunk:
            out = cache(engine, data, autocast)
        else:
            with autocast:
                out = engine(data)
            engine.backward(out["loss"])
        engine.step()
        float(out["loss"])  # a device read: the step is done
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
    result = {"base_mb": base_mb, "s_per_step": min(times)}
    if cuda:
        result["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        del engine, model, cache, out, data
        torch.cuda.empty_cache()
    return result


def run_cuda(args: argparse.Namespace) -> list[dict]:
    """Every (batch, arm) in one child on the GPU (a fresh engine each; peak CUDA memory)."""
    arms = [f"{b}:{c}" for b in args.batches for c in (0, args.chunk)
            if not (c == 0 and args.no_plain_above and b > args.no_plain_above)]  # fmt: skip
    cmd = [sys.executable, __file__, "--child", "--device", "cuda", "--arms", ",".join(arms),
           "--loss-chunk", str(args.loss_chunk), "--threads", str(args.threads),
           "--hidden", str(args.hidden), "--q-len", str(args.q_len), "--p-len", str(args.p_len),
           "--steps", str(args.steps), *(["--bf16"] if args.bf16 else [])]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO / "retromae_ds", env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the CUDA child failed:\n{proc.stderr[-2000:]}")
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]


def run_one(args: argparse.Namespace, batch: int, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--batch", str(batch), "--chunk", str(chunk),
           "--loss-chunk", str(args.loss_chunk), "--threads", str(args.threads),
           "--hidden", str(args.hidden), "--q-len", str(args.q_len), "--p-len", str(args.p_len),
           "--steps", str(args.steps)]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            cmd, cwd=REPO / "retromae_ds", env=env, stdout=subprocess.PIPE, stderr=err
        )
        out = proc.stdout.read()
        # reap the child ourselves: wait4 gives its own peak RSS (ru_maxrss, KiB on Linux)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(
                f"batch {batch} chunk {chunk} failed:\n{err.read().decode()[-2000:]}"
            )
    result = json.loads(out.decode().strip().splitlines()[-1])
    return {"batch": batch, "chunk": chunk, "peak_mb": usage.ru_maxrss / 1024, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--chunk", type=int, default=64, help="GradCache chunk (0 in --child: off)")
    parser.add_argument("--loss-chunk", type=int, default=64, help="grad_cache.loss_chunk")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--q-len", type=int, default=16)
    parser.add_argument("--p-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after a warm-up one")
    parser.add_argument("--no-plain-above", type=int, default=0,
                        help="skip the plain arm above this batch (0: never)")  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: peak CUDA memory, every arm in one process")  # fmt: skip
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--json", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arms", default="", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = run_cuda(args) if args.device == "cuda" else []
    what = "peak CUDA memory" if args.device == "cuda" else "peak RSS"
    for batch in args.batches if args.device == "cpu" else []:
        for chunk in (0, args.chunk):
            if chunk == 0 and args.no_plain_above and batch > args.no_plain_above:
                continue
            rows.append(run_one(args, batch, chunk))
    for row in rows:
        print(
            f"batch {row['batch']:5d} {'cache ' + str(row['chunk']) if row['chunk'] else 'plain':>9}: "
            f"{what} {row['peak_mb']:7.0f} MB (after set-up {row['base_mb']:.0f}), "
            f"{row['s_per_step']:.3f} s/step",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
