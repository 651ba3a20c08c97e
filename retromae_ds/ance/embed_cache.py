"""A content-addressed cache of the refresher's embeddings (``refresh.cache_dir``).

Runs that start from the same encoder mine their first version (``negatives.mine_first``)
from byte-identical step-0 checkpoints: the seeds of a recipe, a resumed sweep. Their passage
and query embeddings are the same, so the first run's are kept and the others load them.

An entry is keyed by the sha256 of everything that decides what the embeddings are: every
file of the encoder folder (weights, config, pooling modules), the data fingerprint (the
shards' sha256), the slice of rows encoded, pooling, normalisation, autocast dtype and device
type. What only changes rounding (threads, batch size) is not in the key. Entries are written
whole (temp + rename) and checked on read (shape, dtype, finite); a bad entry is reported and
recomputed, never used. Nothing is evicted: the folder can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.fsutil import atomic_save_npy, atomic_write_text, sha256_file


def folder_digest(folder: Path) -> str:
    """sha256 over the relative path and sha256 of every file under ``folder``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    listing = "".join(f"{p.relative_to(folder).as_posix()}\0{sha256_file(p)}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def rows_digest(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest()


class EmbeddingCache:
    """``root/<key>.npy`` (float32 ``[rows, D]``) with ``root/<key>.json`` (what the key
    covers, for people). ``root`` empty: every lookup misses and nothing is stored."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root else None

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @staticmethod
    def key(parts: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def load(self, key: str, shape: tuple[int, int]) -> np.ndarray | None:
        if self.root is None:
            return None
        path = self.root / f"{key}.npy"
        if not path.is_file():
            return None
        try:
            array = np.load(path, allow_pickle=False)
            problem = None
            if array.shape != shape or array.dtype != np.float32:
                problem = f"holds {array.dtype} {array.shape}, expected float32 {shape}"
            elif not np.isfinite(array).all():
                problem = "holds non-finite values"
        except (OSError, ValueError) as exc:
            problem = f"unreadable ({exc})"
        if problem:
            print(
                f"refresh: embedding cache entry {path} {problem}; recomputing it",
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
        # two runs writing the same key write the same bytes
        atomic_save_npy(path, np.asarray(array, dtype=np.float32))
        atomic_write_text(path.with_suffix(".json"), json.dumps(parts, indent=2, sort_keys=True))
