"""Memory of the shard reader on a corpus of several hundred MB: opening it and reading a
thousand random samples must cost memory in proportion to the samples, not to the corpus.

The corpus (about 400 MB of random int32 ids, rows of 100-500 tokens, 8 shards) is written
straight into ``tmp_path`` with ``helpers_shards``; the reading happens in a fresh interpreter
so that the resident-set numbers belong to the reader alone.

Why the page cache is emptied first: this kernel keeps freshly written files in large folios,
and a page fault on a mapped file maps the whole folio (or, for small pages, up to 16 cached
neighbours: "fault-around"). Reading one sample of a file that is still cached can then add
megabytes to RssFile, and a thousand samples map the whole corpus, whatever the reader does.
That memory is clean, shared page cache the kernel reclaims at will; it says nothing about
the reader. With the cache emptied, a fault maps only the page the reader touched (the maps
are advised for random access, so no read-ahead either), and RSS growth measures the pages
the reader really touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from retromae_ds.data.preprocess import shard_name

from helpers_shards import random_rows, write_manifest, write_shard

SHARDS = 8
ROWS_PER_SHARD = 33_000  # x 300 tokens x 5 bytes (int32 id + uint8 word start) = ~50 MB a shard
RANDOM_SAMPLES = 1000
BATCHES, BATCH_SIZE = 5, 64
MiB = 2**20

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import pyarrow as pa
    from retromae_ds.data.dataset import ShardDataset

    def rss():
        keys = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return {k: int(fields[k].split()[0]) * 1024 for k in keys if k in fields}

    warmup, folder, seed, samples, batches, batch_size = sys.argv[1:7]
    # Warm up on a tiny corpus so that imports (pyarrow loads pandas on its first to_numpy),
    # library pages and allocator arenas are in the baseline, not in the measurement.
    tiny = ShardDataset(warmup)
    for i in range(len(tiny)):
        tiny[i].input_ids.sum()
    tiny.get_batch(np.arange(len(tiny)))
    tiny.get_batch([0])
    rng = np.random.default_rng(int(seed))

    before = rss()
    ds = ShardDataset(folder)
    opened = rss()
    idx = rng.integers(0, len(ds), int(samples)).tolist()
    sums, starts, tokens = [], [], 0
    for i in idx:
        sample = ds[i]
        sums.append(int(sample.input_ids.sum(dtype=np.int64)))
        starts.append(int(sample.word_starts.sum(dtype=np.int64)))
        tokens += len(sample.input_ids)
    batch_idx = []
    for _ in range(int(batches)):
        b = rng.integers(0, len(ds), int(batch_size))
        batch = ds.get_batch(b)
        batch_idx.extend(b.tolist())
        sums.append(int(batch.input_ids.sum(dtype=np.int64)))
        starts.append(int(batch.word_starts.sum(dtype=np.int64)))
        tokens += int(batch.offsets[-1])
    after = rss()
    print(json.dumps({"before": before, "opened": opened, "after": after, "idx": idx,
                      "batch_idx": batch_idx, "sums": sums, "starts": starts,
                      "tokens": tokens}))
    """
)


def evict_from_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mincore on a map that is not read)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            pages = -(-size // mmap.PAGESIZE)
            vec = ctypes.create_string_buffer(pages)
            view = np.frombuffer(m, dtype=np.uint8)  # only for the address; reads nothing
            status = libc.mincore(view.ctypes.data, size, vec)
            del view  # the map cannot close while a view of it exists
            if status != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident += sum(b & 1 for b in vec.raw)
            total += pages
    return resident / total


@pytest.mark.slow
def test_random_reads_of_a_large_corpus_stay_small_in_memory(tmp_path):
    if shutil.disk_usage(tmp_path).free < 2 * 10**9:
        pytest.skip("needs 2 GB free disk for a 400 MB corpus")
    rng = np.random.default_rng(0)

    warmup = tmp_path / "warmup"
    (warmup / "shards").mkdir(parents=True)
    tiny_entries = [
        write_shard(warmup / "shards" / f"{shard_name(k)}.arrow", random_rows(rng, 20, 100, 500))
        for k in range(2)
    ]
    write_manifest(warmup, tiny_entries)

    folder = tmp_path / "big"
    (folder / "shards").mkdir(parents=True)
    entries, row_sums, row_starts, row_lengths = [], [], [], []
    for k in range(SHARDS):  # one shard in memory at a time
        rows = random_rows(rng, ROWS_PER_SHARD, 100, 500)
        path = folder / "shards" / f"{shard_name(k)}.arrow"
        entries.append(write_shard(path, rows, checksum=False))
        row_sums.append(np.add.reduceat(rows.ids.astype(np.int64), rows.offsets[:-1]))
        row_starts.append(np.add.reduceat(rows.word_starts.astype(np.int64), rows.offsets[:-1]))
        row_lengths.append(np.diff(rows.offsets))
        del rows
    write_manifest(folder, entries)
    row_sums_all, row_starts_all = np.concatenate(row_sums), np.concatenate(row_starts)
    row_lengths_all = np.concatenate(row_lengths)
    shard_paths = [folder / e["file"] for e in entries]
    corpus_bytes = sum(e["bytes"] for e in entries)
    assert corpus_bytes > 350 * MiB

    try:
        evict_from_page_cache(shard_paths)
        cached = resident_fraction(shard_paths)
        if cached > 0.02:
            pytest.skip(
                f"{cached:.0%} of the corpus stays in the page cache after eviction (tmpfs?); "
                "RSS would count fault-around pages, not the reader's reads"
            )
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(warmup),
                str(folder),
                "1",
                str(RANDOM_SAMPLES),
                str(BATCHES),
                str(BATCH_SIZE),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    # the child really read the samples it drew, and read them right
    idx, batch_idx = np.array(report["idx"]), np.array(report["batch_idx"])
    assert len(idx) == RANDOM_SAMPLES and len(batch_idx) == BATCHES * BATCH_SIZE
    for name, per_row in (("sums", row_sums_all), ("starts", row_starts_all)):
        per_batch = per_row[batch_idx].reshape(BATCHES, BATCH_SIZE).sum(axis=1)
        assert report[name] == per_row[idx].tolist() + per_batch.tolist()
    assert report["tokens"] == int(row_lengths_all[idx].sum() + row_lengths_all[batch_idx].sum())

    before, opened, after = report["before"], report["opened"], report["after"]
    growth = {k: after[k] - before[k] for k in after}
    summary = ", ".join(
        f"{k} {before[k] / MiB:.1f} -> {after[k] / MiB:.1f} MiB" for k in sorted(after)
    )
    print(f"\ncorpus {corpus_bytes / MiB:.0f} MiB in {SHARDS} shards; {summary}")

    # Opening reads the manifest only: well under one MiB whatever the corpus size.
    assert opened["VmRSS"] - before["VmRSS"] < 1 * MiB, summary
    # No private copies: copying even one shard's id column would add ~40 MiB of anonymous
    # memory; the reads themselves allocate a few small arrays (measured: < 1 MiB).
    assert growth["RssAnon"] < 16 * MiB, summary
    # Only touched pages: 1,320 random samples touch about 3 pages each (ids, word starts,
    # list offsets), ~15 MiB in all (measured: 13-15 MiB). A reader that read whole shards,
    # or whose reads pulled in read-ahead around each sample, would map most of the 400 MiB:
    # a 10% bound leaves ~2.5x headroom above the honest cost and far below the faulty one.
    assert growth["VmRSS"] < 0.10 * corpus_bytes, summary
