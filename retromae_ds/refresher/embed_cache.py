"""A content-addressed cache of the refresher's embeddings (``refresh.cache_dir``).

Runs that start from the same encoder mine their first version (``negatives.mine_first``)
from byte-identical step-0 checkpoints: the seeds of a recipe, a resumed sweep. Their passage
and query embeddings are the same, so the first run's are kept and the others load them.

An entry is keyed by the sha256 of everything that decides what the embeddings are: every
file of the encoder folder (weights, config, pooling modules), the data fingerprint (the
shards' sha256), the slice of rows encoded, pooling, normalisation, autocast dtype and device
type. What only changes rounding (threads, batch size) is not in the key. Entries are written
whole (temp + rename) with the sha256 of their bytes (hashed as they are written) in the
entry's record, and checked on read: the checksum first (one flipped bit in a vector is a
different file), then shape, dtype and finiteness. An entry that fails any check, or has no
checksum on record (written before entries had one), is a miss: one line says so, the rows
are encoded again and the entry rewritten; its bytes are never searched. Nothing is evicted:
the folder can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.base.fsutil import atomic_save_npy_hashed, atomic_write_text, sha256_file


def folder_digest(folder: Path) -> str:
    """sha256 over the relative path and sha256 of every file under ``folder``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    listing = "".join(f"{p.relative_to(folder).as_posix()}\0{sha256_file(p)}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def rows_digest(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest()


RECORD_FORMAT = 2
"""Entries' records (``<key>.json``) carry ``sha256`` since format 2."""


class EmbeddingCache:
    """``root/<key>.npy`` (``[rows, D]``, float32 or float16) with ``root/<key>.json``, its
    record: ``sha256`` and ``bytes`` of the array file, and ``covers``, what the key covers
    (for people). ``root`` empty: every lookup misses and nothing is stored."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root else None

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @staticmethod
    def key(parts: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def load(self, key: str, shape: tuple[int, int], dtype: str = "float32") -> np.ndarray | None:
        """The entry ``key`` when it passes every check, else None (a miss: absent, or bad
        and reported in one line)."""
        if self.root is None:
            return None
        path = self.root / f"{key}.npy"
        if not path.is_file():
            return None
        problem = _checksum_problem(path)
        if problem is None:
            try:
                array = np.load(path, allow_pickle=False)
                if array.shape != shape or array.dtype != np.dtype(dtype):
                    problem = f"holds {array.dtype} {array.shape}, expected {dtype} {shape}"
                elif not np.isfinite(array).all():
                    problem = "holds non-finite values"
            except (OSError, ValueError) as exc:
                problem = f"is unreadable ({exc})"
        if problem:
            print(
                f"refresh: embedding cache entry {path} {problem}; recomputing it (a miss: "
                "its rows are encoded again, never searched from it)",
                file=sys.stderr,
                flush=True,
            )
            return None
        return array

    def save(self, key: str, array: np.ndarray, parts: dict[str, Any]) -> None:
        if self.root is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{key}.npy"
        # two runs writing one key write the same embeddings (up to rounding: a reader that
        # meets one's bytes with the other's record counts a miss, never a wrong hit)
        digest, size = atomic_save_npy_hashed(path, array)
        record = {"format": RECORD_FORMAT, "sha256": digest, "bytes": size, "covers": parts}
        atomic_write_text(path.with_suffix(".json"), json.dumps(record, indent=2, sort_keys=True))


def _checksum_problem(path: Path) -> str | None:
    """None when ``path`` hashes to the sha256 its record (``.json`` beside it) holds."""
    try:
        record = json.loads(path.with_suffix(".json").read_text())
        recorded = record["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return "has no checksum on record (written before entries had one, or torn)"
    try:
        found = sha256_file(path)
    except OSError as exc:
        return f"is unreadable ({exc})"
    if found != recorded:
        return (
            f"fails its checksum (sha256 {found[:12]}… read, {str(recorded)[:12]}… stored): "
            "its bytes changed since they were written"
        )
    return None
