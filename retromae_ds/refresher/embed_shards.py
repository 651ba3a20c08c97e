"""The refresher's passage embeddings on disk: fixed-size shards, each a memory-mappable
``.npy`` with a small manifest, written atomically, checked before reuse and verified (sha256)
before it is searched.

In a version's work folder (``negatives/.work/v{N}/passages/``)::

    shard_00000.npy    float32 or float16 [rows, D] (numpy's .npy: np.load(mmap_mode="r"))
    shard_00000.json   {"format", "shard", "rows": [lo, hi], "dim", "dtype", "bytes",
                        "sha256", "identity": {...}, "checkpoint", "step"}

Shard ``s`` holds passages ``[s·R, min((s+1)·R, N))`` for ``refresh.shard_rows`` R whatever
the number of refresher ranks (each rank takes a contiguous run of shards), so a refresher
restarted with other ranks reuses what the last one finished. The ``.npy`` is written under a
hidden temporary name, fsynced and renamed, then its manifest the same way: a shard is
complete only once its manifest names it. ``identity`` says what the numbers are: the
encoder folder's digest (``embed_cache.folder_digest``, as the embedding cache keys it), the
corpus (passage count and the corpus shards' sha256), pooling, normalisation, autocast dtype,
device type and the stored dtype. A shard whose manifest names another identity or row range
is encoded again, never mixed with this checkpoint's. ``sha256`` covers the file's bytes,
hashed as they were written: ``verify`` re-reads them before a search opens the shard, and a
shard that fails is deleted and encoded again (``stages``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.base import faults
from retromae_ds.base.fsutil import atomic_save_npy_hashed, atomic_write_text, sha256_file

FORMAT = 1
DTYPES = ("float32", "float16")
PASSAGES = "passages"
"""The shards' folder inside a version's work folder."""


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of a corpus: passages ``lo .. hi - 1``, files in ``folder``."""

    folder: Path
    index: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    @property
    def npy(self) -> Path:
        return self.folder / f"shard_{self.index:05d}.npy"

    @property
    def manifest(self) -> Path:
        return self.npy.with_suffix(".json")


def layout(folder: Path, num_passages: int, shard_rows: int) -> list[Shard]:
    """The shards of ``num_passages`` passages, ``shard_rows`` each (the last one shorter)."""
    return [
        Shard(folder, s, lo, min(lo + shard_rows, num_passages))
        for s, lo in enumerate(range(0, num_passages, shard_rows))
    ]


def corpus_digest(fingerprint: dict[str, Any]) -> str:
    """sha256 naming the passages of a training set (their count and the corpus shards)."""
    corpus = {k: fingerprint[k] for k in ("num_passages", "corpus_shards_sha256")}
    return hashlib.sha256(json.dumps(corpus, sort_keys=True).encode()).hexdigest()


def read_manifest(shard: Shard) -> dict[str, Any] | None:
    try:
        manifest = json.loads(shard.manifest.read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def why_not_reusable(shard: Shard, identity: dict[str, Any], dim: int) -> str | None:
    """None when the shard on disk is complete and holds these passages embedded as
    ``identity`` says; otherwise why it cannot be reused ('' when there is no shard at all).
    Cheap (the manifest and the file's size): ``verify`` checks the bytes before a search."""
    if not shard.npy.is_file() and not shard.manifest.is_file():
        return ""
    manifest = read_manifest(shard)
    if manifest is None:
        return "no readable manifest (left by a writer that stopped)"
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("identity"), dict):
        return f"a manifest of another format ({manifest.get('format')!r})"
    if manifest["identity"] != identity:
        changed = sorted(
            k
            for k in set(identity) | set(manifest["identity"])
            if identity.get(k) != manifest["identity"].get(k)
        )
        return (
            f"embeddings of another {'/'.join(changed)} (checkpoint {manifest.get('checkpoint')})"
        )
    if manifest.get("rows") != [shard.lo, shard.hi] or manifest.get("dim") != dim:
        return f"rows {manifest.get('rows')} of dimension {manifest.get('dim')}"
    try:
        size = shard.npy.stat().st_size
    except OSError:
        return "its manifest but no array"
    if size != manifest.get("bytes"):
        return f"{size} bytes where its manifest says {manifest.get('bytes')}"
    return None


def write(
    shard: Shard, array_ND: np.ndarray, identity: dict[str, Any], about: dict[str, Any]
) -> None:
    """Store ``array_ND`` (``[shard.rows, D]``, cast to ``identity["dtype"]``) as the shard:
    the array through a temporary and a rename, then its manifest (``about``: fields for
    people, e.g. the checkpoint's name and step). An ``OSError`` leaves no temporary behind."""
    if array_ND.shape[0] != shard.rows:
        raise ValueError(f"{shard.npy}: {array_ND.shape[0]} rows for a shard of {shard.rows}")
    remove(shard)  # an old manifest must never describe the new bytes
    shard.folder.mkdir(parents=True, exist_ok=True)
    digest, size = atomic_save_npy_hashed(
        shard.npy,
        np.asarray(array_ND, dtype=identity["dtype"]),
        before_rename=lambda: faults.crash("crash_before_embedding_shard_rename", shard.index),
    )
    manifest = {
        "format": FORMAT,
        "shard": shard.index,
        "rows": [shard.lo, shard.hi],
        "dim": int(array_ND.shape[1]),
        "dtype": identity["dtype"],
        "bytes": size,
        "sha256": digest,
        "identity": identity,
        **about,
    }
    try:
        atomic_write_text(shard.manifest, json.dumps(manifest, indent=2, sort_keys=True))
    except OSError:
        shard.npy.unlink(missing_ok=True)  # bytes without a manifest only hold space
        raise
    faults.crash("crash_after_embedding_shard", shard.index)


def verify(shard: Shard) -> str | None:
    """None when the shard's bytes hash to the sha256 its manifest recorded; else what is
    wrong (read in blocks, so nothing stays resident)."""
    manifest = read_manifest(shard)
    if manifest is None or "sha256" not in manifest:
        return "has no readable manifest"
    try:
        found = sha256_file(shard.npy)
    except OSError as exc:
        return f"cannot be read ({exc})"
    if found != manifest["sha256"]:
        return (
            f"fails its checksum (sha256 {found[:12]}… read, {manifest['sha256'][:12]}… "
            "written): its bytes changed on disk"
        )
    return None


def remove(shard: Shard) -> None:
    """The shard's manifest, then its array (so no manifest outlives its bytes)."""
    shard.manifest.unlink(missing_ok=True)
    shard.npy.unlink(missing_ok=True)


def clean(folder: Path, shards: list[Shard]) -> None:
    """Temporaries of killed writers, and files of shards outside ``shards`` (another shard
    size or corpus), removed from ``folder``."""
    if not folder.is_dir():
        return
    keep = {p.name for s in shards for p in (s.npy, s.manifest)}
    for path in folder.iterdir():
        if path.name.startswith(".") or (path.name.startswith("shard_") and path.name not in keep):
            path.unlink(missing_ok=True)


def open_shard(shard: Shard) -> np.ndarray:
    """The shard's array, memory-mapped read-only (``[rows, D]`` in its stored dtype)."""
    return np.load(shard.npy, mmap_mode="r", allow_pickle=False)


def as_float32(array_ND: np.ndarray) -> np.ndarray:
    """``array_ND`` as float32: itself when it already is (a memory map stays one)."""
    return array_ND if array_ND.dtype == np.float32 else array_ND.astype(np.float32)


class ShardRows:
    """Consecutive shards read as one ``[N, D]`` float32 matrix for gathers
    (``rows[ids]``, ids counted from the first shard's first row): each shard a gather needs
    is memory-mapped for that gather and unmapped after it, so nothing stays resident between
    calls. What ``search.rescore`` and ``mining.positive_scores`` read candidates from."""

    def __init__(self, shards: list[Shard], dim: int) -> None:
        self.shards = shards
        self.offsets = np.cumsum([0] + [s.rows for s in shards])
        self.shape = (int(self.offsets[-1]), dim)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1:
            raise IndexError(f"ShardRows takes a 1-D array of row ids, not shape {ids.shape}")
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"row ids must lie in [0, {len(self)})")
        out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
        which = np.searchsorted(self.offsets, ids, side="right") - 1
        for w in np.unique(which):
            sel = which == w
            mapped = open_shard(self.shards[w])
            out[sel] = mapped[ids[sel] - self.offsets[w]]
            del mapped  # unmapped: its pages leave this process's resident set
        return out


def stats_line(per_shard: list[str]) -> str:
    """``'hit'`` when every shard says the same, else ``'hit 3, miss 2'``."""
    counts: dict[str, int] = {}
    for status in per_shard:
        counts[status] = counts.get(status, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
