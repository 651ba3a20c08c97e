"""Offline, parallel, resumable preprocessing of raw text into Arrow shards.

Run as ``retromae-ds preprocess INPUT... --out DIR (--tokenizer DIR | --train_tokenizer N)``
or ``python tools/preprocess_shards.py ...``. Output folder::

    DIR/plan.json           the work units and every setting that shapes the output
    DIR/tokenizer/          the tokenizer the shards were made with
    DIR/shards/part-NNNNNN.arrow  (+ part-NNNNNN.json: the unit's completion record)
    DIR/rejects.jsonl       with --on_error skip: every skipped record and why
    DIR/manifest.json       written last; the dataset is complete when it exists

Each unit of input becomes exactly one shard, written to a temporary name and renamed, so the
output is byte-identical for any worker count, a killed run redoes only missing units, and
``--num_tasks T --task_index I`` lets T independent processes (a Slurm array) share the work;
``--merge`` then writes the one manifest.

A rerun into an existing folder resumes only when ``plan.json`` matches: the same settings
(tokenizer-training ones included) and unchanged inputs (size, modification time and a content
hash of each); anything else is refused, naming what changed. Temporaries of a killed run
(``tokenizer.tmp-*``, ``backend.tmp-*.json``) are removed by the next run.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import multiprocessing as mp
import os
import re
import shutil
import socket
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa

from retromae_ds.base import faults
from retromae_ds.base.config import flag, parse_size
from retromae_ds.base.errors import DiskFull, disk_full_error
from retromae_ds.base.fsutil import atomic_write_text, sha256_file  # noqa: F401 (re-exported)
from retromae_ds.data import schema
from retromae_ds.data.rows import (
    build_batch,
    continuation_mask,
    make_backend,
    tokenize_documents,
)
from retromae_ds.data.segment import SEGMENTERS, Segmenter, SegmenterSpec
from retromae_ds.data.segment import identity as segmenter_identity
from retromae_ds.data.segment import resolve as resolve_segmenter
from retromae_ds.data.sources import (
    InputError,
    SourceOptions,
    Unit,
    dump_json,
    expand_inputs,
    input_signature,
    plan_units,
    read_unit,
)

PLAN_NAME = "plan.json"
REJECTS_NAME = "rejects.jsonl"


@dataclass(kw_only=True)
class PreprocessConfig:
    """Settings of one preprocessing run."""

    RENAMED: ClassVar[dict[str, str]] = {
        name: f"source.{name}"
        for name in ("text_field", "title_field", "id_field", "title_sep", "txt_mode", "split")
    }
    """The source options were top-level flags before the one spelling (issue 47)."""

    inputs: list[str] = flag(default_factory=list, positional=True, nargs="*")
    """Files, globs or folders (.jsonl[.gz], .txt, .parquet, BEIR, datasets; see ``sources``)."""
    out: str
    """Output folder."""
    tokenizer: str | None = None
    """Local Hugging Face fast-tokenizer folder."""
    train_tokenizer: int | None = None
    """Train a WordPiece tokenizer of this vocabulary size on the inputs first."""
    lowercase: bool = True
    """Lower-case when training a tokenizer."""
    max_length: int = 512
    """Model sequence length including special tokens; rows hold that minus the specials."""
    shard_size: int = flag(0, parse=parse_size)
    """Input bytes (e.g. 64MB) per shard (one work unit); output shards come out at a similar size.
    0 = auto: 1/64 of the input, between 1 MiB and 64 MiB (a function of the input alone, so
    the output stays the same for any worker count)."""
    pack: bool = False
    """Pack consecutive short rows into samples of up to the row limit."""
    segmenter: str = flag("none", choices=SEGMENTERS)
    """Word starts for whole-word masking of Chinese: ``jieba`` (a token inside a jieba word
    with a Han character is no word start; see ``data.segment``), ``auto`` (jieba when the
    inputs hold Han characters) or ``none`` (the tokenizer's words only)."""
    segmenter_dict: str | None = None
    """A jieba main dictionary replacing the shipped one (its hash is part of the plan)."""
    workers: int = 1
    """Worker processes."""
    on_error: str = flag("raise", choices=("raise", "skip"))
    """``raise``: stop at the first bad record; ``skip``: skip it and log it to rejects.jsonl."""
    num_tasks: int = 1
    """Split the units over this many independent processes (e.g. a Slurm array)."""
    task_index: int | None = None
    """Which of the ``num_tasks`` this process is (none: the Slurm array index, from
    ``SLURM_ARRAY_TASK_ID`` less ``SLURM_ARRAY_TASK_MIN``; 0 for a single task)."""
    merge: bool = False
    """Only write the manifest over all tasks' shards."""
    progress: bool = True
    """Show a progress bar on stderr."""
    source: SourceOptions = field(default_factory=SourceOptions)

    def __post_init__(self) -> None:
        if self.task_index is None:
            env = os.environ
            self.task_index = (
                int(env.get("SLURM_ARRAY_TASK_ID", 0)) - int(env.get("SLURM_ARRAY_TASK_MIN", 0))
                if self.num_tasks > 1
                else 0
            )
        if self.segmenter not in SEGMENTERS:
            raise ValueError(f"segmenter must be one of {SEGMENTERS}, not {self.segmenter!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {self.on_error!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_length < 3:
            raise ValueError(f"max_length must be >= 3, got {self.max_length}")
        if self.shard_size < 0:
            raise ValueError(f"shard_size must be >= 0 (0 = auto), got {self.shard_size}")
        if not 0 <= self.task_index < self.num_tasks:
            raise ValueError(f"task_index {self.task_index} outside [0, {self.num_tasks})")
        if not self.merge and (self.tokenizer is None) == (self.train_tokenizer is None):
            raise ValueError("give exactly one of --tokenizer DIR and --train_tokenizer VOCAB_SIZE")
        if self.train_tokenizer is not None and self.num_tasks > 1:
            raise ValueError(
                "--train_tokenizer with --num_tasks > 1 would train one tokenizer per task; "
                "train it once first (retromae-ds train-tokenizer) and pass --tokenizer"
            )


# --------------------------------------------------------------------------- file helpers
def shard_name(unit_index: int) -> str:
    return f"part-{unit_index:06d}"


# --------------------------------------------------------------------------- worker side
_WORKER: dict[str, Any] = {}


def _init_worker(
    backend_json: str,
    limit: int,
    pack: bool,
    on_error: str,
    source: SourceOptions,
    shard_dir: str,
    segmenter: SegmenterSpec | None = None,
) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if not backend_json.lstrip().startswith("{"):  # a path: keeps spawn's start-up payload small
        with open(backend_json, encoding="utf-8") as f:
            backend_json = f.read()
    backend = make_backend(backend_json)
    _WORKER.update(
        backend=backend,
        continuation=continuation_mask(backend),
        limit=limit,
        pack=pack,
        on_error=on_error,
        source=source,
        shard_dir=Path(shard_dir),
        segmenter=None if segmenter is None else Segmenter(segmenter),
    )


def _process_unit(unit: Unit) -> dict[str, Any]:
    """Tokenize one unit and publish its shard; returns its completion record, or for bad
    input or a full disk the one-line message (``error``, ``disk_full``): a worker process
    hands back text, which pickles whatever the exception."""
    w = _WORKER
    try:
        docs = read_unit(unit, w["source"], w["on_error"])
    except InputError as exc:
        return {"unit": unit.index, "error": str(exc)}
    tokens = tokenize_documents(
        w["backend"], docs.texts, continuation=w["continuation"], segmenter=w["segmenter"]
    )
    batch, counts = build_batch(tokens, docs.ids, w["limit"], w["pack"])
    final = w["shard_dir"] / f"{shard_name(unit.index)}{schema.SHARD_SUFFIX}"
    try:
        return _publish_shard(unit, final, batch, {**counts, "rejects": docs.rejects})
    except DiskFull as exc:
        return {"unit": unit.index, "disk_full": str(exc)}


def _publish_shard(
    unit: Unit, final: Path, batch: pa.RecordBatch, counts: dict[str, Any]
) -> dict[str, Any]:
    """Write ``batch`` as shard ``final`` (temporary + rename) and its completion record; a
    full disk is a :class:`DiskFull` naming the file and the free space, the partial shard
    removed."""
    tmp = final.with_name(f"{final.name}.tmp")
    with _naming_a_full_disk(final, tmp):
        with (
            pa.OSFile(str(tmp), "wb") as sink,
            pa.ipc.new_file(sink, schema.SHARD_SCHEMA) as writer,
        ):
            writer.write_batch(batch)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    faults.pause("sleep_before_shard_rename_s")  # widens the window a kill lands mid-shard
    os.replace(tmp, final)
    record = {
        "unit": unit.index,
        "file": f"shards/{final.name}",
        "bytes": final.stat().st_size,
        "sha256": sha256_file(final),
        **counts,
    }
    record_path = final.with_suffix(".json")
    with _naming_a_full_disk(record_path):
        atomic_write_text(record_path, dump_json(record))
    return record


@contextlib.contextmanager
def _naming_a_full_disk(path: Path, partial: Path | None = None):
    """A write of ``path`` that fails for want of space becomes one :class:`DiskFull` naming
    the file and the free space (pyarrow says only "Error writing bytes to file"); the
    partial file is removed, giving its space back. Other errors pass unchanged."""
    try:
        yield
    except OSError as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        full = disk_full_error(exc, path.parent, path.name)
        if full is None:
            raise
        raise DiskFull(
            f"{full}; the complete shards are kept: free space, then rerun the same command",
            full.folder,
        ) from exc


# --------------------------------------------------------------------------- driver side
def _all_texts(units: list[Unit], cfg: PreprocessConfig):
    for unit in units:
        yield from read_unit(unit, cfg.source, cfg.on_error).texts


def _prepare_tokenizer(cfg: PreprocessConfig, out: Path, units: list[Unit]):
    from retromae_ds.data.tokenizer import load_tokenizer, train_wordpiece

    tok_dir = out / "tokenizer"
    if cfg.train_tokenizer is not None:
        # a resumed run keeps the tokenizer it trained: the plan check has made sure it was
        # trained with these settings on these inputs
        if (tok_dir / "tokenizer.json").exists():
            return load_tokenizer(tok_dir)
        tmp = _temporary(out, "tokenizer")
        with _saving(tmp, f"{tok_dir}: cannot save the trained tokenizer"):
            train_wordpiece(
                lambda: _all_texts(units, cfg), cfg.train_tokenizer, tmp, lowercase=cfg.lowercase
            )
            os.replace(tmp, tok_dir)
        return load_tokenizer(tok_dir)
    tok = load_tokenizer(cfg.tokenizer)
    if not (tok_dir / "tokenizer.json").exists():
        tmp = _temporary(out, "tokenizer")
        with _saving(tmp, f"{tok_dir}: cannot save a copy of the tokenizer"):
            tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, tok_dir)
        except OSError:  # another task published it first
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


# --------------------------------------------------------------------------- temporaries
_TEMP = re.compile(r"^(tokenizer|backend)\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)(?:\.json)?$")


def _temporary(out: Path, name: str, suffix: str = "") -> Path:
    """A per-process temporary path in ``out``, named so that a later run can tell whether
    its owner is gone (host and pid)."""
    return out / f"{name}.tmp-{socket.gethostname()}-{os.getpid()}{suffix}"


def _remove_stale_temporaries(out: Path) -> list[str]:
    """Delete temporaries left by killed runs (their process is gone) and return their names.
    Temporaries of another host's tasks are left alone: their owner cannot be checked here."""
    host, removed = socket.gethostname(), []
    for path in out.iterdir():
        m = _TEMP.match(path.name)
        if m is None or m["host"] not in (None, host) or _alive(int(m["pid"])):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # ours, from an earlier call in this process: not in use now
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


@contextlib.contextmanager
def _saving(tmp: Path, what: str):
    """Remove ``tmp`` if the block fails; an OSError (disk full, quota, permissions) becomes
    one clear error naming what could not be saved."""
    try:
        yield
    except OSError as exc:
        _remove(tmp)
        reason = exc.strerror or str(exc)
        hint = " (free some space, then rerun)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise OSError(f"{what}: {reason}{hint}") from exc
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _prepare_out(out: Path) -> None:
    """Create ``out`` (and ``out/shards``), or raise one clear error naming it."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"{out}: exists and is not a folder; --out must name a new folder or an "
            "earlier preprocessing output"
        )
    try:
        (out / "shards").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"{out}: cannot create the output folder: {exc.strerror or exc}") from exc


def _plan_settings(
    cfg: PreprocessConfig,
    inputs: list,
    shard_size: int,
    units: list[Unit],
    plan_rejects: list,
    segmenter: SegmenterSpec | None,
) -> dict:
    """Everything that shapes the output and is known before the tokenizer is ready; with
    the tokenizer's fingerprint and row limit it makes the plan a resumed run must match."""
    training = None
    if cfg.train_tokenizer is not None:
        training = {"vocab_size": cfg.train_tokenizer, "lowercase": cfg.lowercase}
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "inputs": [{"path": i.path, "kind": i.kind, **input_signature(i.path)} for i in inputs],
        "source": asdict(cfg.source),
        "tokenizer_training": training,
        "max_length": cfg.max_length,
        "packed": cfg.pack,
        "segmenter": None if segmenter is None else segmenter_identity(segmenter),
        "shard_size": shard_size,
        "on_error": cfg.on_error,
        "plan_rejects": plan_rejects,
        "units": [u.to_json() for u in units],
    }


def auto_shard_size(inputs: list) -> int:
    """1/64 of the input bytes, clamped to [1 MiB, 64 MiB]: enough shards to keep workers busy
    on a small corpus, shards of a sensible size on a large one."""
    total = sum(_input_bytes(i.path) for i in inputs)
    return int(min(64 * 2**20, max(2**20, total // 64)))


def _input_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _check_plan(out: Path, plan: dict) -> bool:
    """Raise, naming what changed, when ``out`` holds a plan that differs from ``plan`` in any
    of ``plan``'s keys; True when there is a plan to compare with."""
    path = out / PLAN_NAME
    if not path.exists():
        return False
    old = json.loads(path.read_text(encoding="utf-8"))
    changes = [
        _describe_change(k, old.get(k), plan[k]) for k in sorted(plan) if old.get(k) != plan[k]
    ]
    if changes:
        raise ValueError(
            f"{out}: holds a run with different settings or inputs (differs in: "
            f"{'; '.join(changes)}); use another --out folder, or delete this one to start over"
        )
    return True


def _describe_change(key: str, old: Any, new: Any) -> str:
    if key == "inputs":
        return "inputs (" + ", ".join(_input_changes(old or [], new)) + ")"
    if key == "tokenizer_training":

        def how(t: dict | None) -> str:
            if t is None:
                return "--tokenizer DIR"
            case = "lowercase" if t["lowercase"] else "--lowercase false"
            return f"--train_tokenizer {t['vocab_size']} {case}"

        return f"tokenizer training ({how(old)} -> {how(new)})"
    if key == "segmenter":

        def seg(s: dict | None) -> str:
            if s is None:
                return "none"
            return f"{s['name']} {s['version']}, dictionary {s['dictionary']} sha256 " + (
                f"{s['dictionary_sha256'][:12]}, hmm={s['hmm']}"
            )

        return f"segmenter ({seg(old)} -> {seg(new)})"
    if key == "units" or isinstance(new, (dict, list)):
        return key
    return f"{key} ({old!r} -> {new!r})"


def _input_changes(old: list[dict], new: list[dict]) -> list[str]:
    before = {i["path"]: i for i in old}
    after = {i["path"]: i for i in new}
    changes = [f"{p}: new" for p in after if p not in before]
    changes += [f"{p}: no longer given" for p in before if p not in after]
    names = {"bytes": "size", "mtime_ns": "modification time", "sample_sha256": "content"}
    for path in after.keys() & before.keys():
        fields = [
            names.get(k, k) for k in sorted(after[path]) if before[path].get(k) != after[path][k]
        ]
        if fields:
            changes.append(f"{path}: {', '.join(fields)} changed")
    return sorted(changes)


def run_preprocess(cfg: PreprocessConfig) -> dict[str, Any]:
    """Run (or resume) this task's share of the preprocessing; merge when it is the only
    task. Returns the manifest (single task / merge) or this task's summary."""
    out = Path(cfg.out)
    if cfg.merge:
        return merge(out, progress=cfg.progress)
    _prepare_out(out)
    shard_dir = out / "shards"
    removed = _remove_stale_temporaries(out)
    if removed:
        print(
            f"preprocess: removed temporaries of an earlier killed run: {', '.join(removed)}",
            file=sys.stderr,
        )
    started = time.perf_counter()
    inputs = expand_inputs(cfg.inputs)
    shard_size = cfg.shard_size or auto_shard_size(inputs)
    units, plan_rejects = plan_units(inputs, shard_size, cfg.source, cfg.on_error)
    from retromae_ds.data.tokenizer import backend_json, fingerprint

    segmenter = resolve_segmenter(cfg.segmenter, [i.path for i in inputs], cfg.segmenter_dict)
    settings = _plan_settings(cfg, inputs, shard_size, units, plan_rejects, segmenter)
    _check_plan(out, settings)  # before a tokenizer is trained or kept
    tok = _prepare_tokenizer(cfg, out, units)
    limit = cfg.max_length - tok.num_special_tokens_to_add(pair=False)
    plan = {**settings, "tokenizer": fingerprint(tok), "max_tokens_per_row": limit}
    if not _check_plan(out, plan):
        with _naming_a_full_disk(out / PLAN_NAME):
            atomic_write_text(out / PLAN_NAME, dump_json(plan))

    mine = [u for u in units if u.index % cfg.num_tasks == cfg.task_index]
    problems = _shard_problems(shard_dir, [u.index for u in mine])
    todo = [u for u in mine if problems[u.index] is not None]
    for u in todo:
        if problems[u.index]:  # kept from an earlier run, but changed since: say so
            print(
                f"preprocess: {shard_dir / shard_name(u.index)}{schema.SHARD_SUFFIX}: "
                f"{problems[u.index]}; redoing it",
                file=sys.stderr,
                flush=True,
            )
        # its completion record goes first, so a kill while redoing it never leaves the old
        # record next to another shard; then a killed run's leftovers of this unit
        (shard_dir / f"{shard_name(u.index)}.json").unlink(missing_ok=True)
        for stale in shard_dir.glob(f"{shard_name(u.index)}.arrow.tmp*"):
            stale.unlink()
    backend_file = _temporary(out, "backend", ".json")
    with _saving(backend_file, f"{out}: cannot write the tokenizer for the workers"):
        atomic_write_text(backend_file, backend_json(tok))
    try:
        stats = _run_units(
            cfg, todo, str(backend_file), limit, shard_dir, len(mine) - len(todo), segmenter
        )
    finally:
        backend_file.unlink(missing_ok=True)
    elapsed = time.perf_counter() - started
    if cfg.num_tasks == 1:
        # every shard was just checked against its record (kept ones) or written (the rest)
        manifest = merge(out, progress=False, check_content=False)
        _print_summary(manifest["counts"], len(manifest["shards"]), elapsed, stats)
        return manifest
    marker = out / "tasks" / f"task-{cfg.task_index:05d}-of-{cfg.num_tasks:05d}.json"
    marker.parent.mkdir(exist_ok=True)
    summary = {
        "task_index": cfg.task_index,
        "num_tasks": cfg.num_tasks,
        "units": [u.index for u in mine],
    }
    with _naming_a_full_disk(marker):
        atomic_write_text(marker, dump_json(summary))
    print(
        f"preprocess task {cfg.task_index}/{cfg.num_tasks}: {len(mine)} shards "
        f"({len(mine) - len(todo)} kept from an earlier run) in {elapsed:.1f}s; "
        f"run with --merge once every task is done",
        flush=True,
    )
    return summary


def _shard_problems(
    shard_dir: Path, unit_indices: list[int], check_content: bool = True
) -> dict[int, str | None]:
    """Per unit: None when its shard can be kept, "" when it was never finished (no shard or
    no completion record: a killed run), else why the shard no longer matches its record.
    With ``check_content`` the shard's sha256 is compared with the one its record holds
    (every byte read once; threads, as hashlib releases the GIL), so a shard changed after it
    was written is redone, never kept under a manifest it does not match."""
    if not unit_indices:
        return {}
    check = functools.partial(_shard_problem, shard_dir, check_content=check_content)
    with ThreadPoolExecutor(min(8, len(unit_indices), os.cpu_count() or 1)) as pool:
        return dict(zip(unit_indices, pool.map(check, unit_indices), strict=True))


def _shard_problem(shard_dir: Path, unit_index: int, check_content: bool) -> str | None:
    record_path = shard_dir / f"{shard_name(unit_index)}.json"
    shard = shard_dir / f"{shard_name(unit_index)}{schema.SHARD_SUFFIX}"
    if not (record_path.exists() and shard.exists()):
        return ""
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        size, sha = record["bytes"], record["sha256"]
    except (ValueError, KeyError, TypeError):
        return f"its completion record {record_path.name} is unreadable"
    try:
        actual = shard.stat().st_size
        if actual != size:
            return f"{actual} bytes, its completion record says {size}"
        if check_content and sha256_file(shard) != sha:
            return "its sha256 differs from its completion record (changed after it was written)"
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"
    return None


def _run_units(
    cfg: PreprocessConfig,
    todo: list[Unit],
    backend: str,
    limit: int,
    shard_dir: Path,
    kept: int,
    segmenter: SegmenterSpec | None,
) -> dict:
    from tqdm import tqdm

    init_args = (backend, limit, cfg.pack, cfg.on_error, cfg.source, str(shard_dir), segmenter)
    totals = {"documents": 0, "tokens": 0, "kept": kept}
    bar = tqdm(
        total=len(todo), unit="shard", disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True
    )
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if cfg.workers == 1 or len(todo) <= 1:
            _init_worker(*init_args)
            results = map(_process_unit, todo)
        else:
            # spawn: fork after Rust thread pools have run can deadlock. An executor, not
            # multiprocessing.Pool: a worker that dies (OOM killer, SIGKILL) breaks the pool
            # with an error here instead of leaving the run waiting forever for its result.
            pool = ProcessPoolExecutor(
                min(cfg.workers, len(todo)),
                mp_context=mp.get_context("spawn"),
                initializer=_init_worker,
                initargs=init_args,
            )
            stack.callback(pool.shutdown, wait=True, cancel_futures=True)
            results = _completed(pool, todo)
        for record in results:
            if "error" in record:
                bar.close()
                raise InputError(record["error"])
            if "disk_full" in record:
                bar.close()
                raise DiskFull(record["disk_full"], shard_dir)
            totals["documents"] += record["documents"]
            totals["tokens"] += record["tokens"]
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(
                f"{totals['documents'] / dt:,.0f} docs/s, {totals['tokens'] / dt:,.0f} tok/s",
                refresh=False,
            )
            bar.update(1)
    bar.close()
    totals["seconds"] = time.perf_counter() - t0
    return totals


def _completed(pool: ProcessPoolExecutor, todo: list[Unit]):
    """Each unit's record as it completes; a dead worker raises, naming what happened."""
    futures = [pool.submit(_process_unit, unit) for unit in todo]
    try:
        for future in as_completed(futures):
            yield future.result()
    except BrokenProcessPool as e:
        raise RuntimeError(
            "a preprocessing worker died (killed, or out of memory); the shards completed "
            "so far are kept: rerun the same command to finish"
        ) from e


def merge(out: Path, progress: bool = True, check_content: bool = True) -> dict[str, Any]:
    """Write ``manifest.json`` (and ``rejects.jsonl``) over every unit's shard. Fails, naming
    the missing units and their tasks, unless every unit of the plan is complete and (with
    ``check_content``) every shard still has the sha256 its completion record holds."""
    plan_path = out / PLAN_NAME
    if not plan_path.exists():
        raise FileNotFoundError(f"{plan_path}: no plan; run preprocessing before --merge")
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    shard_dir = out / "shards"
    units = plan["units"]
    problems = _shard_problems(shard_dir, [u["index"] for u in units], check_content)
    changed = {i: p for i, p in problems.items() if p}
    if changed:
        index, problem = next(iter(sorted(changed.items())))
        raise RuntimeError(
            f"{shard_dir / shard_name(index)}{schema.SHARD_SUFFIX}: {problem}"
            f"{f' (and {len(changed) - 1} more shards)' if len(changed) > 1 else ''}; "
            f"{_owner(out, index)} to redo it, then --merge"
        )
    missing = [i for i, p in problems.items() if p is not None]
    if missing:
        raise RuntimeError(
            f"{out}: {len(missing)} of {len(units)} shards are not complete (first: "
            f"{', '.join(shard_name(i) for i in missing[:5])}); rerun the tasks that own them"
        )
    records = [
        json.loads((shard_dir / f"{shard_name(u['index'])}.json").read_text()) for u in units
    ]
    counts = {
        k: sum(r[k] for r in records)
        for k in ("documents", "empty_documents", "rows", "packs", "tokens")
    }
    rejects = list(plan["plan_rejects"]) + [rej for r in records for rej in r["rejects"]]
    counts["rejected"] = len(rejects)
    _warn_about_empty_inputs(plan, records, counts)
    manifest = {
        "format": "retromae-ds-shards",
        "schema_version": plan["schema_version"],
        "tokenizer": plan["tokenizer"],
        "max_length": plan["max_length"],
        "max_tokens_per_row": plan["max_tokens_per_row"],
        "packed": plan["packed"],
        "segmenter": plan.get("segmenter"),
        "counts": counts,
        "shards": [
            {k: r[k] for k in ("file", "rows", "packs", "documents", "tokens", "bytes", "sha256")}
            for r in records
        ],
    }
    if plan["on_error"] == "skip":
        with _naming_a_full_disk(out / REJECTS_NAME):
            atomic_write_text(
                out / REJECTS_NAME,
                "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rejects),
            )
    with _naming_a_full_disk(out / schema.MANIFEST_NAME):
        atomic_write_text(out / schema.MANIFEST_NAME, dump_json(manifest))
    return manifest


def _owner(out: Path, unit_index: int) -> str:
    """Which task to rerun for a unit, from the tasks' completion markers."""
    for marker in sorted((out / "tasks").glob("task-*.json")):
        try:
            task = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if unit_index in task.get("units", ()):
            return (
                f"rerun task {task['task_index']} of {task['num_tasks']} "
                f"(--task_index {task['task_index']})"
            )
    return "rerun the preprocessing task that wrote it"


def _warn_about_empty_inputs(plan: dict, records: list[dict], counts: dict) -> None:
    """One stderr line naming the inputs no row came out of (empty or blank-only files): the
    dataset is still written, but training refuses a dataset without rows."""
    rows = {i["path"]: 0 for i in plan["inputs"]}
    path_of = {u["index"]: u["path"] for u in plan["units"]}
    for r in records:
        rows[path_of[r["unit"]]] = rows.get(path_of[r["unit"]], 0) + r["rows"]
    unreadable = {r["file"] for r in plan["plan_rejects"]}  # already reported as rejects
    empty = [p for p, n in rows.items() if n == 0 and p not in unreadable]
    if not empty:
        return
    outcome = (
        "the dataset has no rows: training and inspect will refuse it"
        if counts["rows"] == 0
        else f"the dataset has {counts['rows']:,} rows from the other inputs"
    )
    print(
        f"preprocess: warning: no text in {len(empty)} input(s) (empty, blank-only or every "
        f"record rejected): {', '.join(empty)}; {outcome}",
        file=sys.stderr,
        flush=True,
    )


def _print_summary(counts: dict, shards: int, elapsed: float, stats: dict) -> None:
    rate = stats["seconds"] or 1e-9
    print(
        f"preprocess: {counts['documents']:,} documents ({counts['empty_documents']:,} empty, "
        f"{counts['rejected']:,} rejected) -> {counts['rows']:,} rows, {counts['tokens']:,} tokens "
        f"in {shards} shards ({stats['kept']} kept from an earlier run); {elapsed:.1f}s, "
        f"{stats['documents'] / rate:,.0f} docs/s, {stats['tokens'] / rate:,.0f} tok/s",
        flush=True,
    )
