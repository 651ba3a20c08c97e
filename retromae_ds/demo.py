"""The README's main job on the built-in corpus (grows with each stage of the pipeline).

Today: write the built-in corpus, train a WordPiece tokenizer on it, preprocess it into
shards with two workers, reopen the shards with the memory-mapped reader, check them against
the tokenizer, read random samples through the distributed sampler, and print a summary.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from retromae_ds.data.builtin_corpus import write_corpus
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
from retromae_ds.data.sampler import ResumableDistributedSampler
from retromae_ds.data.tokenizer import load_tokenizer


def run_demo(out: str | Path, workers: int = 2, max_docs: int | None = None) -> dict:
    out = Path(out)
    t0 = time.perf_counter()
    corpus = out / "corpus" / "builtin.jsonl"
    n_docs = write_corpus(corpus, max_docs)
    print(
        f"[1/3] built-in corpus: {n_docs:,} documents (stdlib docstrings + pydoc topics) -> {corpus}"
    )

    print("[2/3] preprocess: train a WordPiece tokenizer, tokenize, shard")
    manifest = run_preprocess(
        PreprocessConfig(
            inputs=[str(corpus)],
            out=str(out / "shards"),
            train_tokenizer=8000,
            max_length=128,
            shard_size=512 * 2**10,
            workers=workers,
            progress=True,
        )
    )

    tok = load_tokenizer(out / "shards" / "tokenizer")
    ds = ShardDataset(out / "shards", tokenizer=tok, verify=True)
    sampler = ResumableDistributedSampler(len(ds), num_replicas=2, rank=0, seed=0)
    first = sampler.indices(0, 256)
    batch = ds.get_batch(first)
    lengths = batch.lengths
    print("[3/3] read back through the memory-mapped reader and the sampler (rank 0 of 2):")
    counts = manifest["counts"]
    rows = [
        (
            "documents",
            f"{counts['documents']:,} ({counts['empty_documents']} empty, {counts['rejected']} rejected)",
        ),
        ("rows (chunks <= 126 tokens)", f"{counts['rows']:,}"),
        ("tokens", f"{counts['tokens']:,}"),
        ("shards", f"{len(manifest['shards'])} (sha256 verified)"),
        (
            "tokenizer",
            f"{manifest['tokenizer']['class']}, {manifest['tokenizer']['vocab_size']:,} tokens",
        ),
        (
            "batch of 256 sampled rows",
            f"mean length {lengths.mean():.1f}, max {int(lengths.max())}",
        ),
        ("whole words in that batch", f"{int(batch.word_starts.sum()):,}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    sample = ds[int(first[0])]
    ((doc_id, chunk),) = ds.source(int(first[0]))
    text = tok.decode(np.asarray(sample.input_ids).tolist())
    print(f"  sample {int(first[0])} ({doc_id}, chunk {chunk}): {text[:160]!r}")
    print(f"demo done in {time.perf_counter() - t0:.1f}s; outputs in {out}")
    return {"manifest": manifest, "samples": len(ds)}
