"""The candidate pool of ``refresh.mode pool``: a refresh that re-scores each training query's
previous top-K' with the newest checkpoint instead of encoding the whole corpus.

**The pool on disk.** In pool mode a full refresh (and BM25's v0) keeps the top-K' it found
per training query as ``negatives/pools/v{N}.npy`` (int32 ``[Q, K']``, best first, ``-1`` in
empty slots) with ``v{N}.json`` (``POOL_FORMAT``: the array's sha256 and bytes, its shape,
the data fingerprint, the source and step it came from): the array through a temporary,
fsync and rename, then its record, before the version is published, so the pool a published
version names is complete. ``keep_last`` prunes versions, not pools: after each publication
every pool other than the one the new version names is deleted, so the pool in use survives
whatever ``keep_last`` removed, and one pool (Q × K' × 4 bytes) is kept at a time.

**A pool version** (``rescore_stage``) encodes the queries and the sorted union of the pool's
passages (with the positives when the false-negative filter needs their scores) with the new
checkpoint's towers and pooling, in the embedding shards a full refresh writes
(``embed_shards``: checksummed, kept by a killed refresher, the shards split over the
refresher's ranks, every shard verified before any rank reads it); each rank scores its
contiguous part of the queries against their K' candidates exactly (inner product in float32,
as the exact search), orders them as ``merge_topk`` does (score descending, passage index
ascending) and keeps ``mining.top_k``; rank 0 merges the parts into ``ranking.npz`` and the
version takes ``publish.mine_and_publish`` like a full one. Cost: the queries and at most
Q · K' passages (their union) encoded, where a full refresh encodes the corpus. Killed at
``crash_in_refresh_at: "rescore"`` (shards verified, nothing scored yet) it publishes nothing.

**Which versions are pool versions** (``plan``, rank 0, again on a restart): with
``refresh.mode pool``, version N re-scores the pool the newest published version names
unless that pool was written ``pool_full_every`` or more versions before N, is BM25's (and
``pool_from_bm25`` is off), or is unusable (missing, a failed checksum, another data
fingerprint, narrower than K'); it is then mined in full, which writes a new pool, and one
line says why. Each manifest of pool mode records ``candidate_pool``: ``mode`` (``full``,
``pool`` or ``bm25``), ``k``, ``pool_version`` (the pool written or re-scored), ``age``,
``passages_encoded`` and ``why`` a version was mined in full.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.base import faults
from retromae_ds.base.fsutil import atomic_save_npy_hashed, atomic_write_text, sha256_file
from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.data import TrainingSet
from retromae_ds.refresher.config import RefreshConfig
from retromae_ds.refresher.embed_shards import Shard, ShardRows
from retromae_ds.refresher.mining import positive_pairs
from retromae_ds.refresher.publish import Ranking
from retromae_ds.refresher.stages import Job, split, writing

POOLS = "pools"
"""The pools' folder inside the negatives folder."""
POOL_FORMAT = 1
RESCORE_ROWS = 65536
"""Candidate embeddings gathered at a time while re-scoring (65,536 × 768 float32: 192 MiB)."""


class PoolProblem(ValueError):
    """A candidate pool that cannot be re-scored (missing, damaged, for other data)."""


def pool_width(cfg: RefreshConfig) -> int:
    """K': ``refresh.pool_k``, or ``mining.top_k`` when it is 0."""
    return cfg.pool_k or cfg.mining.top_k


def pool_files(root: Path, version: int) -> tuple[Path, Path]:
    """(array, record) of version ``version``'s pool under the negatives folder ``root``."""
    folder = Path(root) / POOLS
    return folder / f"v{version}.npy", folder / f"v{version}.json"


# --------------------------------------------------------------------------- the store
def save_pool(
    root: Path,
    version: int,
    ids_QK: np.ndarray,
    ts: TrainingSet,
    *,
    source: str,
    step: int,
    checkpoint: str | None = None,
) -> dict[str, Any]:
    """Keep ``ids_QK`` (best first, -1 empty) as version ``version``'s pool: the array through
    a temporary and a rename, then its record; a failed write raises
    ``handoff.NegativesWriteError`` naming the file, leaving no temporary. Returns the record."""
    npy, record_path = pool_files(root, version)
    ids = np.ascontiguousarray(ids_QK, dtype=np.int32)
    with writing(npy, "the candidate pool", npy.with_name(f".{npy.name}.tmp*")):
        npy.parent.mkdir(parents=True, exist_ok=True)
        record_path.unlink(missing_ok=True)  # an old record must never describe new bytes
        digest, size = atomic_save_npy_hashed(npy, ids)
        record = {
            "format": POOL_FORMAT,
            "version": version,
            "source": source,
            "step": int(step),
            "checkpoint": checkpoint,
            "shape": list(ids.shape),
            "dtype": "int32",
            "bytes": size,
            "sha256": digest,
            "data": ts.fingerprint(),
        }
        try:
            atomic_write_text(record_path, json.dumps(record, indent=2))
        except OSError:
            npy.unlink(missing_ok=True)
            raise
    return record


def check_pool(root: Path, version: int, ts: TrainingSet, k: int) -> dict[str, Any]:
    """The record of version ``version``'s pool when its bytes match their sha256, it was
    kept for this training data and holds at least ``k`` valid candidates a query; else a
    ``PoolProblem`` saying what is wrong (naming the file)."""
    npy, record_path = pool_files(root, version)
    try:
        record = json.loads(record_path.read_text())
    except FileNotFoundError:
        raise PoolProblem(f"{record_path}: missing (pruned, or never written)") from None
    except (OSError, ValueError) as exc:
        raise PoolProblem(f"{record_path}: unreadable ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != POOL_FORMAT:
        raise PoolProblem(f"{record_path}: not a candidate pool record of format {POOL_FORMAT}")
    try:
        found = sha256_file(npy)
    except OSError as exc:
        raise PoolProblem(f"{npy}: unreadable ({exc})") from None
    if found != record.get("sha256"):
        raise PoolProblem(
            f"{npy}: fails its checksum (sha256 {found[:12]}… read, "
            f"{str(record.get('sha256'))[:12]}… written)"
        )
    if record.get("data") != ts.fingerprint():
        raise PoolProblem(f"{npy}: kept for other training data")
    rows, width = record.get("shape", [0, 0])
    if rows != ts.num_queries or width < k:
        raise PoolProblem(
            f"{npy}: {rows} × {width} candidates, this refresh needs {ts.num_queries} × {k}"
        )
    ids = np.load(npy, mmap_mode="r", allow_pickle=False)
    if ids.dtype != np.int32 or list(ids.shape) != [rows, width]:
        raise PoolProblem(
            f"{npy}: holds {ids.dtype} {ids.shape}, its record says int32 {rows, width}"
        )
    if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= ts.num_passages):
        raise PoolProblem(f"{npy}: passage indices outside [-1, {ts.num_passages})")
    return record


def load_ids(root: Path, version: int, k: int) -> np.ndarray:
    """The best ``k`` candidates a query of version ``version``'s pool, ``[Q, k]`` int32,
    memory-mapped (``check_pool`` verified it)."""
    return np.load(pool_files(root, version)[0], mmap_mode="r", allow_pickle=False)[:, :k]


def prune(root: Path, keep: int) -> None:
    """Every pool other than version ``keep``'s, and writers' temporaries, removed."""
    folder = Path(root) / POOLS
    if not folder.is_dir():
        return
    kept = {p.name for p in pool_files(root, keep)}
    for path in folder.iterdir():
        if path.name not in kept:
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """How version ``version`` of ``refresh.mode pool`` is mined (every rank holds it)."""

    mode: str
    """``full`` (encode the corpus, write a pool of ``k``), ``pool`` (re-score ``source``),
    or ``bm25`` (BM25's v0, which keeps its top ``k`` as a pool)."""
    k: int
    """K'."""
    version: int
    source: int | None = None
    """The pool re-scored (pool versions)."""
    source_record: dict[str, Any] | None = None
    why: str | None = None
    """Why a version of pool mode is mined in full."""

    @property
    def pool_version(self) -> int:
        """The pool this version writes (full) or re-scores (pool)."""
        return self.source if self.mode == "pool" else self.version

    def meta(self) -> dict[str, Any]:
        """What the work folder's ``meta.json`` adds: parts of another plan are not reused."""
        return {"mode": self.mode, "pool_version": self.pool_version, "pool_k": self.k}

    def record(self, passages_encoded: int, full_every: int) -> dict[str, Any]:
        """The manifest's ``candidate_pool``."""
        record: dict[str, Any] = {
            "mode": self.mode,
            "k": self.k,
            "pool_version": self.pool_version,
            "age": self.version - self.pool_version,
            "full_every": full_every,
            "passages_encoded": passages_encoded,
            "why": self.why,
        }
        if self.source_record is not None:
            record["pool_source"] = self.source_record.get("source")
            record["pool_step"] = self.source_record.get("step")
        return record


def _previous(root: Path, version: int) -> tuple[int, dict[str, Any]] | None:
    """The newest published version before ``version`` whose manifest reads, and it."""
    for earlier in reversed([v for v in handoff.published_versions(root) if v < version]):
        try:
            return earlier, json.loads(handoff.manifest_file(root, earlier).read_text())
        except (OSError, ValueError):
            continue
    return None


def plan(cfg: RefreshConfig, root: Path, version: int, ts: TrainingSet) -> Plan | None:
    """Rank 0: how version ``version`` is mined (None: ``refresh.mode full``, the refresher
    of before). A version of pool mode mined in full says why in one line."""
    if cfg.mode != "pool":
        return None
    k = pool_width(cfg)

    def full(why: str) -> Plan:
        print(f"refresh: v{version}: mined in full ({why})", file=sys.stderr, flush=True)
        return Plan("full", k, version, why=why)

    previous = _previous(Path(root), version)
    if previous is None:
        return full("no published version names a candidate pool")
    earlier, manifest = previous
    info = manifest.get("candidate_pool")
    if not isinstance(info, dict) or not isinstance(info.get("pool_version"), int):
        return full(f"v{earlier} names no candidate pool: it was mined without refresh.mode pool")
    source = info["pool_version"]
    age = version - source
    if cfg.pool_full_every and age >= cfg.pool_full_every:
        return full(
            f"the pool of v{source} is {age} versions old; refresh.pool_full_every "
            f"{cfg.pool_full_every}"
        )
    try:
        record = check_pool(Path(root), source, ts, k)
    except PoolProblem as exc:
        return full(f"candidate pool {exc}; falling back to a full refresh")
    if record.get("source") == "bm25" and not cfg.pool_from_bm25:
        return full(f"the pool of v{source} is BM25's and refresh.pool_from_bm25 is false")
    return Plan("pool", k, version, source=source, source_record=record)


def set_up(plan: Plan, job: Job, root: Path) -> Callable[..., None] | None:
    """Point ``job`` at what ``plan`` mines: a pool version encodes the pool's union (the
    re-scoring stage returned, to run in place of the search), a full version searches
    K' deep (None returned: the search stage as ever)."""
    cfg = job.cfg
    if plan.mode != "pool":
        job.search_k = max(cfg.mining.top_k, plan.k)
        return None
    candidates = load_ids(root, plan.source, plan.k)
    with_positives = cfg.mining.max_score_ratio > 0  # the filter needs their scores
    job.passages = union(candidates, job.ts.positives, with_positives)
    return functools.partial(rescore_stage, candidates_QK=candidates, with_positives=with_positives)


def union(
    candidates_QK: np.ndarray, positives: list[np.ndarray], with_positives: bool
) -> np.ndarray:
    """The passages a pool version encodes, sorted: every candidate of the pool (and every
    positive, whose scores the false-negative filter needs)."""
    parts = [np.asarray(candidates_QK, dtype=np.int64).ravel()]
    if with_positives:
        parts += [np.asarray(p, dtype=np.int64) for p in positives]
    found = np.unique(np.concatenate(parts))
    return found[found >= 0]


# --------------------------------------------------------------------------- re-scoring
def rescore_stage(
    job: Job,
    queries: np.ndarray,
    shards: list[Shard],
    *,
    candidates_QK: np.ndarray,
    with_positives: bool,
) -> None:
    """Every rank: its contiguous part of the queries scored against their candidates, read
    from the (verified) shards of the pool's union (every rank's: ``job.passages`` maps a
    passage to its row), the best ``mining.top_k`` kept and written, with the positives'
    scores of its queries, to ``topk_rank{r}.npz`` (other ranks' queries empty, so rank 0's
    ``merge_stage`` joins the parts). ``shards`` (this rank's) were verified already."""
    del shards  # every rank reads every shard; each was verified by the rank that wrote it
    faults.crash("crash_in_refresh_at", "rescore")
    t0 = time.perf_counter()
    group, passages = job.group, job.passages
    assert passages is not None, "a pool version encodes the pool's union"
    num_queries, width = candidates_QK.shape
    dim = queries.shape[1]
    rows = ShardRows(job.shards(), dim)
    k = min(job.top_k(), width)
    scores = np.full((num_queries, k), -np.inf, dtype=np.float32)
    ids = np.full((num_queries, k), -1, dtype=np.int64)
    qlo, qhi = split(num_queries, group.world, group.rank)
    batch = max(1, RESCORE_ROWS // max(1, width))
    for s in range(qlo, qhi, batch):
        e = min(s + batch, qhi)
        cand_BK = np.asarray(candidates_QK[s:e], dtype=np.int64)
        valid_BK = cand_BK >= 0
        where_BK = np.searchsorted(passages, np.where(valid_BK, cand_BK, passages[0]))
        emb_BKD = rows[where_BK.ravel()].reshape(e - s, width, dim)
        score_BK = np.matmul(emb_BKD, queries[s:e, :, None].astype(np.float32))[..., 0]
        score_BK = np.where(valid_BK, score_BK, -np.inf).astype(np.float32)
        # as merge_topk orders: empty slots last, then score descending, then index ascending
        order = np.lexsort((cand_BK, -score_BK, ~valid_BK), axis=1)[:, :k]
        scores[s:e] = np.take_along_axis(score_BK, order, 1)
        kept = np.take_along_axis(cand_BK, order, 1)
        ids[s:e] = np.where(np.take_along_axis(valid_BK, order, 1), kept, -1)
    pos_scores = _positive_scores(job, queries, rows, qlo, qhi, with_positives)
    topk = job.part("topk").with_suffix(".npz")
    with writing(topk, "the re-scored candidates", topk.with_name(f".{topk.name}")):
        Ranking(ids=ids, scores=scores, positives=pos_scores).save(topk)
    job.timings["rescore_s"] = time.perf_counter() - t0


def _positive_scores(
    job: Job, queries: np.ndarray, rows: ShardRows, qlo: int, qhi: int, with_positives: bool
) -> np.ndarray:
    """As ``mining.positive_scores``: per (query, positive) pair in the order of
    ``ts.positives``, the inner product (float64) for this rank's queries, NaN elsewhere (and
    everywhere when the positives were not encoded)."""
    q_idx, p_idx = positive_pairs(job.ts.positives)
    out = np.full(len(p_idx), np.nan, dtype=np.float64)
    if not with_positives:
        return out
    here = (q_idx >= qlo) & (q_idx < qhi)
    emb = rows[np.searchsorted(job.passages, p_idx[here])].astype(np.float64)
    out[here] = np.einsum("nd,nd->n", queries[q_idx[here]].astype(np.float64), emb)
    return out
