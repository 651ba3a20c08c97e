"""Checkpoints that a crash cannot corrupt: saving, resuming, and finding them.

Layout: see ``retromae_ds.components.layout`` (``RUN/checkpoints/step_N/`` with a ``COMPLETE`` record,
the DeepSpeed files, one ``rank_R.pt`` per rank and the encoder as a Hugging Face folder).

:class:`CheckpointManager` is the one writer and reader of a run's checkpoints, used by
pre-training and fine-tuning alike. Every rank writes into ``step_N.partial``; after a barrier
rank 0 writes the ``COMPLETE`` record and renames the folder, then prunes old checkpoints
(keep-last-k). DeepSpeed's own ``latest`` file is not written: it is updated by rank 0 before
the other ranks finish. ``--checkpoint.resume auto`` takes the newest checkpoint that verifies against
its record (:func:`resolve_resume`); every newer step folder (corrupt, or without a record) is
set aside as ``step_N.corrupt``, never deleted, so the steps retrained after it are saved and
pruning never sees it. A run folder whose checkpoints all fail is not started over unless the
user says so (``--checkpoint.resume none``, which sets them aside as ``step_N.superseded``).

:func:`resolve_checkpoint` and :func:`resolve_encoder` are the one place that turns what a
user names ("a run folder, a checkpoint, or a Hugging Face folder") into a folder, and the
one place that checks it: every consumer (``eval``, ``finetune --model.init``, continued
pre-training, ``export``) gets a checkpoint whose model files match its ``COMPLETE`` record
(a run folder falls back to its newest checkpoint that does, saying so; a checkpoint named
explicitly is refused naming the file). A folder is hashed once per process while its files
are unchanged (:func:`verify_cached`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retromae_ds.base import faults
from retromae_ds.base.fsutil import atomic_write_json, atomic_write_text, fsync_dir, sha256_file
from retromae_ds.components.layout import (
    COMPLETE,
    ENCODER,
    PARTIAL_DIR,
    QUERY_ENCODER,
    RUN_CONFIG,
    SET_ASIDE_DIR,
    STEP_DIR,
    RunLayout,
    rank_state_file,
)
from retromae_ds.hf.util import quiet_transformers


@dataclass(kw_only=True)
class CheckpointConfig:
    every_steps: int = 0
    """Save every N optimizer steps (0: only at the end)."""
    keep_last: int = 3
    """Complete checkpoints to keep (0: all)."""
    keep_best: bool = False
    """Also keep the checkpoint with the best evaluation during training (the first of
    ``eval.measures`` at the first pooling, higher is better, ties to the newer), among the
    checkpoints saved at an evaluation step; its record's ``eval`` holds the value and
    ``best_checkpoint`` finds it."""
    resume: str = "auto"
    """``auto``: the run's newest checkpoint that verifies (newer, corrupt ones are set aside
    as ``step_N.corrupt``), or step 0 when it has none; a run whose checkpoints all fail is
    refused. ``none``: start over at step 0 (checkpoints already there are set aside as
    ``step_N.superseded``). Or the path of a checkpoint."""
    prune_set_aside: bool = False
    """Delete the checkpoint folders set aside (``step_N.corrupt``, ``step_N.superseded``) when
    the run starts, those this start sets aside included; false keeps them and says at each
    start how many there are and the space they hold."""

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"checkpoint.{name} must be >= 0 (0: "
                    f"{'only at the end' if name == 'every_steps' else 'keep all'}), "
                    f"not {getattr(self, name)}"
                )
        if not self.resume:
            raise ValueError("checkpoint.resume must be auto, none or a checkpoint's path")


MODEL_FILES = (f"{ENCODER}/", f"{QUERY_ENCODER}/")
"""The files a consumer of a checkpoint's models reads (``verify``'s ``under``)."""


# --------------------------------------------------------------------------- finding
def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = STEP_DIR.match(path.name)
        if m and (path / COMPLETE).is_file():
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_complete(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def resolve_checkpoint(
    path: str | Path,
    *,
    under: str | tuple[str, ...] = MODEL_FILES,
    log: Callable[[str], None] | None = None,
) -> Path:
    """A complete checkpoint folder, or a run folder (or its ``checkpoints/``) -> the complete
    checkpoint it names, its files under ``under`` checked against its record
    (:func:`verify_cached`).

    A checkpoint named explicitly that does not verify raises :class:`CheckpointCorrupt`
    naming the file. A run folder gives its newest checkpoint that verifies; passing over a
    newer one is said once through ``log`` (stderr by default), naming the file that failed.
    """
    path = Path(path)
    if is_checkpoint(path):
        verify_cached(path, under)
        return path
    candidates = complete_checkpoints(RunLayout(path).checkpoints) or complete_checkpoints(path)
    if not candidates:
        raise FileNotFoundError(
            f"{path}: neither a complete checkpoint nor a run folder holding one"
        )
    problems: list[str] = []
    for candidate in reversed(candidates):
        try:
            verify_cached(candidate, under)
        except CheckpointCorrupt as exc:
            if candidate.exists():  # else a live run pruned it meanwhile: not a problem
                problems.append(str(exc))
            continue
        if problems:
            _say_once(
                log,
                f"{path}: using {candidate.name}, the newest checkpoint that verifies "
                f"(passed over: {'; '.join(problems)})",
            )
        return candidate
    if not problems:
        raise FileNotFoundError(f"{path}: its checkpoints were removed while being read; retry")
    raise CheckpointCorrupt(f"{path}: no complete checkpoint verifies (newest: {problems[0]})")


def resolve_encoder(path: str | Path, *, log: Callable[[str], None] | None = None) -> Path:
    """The Hugging Face encoder folder that ``path`` names: a complete checkpoint (its
    ``encoder/``), a run folder (its newest complete checkpoint's), or a Hugging Face folder.
    A run folder also holds a ``config.json`` (the training config), so checkpoints are looked
    for before a model config. The encoder of a checkpoint, however named (the checkpoint,
    its run, or its ``encoder/`` folder itself), is checked against the checkpoint's record
    as :func:`resolve_checkpoint` does."""
    path = Path(path)
    if is_checkpoint(path) or RunLayout(path).checkpoints.is_dir() or latest_complete(path):
        folder = resolve_checkpoint(path, under=f"{ENCODER}/", log=log) / ENCODER
    elif (path / "config.json").is_file():
        folder = path
        real = path.resolve()
        if real.name in (ENCODER, QUERY_ENCODER) and is_checkpoint(real.parent):
            verify_cached(real.parent, f"{real.name}/")  # a checkpoint's part, named directly
    else:
        raise FileNotFoundError(
            f"{path}: neither a Hugging Face encoder folder, a complete checkpoint, "
            "nor a run folder holding one"
        )
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no Hugging Face model (config.json) there")
    return folder


_said: set[str] = set()


def _say_once(log: Callable[[str], None] | None, text: str) -> None:
    """``text`` through ``log`` (stderr by default), once per process: a run resolves the
    same folder several times (the vocabulary check, then the model)."""
    if text in _said:
        return
    _said.add(text)
    if log is None:
        print(text, file=sys.stderr, flush=True)
    else:
        log(text)


def step_folders(root: Path) -> list[Path]:
    """Every ``step_N`` folder under ``root``, with or without its record, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def set_aside(folder: Path, why: str) -> Path:
    """Rename ``folder`` to ``NAME.WHY`` (``NAME.2.WHY``, ... when taken) beside it: out of
    every listing of checkpoints (resume, pruning, ``eval``), and kept for the user."""
    target = folder.with_name(f"{folder.name}.{why}")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.{n}.{why}")
    os.replace(folder, target)
    return target


def set_aside_folders(root: Path) -> list[Path]:
    """The step folders of ``root`` a resume set aside (``step_N.corrupt``,
    ``step_N.superseded``), oldest step first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p.name, p) for p in root.iterdir()
             if (m := SET_ASIDE_DIR.match(p.name)) and p.is_dir()]  # fmt: skip
    return [p for *_, p in sorted(found)]


def _tree_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``; what cannot be read counts 0 (rank 0 sizes the
    folders while the other ranks wait, so nothing here may raise)."""
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                continue
    return total


def account_set_aside(root: Path, *, prune: bool, log: Callable[[str], None]) -> None:
    """One line at a run's start about the folders set aside under ``root``: how many and
    the space they hold, and how to delete them; with ``prune``, delete them and say what
    was freed. Set-aside folders are never read again, so each repeated corruption or
    ``--checkpoint.resume none`` would otherwise keep one more whole checkpoint unsaid."""
    folders = set_aside_folders(root)
    if not folders:
        return
    size = sum(_tree_bytes(f) for f in folders)
    kinds = "step_N.corrupt, step_N.superseded"
    if prune:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        log(f"checkpoints: deleted {len(folders)} set-aside folder(s) ({kinds}) in {root}, "
            f"{_mb(size)} freed (--checkpoint.prune_set_aside true)")  # fmt: skip
        return
    log(f"checkpoints: {len(folders)} set-aside folder(s) ({kinds}) in {root} hold {_mb(size)}; "
        "no run reads them again: delete them, or start a run with "
        "--checkpoint.prune_set_aside true to delete them")  # fmt: skip


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def recorded_config(checkpoint: Path) -> Path | None:
    """The resolved config a checkpoint records of the run that wrote it (its
    ``run_config.json``, listed in its record), or None for one written before checkpoints
    recorded it."""
    path = Path(checkpoint) / RUN_CONFIG
    return path if path.is_file() else None


def _problem(checkpoint: Path) -> str | None:
    """Why a step folder is no checkpoint to resume from (no record, or a file or the record
    itself failing :func:`verify`), or None when it verifies."""
    if not (checkpoint / COMPLETE).is_file():
        return f"{checkpoint / COMPLETE}: missing (the folder lost its completion record)"
    try:
        verify(checkpoint)
    except CheckpointCorrupt as exc:
        return str(exc)
    return None


def pretraining_evidence(layout: RunLayout) -> str | None:
    """What shows ``layout.root`` to be a pre-training run (its ``config.json`` has a
    pre-training objective, or its newest complete checkpoint records one), or None. Reads
    only; an unreadable file is no evidence (the commands that read it name it)."""
    try:
        saved = json.loads(layout.config.read_text())
        model = saved.get("model") if isinstance(saved, dict) else None
        if isinstance(model, dict) and "objective" in model:
            return "its config.json has a pre-training objective"
    except (OSError, ValueError):
        pass  # no or an unreadable config.json: the checkpoints' records tell
    newest = latest_complete(layout.checkpoints)
    if newest is None:
        return None
    try:
        objective = read_marker(newest).get("objective", "contrastive")
    except (OSError, ValueError):
        return None
    if objective == "contrastive":
        return None
    return f"{newest.name} records the {objective!r} objective"


def resolve_resume(
    resume: str, run_dir: Path, *, log=print, check: Callable[[Path], None] | None = None
) -> Path | None:
    """The checkpoint a run resumes from (rank 0, before any rank loads it). ``check`` (the
    trainer's settings check) runs on it before any folder is set aside, so a resume it
    refuses moves nothing.

    ``none`` -> None: the run starts over; the step folders already there are set aside as
    ``step_N.superseded`` (one line), so the new run's checkpoints never mix with them.
    ``auto`` -> the newest checkpoint of the run that verifies; every newer step folder is
    set aside as ``step_N.corrupt`` with one line naming what failed, and the fallback is
    said. None when the run has no step folder; when it has some but none verifies, a
    :class:`CheckpointCorrupt` naming them (starting over would silently drop the run).
    A path -> that checkpoint, which must be complete and verify; newer step folders of its
    own run are set aside as ``step_N.superseded`` (the run rewinds to it)."""
    root = RunLayout(run_dir).checkpoints
    if resume == "none":
        _set_aside_newer(root, -1, log, "resume none: starting over at step 0; the checkpoints")
        return None
    if resume == "auto":
        bad: list[tuple[Path, str]] = []
        for candidate in reversed(step_folders(root)):
            problem = _problem(candidate)
            if problem is None:
                if check is not None:
                    check(candidate)
                for folder, why in bad:
                    log(f"resume: {folder.name} is corrupt ({why}); set aside as "
                        f"{set_aside(folder, 'corrupt').name}, not deleted")  # fmt: skip
                if bad:
                    log(f"resume: falling back to {candidate.name}, the newest that verifies")
                return candidate
            bad.append((candidate, problem))
        if not bad:
            return None
        named = "; ".join(f"{folder.name}: {why}" for folder, why in bad[:3])
        raise CheckpointCorrupt(
            f"{root}: none of its {len(bad)} checkpoint(s) verifies ({named}"
            f"{'; ...' if len(bad) > 3 else ''}); not starting over on its own: rerun with "
            "--checkpoint.resume none to start at step 0 (they are then set aside as step_N.superseded, "
            "not deleted)"
        )
    path = Path(resume)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
    verify(path)
    if check is not None:
        check(path)
    step = read_marker(path).get("step")
    if path.resolve().parent == root.resolve() and isinstance(step, int):
        _set_aside_newer(root, step, log, f"resume from {path.name}: the newer checkpoints")
    return path


def _set_aside_newer(root: Path, step: int, log, what: str) -> None:
    """Set the step folders of ``root`` after ``step`` aside as ``*.superseded``, in one line:
    a run that goes back to ``step`` writes their steps again."""
    newer = [p for p in step_folders(root) if int(STEP_DIR.match(p.name).group(1)) > step]
    if newer:
        moved = [f"{p.name} -> {set_aside(p, 'superseded').name}" for p in newer]
        log(f"{what} already here are set aside, not deleted: {', '.join(moved)}")


def read_marker(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's completion record; one that does not parse is a
    :class:`CheckpointCorrupt` naming the file."""
    path = ckpt / COMPLETE
    data = path.read_bytes()
    try:
        record = json.loads(data)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise CheckpointCorrupt(f"{path}: unreadable completion record ({exc})") from None
    if not isinstance(record, dict):
        raise CheckpointCorrupt(f"{path}: unreadable completion record (not a JSON object)")
    return record


class CheckpointCorrupt(ValueError):
    """A checkpoint whose files do not match its completion record."""


def file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``folder`` (relative POSIX paths), except the
    completion record itself."""
    records = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != COMPLETE:
            records[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return records


def verify(ckpt: Path, under: str | tuple[str, ...] = "") -> None:
    """Check every file listed in the completion record (size, then sha256), or only those
    whose path starts with ``under`` (e.g. ``"encoder/"``, or one of several such prefixes);
    raise CheckpointCorrupt naming the first file that does not match. A record without a
    file list (written before the lists existed) is accepted as it is."""
    try:
        marker = read_marker(ckpt)
    except CheckpointCorrupt:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(
            f"{ckpt / COMPLETE}: unreadable completion record ({exc})"
        ) from None
    for rel, want in marker.get("files", {}).items():
        if not rel.startswith(under):
            continue
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointCorrupt(f"{path}: listed in {COMPLETE} but missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointCorrupt(f"{path}: {size} bytes, {COMPLETE} says {want['bytes']}")
        if sha256_file(path) != want["sha256"]:
            raise CheckpointCorrupt(f"{path}: sha256 differs from {COMPLETE} (corrupted)")


_verified: dict[tuple[str, str | tuple[str, ...]], tuple] = {}
"""(checkpoint, under) -> the stat signature of the files that verified."""


def verify_cached(ckpt: Path, under: str | tuple[str, ...] = "") -> None:
    """:func:`verify`, skipped when the same files (same inode, size and modification time
    as when they last verified in this process) were checked already: hashing a BERT-base
    encoder takes about a second, and one command resolves the same folder several times."""
    key = (str(Path(ckpt).resolve()), under)
    signature = _signature(Path(ckpt), under)  # taken first: a change while hashing shows
    if signature is not None and _verified.get(key) == signature:
        return
    verify(Path(ckpt), under)
    if signature is not None:
        _verified[key] = signature


def _signature(ckpt: Path, under: str | tuple[str, ...]) -> tuple | None:
    """Identity of the record and of every file it lists under ``under``, or None when one
    cannot be read (then :func:`verify` says what is wrong)."""
    try:
        files = read_marker(ckpt).get("files", {})
        paths = [ckpt / COMPLETE, *(ckpt / rel for rel in sorted(files) if rel.startswith(under))]
        stats = [p.stat() for p in paths]
    except (OSError, ValueError, AttributeError):
        return None
    return tuple(
        (str(p), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        for p, st in zip(paths, stats, strict=True)
    )


# --------------------------------------------------------------------------- rank state
def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 (the global state, saved as is)
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rank_state(staging: Path, rank: int, state: dict[str, Any]) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    path = rank_state_file(staging, rank)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def read_rank_state(ckpt: Path, rank: int) -> dict[str, Any]:
    path = rank_state_file(ckpt, rank)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; was the checkpoint written with another world size?"
        )
    return torch.load(path, weights_only=False)


# --------------------------------------------------------------------------- publishing
def publish(
    staging: Path, final: Path, marker: dict[str, Any], keep_last: int, keep_best: bool = False
) -> None:
    """Rank 0, after all ranks wrote ``staging``: write the completion record (with every
    file's size and sha256), rename into place, prune old ones. A folder already at ``final``
    (the same step saved again after resuming from an older checkpoint, or one left without
    its record or corrupt) is replaced by the new, complete one."""
    record = {**marker, "files": file_records(staging)}
    atomic_write_text(staging / COMPLETE, json.dumps(record, indent=2))
    if final.exists():
        old = final.with_name(final.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_dir(final.parent)
    prune(final.parent, keep_last, keep_best)


def prune(root: Path, keep_last: int, keep_best: bool = False) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` (but the best one with
    ``keep_best``) and stale partial ones."""
    done = complete_checkpoints(root)
    best = best_checkpoint(root) if keep_best else None
    if keep_last > 0:
        for old in done[:-keep_last]:
            if old != best:
                shutil.rmtree(old, ignore_errors=True)
    newest = int(STEP_DIR.match(done[-1].name).group(1)) if done else -1
    for path in root.glob("step_*.partial"):
        m = PARTIAL_DIR.match(path.name)
        if m and int(m.group(1)) <= newest:
            shutil.rmtree(path, ignore_errors=True)


def best_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint under ``root`` whose record holds the best evaluation (its
    ``eval``: ``{measure key: value}``, higher is better, ties to the newer); None when no
    checkpoint was saved at an evaluation step."""
    scored = []
    for path in complete_checkpoints(root):
        try:
            value = next(iter(read_marker(path).get("eval", {}).values()), None)
        except (CheckpointCorrupt, OSError):  # resume sets it aside; it is never the best
            continue
        if isinstance(value, int | float):
            scored.append((float(value), path))
    return max(scored, key=lambda vp: vp[0])[1] if scored else None


# --------------------------------------------------------------------------- the manager
@dataclass
class Restored:
    """What a resume brings back besides the engine state: the checkpoint, its completion
    record and this rank's state (sampler, RNG already applied, task state)."""

    checkpoint: Path
    step: int
    marker: dict[str, Any]
    rank_state: dict[str, Any]


class CheckpointManager:
    """Saves and restores a run's checkpoints for every rank of a DeepSpeed engine.

    ``save`` is collective (every rank calls it at the same step); ``write_models`` is called
    on rank 0 with the consolidated full state dict and the staging folder, under a forked
    RNG (building a model draws random weights: saving must not move the training streams).
    """

    def __init__(
        self,
        layout: RunLayout,
        *,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_best: bool = False,
    ) -> None:
        self.layout = layout
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.keep_best = keep_best
        self._newest: int | None = None

    def save(
        self,
        engine,
        step: int,
        *,
        rank_state: dict[str, Any],
        marker: dict[str, Any],
        write_models: Callable[[dict[str, torch.Tensor], Path], None],
        run_config: dict[str, Any] | None = None,
    ) -> None:
        """A complete checkpoint of ``step`` (collective); ``run_config``, the run's resolved
        config, is recorded in it (``run_config.json``, hashed in the record like every file):
        the settings a resume from it is checked against."""
        from retromae_ds.components import engine as eng

        root = self.layout.checkpoints
        final, staging = self.layout.checkpoint(step), self.layout.staging(step)
        if self.rank == 0 and staging.exists():
            shutil.rmtree(staging)
        eng.barrier()
        eng.save_engine(engine, root, staging.name, {"step": step})
        write_rank_state(staging, self.rank, {**rank_state, "rng": rng_state()})
        if self.rank == 0 and run_config is not None:
            atomic_write_json(staging / RUN_CONFIG, run_config)
        state = eng.consolidated_state_dict(engine)
        if state is not None:
            with torch.random.fork_rng(devices=[]), quiet_transformers():
                write_models(state, staging)
        faults.crash("crash_in_save_at_step", step)  # every file written, not yet complete
        eng.barrier()
        if self.rank == 0:
            record = {"step": step, "world_size": self.world_size, **marker}
            publish(staging, final, record, self.keep_last, self.keep_best)
        eng.barrier()
        self._newest = step

    def newest_step(self) -> int | None:
        """The step of the newest checkpoint this run knows to be good: the one it resumed
        from (verified) or the last it wrote; None before either. Never read off the folder
        names, where a newer folder may be corrupt: the final save depends on it."""
        return self._newest

    def choose(
        self,
        resume: str,
        *,
        prune_set_aside: bool = False,
        check: Callable[[Path], None] | None = None,
    ) -> Path | None:
        """The checkpoint ``resume`` names, verified and passed by ``check`` before anything
        is set aside (collective: rank 0 checks the files and chooses, every rank gets the
        same answer or the same error); rank 0 then accounts for the folders set aside
        (:func:`account_set_aside`)."""
        from retromae_ds.components import engine as eng

        def note(text: str) -> None:
            print(text, file=sys.stderr, flush=True)

        # rank 0 checks the files, sets aside what it passes over and chooses; every rank
        # loads the same checkpoint (or raises the same error)
        chosen, problem = None, None
        if self.rank == 0:
            try:
                found = resolve_resume(resume, self.layout.root, log=note, check=check)
            except (OSError, ValueError) as exc:
                problem = exc  # picklable: every rank raises the same error
            else:
                chosen = None if found is None else str(found)
                account_set_aside(self.layout.checkpoints, prune=prune_set_aside, log=note)
        chosen, problem = eng.broadcast_object((chosen, problem))
        if problem is not None:
            raise problem
        return None if chosen is None else Path(chosen)

    def load(self, engine, checkpoint: Path) -> Restored:
        """Engine state, this rank's RNG and state from a chosen checkpoint."""
        from retromae_ds.components import engine as eng

        marker = read_marker(checkpoint)
        if marker["world_size"] != self.world_size:
            raise ValueError(
                f"{checkpoint}: saved with world size {marker['world_size']}, "
                f"this run has {self.world_size}"
            )
        try:
            eng.load_engine(engine, checkpoint.parent, checkpoint.name)
        except RuntimeError as exc:
            if "state_dict" not in str(exc):
                raise
            # a model of another shape (another objective or encoder): one line, not a dump
            # of every key
            lines = str(exc).strip().splitlines()
            kinds = [x.split(":")[0].strip() for x in lines[1:] if "key(s)" in x]
            first = "; ".join([lines[0].rstrip(":"), *kinds])
            raise ValueError(
                f"{checkpoint}: its model does not fit this run's ({first}); resume it with the "
                "settings that wrote it, or start a new run_dir (or --checkpoint.resume none to "
                "start over)"
            ) from None
        rank_state = read_rank_state(checkpoint, self.rank)
        set_rng_state(rank_state["rng"])
        if checkpoint.resolve().parent == self.layout.checkpoints.resolve():
            self._newest = marker["step"]  # one of another run's is no checkpoint of this one
        return Restored(checkpoint, marker["step"], marker, rank_state)
