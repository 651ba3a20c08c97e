"""Write synthetic shard folders directly with the schema module, without tokenizing.

A folder made here looks like a preprocessing output to the reader: ``shards/part-NNNNNN.arrow``
(Arrow IPC files of ``schema.SHARD_SCHEMA``) and a ``manifest.json`` with the keys that
``retromae_ds.data.preprocess.merge`` writes (``test_reader`` holds the two key sets against
each other). Rows come from numpy arrays, so a corpus of hundreds of MB is written in seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from retromae_ds.data import schema
from retromae_ds.data.preprocess import PreprocessConfig, sha256_file, shard_name


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """``texts`` as a JSONL corpus (ids ``doc0``, ``doc1``, ...)."""
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"_id": f"doc{i}", "text": text}) + "\n")
    return path


def preprocess_config(inputs, out, tokenizer_dir=None, **kw) -> PreprocessConfig:
    """A quiet ``PreprocessConfig`` of ``inputs`` into ``out`` (32 tokens unless said)."""
    if tokenizer_dir is not None:
        kw["tokenizer"] = str(tokenizer_dir)
    kw.setdefault("max_length", 32)
    return PreprocessConfig(inputs=[str(p) for p in inputs], out=str(out), progress=False, **kw)


SYNTHETIC_TOKENIZER: dict[str, Any] = {
    "class": "SyntheticTokenizer",
    "vocab_size": 30522,
    "vocab_sha256": "0" * 64,
    "special_token_ids": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
}


@dataclass
class ShardRows:
    """The rows of one shard: row r owns ``ids[offsets[r]:offsets[r+1]]``."""

    ids: np.ndarray  # int32 [T]
    word_starts: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int [R+1], from 0
    doc_ids: list[str] | None = None  # default: one document per row
    chunk_index: np.ndarray | None = None  # int32 [R]; default 0
    pack_ids: np.ndarray | None = None  # int32 [R]; default: every row its own pack

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return self.ids[a:b], self.word_starts[a:b]


def random_rows(
    rng: np.random.Generator,
    num_rows: int,
    min_len: int,
    max_len: int,
    *,
    vocab_size: int = 30522,
    pack_limit: int | None = None,
    doc_prefix: str = "doc",
) -> ShardRows:
    """Random rows of ``min_len..max_len`` tokens; with ``pack_limit`` also greedy pack ids."""
    lengths = rng.integers(min_len, max_len + 1, size=num_rows, dtype=np.int64)
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    ids = rng.integers(5, vocab_size, size=total, dtype=np.int32)
    word_starts = (rng.random(total) < 0.7).astype(np.uint8)
    pack_ids = None
    if pack_limit is not None:
        pack_ids = np.empty(num_rows, dtype=np.int32)
        pack, used = 0, 0
        for r, n in enumerate(lengths.tolist()):
            if used and used + n > pack_limit:
                pack, used = pack + 1, 0
            pack_ids[r] = pack
            used += n
    doc_ids = [f"{doc_prefix}{r}" for r in range(num_rows)]
    return ShardRows(ids, word_starts, offsets, doc_ids=doc_ids, pack_ids=pack_ids)


def record_batch(rows: ShardRows, arrow_schema: pa.Schema = schema.SHARD_SCHEMA) -> pa.RecordBatch:
    """The rows as one record batch of ``arrow_schema`` (the shard schema, or a deliberately
    wrong one cast from it, for tests of what the reader refuses)."""
    n = rows.num_rows
    offsets = pa.array(np.asarray(rows.offsets, dtype=np.int32))
    doc_ids = rows.doc_ids if rows.doc_ids is not None else [f"row{r}" for r in range(n)]
    chunk_index = rows.chunk_index if rows.chunk_index is not None else np.zeros(n, np.int32)
    pack_ids = rows.pack_ids if rows.pack_ids is not None else np.arange(n, dtype=np.int32)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(offsets, pa.array(rows.ids, type=pa.int32())),
            pa.ListArray.from_arrays(offsets, pa.array(rows.word_starts, type=pa.uint8())),
            pa.array(doc_ids, type=pa.string()),
            pa.array(np.asarray(chunk_index, dtype=np.int32), type=pa.int32()),
            pa.array(np.asarray(pack_ids, dtype=np.int32), type=pa.int32()),
        ],
        schema=schema.SHARD_SCHEMA,
    )
    return batch if arrow_schema.equals(batch.schema) else batch.cast(arrow_schema)


def write_shard(
    path: Path,
    rows: ShardRows,
    *,
    record_batches: int = 1,
    arrow_schema: pa.Schema = schema.SHARD_SCHEMA,
    checksum: bool = True,
) -> dict[str, Any]:
    """Write one shard (as ``record_batches`` record batches) and return its manifest entry,
    with ``file`` relative to the corpus folder."""
    batch = record_batch(rows, arrow_schema)
    cuts = np.linspace(0, rows.num_rows, record_batches + 1).astype(int)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, arrow_schema) as writer:
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            writer.write_batch(batch.slice(int(a), int(b - a)))
    pack_ids = batch.column(schema.PACK_ID).to_numpy()
    return {
        "file": f"{path.parent.name}/{path.name}",
        "rows": rows.num_rows,
        "packs": int(pack_ids[-1]) + 1 if len(pack_ids) else 0,
        "documents": len(set(batch.column(schema.DOC_ID).to_pylist())),
        "tokens": int(rows.offsets[-1]),
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path) if checksum else "",
    }


def write_manifest(
    folder: Path,
    entries: list[dict[str, Any]],
    *,
    packed: bool = False,
    tokenizer: dict[str, Any] | None = None,
    max_length: int = 512,
    schema_version: int = schema.SCHEMA_VERSION,
) -> dict[str, Any]:
    """``manifest.json`` over ``entries`` in the layout ``preprocess.merge`` writes."""
    counts = {k: sum(e[k] for e in entries) for k in ("documents", "rows", "packs", "tokens")}
    manifest = {
        "format": "retromae-ds-shards",
        "schema_version": schema_version,
        "tokenizer": tokenizer if tokenizer is not None else SYNTHETIC_TOKENIZER,
        "max_length": max_length,
        "max_tokens_per_row": max_length - 2,
        "packed": packed,
        "segmenter": None,
        "counts": {**counts, "empty_documents": 0, "rejected": 0},
        "shards": entries,
    }
    (folder / schema.MANIFEST_NAME).write_text(
        json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8"
    )
    return manifest


def write_corpus(
    folder: Path,
    shards: list[ShardRows],
    *,
    packed: bool = False,
    record_batches: int | list[int] = 1,
    checksum: bool = True,
    **manifest_fields: Any,
) -> dict[str, Any]:
    """A complete synthetic corpus folder; returns its manifest. ``record_batches``: per
    shard, or one count for all."""
    if isinstance(record_batches, int):
        record_batches = [record_batches] * len(shards)
    shard_dir = folder / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    entries = [
        write_shard(
            shard_dir / f"{shard_name(k)}{schema.SHARD_SUFFIX}",
            rows,
            record_batches=batches,
            checksum=checksum,
        )
        for k, (rows, batches) in enumerate(zip(shards, record_batches, strict=True))
    ]
    return write_manifest(folder, entries, packed=packed, **manifest_fields)


def expected_samples(shards: list[ShardRows], packed: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, word_starts) of every sample in reader order, computed from the rows directly."""
    out = []
    for rows in shards:
        if not packed:
            out.extend(rows.row(r) for r in range(rows.num_rows))
            continue
        pack_ids = rows.pack_ids if rows.pack_ids is not None else np.arange(rows.num_rows)
        for p in np.unique(pack_ids):
            members = np.flatnonzero(pack_ids == p)
            a, b = int(rows.offsets[members[0]]), int(rows.offsets[members[-1] + 1])
            out.append((rows.ids[a:b], rows.word_starts[a:b]))
    return out
