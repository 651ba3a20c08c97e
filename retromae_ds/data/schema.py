"""The shard schema, defined once and imported by the preprocessing tool and the reader.

A shard is an Arrow IPC *file* (random access, memory-mappable, uncompressed so that columns
are zero-copy numpy views). One row is one chunk of one document:

- ``input_ids``   list<int32>: token ids, no special tokens (the collator adds them).
- ``word_starts`` list<uint8>: 1 where a token begins a word according to the fast
  tokenizer's word ids, else 0. uint8 rather than Arrow's bit-packed bool so that it maps to
  numpy without a copy. Flags are those of the *whole-document* tokenization, so a chunk may
  begin with a 0 when a long word straddles a chunk boundary (the chunker avoids that when
  the word is shorter than a chunk).
- ``doc_id``      string: the source document's id (from the input, or ``path:line``).
- ``chunk_index`` int32: position of this chunk within its document, from 0.
- ``pack_id``     int32: the packed sample this row belongs to, counted from 0 within the
  shard and non-decreasing. Without packing every row is its own pack (``pack_id`` = row).

Bump ``SCHEMA_VERSION`` on any change to columns, dtypes or meaning; readers refuse shards of
another version.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
SHARD_SUFFIX = ".arrow"
MANIFEST_NAME = "manifest.json"

INPUT_IDS = "input_ids"
WORD_STARTS = "word_starts"
DOC_ID = "doc_id"
CHUNK_INDEX = "chunk_index"
PACK_ID = "pack_id"

SHARD_SCHEMA = pa.schema(
    [
        pa.field(INPUT_IDS, pa.list_(pa.int32()), nullable=False),
        pa.field(WORD_STARTS, pa.list_(pa.uint8()), nullable=False),
        pa.field(DOC_ID, pa.string(), nullable=False),
        pa.field(CHUNK_INDEX, pa.int32(), nullable=False),
        pa.field(PACK_ID, pa.int32(), nullable=False),
    ],
    metadata={b"retromae_ds.schema_version": str(SCHEMA_VERSION).encode()},
)


def check_schema(schema: pa.Schema, where: str) -> None:
    """Raise ValueError naming ``where`` if ``schema`` is not this version's shard schema."""
    meta = schema.metadata or {}
    version = meta.get(b"retromae_ds.schema_version", b"?").decode()
    if version != str(SCHEMA_VERSION):
        raise ValueError(
            f"{where}: shard schema version {version}, this reader expects {SCHEMA_VERSION}; "
            "re-run preprocessing with this version of retromae-ds"
        )
    if not schema.equals(SHARD_SCHEMA, check_metadata=False):
        raise ValueError(f"{where}: columns {schema} differ from the expected {SHARD_SCHEMA}")
