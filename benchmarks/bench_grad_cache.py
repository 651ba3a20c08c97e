"""GradCache's memory and time: peak RSS and seconds per fine-tuning step at several global
batches, with and without ``--grad_cache``, on CPU.

``python benchmarks/bench_grad_cache.py --batches 64 256 1024 4096 --json out.json``

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
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import resource

    import torch
    from transformers import BertConfig, BertModel

    from retromae_ds.components import engine as eng
    from retromae_ds.finetuning.grad_cache import GradCache, GradCacheConfig
    from retromae_ds.finetuning.model import DualEncoder

    eng.setup_distributed()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=8000, hidden_size=args.hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=4 * args.hidden, max_position_embeddings=max(args.q_len, args.p_len),
    )  # fmt: skip
    model = DualEncoder(BertModel(config, add_pooling_layer=False), temperature=0.5)
    batch = args.batch
    ds = eng.build_ds_config(
        ["ds_configs/zero2.json", "ds_configs/fp32.json"],
        micro_batch=batch, grad_accum=1, world_size=1, grad_clip=1.0, cuda=False,
    )  # fmt: skip
    engine = eng.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), None, ds)
    chunks = GradCacheConfig(
        query_chunk=args.chunk, passage_chunk=args.chunk, loss_chunk=args.loss_chunk
    )
    cache = GradCache(chunks, model.loss_grads) if args.chunk else None
    off = torch.autocast("cpu", enabled=False)
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
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
        start = time.perf_counter()
        if args.chunk:
            out = cache(engine, data, off)
        else:
            out = engine(data)
            engine.backward(out["loss"])
        engine.step()
        float(out["loss"])
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
    print(json.dumps({"base_mb": base_kb / 1024, "s_per_step": min(times)}))


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
    parser.add_argument("--json", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for batch in args.batches:
        for chunk in (0, args.chunk):
            if chunk == 0 and args.no_plain_above and batch > args.no_plain_above:
                continue
            rows.append(run_one(args, batch, chunk))
            row = rows[-1]
            print(
                f"batch {batch:5d} {'cache ' + str(chunk) if chunk else 'plain':>9}: peak RSS "
                f"{row['peak_mb']:7.0f} MB (after set-up {row['base_mb']:.0f}), "
                f"{row['s_per_step']:.3f} s/step",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
