"""The negatives hand-off between the refresher and the trainer: versioned files, one pointer.

Layout under ``RUN/negatives``::

    v0.arrow, v0.json        version 0 (BM25) and its manifest
    v1.arrow, v1.json        version 1, mined with the checkpoint named in its manifest
    CURRENT                  pointer (JSON: version, step, path, sha256), replaced atomically

A version is published in this order: the Arrow file is written under a temporary name,
fsynced and renamed to ``v{N}.arrow``; its manifest is written the same way; only then is
``CURRENT`` replaced by an atomic rename. A reader reads ``CURRENT``, then the file it names,
and checks the file's sha256 against the pointer, so it only ever sees complete versions; a
writer killed at any point leaves at most hidden temporary files (removed on the next
publish) and the previous pointer in place. A pointer damaged anyway (by hand, by a broken
file system) raises ``HandoffError`` naming it; ``next_version`` then numbers from the
published versions alone, and the next ``publish`` replaces the bad pointer.

File schema (``NEGATIVES_SCHEMA``): one row per training query, in training-set order,
``negatives`` = passage indices (int32) into the training set's passage table. The manifest
names the version, the trainer step of the checkpoint it was mined with (0 for BM25), the
source, the corpus/query fingerprint it refers to, and the refresh timings.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from retromae_ds.base.fsutil import atomic_open, atomic_write_text, fsync_dir, sha256_file

SCHEMA_VERSION = 1
POINTER = "CURRENT"
NEGATIVES_SCHEMA = pa.schema(
    [
        pa.field("query_index", pa.int32(), nullable=False),
        pa.field("negatives", pa.list_(pa.int32()), nullable=False),
    ],
    metadata={b"retromae_ds.negatives_schema_version": str(SCHEMA_VERSION).encode()},
)
SCORED_SCHEMA = pa.schema(
    [
        *NEGATIVES_SCHEMA,
        pa.field("scores", pa.list_(pa.float32()), nullable=False),
        pa.field("positive_scores", pa.list_(pa.float32()), nullable=False),
    ],
    metadata=NEGATIVES_SCHEMA.metadata,
)
"""A version with teacher scores (distillation): ``scores`` aligned with ``negatives``,
``positive_scores`` with the training set's positives of the query (``TrainingSet.positives``)."""
_VERSION_FILE = re.compile(r"^v(\d+)\.json$")


class HandoffError(ValueError):
    """The ``CURRENT`` pointer is unreadable (not JSON, not a pointer); names the file."""


class NegativesWriteError(OSError):
    """A write under the negatives folder failed; the message names the file (and, when the
    disk is full, the space left on it; when the folder is read-only or not ours to write,
    that folder). ``errno`` is the original error's."""


NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
"""Errors of a folder that cannot be written (read-only file system, permissions), as
opposed to a full one (``ENOSPC``, ``EDQUOT``)."""


def write_error(path: Path, exc: OSError, what: str) -> NegativesWriteError:
    """``exc`` (met writing ``what`` to ``path``) as a ``NegativesWriteError`` naming the path:
    a full disk's ``write()`` error carries no file name of its own; a read-only or
    permission error names the folder that is not writable."""
    if isinstance(exc, NegativesWriteError):
        return exc
    reason = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)
    folder = Path(path).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(folder).free
            reason += f" ({free / 2**20:.1f} MiB free on the file system of {folder})"
        except OSError:
            pass
    elif exc.errno in NOT_WRITABLE:
        cause = "a read-only file system" if exc.errno == errno.EROFS else "no write permission"
        reason += f" ({folder} is not writable: {cause})"
    error = NegativesWriteError(f"{path}: cannot write {what}: {reason}")
    error.errno = exc.errno
    return error


def data_file(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}.arrow"


def manifest_file(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}.json"


@dataclass
class Negatives:
    """One published version in memory: query q's negatives are
    ``values[offsets[q]:offsets[q+1]]`` (passage indices)."""

    version: int
    step: int
    manifest: dict[str, Any]
    offsets: np.ndarray  # int64 [Q+1]
    values: np.ndarray  # int32 [total]
    scores: np.ndarray | None = None  # float32 [total]: teacher scores of ``values``
    positive_offsets: np.ndarray | None = None  # int64 [Q+1]
    positive_scores: np.ndarray | None = None  # float32: teacher scores of each positive

    @property
    def num_queries(self) -> int:
        return len(self.offsets) - 1

    def of(self, query: int) -> np.ndarray:
        return self.values[self.offsets[query] : self.offsets[query + 1]]

    @property
    def scored(self) -> bool:
        """Whether the version carries teacher scores (``scores_of``, ``positive_scores_of``)."""
        return self.scores is not None

    def scores_of(self, query: int) -> np.ndarray:
        """The teacher scores of ``of(query)``, in its order."""
        assert self.scores is not None, f"negatives v{self.version} carries no teacher scores"
        return self.scores[self.offsets[query] : self.offsets[query + 1]]

    def positive_scores_of(self, query: int) -> np.ndarray:
        """The teacher scores of the query's positives, in the training set's order."""
        assert self.positive_scores is not None and self.positive_offsets is not None
        return self.positive_scores[self.positive_offsets[query] : self.positive_offsets[query + 1]]


def published_versions(root: Path) -> list[int]:
    """Versions whose manifest exists (so their data file is complete), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION_FILE.match(p.name))]
    return sorted(found)


def next_version(root: Path) -> int:
    """The version number a new publication gets: one past every version ever published
    (a restarted refresher continues the sequence; a killed one never consumed a number)."""
    versions = published_versions(root)
    try:
        pointer = read_pointer(root)
    except HandoffError:  # the pointer is lost, the versions are not: number past them
        pointer = None
    last = max(versions + ([pointer["version"]] if pointer else []), default=-1)
    return last + 1


def _list_column(rows: list[np.ndarray], dtype) -> pa.ListArray:
    lengths = np.fromiter((len(n) for n in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = (
        np.concatenate([np.asarray(n, dtype=dtype) for n in rows]) if rows else np.zeros(0, dtype)
    )
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _write_arrow(path: Path, negatives: list[np.ndarray], scores: Scores | None = None) -> None:
    columns = [pa.array(np.arange(len(negatives), dtype=np.int32)),
               _list_column(negatives, np.int32)]  # fmt: skip
    schema = NEGATIVES_SCHEMA
    if scores is not None:
        for q, (negs, got) in enumerate(zip(negatives, scores.negatives, strict=True)):
            if len(negs) != len(got):
                raise ValueError(f"query {q}: {len(got)} teacher scores for {len(negs)} negatives")
        columns += [_list_column(scores.negatives, np.float32),
                    _list_column(scores.positives, np.float32)]  # fmt: skip
        schema = SCORED_SCHEMA
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    with atomic_open(path, "wb") as f, pa.ipc.new_file(f, schema) as writer:
        writer.write_batch(batch)


@dataclass(frozen=True)
class Scores:
    """Teacher scores of a version (``publish(..., scores=)``): per query, one per negative
    (in its order) and one per training positive (``TrainingSet.positives`` order)."""

    negatives: list[np.ndarray]
    positives: list[np.ndarray]


RESERVED = frozenset(
    ("schema_version", "version", "step", "file", "sha256", "bytes", "num_queries",
     "num_negatives", "created", "teacher_scores")
)  # fmt: skip
"""The manifest keys ``publish`` writes itself; a ``meta`` naming one is refused."""


def publish(
    root: Path,
    version: int,
    negatives: list[np.ndarray],
    *,
    step: int,
    meta: dict[str, Any] | None = None,
    keep_last: int = 0,
    scores: Scores | None = None,
) -> dict[str, Any]:
    """Write version ``version`` (data file, manifest) and point ``CURRENT`` at it.

    ``negatives[q]`` are query q's negative passage indices; ``scores``, when given, their
    teacher scores and those of the query's positives (``SCORED_SCHEMA``). ``keep_last`` > 0 deletes
    versions older than the newest ``keep_last`` (never the one being published). Returns the
    pointer written.
    """
    clash = sorted(set(meta or {}) & RESERVED)
    if clash:  # a caller's meta would overwrite what readers check
        raise ValueError(f"negatives v{version}: meta may not set {', '.join(clash)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if manifest_file(root, version).exists():
        raise FileExistsError(f"{manifest_file(root, version)}: version {version} already exists")
    for stale in root.glob(".v*.tmp"):  # leftovers of a writer killed mid-write
        stale.unlink(missing_ok=True)
    path, mpath = data_file(root, version), manifest_file(root, version)
    try:
        _write_arrow(path, negatives, scores)
        fsync_dir(root)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise write_error(path, exc, f"negatives v{version}") from exc
    digest = sha256_file(path)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "version": version,
        "step": int(step),
        "file": path.name,
        "sha256": digest,
        "bytes": path.stat().st_size,
        "num_queries": len(negatives),
        "num_negatives": int(sum(len(n) for n in negatives)),
        "created": time.time(),
        "teacher_scores": scores is not None,
        **(meta or {}),
    }
    pointer = {
        "version": version,
        "step": int(step),
        "path": path.name,
        "sha256": digest,
        "manifest": mpath.name,
    }
    # the manifest publishes the version and the pointer selects it: until the pointer is
    # replaced, a failure removes the version's files (nothing half-published is left visible)
    target = mpath
    try:
        atomic_write_text(mpath, json.dumps(manifest, indent=2))
        target = root / POINTER
        atomic_write_text(target, json.dumps(pointer))
    except OSError as exc:
        mpath.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise write_error(target, exc, f"negatives v{version}") from exc
    fsync_dir(root)
    if keep_last > 0:
        for old in published_versions(root)[:-keep_last]:
            if old != version:
                manifest_file(root, old).unlink(missing_ok=True)
                data_file(root, old).unlink(missing_ok=True)
    return pointer


def read_pointer(root: Path) -> dict[str, Any] | None:
    """The current pointer, or None before the first publication. Raises ``HandoffError``
    (naming the file) when ``CURRENT`` exists but is not a valid pointer."""
    path = Path(root) / POINTER
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise HandoffError(f"{path}: unreadable negatives pointer ({exc})") from exc
    try:
        pointer = json.loads(text)  # replaced by rename: never half-written by us
    except json.JSONDecodeError as exc:
        raise HandoffError(f"{path}: negatives pointer is not valid JSON ({exc})") from exc
    if not isinstance(pointer, dict):
        raise HandoffError(
            f"{path}: negatives pointer is a JSON {type(pointer).__name__}, not an object"
        )
    for key in ("version", "step", "path", "sha256"):
        if key not in pointer:
            raise HandoffError(f"{path}: negatives pointer lacks {key!r}")
    for key in ("version", "step"):
        value = pointer[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise HandoffError(f"{path}: negatives pointer has {key}={value!r}")
    return pointer


def load_version(root: Path, version: int, *, sha256: str | None = None) -> Negatives:
    """Read and validate version ``version``: manifest, sha256, schema, row count."""
    root = Path(root)
    mpath = manifest_file(root, version)
    if not mpath.is_file():
        raise FileNotFoundError(f"{mpath}: negatives version {version} is not published")
    manifest = json.loads(mpath.read_text(encoding="utf-8"))
    path = root / manifest["file"]
    data = path.read_bytes()  # one read: the checksum and the table come from the same bytes
    import hashlib

    digest = hashlib.sha256(data).hexdigest()
    for expected, who in ((manifest["sha256"], "its manifest"), (sha256, "the pointer")):
        if expected is not None and digest != expected:
            raise ValueError(f"{path}: sha256 {digest[:12]} differs from {who} ({expected[:12]})")
    reader = pa.ipc.open_file(pa.BufferReader(data))
    meta = reader.schema.metadata or {}
    got = meta.get(b"retromae_ds.negatives_schema_version", b"?").decode()
    scored = reader.schema.equals(SCORED_SCHEMA, check_metadata=False)
    if got != str(SCHEMA_VERSION) or not (
        scored or reader.schema.equals(NEGATIVES_SCHEMA, check_metadata=False)
    ):
        raise ValueError(f"{path}: not a negatives file of schema version {SCHEMA_VERSION}")
    table = reader.read_all().combine_chunks()
    if table.num_rows != manifest["num_queries"]:
        raise ValueError(f"{path}: {table.num_rows} rows, manifest says {manifest['num_queries']}")
    offsets, values = _read_list(table, "negatives", np.int32)
    extra: dict[str, np.ndarray] = {}
    if scored:
        _, extra["scores"] = _read_list(table, "scores", np.float32)
        extra["positive_offsets"], extra["positive_scores"] = _read_list(
            table, "positive_scores", np.float32
        )
    return Negatives(version, int(manifest["step"]), manifest, offsets, values, **extra)


def _read_list(table: pa.Table, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [rows + 1], values) of the list column ``name``."""
    if not table.num_rows:
        return np.zeros(1, np.int64), np.zeros(0, dtype)
    column = table.column(name).chunk(0)
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy().astype(dtype)[offsets[0] : offsets[-1]]
    return offsets - offsets[0], values
