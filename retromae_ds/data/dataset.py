"""Memory-mapped reader over a folder of shards written by the preprocessing tool.

``ShardDataset(folder)[i]`` returns sample ``i`` as zero-copy numpy views into the mapped
shard files; ``get_batch(indices)`` gathers many samples with vectorised numpy. Opening reads
only the manifest (and checks the files' sizes); a shard's Arrow footer is read, and its schema
and row count checked, on first access. ``check_shards=True`` (training) also reads every
shard once at opening: its sha256 against the manifest and its token ids against the
vocabulary (threads; about 0.8 s per GB and core here), so a flipped bit or a foreign id
stops the run before it starts, in one line naming the shard (and the row). A corpus far larger than RAM costs nothing until
samples are touched, and then only the pages they live on (the maps are advised for random
access, so the kernel does not read ahead around each sample).

A sample is one row, or with a packed corpus one pack of consecutive rows (still one
contiguous, zero-copy slice). Usable in DataLoader workers: maps are opened lazily per process.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from retromae_ds.base.config import flag
from retromae_ds.base.fsutil import sha256_file
from retromae_ds.data import schema
from retromae_ds.data.tokenizer import fingerprint, fingerprint_mismatch


@dataclass
class Sample:
    """One sample: views into the mapped shard (do not write to them)."""

    input_ids: np.ndarray  # int32 [n]
    word_starts: np.ndarray  # uint8 [n]
    segment_lengths: np.ndarray  # int32 [rows in the pack]; [n] when unpacked


@dataclass
class Batch:
    """Ragged batch: sample b owns ``input_ids[offsets[b]:offsets[b+1]]``."""

    input_ids: np.ndarray  # int32 [total]
    word_starts: np.ndarray  # uint8 [total]
    offsets: np.ndarray  # int64 [B+1]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def padded(self, pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids_BL, word_starts_BL) right-padded to ``length`` (default: the longest sample)."""
        lengths = self.lengths
        width = int(lengths.max(initial=0)) if length is None else length
        if len(lengths) and lengths.max() > width:
            raise ValueError(f"a sample of {int(lengths.max())} tokens exceeds length {width}")
        ids = np.full((len(lengths), width), pad_id, dtype=np.int32)
        starts = np.zeros((len(lengths), width), dtype=np.uint8)
        mask = np.arange(width) < lengths[:, None]
        ids[mask] = self.input_ids
        starts[mask] = self.word_starts
        return ids, starts


class _Shard:
    """One mapped shard: numpy views of its columns (single- or multi-batch files)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_RANDOM"):
            self._map.madvise(mmap.MADV_RANDOM)
        try:
            reader = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(self._map)))
            schema.check_schema(reader.schema, str(path))
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except pa.ArrowException as exc:
            raise ValueError(
                f"{path}: not a readable Arrow shard ({exc}); check the folder with verify=True "
                "or re-run preprocessing"
            ) from exc
        table = (
            pa.Table.from_batches(batches, schema=reader.schema).combine_chunks()
            if len(batches) > 1
            else None
        )
        if table is not None:  # rare (not written by our tool): one copy at open
            batches = table.to_batches()
        b = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=schema.SHARD_SCHEMA)
        ids_col = b.column(schema.INPUT_IDS)
        ws_col = b.column(schema.WORD_STARTS)
        self.offsets = _offsets_view(ids_col)
        self.row_lengths = np.diff(self.offsets).astype(np.int32)  # segment lengths, by slicing
        self.ids = ids_col.values.to_numpy(zero_copy_only=True)
        self.word_starts = ws_col.values.to_numpy(zero_copy_only=True)
        self.pack_ids = b.column(schema.PACK_ID).to_numpy(zero_copy_only=True)
        self._batch = b

    def doc_id(self, row: int) -> str:
        return self._batch.column(schema.DOC_ID)[row].as_py()

    def chunk_index(self, row: int) -> int:
        return self._batch.column(schema.CHUNK_INDEX)[row].as_py()


SPECIAL_TOKENS = 2
"""Tokens the collators add around every sample ([CLS] and [SEP])."""


def shard_problem(path: Path, sha256: str | None, vocab_size: int) -> str | None:
    """What is wrong with one shard, as the start of a one-line message naming it: its bytes
    differ from the manifest's sha256 (a flipped bit, an edit), or a row holds a token id
    outside ``[0, vocab_size)`` (named with its row, document and value); None when neither.
    A manifest without a sha256 (synthetic test corpora) skips that check."""
    changed = bool(sha256) and sha256_file(path) != sha256
    try:
        shard = _Shard(path)
    except ValueError as exc:
        return f"{path}: sha256 differs from the manifest ({exc})" if changed else str(exc)
    ids = shard.ids
    foreign = ""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        at = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        row = int(np.searchsorted(shard.offsets, at, side="right")) - 1
        foreign = (
            f"row {row} (document {shard.doc_id(row)!r}, chunk {shard.chunk_index(row)}) "
            f"holds token id {int(ids[at])}, outside the vocabulary of {vocab_size} tokens"
        )
    del shard, ids  # unmaps the shard: the check leaves no pages behind
    if changed:
        detail = f"; its {foreign}" if foreign else ""
        return (
            f"{path}: sha256 differs from the manifest: the shard changed since preprocessing "
            f"wrote it (a flipped bit, an edit){detail}"
        )
    if foreign:
        return f"{path}: {foreign} (a damaged shard, or one made with another tokenizer)"
    return None


def _readable_size(path: Path) -> int:
    """The size of a shard that this process can open for reading, or one clear error naming
    it: checked for every shard when the dataset opens, so an unreadable one stops a run
    before training starts instead of at the step that first samples from it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: shard listed in the manifest is missing") from None
    except OSError as exc:
        hint = " (check its permissions)" if isinstance(exc, PermissionError) else ""
        raise type(exc)(f"{path}: cannot read the shard: {exc.strerror or exc}{hint}") from None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _disagrees(
    manifest: Path, field: str, claimed: Any, actual: Any, how: str | None = None
) -> str:
    """The one-line error for a manifest field the shards contradict."""
    detail = f" ({how})" if how else ""
    return (
        f"{manifest}: {field} is {claimed} in the manifest, the shards hold {actual}{detail}; "
        "the manifest does not describe these shards (edited or damaged): re-run preprocessing"
    )


def _offsets_view(col: pa.ListArray) -> np.ndarray:
    offsets = col.offsets.to_numpy(zero_copy_only=True)
    if col.values.offset:
        raise ValueError("unexpected sliced list values in shard")
    return offsets


class ShardDataset:
    """Random access to every sample of a preprocessed corpus.

    Args:
        folder: the preprocessing output folder (holding ``manifest.json``).
        tokenizer: the tokenizer the run will use (a Hugging Face fast tokenizer or its
            fingerprint dict); a mismatch with the shards' tokenizer raises ValueError.
        verify: check every shard's sha256 against the manifest and its token ids against
            the vocabulary (``check_shards``), then the manifest's counts and lengths against
            the shards.
        check_shards: check every shard's sha256 against the manifest and its token ids
            against the tokenizer's vocabulary (reads every byte once, shards in parallel):
            what training does before it starts.
        require_rows: refuse (ValueError) a corpus without a single sample, which is what
            empty or blank-only inputs give; pass False to accept an empty dataset.
    """

    def __init__(
        self,
        folder: str | Path,
        tokenizer: Any = None,
        verify: bool = False,
        *,
        require_rows: bool = True,
        check_shards: bool = False,
    ) -> None:
        self.folder = Path(folder)
        manifest_path = self.folder / schema.MANIFEST_NAME
        if not manifest_path.exists():
            raise FileNotFoundError(
                f"{manifest_path}: no manifest; the folder is not a complete preprocessing output"
            )
        try:
            self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{manifest_path}: not valid JSON ({exc})") from exc
        version = self.manifest.get("schema_version")
        if version != schema.SCHEMA_VERSION:
            raise ValueError(
                f"{manifest_path}: schema_version {version}, this reader expects "
                f"{schema.SCHEMA_VERSION}; re-run preprocessing with this version"
            )
        if tokenizer is not None:
            actual = tokenizer if isinstance(tokenizer, dict) else fingerprint(tokenizer)
            problems = fingerprint_mismatch(self.manifest["tokenizer"], actual)
            if problems:
                raise ValueError(
                    f"{manifest_path}: shards were made with another tokenizer: "
                    + "; ".join(problems)
                )
        self.packed = bool(self.manifest["packed"])
        shards = self.manifest["shards"]
        per_shard = [s["packs"] if self.packed else s["rows"] for s in shards]
        self._starts = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum(per_shard, out=self._starts[1:])
        if require_rows and self._starts[-1] == 0:
            counts = self.manifest.get("counts", {})
            raise ValueError(
                f"{self.folder}: the dataset has no samples ({counts.get('documents', 0)} "
                f"documents, {counts.get('rows', 0)} rows): its inputs were empty, blank-only "
                "or every record was rejected; re-run preprocessing on inputs with text"
            )
        self._paths = [self.folder / s["file"] for s in shards]
        for k, (path, meta) in enumerate(zip(self._paths, shards, strict=True)):
            size = _readable_size(path)
            if size != meta["bytes"]:
                raise ValueError(
                    _disagrees(manifest_path, f"shards[{k}].bytes", meta["bytes"], size, str(path))
                )
        if verify or check_shards:
            self._check_shards(manifest_path)
        if verify:
            self._check_manifest_against_shards(manifest_path)
        self._open: dict[int, _Shard] = {}
        self._pid = os.getpid()
        self._len = int(self._starts[-1])
        self._starts_list = self._starts.tolist()  # bisect on a list beats np.searchsorted per call

    def _check_shards(self, manifest_path: Path) -> None:
        """``shards_problem``, raised as one ValueError."""
        problem = self.shards_problem()
        if problem is not None:
            raise ValueError(f"{problem}; re-run preprocessing ({manifest_path})")

    def shards_problem(self) -> str | None:
        """Every shard's sha256 against the manifest and its token ids against the
        vocabulary, shards in parallel (hashlib and numpy release the GIL): the start of one
        line naming the first bad shard (and how many more), or None when all are whole. A
        reader whose data is made again another way says how (``finetuning.data.load``)."""
        vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        shards = self.manifest["shards"]
        threads = max(1, min(8, len(shards), os.cpu_count() or 1))
        with ThreadPoolExecutor(threads) as pool:
            problems = list(
                pool.map(
                    lambda pair: shard_problem(pair[0], pair[1].get("sha256"), vocab_size),
                    zip(self._paths, shards, strict=True),
                )
            )
        bad = [p for p in problems if p is not None]
        if not bad:
            return None
        more = f" (and {len(bad) - 1} more shard(s))" if len(bad) > 1 else ""
        return f"{bad[0]}{more}"

    def _check_manifest_against_shards(self, manifest_path: Path) -> None:
        """``verify``: every count and length the manifest states, recomputed from the shards
        (a hand-edited manifest passes the sha256 check, which covers the shards only)."""
        shards = self.manifest["shards"]
        totals = {"rows": 0, "packs": 0, "tokens": 0}
        longest_row = longest_sample = 0
        for k, (path, meta) in enumerate(zip(self._paths, shards, strict=True)):
            shard = _Shard(path)
            rows = len(shard.offsets) - 1
            row_lengths = np.diff(shard.offsets)
            # packs are runs of equal, non-decreasing pack ids: a pack starts where it changes
            starts = np.flatnonzero(np.diff(shard.pack_ids, prepend=-1)) if rows else []
            actual = {
                "rows": rows,
                "packs": len(starts),
                "tokens": int(shard.offsets[-1] - shard.offsets[0]),
            }
            for key, value in actual.items():
                if meta.get(key) != value:
                    raise ValueError(
                        _disagrees(
                            manifest_path, f"shards[{k}].{key}", meta.get(key), value, str(path)
                        )
                    )
                totals[key] += value
            if rows:
                longest_row = max(longest_row, int(row_lengths.max()))
                sample_starts = shard.offsets[starts] if self.packed else shard.offsets[:-1]
                sample_ends = np.append(sample_starts[1:], shard.offsets[-1])
                longest_sample = max(longest_sample, int((sample_ends - sample_starts).max()))
        counts = self.manifest.get("counts", {})
        for key, value in totals.items():
            if counts.get(key) != value:
                raise ValueError(_disagrees(manifest_path, f"counts.{key}", counts.get(key), value))
        documents = sum(s["documents"] for s in shards)
        if counts.get("documents") != documents:
            raise ValueError(
                _disagrees(
                    manifest_path,
                    "counts.documents",
                    counts.get("documents"),
                    documents,
                    "summed over its shards' entries",
                )
            )
        limit = self.manifest.get("max_tokens_per_row")
        if not isinstance(limit, int) or longest_row > limit:
            raise ValueError(
                _disagrees(
                    manifest_path,
                    "max_tokens_per_row",
                    limit,
                    longest_row,
                    "tokens in their longest row",
                )
            )
        needed = longest_sample + SPECIAL_TOKENS
        max_length = self.manifest.get("max_length")
        if not isinstance(max_length, int) or max_length < needed:
            raise ValueError(
                _disagrees(
                    manifest_path,
                    "max_length",
                    max_length,
                    needed,
                    f"their longest sample, {longest_sample} tokens, + {SPECIAL_TOKENS} special "
                    "tokens",
                )
            )

    # ------------------------------------------------------------------ plumbing
    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict:  # maps are per process: reopen lazily after pickling
        state = self.__dict__.copy()
        state["_open"] = {}
        return state

    def _shard(self, k: int) -> _Shard:
        if self._pid != os.getpid():  # forked DataLoader worker: do not share maps
            self._open, self._pid = {}, os.getpid()
        shard = self._open.get(k)
        if shard is None:
            shard = _Shard(self._paths[k])
            meta = self.manifest["shards"][k]
            rows = len(shard.offsets) - 1
            packs = int(shard.pack_ids[-1]) + 1 if rows else 0
            if rows != meta["rows"] or (self.packed and packs != meta["packs"]):
                raise ValueError(
                    f"{self._paths[k]}: {rows} rows / {packs} packs, the manifest says "
                    f"{meta['rows']} / {meta['packs']}; the folder is inconsistent"
                )
            self._open[k] = shard
        return shard

    def _locate(self, index: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        index %= n
        k = bisect.bisect_right(self._starts_list, index) - 1
        return k, index - self._starts_list[k]

    def _row_span(self, shard: _Shard, local: int) -> tuple[int, int]:
        if not self.packed:
            return local, local + 1
        lo = int(np.searchsorted(shard.pack_ids, local, side="left"))
        hi = int(np.searchsorted(shard.pack_ids, local, side="right"))
        return lo, hi

    # ------------------------------------------------------------------ access
    def __getitem__(self, index: int) -> Sample:
        shard_k, local = self._locate(int(index))
        shard = self._shard(shard_k)
        lo, hi = self._row_span(shard, local)
        a, b = int(shard.offsets[lo]), int(shard.offsets[hi])
        return Sample(shard.ids[a:b], shard.word_starts[a:b], shard.row_lengths[lo:hi])

    def source(self, index: int) -> list[tuple[str, int]]:
        """(document id, chunk index) of each row in sample ``index``."""
        shard_k, local = self._locate(int(index))
        shard = self._shard(shard_k)
        lo, hi = self._row_span(shard, local)
        return [(shard.doc_id(r), shard.chunk_index(r)) for r in range(lo, hi)]

    def lengths_of(self, indices) -> np.ndarray:
        """Tokens of samples ``indices`` (int64), read from the shards' offsets alone."""
        _, begin, end = self._spans(indices)
        return end - begin

    def get_batch(self, indices) -> Batch:
        """Gather samples ``indices`` into one ragged batch (vectorised per shard)."""
        shard_of, begin, end = self._spans(indices)
        lengths = end - begin
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # every sample is one contiguous slice of its shard: copy slices, no per-token index
        shard_list = shard_of.tolist()
        shards = {k: self._shard(k) for k in set(shard_list)}
        spans = list(zip(shard_list, begin.tolist(), end.tolist(), strict=True))
        empty_ids, empty_starts = np.zeros(0, np.int32), np.zeros(0, np.uint8)
        ids = np.concatenate([empty_ids] + [shards[k].ids[a:b] for k, a, b in spans])
        starts = np.concatenate([empty_starts] + [shards[k].word_starts[a:b] for k, a, b in spans])
        return Batch(ids, starts, offsets)

    def _spans(self, indices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first token, end token) of each of samples ``indices``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"indices out of range for {n} samples")
        idx = idx % max(n, 1)
        # one pass over the samples, grouped by shard with a stable sort: O(B log B), not
        # O(B x distinct shards)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        order = np.argsort(shard_of, kind="stable")
        sorted_shards = shard_of[order]
        cuts = np.flatnonzero(np.diff(sorted_shards)) + 1
        begin = np.empty(idx.size, dtype=np.int64)
        end = np.empty(idx.size, dtype=np.int64)
        for sel in np.split(order, cuts) if idx.size else []:
            k = int(shard_of[sel[0]])
            shard = self._shard(k)
            local = idx[sel] - self._starts[k]
            if self.packed:
                lo = np.searchsorted(shard.pack_ids, local, side="left")
                hi = np.searchsorted(shard.pack_ids, local, side="right")
            else:
                lo, hi = local, local + 1
            begin[sel] = shard.offsets[lo]
            end[sel] = shard.offsets[hi]
        return shard_of, begin, end

    def summary(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "samples": len(self),
            "shards": len(self._paths),
            "packed": self.packed,
            **self.manifest["counts"],
            "tokenizer": self.manifest["tokenizer"]["class"],
            "vocab_size": self.manifest["tokenizer"]["vocab_size"],
            "max_length": self.manifest["max_length"],
        }


@dataclass(kw_only=True)
class InspectConfig:
    """``retromae-ds inspect``: the summary of a shards folder."""

    folder: str = flag(positional=True)
    """A shards folder (manifest.json)."""
    verify: bool = False
    """Check every shard's sha256."""
