"""The asynchronous hard-negative refresher: ``retromae-ds refresh --run_dir RUN [...]``.

Also ``python -m retromae_ds.ance.refresher``. A separate process (or Slurm job step, or the
trainer's ``--refresher local`` subprocess) that loops:

1. wait for a *complete* trainer checkpoint newer than the one behind the current negatives;
2. load its encoder(s) (``checkpoint/encoder``, ``query_encoder`` when not shared);
3. encode the passages in batches, each rank its own contiguous part, written to
   ``negatives/.work/v{N}/passages_rank{r}.npy`` (temp + rename; a restarted refresher reuses
   complete parts of the same checkpoint); the queries likewise, split over the ranks.
   With ``cache_dir`` the embeddings are looked up first by content (``embed_cache``: the
   encoder's files, the data, the rows, pooling, precision), so runs from the same init
   encode its step-0 checkpoint once between them;
4. each rank searches all queries in its own part (``retromae_ds.index``: faiss, on GPUs when
   usable, or exact torch matmul + top-k) into ``topk_rank{r}.npz``, so no rank ever holds the
   whole corpus embedding matrix; rank 0 merges the ranks' top-K lists (``merge_topk``,
   ``[Q, K]`` each) into ``ranking.npz`` (a refresher restarted after that point mines from it
   without encoding again);
5. hands the ranking to ``publish.mine_and_publish``, the path BM25's first version takes too:
   the false-negative filter, every positive removed, n negatives sampled per query
   (``mining.mine``, seed ``seed + N``) and ``negatives/v{N}.arrow`` + manifest + the
   ``CURRENT`` pointer published (``handoff.publish``).

Versions continue from the last published one after a restart; a refresher killed at any
point leaves only the hidden ``.work`` folder, never a visible partial version. An unreadable
``CURRENT`` pointer is reported (once) and treated as "current version unknown": the next
checkpoint is mined into the version after the highest published one, whose publication
replaces the bad pointer. It exits when the run is finished (``RUN/FINISHED``) and no
checkpoint newer than the current negatives is waiting (at once, saying so, on a run that
finished before it started), after ``max_versions`` versions, after ``idle_timeout_s``
without a new checkpoint, or when the process named by ``parent_pid`` (the trainer of a local
refresher) is gone. Timings per version go to ``RUN/refresh_metrics.jsonl`` and the manifest.

Guards: one refresher per negatives folder (an ``flock`` on ``negatives/.refresher.lock``
naming its holder; a second one fails at start naming it). A data folder (``data_dir``; by
default the one the trainer named in ``refresh_config.json``) whose fingerprint differs from
the one the run's negatives were mined for is refused at start. A write that fails (a full
disk under ``negatives/``) stops the refresher with one line naming the file and the space
left (exit 1) instead of re-encoding forever; the hidden ``.work`` parts already complete are
reused by the next refresher once there is space. A checkpoint that cannot be read (pruned by
the trainer meanwhile) is skipped once, not retried.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from retromae_ds import checkpoint as ckpt
from retromae_ds import faults, holder_lock, sbert
from retromae_ds.ance import data as ance_data
from retromae_ds.ance import handoff
from retromae_ds.ance.embed_cache import EmbeddingCache, folder_digest, rows_digest
from retromae_ds.ance.mining import positive_scores
from retromae_ds.ance.model import load_body
from retromae_ds.ance.publish import Ranking, mine_and_publish
from retromae_ds.ance.refresh_config import RefreshConfig
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.errors import run_reporting
from retromae_ds.eval.encode import pool, resolve_device
from retromae_ds.fsutil import atomic_save_npy, atomic_write_text
from retromae_ds.layout import ENCODER, QUERY_ENCODER, RunLayout
from retromae_ds.tokens import SpecialIds


# --------------------------------------------------------------------------- encoding
def encode_rows(
    model: torch.nn.Module,
    ds: ShardDataset,
    rows: np.ndarray,
    special: SpecialIds,
    *,
    pooling: str,
    normalize: bool,
    batch_size: int,
    amp_dtype: torch.dtype | None = None,
    desc: str = "encode",
    progress: bool = True,
) -> np.ndarray:
    """Embeddings float32 ``[len(rows), D]`` of shard rows (``[CLS] row [SEP]``), in order.

    Rows are taken in windows of 64 batches, each sorted by length so padding stays small.
    """
    device = next(model.parameters()).device
    out = np.empty((len(rows), model.config.hidden_size), dtype=np.float32)
    was_training = model.training
    model.eval()
    window = batch_size * 64
    with (
        torch.inference_mode(),
        tqdm(total=len(rows), desc=desc, unit="text", disable=not progress) as bar,
    ):
        for w0 in range(0, len(rows), window):
            chunk = rows[w0 : w0 + window]
            order = np.argsort(-ds.get_batch(chunk).lengths, kind="stable")
            for b0 in range(0, len(order), batch_size):
                sel = order[b0 : b0 + batch_size]
                ids, mask = ance_data.token_batch(ds, chunk[sel], special)
                ids, mask = ids.to(device), mask.to(device)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
                emb = pool(hidden, mask, pooling).float()
                if normalize:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
                out[w0 + sel] = emb.cpu().numpy()
                bar.update(len(sel))
                faults.pause("sleep_after_encode_batch_s")
    model.train(was_training)
    return out


def _split(n: int, parts: int, part: int) -> tuple[int, int]:
    """Contiguous slice ``part`` of ``parts`` over ``range(n)``."""
    return n * part // parts, n * (part + 1) // parts


# --------------------------------------------------------------------------- distributed
class _Group:
    """Rank/world from the environment (torchrun, srun); a process group only with >1 rank."""

    def __init__(self, timeout_s: int) -> None:
        from retromae_ds import engine as eng

        self.rank = eng.env_int("RANK", "SLURM_PROCID", default=0)
        self.world = eng.env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
        self.local_rank = eng.env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
        if self.world > 1:
            self.info = eng.setup_distributed(timeout_s)

    def broadcast(self, obj: Any) -> Any:
        from retromae_ds import engine as eng

        return obj if self.world == 1 else eng.broadcast_object(obj)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


# --------------------------------------------------------------------------- guards
LOCK = ".refresher.lock"
"""In the negatives folder: held (``flock``) by the refresher writing there."""


class RefresherBusy(ValueError):
    """Another live refresher holds the negatives folder."""


def _take_lock(root: Path) -> tuple[int | None, str | None]:
    """(fd, None) when locked; (None, error) when another refresher holds it; (None, None)
    when the filesystem cannot lock (warned)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, holder = holder_lock.acquire(root / LOCK, what="refresher for this run")
    except OSError as exc:
        raise handoff.write_error(root / LOCK, exc, "the refresher's lock") from exc
    if holder is not None:
        return None, (
            f"{root}: another refresher is writing into this negatives folder ({holder}; lock "
            f"file {root / LOCK}); stop it first, or leave this run to it"
        )
    return fd, None


@contextlib.contextmanager
def hold_negatives(root: Path, group: _Group) -> Iterator[None]:
    """Rank 0 holds the negatives folder's refresher lock for the duration; every rank raises
    ``RefresherBusy`` when another refresher holds it (collective)."""
    fd, problem = _take_lock(root) if group.rank == 0 else (None, None)
    problem = group.broadcast(problem)
    if problem is not None:
        raise RefresherBusy(problem)
    try:
        yield
    finally:
        holder_lock.release(fd)


@contextlib.contextmanager
def _writing(path: Path, what: str, *leftovers: Path) -> Iterator[None]:
    """Re-raise an ``OSError`` of the writes inside as ``handoff.NegativesWriteError`` naming
    ``path`` (and the space left on a full disk), after removing the hidden ``leftovers`` the
    write may have left (temporaries that would hold on to the little space there is)."""
    try:
        yield
    except OSError as exc:
        for leftover in leftovers:
            for found in leftover.parent.glob(leftover.name):
                found.unlink(missing_ok=True)
        raise handoff.write_error(path, exc, what) from exc


def _save_part(path: Path, array: np.ndarray, what: str) -> None:
    """``atomic_save_npy`` naming the file when it fails, leaving no temporary behind."""
    with _writing(path, what, path.with_name(f".{path.name}.tmp*")):
        atomic_save_npy(path, array)


def _read_json(path: Path) -> Any:
    """The JSON in ``path``, None when it cannot be read or parsed (a file left empty by a
    full disk before the writes were atomic)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _process_gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie waiting for its parent counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # Linux: the state letter after the command name in /proc/PID/stat
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def _trainer_data_dir(layout: RunLayout) -> str:
    """The data folder the trainer named in ``RUN/refresh_config.json`` ('' when absent)."""
    try:
        return str(json.loads(layout.refresh_config.read_text()).get("data_dir") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def check_data(ts: ance_data.TrainingSet, data_dir: Path, root: Path) -> None:
    """Refuse a data folder whose fingerprint is not the one the run's negatives were mined
    for (the newest published version's manifest), naming both."""
    for version in reversed(handoff.published_versions(root)):
        try:
            manifest = json.loads(handoff.manifest_file(root, version).read_text())
        except (OSError, ValueError):
            continue
        theirs = manifest.get("data")
        if theirs is None:
            continue
        if theirs != ts.fingerprint():
            mine_ = ts.fingerprint()
            raise ValueError(
                f"{data_dir}: not this run's training data: {handoff.manifest_file(root, version)}"
                f" was mined for {theirs.get('num_passages')} passages and "
                f"{theirs.get('num_queries')} queries with other shards, this folder holds "
                f"{mine_['num_passages']} and {mine_['num_queries']}; point --data_dir at the "
                "folder the trainer prepared (refresh_config.json names it)"
            )
        return


# --------------------------------------------------------------------------- one refresh
def _pick_device(cfg: RefreshConfig, local_rank: int) -> torch.device:
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return device


@dataclass
class _Job:
    """One version being mined: what every stage reads, and where it leaves its files
    (``negatives/.work/v{N}``: each stage's output is there before the next stage starts)."""

    cfg: RefreshConfig
    ts: ance_data.TrainingSet
    checkpoint: Path
    version: int
    step: int
    group: _Group
    work: Path
    timings: dict[str, float] = field(default_factory=dict)
    cached: dict[str, str] = field(default_factory=dict)

    def part(self, name: str, rank: int | None = None) -> Path:
        return self.work / f"{name}_rank{self.group.rank if rank is None else rank:05d}"


def _open_work(root: Path, version: int, meta: dict[str, Any], group: _Group) -> Path:
    """``root/.work/v{version}``, kept when it holds parts of the same checkpoint and ranks
    (``meta.json``), otherwise started over; every other version's work folder removed."""
    work = root / ".work" / f"v{version}"
    if group.rank == 0:
        if (work / "meta.json").is_file() and _read_json(work / "meta.json") != meta:
            shutil.rmtree(work)  # parts of another checkpoint (or unknown ones): start over
        for other in (root / ".work").glob("v*") if (root / ".work").is_dir() else []:
            if other != work:
                shutil.rmtree(other, ignore_errors=True)
        with _writing(work / "meta.json", "the refresher's work folder"):
            work.mkdir(parents=True, exist_ok=True)
            atomic_write_text(work / "meta.json", json.dumps(meta))
    group.barrier()
    return work


def encode_stage(job: _Job) -> tuple[np.ndarray, np.ndarray, int]:
    """Every rank: its contiguous part of the passages (``passages_rank{r}.npy``, reused when
    a killed refresher left it complete) and of the queries (``queries_rank{r}.npy``), from
    the embedding cache when it holds them; returns (its passages, all queries, the index of
    its first passage)."""
    cfg, ts, group, timings = job.cfg, job.ts, job.group, job.timings
    t0 = time.perf_counter()
    device = _pick_device(cfg, group.local_rank)
    encoder_dir = job.checkpoint / ENCODER
    spec = sbert.read_spec(encoder_dir)
    passage_model = load_body(encoder_dir).to(device)
    query_dir = job.checkpoint / QUERY_ENCODER
    query_model = load_body(query_dir).to(device) if query_dir.is_dir() else passage_model
    use_bf16 = cfg.bf16 and (device.type == "cuda" or cfg.bf16_cpu)
    amp = torch.bfloat16 if use_bf16 else None
    timings["load_s"] = time.perf_counter() - t0
    common = dict(
        pooling=spec.pooling,
        normalize=spec.normalize,
        batch_size=cfg.batch_size,
        amp_dtype=amp,
        progress=cfg.progress,
    )
    if group.rank == 0:
        print(
            f"refresh: v{job.version} from {job.checkpoint.name} (step {job.step}): encoding "
            f"{ts.num_passages} passages on {group.world} rank(s)",
            file=sys.stderr,
            flush=True,
        )

    lo, hi = _split(ts.num_passages, group.world, group.rank)
    qlo, qhi = _split(ts.num_queries, group.world, group.rank)
    cache = EmbeddingCache(cfg.cache_dir)
    keys: dict[str, dict[str, Any]] = {}
    if cache.enabled:
        t0 = time.perf_counter()
        base = {
            "data": ts.fingerprint(),
            "pooling": spec.pooling,
            "normalize": spec.normalize,
            "autocast": str(amp),
            "device": device.type,
        }
        passage_digest = folder_digest(encoder_dir)
        keys["passages"] = {
            **base,
            "encoder": passage_digest,
            "rows": rows_digest(ts.passage_rows[lo:hi]),
        }
        keys["queries"] = {
            **base,
            "encoder": folder_digest(query_dir) if query_dir.is_dir() else passage_digest,
            "rows": rows_digest(ts.query_rows[qlo:qhi]),
        }
        timings["cache_key_s"] = time.perf_counter() - t0

    def encode(what: str, model: torch.nn.Module, texts: Any, rows: np.ndarray) -> np.ndarray:
        """``rows`` encoded, or loaded from the embedding cache (and stored there on a miss)."""
        key = cache.key({"texts": what, **keys[what]}) if cache.enabled else ""
        found = cache.load(key, (len(rows), model.config.hidden_size)) if key else None
        job.cached[what] = "off" if not key else "miss" if found is None else "hit"
        if found is not None:
            return found
        out = encode_rows(model, texts, rows, ts.special, desc=f"{what} r{group.rank}", **common)
        if key:
            try:
                cache.save(key, out, {"texts": what, **keys[what]})
            except OSError as exc:  # the cache only saves time: say so and go on without it
                job.cached[what] = "not stored"
                print(
                    f"refresh: embedding cache {cfg.cache_dir}: not stored "
                    f"({handoff.write_error(Path(cfg.cache_dir), exc, 'embeddings')})",
                    file=sys.stderr,
                    flush=True,
                )
        return out

    t0 = time.perf_counter()
    part_file = job.part("passages").with_suffix(".npy")
    if part_file.is_file():  # left complete by a refresher killed later in this version
        passages = np.load(part_file)
        job.cached["passages"] = "resumed"
    else:
        passages = encode("passages", passage_model, ts.corpus, ts.passage_rows[lo:hi])
        _save_part(part_file, passages, "passage embeddings")
    timings["encode_passages_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    query_part = encode("queries", query_model, ts.queries, ts.query_rows[qlo:qhi])
    _save_part(job.part("queries").with_suffix(".npy"), query_part, "query embeddings")
    group.barrier()
    queries = np.concatenate(
        [np.load(job.part("queries", r).with_suffix(".npy")) for r in range(group.world)]
    )
    timings["encode_queries_s"] = time.perf_counter() - t0
    return passages, queries, lo


def search_stage(job: _Job, passages: np.ndarray, queries: np.ndarray, lo: int) -> None:
    """Every rank: all queries against its own passages (``retromae_ds.index``), top-K with
    global passage indices and the scores of the positives it holds, written to
    ``topk_rank{r}.npz``; no rank ever holds the whole corpus embedding matrix."""
    from retromae_ds.index import ExactIndex

    cfg, timings = job.cfg, job.timings
    t0 = time.perf_counter()
    index = ExactIndex(passages.shape[1], backend=cfg.index)
    index.add(passages)
    timings["index_build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    k = min(cfg.mining.top_k, max(1, len(passages)))
    scores_parts, ids_parts = [], []
    q_step = 4096
    for s in tqdm(
        range(0, len(queries), q_step),
        desc=f"search r{job.group.rank}",
        unit="batch",
        disable=not cfg.progress,
    ):
        sc, ix = index.search(queries[s : s + q_step], k)
        scores_parts.append(sc)
        ids_parts.append(np.where(ix >= 0, ix + lo, -1))
    scores = np.concatenate(scores_parts) if scores_parts else np.zeros((0, k), np.float32)
    ids = np.concatenate(ids_parts) if ids_parts else np.zeros((0, k), np.int64)
    pos_scores = positive_scores(queries, passages, lo, job.ts.positives)
    topk = job.part("topk").with_suffix(".npz")
    with _writing(topk, "the search results", topk.with_name(f".{topk.name}")):
        Ranking(ids=ids, scores=scores, positives=pos_scores).save(topk)
    timings["search_s"] = time.perf_counter() - t0


def merge_stage(job: _Job) -> Ranking:
    """Rank 0: the ranks' top-K lists merged into one (``merge_topk``) and the positives'
    scores joined (each pair was scored on one rank), written to ``ranking.npz``."""
    from retromae_ds.index import merge_topk

    t0 = time.perf_counter()
    merged = Ranking.load(job.part("topk", 0).with_suffix(".npz"))
    scores, ids, pos_scores = merged.scores, merged.ids, merged.positives
    for r in range(1, job.group.world):
        part = Ranking.load(job.part("topk", r).with_suffix(".npz"))
        scores, ids = merge_topk(scores, ids, part.scores, part.ids, job.cfg.mining.top_k)
        pos_scores = np.fmin(pos_scores, part.positives)
    ranking = Ranking(ids=ids, scores=scores, positives=pos_scores)
    path = job.work / RANKING
    with _writing(path, "the merged ranking", path.with_name(f".{path.name}")):
        ranking.save(path)
    job.timings["merge_s"] = time.perf_counter() - t0
    return ranking


RANKING = "ranking.npz"
"""The merged ranking of a version in its work folder: a refresher restarted after it was
written mines and publishes from it without encoding again."""


def refresh_once(
    cfg: RefreshConfig,
    ts: ance_data.TrainingSet,
    checkpoint: Path,
    version: int,
    group: _Group,
) -> dict[str, Any] | None:
    """Mine and publish version ``version`` from ``checkpoint`` through the stages encode →
    search → merge (files in ``negatives/.work/v{N}``) → mine and publish
    (``publish.mine_and_publish``, the BM25 version's path too); returns the manifest
    (rank 0) or None. Every rank calls it."""
    layout = RunLayout(cfg.run_dir)
    root = layout.negatives
    step = ckpt.read_marker(checkpoint)["step"]
    meta = {"checkpoint": str(checkpoint), "step": step, "world_size": group.world}
    work = _open_work(root, version, meta, group)
    job = _Job(cfg, ts, checkpoint, version, step, group, work)
    ranked = group.broadcast((work / RANKING).is_file() if group.rank == 0 else None)
    if not ranked:
        passages, queries, lo = encode_stage(job)
        search_stage(job, passages, queries, lo)
        del passages, queries
        group.barrier()
    manifest = None
    if group.rank == 0:
        if ranked:
            ranking = Ranking.load(work / RANKING)
            job.cached = {"passages": "ranked", "queries": "ranked"}
            print(f"refresh: v{version}: ranking found in {work}", file=sys.stderr, flush=True)
        else:
            ranking = merge_stage(job)
        if "encode_passages_s" in job.timings:
            job.timings["passages_per_s"] = ts.num_passages / max(
                job.timings["encode_passages_s"], 1e-9
            )
        manifest, filtered = mine_and_publish(
            root,
            version,
            ranking,
            ts,
            cfg.mining,
            seed=cfg.mining.seed + version,
            keep_last=cfg.keep_last,
            step=step,
            source={"source": "model", "checkpoint": checkpoint.name},
            extra={"ranks": group.world, "embedding_cache": job.cached},
            timings=job.timings,
        )
        _record(layout, manifest, filtered)
        shutil.rmtree(work, ignore_errors=True)
        print(
            f"refresh: published v{version} (step {step}) {manifest['timings']}; "
            f"embedding cache {job.cached}",
            file=sys.stderr,
            flush=True,
        )
    group.barrier()
    return manifest


def _record(layout: RunLayout, manifest: dict[str, Any], filtered: dict[str, Any] | None) -> None:
    """One line of ``RUN/refresh_metrics.jsonl`` for a published version."""
    dropped = {"false_negatives_dropped": filtered["dropped"]} if filtered else {}
    row = {"version": manifest["version"], "step": manifest["step"], **manifest["timings"]}
    try:
        with open(layout.refresh_metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps({**row, **dropped}) + "\n")
    except OSError as exc:  # the version is published; its timings are in its manifest too
        print(
            f"refresh: {layout.refresh_metrics}: timings not appended ({exc})",
            file=sys.stderr,
            flush=True,
        )


# --------------------------------------------------------------------------- the loop
def _set_threads(cfg: RefreshConfig, step: int, all_threads: int) -> None:
    """``cfg.threads`` torch threads while the trainer trains; all of them for a step-0
    checkpoint, whose negatives the trainer waits for (``negatives.mine_first``)."""
    want = all_threads if step == 0 or not cfg.threads else cfg.threads
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    print(
        f"refresh: {want} torch CPU threads (step {step}; default {all_threads})",
        file=sys.stderr,
        flush=True,
    )


def run_refresher(cfg: RefreshConfig) -> int:
    """Refresh until told to stop (see the module docstring); returns versions published."""
    if not cfg.run_dir:
        raise ValueError("refresh: --run_dir is required")
    group = _Group(cfg.timeout_s)
    layout = RunLayout(cfg.run_dir)
    with hold_negatives(layout.negatives, group):  # one refresher per negatives folder
        return _refresh_loop(cfg, group, layout)


def _refresh_loop(cfg: RefreshConfig, group: _Group, layout: RunLayout) -> int:
    all_threads = torch.get_num_threads()
    # the folder the trainer prepared (it names it in refresh_config.json), else RUN/data
    data_dir = Path(cfg.data_dir or _trainer_data_dir(layout) or layout.data)
    published = 0
    last_new = time.monotonic()
    ts = None
    reported: set[str] = set()  # pointer problems already printed
    skipped: set[str] = set()  # checkpoints that could not be read: not retried
    parent_ppid = os.getppid()
    while True:
        action: dict[str, Any] = {"do": "wait"}
        if group.rank == 0:
            action = _next_action(cfg, layout, data_dir, last_new, reported, skipped, parent_ppid)
        action = group.broadcast(action)
        if action.get("ready") and ts is None:
            # refused at start: a data folder that is not the one the negatives refer to
            ts = ance_data.load(data_dir)
            check_data(ts, data_dir, layout.negatives)
        if action["do"] == "stop":
            if group.rank == 0:
                print(f"refresh: stopping ({action['why']})", file=sys.stderr, flush=True)
            return published
        if action["do"] == "wait":
            time.sleep(cfg.poll_s)
            continue
        _set_threads(cfg, action["step"], all_threads)
        try:
            refresh_once(cfg, ts, Path(action["checkpoint"]), action["version"], group)
        except handoff.NegativesWriteError:
            raise  # a full disk does not fix itself: re-encoding again would only loop
        except (FileNotFoundError, OSError) as exc:
            if group.world > 1:
                raise
            # the trainer pruned the checkpoint while it was being read: take the next one
            print(f"refresh: skipped {action['checkpoint']}: {exc}", file=sys.stderr, flush=True)
            skipped.add(action["checkpoint"])
            continue
        published += 1
        last_new = time.monotonic()
        if cfg.max_versions and published >= cfg.max_versions:
            if group.rank == 0:
                print(f"refresh: stopping (max_versions {cfg.max_versions})", file=sys.stderr)
            return published


def _source(root: Path, version: int) -> str | None:
    try:
        return json.loads(handoff.manifest_file(root, version).read_text()).get("source")
    except (FileNotFoundError, ValueError):
        return None


def _next_action(
    cfg: RefreshConfig,
    layout: RunLayout,
    data_dir: Path,
    last_new: float,
    reported: set[str] | None = None,
    skipped: set[str] | None = None,
    parent_ppid: int | None = None,
) -> dict[str, Any]:
    """Rank 0: ``{"do": "wait" | "stop" | "refresh", ...}``; ``ready`` once the data is
    prepared and a negatives version exists (the data can then be checked)."""
    root = layout.negatives
    if cfg.parent_pid and (
        _process_gone(cfg.parent_pid)
        or (cfg.parent_pid == parent_ppid and os.getppid() != parent_ppid)
    ):
        return {
            "do": "stop",
            "why": f"the trainer it serves (pid {cfg.parent_pid}) is gone",
        }
    # FINISHED: the trainer reached max_steps. Whenever it was written (before this refresher
    # started too: slurm/finetune.sh and the trainer remove a previous one before they start),
    # once nothing newer than the current negatives is left to mine, there is nothing to do.
    finished = layout.finished
    done = finished.is_file()
    if cfg.idle_timeout_s and time.monotonic() - last_new > cfg.idle_timeout_s:
        return {"do": "stop", "why": f"no new checkpoint for {cfg.idle_timeout_s:.0f} s"}
    try:
        pointer, unknown = handoff.read_pointer(root), False
    except handoff.HandoffError as exc:
        # the current version is unknown; publishing the next one replaces the bad pointer
        pointer, unknown = None, True
        if reported is None or str(exc) not in reported:
            print(f"refresh: {exc}; will publish a new version", file=sys.stderr, flush=True)
            if reported is not None:
                reported.add(str(exc))
    if not (data_dir / ance_data.READY).is_file() or (pointer is None and not unknown):
        # the trainer prepares the data and publishes the BM25 version first
        return (
            {"do": "stop", "why": f"the run is finished ({finished})"} if done else {"do": "wait"}
        )
    # the newest checkpoint whose encoder(s) match their record (a corrupt newer one is
    # passed over, saying so once), as every other reader of checkpoints does
    try:
        newest = ckpt.resolve_checkpoint(layout.root)
    except FileNotFoundError:
        newest = None  # none yet, or pruned while being read: wait
    except ckpt.CheckpointCorrupt as exc:
        newest = None  # wait for one that verifies, having said why once
        if reported is None or str(exc) not in reported:
            print(f"refresh: {exc}; waiting for a newer checkpoint", file=sys.stderr, flush=True)
            if reported is not None:
                reported.add(str(exc))
    if newest is not None and skipped and str(newest) in skipped:
        newest = None  # unreadable once: wait for the next one
    # BM25 negatives come from no checkpoint: any checkpoint, even step 0, is newer (and so
    # it is when the current version is unknown)
    fresh = newest is not None and (
        unknown
        or _source(root, pointer["version"]) == "bm25"
        or ckpt.read_marker(newest)["step"] >= pointer["step"] + max(1, cfg.min_new_steps)
    )
    if fresh:
        # numbered past every published version (data + manifest), whatever the pointer says
        return {
            "do": "refresh",
            "ready": True,
            "checkpoint": str(newest),
            "step": ckpt.read_marker(newest)["step"],
            "version": handoff.next_version(root),
        }
    if done:
        current = (
            f"negatives v{pointer['version']} (step {pointer['step']})"
            if pointer
            else "the negatives"
        )
        return {
            "do": "stop",
            "ready": True,
            "why": f"the run is finished ({finished}) and no checkpoint is newer than {current}",
        }
    return {"do": "wait", "ready": True}


def _run_main(argv: list[str] | None) -> None:
    from retromae_ds.config import make_parser, parse_config

    parser = make_parser(
        RefreshConfig, prog="retromae-ds refresh", description=__doc__.splitlines()[0]
    )
    cfg, _ = parse_config(RefreshConfig, parser, argv)
    try:
        run_refresher(cfg)
    except handoff.NegativesWriteError as exc:
        error = handoff.NegativesWriteError(
            f"{exc}; the trainer trains on with the version it has: free space there and start "
            "the refresher again (a resumed fine-tuning starts its local one)"
        )
        error.errno = exc.errno
        raise error from exc


def main(argv: list[str] | None = None) -> int:
    """``retromae-ds refresh`` (also ``python -m retromae_ds.ance.refresher``, as the trainer's
    local refresher and slurm/finetune.sh run it): one error line, exit 2 for bad input and 1
    for files, a traceback only with ``RETROMAE_DS_DEBUG`` on (``errors.run_reporting``)."""
    return run_reporting("retromae-ds refresh", _run_main, argv)


if __name__ == "__main__":
    sys.exit(main())
