"""Padding: the share of a pre-training step's positions that are padding, on real shards.

Every position of a padded [B, L] batch costs the encoder and the decoder the same FLOPs,
real token or not. This measures the pad fraction (1 - real tokens / B×L positions) of
micro-batches of the real shards, as the trainer builds them (the sampler, then the collator,
which pads to the batch's longest row rounded up to a multiple of 8), under

- ``shuffled``: the default sampler order;
- ``grouped``: ``--data.length_grouping G`` (each group of G steps' samples sorted by
  length, ``LengthGroupedSampler``);
- ``--data.packing``: the collator's packing of each micro-batch (``PackedLayout``,
  first-fit decreasing into rows of at most ``max_length``), in either order;
- ``packed (ideal)``: first-fit-decreasing packing of each group's rows into windows of
  ``max_length`` (the bound of packing across a whole group of steps; computed, not
  trained),

for three corpora preprocessed here: WikiText-2 (test split, one document a line) + the
SciFact corpus (title + abstract) at 512 tokens with a WordPiece trained on them, and CSL's
abstracts + 8,000 titles with BERT-Chinese's vocabulary and jieba word starts at 256 and 512.

    python benchmarks/bench_padding.py [--data ../shared/data] [--batch 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from retromae_ds.data.collate import PackedLayout  # noqa: E402
from retromae_ds.data.dataset import ShardDataset  # noqa: E402
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess  # noqa: E402
from retromae_ds.data.sampler import (  # noqa: E402
    LengthGroupedSampler,
    ResumableDistributedSampler,
)
from retromae_ds.data.sources import SourceOptions  # noqa: E402

MULTIPLE = 8  # the collator's pad_to_multiple_of


def corpora(data: Path, work: Path) -> dict[str, Path]:
    """name -> shards folder."""
    out = {}
    english = PreprocessConfig(
        inputs=[str(data / "wikitext2" / "wiki.test.raw"), str(data / "scifact" / "corpus.jsonl")],
        out=str(work / "en512"),
        train_tokenizer=8000,
        max_length=512,
        progress=False,
        source=SourceOptions(title_field="title"),
    )
    run_preprocess(english)
    out["WikiText-2 + SciFact, 512"] = work / "en512"
    titles = work / "csl_titles.jsonl"
    with open(titles, "w", encoding="utf-8") as f:
        for line in (data / "csl" / "train_titles.txt").read_text(encoding="utf-8").splitlines():
            if line.strip():
                f.write(json.dumps({"text": line.strip()}, ensure_ascii=False) + "\n")
    for length in (256, 512):
        cfg = PreprocessConfig(
            inputs=[str(data / "csl" / "corpus.jsonl"), str(titles)],
            out=str(work / f"csl{length}"),
            tokenizer=str(_chinese_tokenizer(data, work)),
            max_length=length,
            segmenter="jieba",
            progress=False,
        )
        run_preprocess(cfg)
        out[f"CSL abstracts + titles, {length}"] = work / f"csl{length}"
    return out


def _chinese_tokenizer(data: Path, work: Path) -> Path:
    folder = work / "zh_tokenizer"
    if not folder.is_dir():
        from retromae_ds.data.tokenizer import make_wordpiece

        make_wordpiece(data / "chinese" / "vocab.txt", folder, chinese=True)
    return folder


def _padded(lengths_B: np.ndarray, max_length: int) -> int:
    width = int(lengths_B.max()) + 2
    width = min(-(-width // MULTIPLE) * MULTIPLE, max_length)
    return width * len(lengths_B)


def _packed_batch(lengths_B: np.ndarray, max_length: int) -> int:
    """Positions of one micro-batch packed by the collator (``--data.packing``)."""
    layout = PackedLayout.first_fit(lengths_B.astype(np.int64) + 2, max_length, MULTIPLE)
    return layout.shape[0] * layout.shape[1]


def _ffd_windows(lengths: np.ndarray, max_length: int) -> int:
    """Windows first-fit-decreasing packing needs for rows of ``lengths`` (+2 specials)."""
    free: list[int] = []
    for n in sorted((int(x) + 2 for x in lengths), reverse=True):
        for i, room in enumerate(free):
            if room >= n:
                free[i] -= n
                break
        else:
            free.append(max_length - n)
    return len(free)


def measure(shards: Path, batch: int, group: int) -> dict:
    data = ShardDataset(shards)
    max_length = int(data.manifest["max_length"])
    n = len(data)
    all_lengths = data.lengths_of(np.arange(n))
    tokens = int(all_lengths.sum()) + 2 * n
    row = {
        "rows": n,
        "max_length": max_length,
        "mean_tokens": tokens / n,
        "full_rows": float(np.mean(all_lengths + 2 >= max_length)),
    }
    samplers = {
        "shuffled": ResumableDistributedSampler(n, seed=0),
        "grouped": LengthGroupedSampler(
            n, lengths=data.lengths_of, block=batch, group_blocks=group, seed=0
        ),
    }
    for name, sampler in samplers.items():
        order = np.fromiter(iter(sampler), dtype=np.int64)
        slots = sum(
            _padded(all_lengths[order[i : i + batch]], max_length)
            for i in range(0, len(order), batch)
        )
        row[f"pad_{name}"] = 1 - tokens / slots
        packed = sum(
            _packed_batch(all_lengths[order[i : i + batch]], max_length)
            for i in range(0, len(order), batch)
        )
        row[f"pad_{name}_packing"] = 1 - tokens / packed
    chunk = batch * group
    order = np.random.default_rng(0).permutation(n)
    windows = sum(
        _ffd_windows(all_lengths[order[i : i + chunk]], max_length) for i in range(0, n, chunk)
    )
    row["pad_packed"] = 1 - tokens / (windows * max_length)
    row["packed_rows_per_window"] = n / windows
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--group", type=int, default=64, help="--data.length_grouping")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    data = Path(args.data)
    if not (data / "wikitext2").is_dir():
        sys.exit(f"{data}: no wikitext2/ (the shared data folder)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shards in corpora(data, Path(tmp)).items():
            row = {"corpus": name, **measure(shards, args.batch, args.group)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        f"\nmicro-batch {args.batch}; grouped: --data.length_grouping {args.group}; packed: "
        f"first-fit-decreasing over each group of {args.batch * args.group} rows"
    )
    print(
        "| corpus | rows | mean tokens | full rows | pad, shuffled | pad, grouped "
        "| --data.packing, shuffled | --data.packing, grouped "
        "| pad, packed (ideal) | rows per window |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['corpus']} | {r['rows']:,} | {r['mean_tokens']:.0f} | "
            f"{100 * r['full_rows']:.0f} % | {100 * r['pad_shuffled']:.1f} % | "
            f"{100 * r['pad_grouped']:.1f} % | {100 * r['pad_shuffled_packing']:.1f} % | "
            f"{100 * r['pad_grouped_packing']:.1f} % | {100 * r['pad_packed']:.1f} % | "
            f"{r['packed_rows_per_window']:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
