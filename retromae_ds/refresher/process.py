"""The asynchronous hard-negative refresher: ``retromae-ds refresh --run_dir RUN [...]``.

Also ``python -m retromae_ds.refresh``. The loop, its guards and one refresh live here;
the stages it runs are ``retromae_ds.refresher.stages``. A separate process (or Slurm job step, or the
trainer's ``--refresher local`` subprocess) that loops:

1. wait for a *complete* trainer checkpoint newer than the one behind the current negatives;
2. load its encoder(s) (``checkpoint/encoder``, ``query_encoder`` when not shared);
3. encode the passages in shards of ``shard_rows`` (``embed_shards``:
   ``negatives/.work/v{N}/passages/shard_{s}.npy`` + manifest with the encoder's and the
   corpus's identity and the bytes' sha256; temp + rename), each rank a contiguous run of
   shards, one shard in memory at a time; a restarted refresher keeps the complete shards of
   the same encoder and corpus, whatever its number of ranks. The queries likewise, split
   over the ranks. With ``cache_dir`` the embeddings are looked up first by content
   (``embed_cache``: the encoder's files, the data, the rows, pooling, precision; entries
   checksummed), so runs from the same init encode its step-0 checkpoint once between them;
4. each rank verifies its shards' checksums (a shard that fails is encoded again, never
   searched) and searches all queries in them (``retromae_ds.search``: the index ``index``
   names, exact by default below 200,000 passages a rank, shard by shard through faiss on
   GPUs when usable, or exact torch matmul + top-k with ``search_backend torch``) into
   ``topk_rank{r}.npz``, so no rank ever holds the whole corpus embedding matrix; rank 0
   merges the ranks' top-K lists (``merge_topk``, ``[Q, K]`` each) into ``ranking.npz`` (a
   refresher restarted after that point mines from it without encoding again);
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

Guards: ``run_dir`` must be a fine-tuning run folder (``refresh_config.json`` or ``negatives/``
in it, or the trainer's ``config.json`` with fine-tuning settings); anything else (a missing
folder, a file, a pre-training run) is refused in one line before anything is created. While
it waits it says what for every ``wait_report_s``. One refresher per negatives folder (an ``flock`` on ``negatives/.refresher.lock``
naming its holder; a second one fails at start naming it). A data folder (``data_dir``; by
default the one the trainer named in ``refresh_config.json``) whose fingerprint differs from
the one the run's negatives were mined for is refused at start. A write that fails (a full
disk under ``negatives/``, or a read-only one) stops the refresher with one line naming the
file and the space left, or the folder that is not writable (exit 1), instead of
re-encoding forever; the hidden ``.work`` shards already complete are reused by the next
refresher once there is space. A checkpoint that cannot be read (pruned by
the trainer meanwhile) is skipped once, not retried.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from retromae_ds.base import faults
from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components import holder_lock
from retromae_ds.components.layout import RunLayout
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.refresher import candidate_pool, embed_shards
from retromae_ds.refresher.config import RefreshConfig
from retromae_ds.refresher.publish import Ranking, mine_and_publish
from retromae_ds.refresher.stages import (
    RANKING,
    Group,
    Job,
    encode_verified,
    merge_stage,
    open_work,
    pick_device,
    read_json,
    search_stage,
)
from retromae_ds.refresher.teacher import teacher_for

# --------------------------------------------------------------------------- guards
LOCK = ".refresher.lock"
"""In the negatives folder: held (``flock``) by the refresher writing there."""


class RefresherBusy(ValueError):
    """Another live refresher holds the negatives folder."""


def run_folder_problem(layout: RunLayout) -> str | None:
    """Why ``layout.root`` is not a fine-tuning run folder a refresher may serve (None when it
    is one, or one whose trainer has started: its ``config.json`` has fine-tuning settings).
    Looks only; creates nothing."""
    root = layout.root
    hint = (
        "; a refresher serves a fine-tuning run: point --run_dir at the folder "
        "`retromae-ds finetune --run_dir` writes (start the trainer first; slurm/finetune.sh "
        "starts its refresher once RUN/refresh_config.json exists)"
    )
    if not root.exists():
        return f"{root}: no such run folder{hint}"
    if not root.is_dir():
        return f"{root}: is a file, not a run folder{hint}"
    if layout.refresh_config.is_file() or layout.negatives.is_dir():
        return None
    if layout.config.is_file():
        try:
            saved = json.loads(layout.config.read_text())
        except (OSError, ValueError) as exc:
            return f"{layout.config}: unreadable ({exc}), so {root} is not a run it can serve"
        if isinstance(saved, dict) and "negatives" in saved and "refresh" in saved:
            return None  # the trainer has started; it prepares the data and negatives next
        kind = (
            "a pre-training run" if ckpt.pretraining_evidence(layout) else "not a fine-tuning run"
        )
        return (
            f"{root}: {kind} (its config.json has no fine-tuning settings, and it holds no "
            f"refresh_config.json or negatives/){hint}"
        )
    return f"{root}: holds no fine-tuning run (no config.json, refresh_config.json or negatives/){hint}"


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
def hold_negatives(root: Path, group: Group) -> Iterator[None]:
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
def refresh_once(
    cfg: RefreshConfig,
    ts: ance_data.TrainingSet,
    checkpoint: Path,
    version: int,
    group: Group,
) -> dict[str, Any] | None:
    """Mine and publish version ``version`` from ``checkpoint`` through the stages encode →
    search → merge (files in ``negatives/.work/v{N}``) → mine and publish
    (``publish.mine_and_publish``, the BM25 version's path too); returns the manifest
    (rank 0) or None. Every rank calls it."""
    layout = RunLayout(cfg.run_dir)
    root = layout.negatives
    step = ckpt.read_marker(checkpoint)["step"]
    meta = {"checkpoint": str(checkpoint), "step": step, "world_size": group.world}
    job = Job(cfg, ts, checkpoint, version, step, group, root / ".work" / f"v{version}")
    # refresh.mode pool: re-score the candidate pool, or mine in full and keep a new one
    plan = group.broadcast(candidate_pool.plan(cfg, root, version, ts) if group.rank == 0 else None)
    search: Callable[..., None] = search_stage
    if plan is not None:
        meta.update(plan.meta())
        search = candidate_pool.set_up(plan, job, root) or search_stage
    work = open_work(root, version, meta, group, job.shards())
    ranked = group.broadcast((work / RANKING).is_file() if group.rank == 0 else None)
    shard_report: list[dict[str, Any]] = []
    if not ranked:
        encode_verified(job, search)
        shard_report = group.gather(
            {"counts": job.shard_counts(), "cache": list(job.shard_cache.values())}
        )
        group.barrier()
        faults.crash("crash_in_refresh_at", "merge")
    manifest = None
    if group.rank == 0:
        manifest = _mine_and_publish(job, plan, work, ranked, shard_report)
    group.barrier()
    return manifest


def _mine_and_publish(
    job: Job,
    plan: candidate_pool.Plan | None,
    work: Path,
    ranked: bool,
    shard_report: list[dict[str, Any]],
) -> dict[str, Any]:
    """Rank 0: the ranking (merged now, or left ``ranked`` by an earlier refresher) mined and
    published as ``job``'s version, with the candidate pool kept first in pool mode; the
    work folder removed after. Returns the manifest."""
    cfg, ts, version, step, checkpoint = job.cfg, job.ts, job.version, job.step, job.checkpoint
    root = RunLayout(cfg.run_dir).negatives
    if ranked:
        ranking = Ranking.load(work / RANKING)
        job.cached = {"passages": "ranked", "queries": "ranked"}
        print(f"refresh: v{version}: ranking found in {work}", file=sys.stderr, flush=True)
    else:
        ranking = merge_stage(job)
        job.cached["passages"] = embed_shards.stats_line(
            [answer for rank in shard_report for answer in rank["cache"]] or ["none"]
        )
    faults.crash("crash_in_refresh_at", "publish")
    if plan is not None and plan.mode == "full":  # kept before the version names it
        candidate_pool.save_pool(
            root, version, ranking.ids[:, : plan.k], ts, source="model", step=step,
            checkpoint=checkpoint.name,
        )  # fmt: skip
    ranking = ranking.head(cfg.mining.top_k)  # a full refresh of pool mode searched K'
    if "encode_passages_s" in job.timings:
        job.timings["passages_per_s"] = job.num_encoded() / max(
            job.timings["encode_passages_s"], 1e-9
        )
    extra = {} if plan is None else {
        "candidate_pool": plan.record(job.num_encoded(), cfg.pool_full_every)
    }  # fmt: skip
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
        teacher=teacher_for(cfg, ts, str(pick_device(cfg, job.group.local_rank))),
        extra={
            "ranks": job.group.world,
            "embedding_cache": job.cached,
            "device": str(pick_device(cfg, job.group.local_rank)),
            "index": cfg.index,
            "search_backend": cfg.search_backend,
            # what rank 0's index resolved to (factory string, nprobe, ef_search, ...)
            "index_resolved": read_json(job.part("index", 0).with_suffix(".json")),
            "embedding_shards": _shard_summary(cfg, job, shard_report),
            **extra,
        },
        timings=job.timings,
    )
    if plan is not None:  # the pool the new version names is the one kept
        candidate_pool.prune(root, plan.pool_version)
    _record(RunLayout(cfg.run_dir), manifest, filtered)
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"refresh: published v{version} (step {step}) {manifest['timings']}; "
        f"embedding cache {job.cached}",
        file=sys.stderr,
        flush=True,
    )
    return manifest


def _shard_summary(
    cfg: RefreshConfig, job: Job, report: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The manifest's ``embedding_shards``: the layout and how every rank's shards came to
    be (None for a version mined from a ranking left by an earlier refresher)."""
    if not report:
        return None
    totals = {name: sum(rank["counts"][name] for rank in report) for name in report[0]["counts"]}
    return {
        "shards": len(job.shards()),
        "shard_rows": job.shard_rows(),
        "dim": job.dim,
        "dtype": cfg.embedding_dtype,
        **totals,
    }


def _record(layout: RunLayout, manifest: dict[str, Any], filtered: dict[str, Any] | None) -> None:
    """One line of ``RUN/refresh_metrics.jsonl`` for a published version."""
    dropped = (
        {"false_negatives_dropped": filtered["dropped"]}
        if filtered and "dropped" in filtered
        else {}
    )
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
    group = Group(cfg.timeout_s)
    layout = RunLayout(cfg.run_dir)
    problem = group.broadcast(run_folder_problem(layout) if group.rank == 0 else None)
    if problem is not None:
        raise ValueError(f"refresh: {problem}")
    with hold_negatives(layout.negatives, group):  # one refresher per negatives folder
        return _refresh_loop(cfg, group, layout)


@dataclass(frozen=True)
class Decision:
    """What the refresher does next: rank 0 decides (``_next_action``), every rank follows."""

    do: str
    """``wait``, ``stop`` or ``refresh``."""
    why: str = ""
    """stop: the reason; wait: what is awaited (said every ``wait_report_s``)."""
    ready: bool = False
    """The data is prepared and a negatives version exists: the data can be checked."""
    checkpoint: str = ""
    """refresh: the checkpoint to mine from, its step and the version to publish."""
    step: int = 0
    version: int = 0


@dataclass
class Watch:
    """What rank 0's decisions remember between polls."""

    last_new: float
    """When the last version was published (or the loop started): ``idle_timeout_s``."""
    parent_ppid: int
    """This process's parent at start: a local refresher whose trainer died is re-parented."""
    reported: set[str] = field(default_factory=set)
    """Problems already printed (a bad pointer, a corrupt checkpoint): said once."""
    skipped: set[str] = field(default_factory=set)
    """Checkpoints that could not be read: not retried."""

    def say_once(self, message: str) -> None:
        if message not in self.reported:
            print(message, file=sys.stderr, flush=True)
            self.reported.add(message)


def _refresh_loop(cfg: RefreshConfig, group: Group, layout: RunLayout) -> int:
    all_threads = torch.get_num_threads()
    # the folder the trainer prepared (it names it in refresh_config.json), else RUN/data
    data_dir = Path(cfg.data_dir or _trainer_data_dir(layout) or layout.data)
    published = 0
    ts = None
    watch = Watch(last_new=time.monotonic(), parent_ppid=os.getppid())
    started = time.monotonic()
    next_report = started + cfg.wait_report_s  # a short wait goes without a word
    while True:
        action = Decision("wait", why="rank 0")
        if group.rank == 0:
            action = _next_action(cfg, layout, data_dir, watch)
        action = group.broadcast(action)
        if action.ready and ts is None:
            # refused at start: a data folder that is not the one the negatives refer to
            ts = ance_data.load(data_dir)
            check_data(ts, data_dir, layout.negatives)
        if action.do == "stop":
            if group.rank == 0:
                print(f"refresh: stopping ({action.why})", file=sys.stderr, flush=True)
            return published
        if action.do == "wait":
            if group.rank == 0 and time.monotonic() >= next_report:
                waited = time.monotonic() - started
                print(
                    f"refresh: waiting for {action.why} ({waited:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                next_report = time.monotonic() + cfg.wait_report_s
            time.sleep(cfg.poll_s)
            continue
        _set_threads(cfg, action.step, all_threads)
        try:
            refresh_once(cfg, ts, Path(action.checkpoint), action.version, group)
        except handoff.NegativesWriteError:
            raise  # a full disk does not fix itself: re-encoding again would only loop
        except (FileNotFoundError, OSError) as exc:
            if group.world > 1:
                raise
            # the trainer pruned the checkpoint while it was being read: take the next one
            print(f"refresh: skipped {action.checkpoint}: {exc}", file=sys.stderr, flush=True)
            watch.skipped.add(action.checkpoint)
            continue
        published += 1
        watch.last_new = time.monotonic()
        if cfg.max_versions and published >= cfg.max_versions:
            if group.rank == 0:
                print(f"refresh: stopping (max_versions {cfg.max_versions})", file=sys.stderr)
            return published


def _source(root: Path, version: int) -> str | None:
    try:
        return json.loads(handoff.manifest_file(root, version).read_text()).get("source")
    except (FileNotFoundError, ValueError):
        return None


# --------------------------------------------------------------------------- deciding
def _trainer_gone(cfg: RefreshConfig, watch: Watch) -> bool:
    """The trainer this refresher serves (``parent_pid``) exited, or this process was
    re-parented away from it."""
    return bool(cfg.parent_pid) and (
        _process_gone(cfg.parent_pid)
        or (cfg.parent_pid == watch.parent_ppid and os.getppid() != watch.parent_ppid)
    )


def _current_version(root: Path, watch: Watch) -> tuple[dict[str, Any] | None, bool]:
    """(the negatives pointer or None, whether it is unreadable: the current version is
    unknown, and publishing the next one replaces the bad pointer)."""
    try:
        return handoff.read_pointer(root), False
    except handoff.HandoffError as exc:
        watch.say_once(f"refresh: {exc}; will publish a new version")
        return None, True


def _awaited_start(data_dir: Path, root: Path) -> str:
    """What the trainer has not yet done before anything can be mined ("" once done): it
    prepares the data and publishes the BM25 version first."""
    if not (data_dir / ance_data.READY).is_file():
        return f"the trainer to prepare its data ({data_dir / ance_data.READY})"
    return f"the trainer's first negatives version ({root / handoff.POINTER})"


def _newest_checkpoint(layout: RunLayout, watch: Watch) -> Path | None:
    """The newest checkpoint whose encoder(s) match their record, as every other reader of
    checkpoints picks it (a corrupt newer one is passed over, saying so once); None while
    there is none, or it was pruned while being read, or could not be read before."""
    try:
        newest = ckpt.resolve_checkpoint(layout.root)
    except FileNotFoundError:
        return None
    except ckpt.CheckpointCorrupt as exc:
        watch.say_once(f"refresh: {exc}; waiting for a newer checkpoint")
        return None
    return None if str(newest) in watch.skipped else newest


def _is_newer(
    cfg: RefreshConfig, root: Path, checkpoint: Path, pointer: dict[str, Any] | None
) -> bool:
    """Whether ``checkpoint`` is worth mining over the current version ``pointer`` (None:
    unknown). BM25 negatives come from no checkpoint: any checkpoint, even step 0, is newer;
    otherwise it must be ``min_new_steps`` (at least 1) past the version's step."""
    if pointer is None or _source(root, pointer["version"]) == "bm25":
        return True
    return ckpt.read_marker(checkpoint)["step"] >= pointer["step"] + max(1, cfg.min_new_steps)


def _next_action(cfg: RefreshConfig, layout: RunLayout, data_dir: Path, watch: Watch) -> Decision:
    """Rank 0's decision for this poll (``Decision``)."""
    root = layout.negatives
    if _trainer_gone(cfg, watch):
        return Decision("stop", why=f"the trainer it serves (pid {cfg.parent_pid}) is gone")
    if cfg.idle_timeout_s and time.monotonic() - watch.last_new > cfg.idle_timeout_s:
        return Decision("stop", why=f"no new checkpoint for {cfg.idle_timeout_s:.0f} s")
    # FINISHED: the trainer reached max_steps. Whenever it was written (before this refresher
    # started too: slurm/finetune.sh and the trainer remove a previous one before they start),
    # once nothing newer than the current negatives is left to mine, there is nothing to do.
    finished = layout.finished
    done = finished.is_file()
    pointer, unknown = _current_version(root, watch)
    if not (data_dir / ance_data.READY).is_file() or (pointer is None and not unknown):
        if done:
            return Decision("stop", why=f"the run is finished ({finished})")
        return Decision("wait", why=_awaited_start(data_dir, root))
    newest = _newest_checkpoint(layout, watch)
    if newest is not None and _is_newer(cfg, root, newest, pointer):
        # numbered past every published version (data + manifest), whatever the pointer says
        return Decision(
            "refresh",
            ready=True,
            checkpoint=str(newest),
            step=ckpt.read_marker(newest)["step"],
            version=handoff.next_version(root),
        )
    current = f"v{pointer['version']} (step {pointer['step']})" if pointer else ""
    if done:
        newer_than = f"negatives {current}" if pointer else "the negatives"
        why = f"the run is finished ({finished}) and no checkpoint is newer than {newer_than}"
        return Decision("stop", why=why, ready=True)
    why = (
        f"a complete checkpoint in {layout.checkpoints} newer than negatives "
        f"{current or 'the current version'}"
    )
    return Decision("wait", why=why, ready=True)
