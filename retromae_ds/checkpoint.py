"""Checkpoints that a crash cannot corrupt: saving, resuming, and finding them.

Layout: see ``retromae_ds.layout`` (``RUN/checkpoints/step_N/`` with a ``COMPLETE`` record,
the DeepSpeed files, one ``rank_R.pt`` per rank and the encoder as a Hugging Face folder).

:class:`CheckpointManager` is the one writer and reader of a run's checkpoints, used by
pre-training and fine-tuning alike. Every rank writes into ``step_N.partial``; after a barrier
rank 0 writes the ``COMPLETE`` record and renames the folder, then prunes old checkpoints
(keep-last-k). DeepSpeed's own ``latest`` file is not written: it is updated by rank 0 before
the other ranks finish. ``--resume auto`` takes the newest folder with a record.

:func:`resolve_checkpoint` and :func:`resolve_encoder` are the one place that turns what a
user names ("a run folder, a checkpoint, or a Hugging Face folder") into a folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retromae_ds import faults
from retromae_ds.fsutil import atomic_write_text, fsync_dir
from retromae_ds.hfutil import quiet_transformers
from retromae_ds.layout import (
    COMPLETE,
    ENCODER,
    PARTIAL_DIR,
    STEP_DIR,
    RunLayout,
    rank_state_file,
    step_tag,
)

MARKER = COMPLETE
tag_for = step_tag


# --------------------------------------------------------------------------- finding
def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = STEP_DIR.match(path.name)
        if m and (path / MARKER).is_file():
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_complete(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint folder, or a run folder (or its ``checkpoints/``) -> the complete
    checkpoint it names (a run's newest)."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    latest = latest_complete(RunLayout(path).checkpoints) or latest_complete(path)
    if latest is None:
        raise FileNotFoundError(
            f"{path}: neither a complete checkpoint nor a run folder holding one"
        )
    return latest


def resolve_encoder(path: str | Path) -> Path:
    """The Hugging Face encoder folder that ``path`` names: a complete checkpoint (its
    ``encoder/``), a run folder (its newest complete checkpoint's), or a Hugging Face folder.
    A run folder also holds a ``config.json`` (the training config), so checkpoints are looked
    for before a model config."""
    path = Path(path)
    if is_checkpoint(path) or RunLayout(path).checkpoints.is_dir():
        folder = resolve_checkpoint(path) / ENCODER
    elif (path / "config.json").is_file():
        folder = path
    else:
        raise FileNotFoundError(
            f"{path}: neither a Hugging Face encoder folder, a complete checkpoint, "
            "nor a run folder holding one"
        )
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no Hugging Face model (config.json) there")
    return folder


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """``none`` -> None; ``auto`` -> newest complete checkpoint of the run (or None);
    a path -> that checkpoint, which must be complete."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_complete(RunLayout(run_dir).checkpoints)
    path = Path(resume)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    return path


def read_marker(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MARKER).read_text())


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
def publish(staging: Path, final: Path, marker: dict[str, Any], keep_last: int) -> None:
    """Rank 0, after all ranks wrote ``staging``: mark complete, rename, prune old ones."""
    atomic_write_text(staging / MARKER, json.dumps(marker, indent=2))
    if final.exists():  # the same step saved again after a resume: keep the older copy
        shutil.rmtree(staging)
    else:
        os.replace(staging, final)
    fsync_dir(final.parent)
    prune(final.parent, keep_last)


def prune(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` and stale partial ones."""
    done = complete_checkpoints(root)
    if keep_last > 0:
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    newest = int(STEP_DIR.match(done[-1].name).group(1)) if done else -1
    for path in root.glob("step_*.partial"):
        m = PARTIAL_DIR.match(path.name)
        if m and int(m.group(1)) <= newest:
            shutil.rmtree(path, ignore_errors=True)


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

    def __init__(self, layout: RunLayout, *, rank: int, world_size: int, keep_last: int) -> None:
        self.layout = layout
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last

    def save(
        self,
        engine,
        step: int,
        *,
        rank_state: dict[str, Any],
        marker: dict[str, Any],
        write_models: Callable[[dict[str, torch.Tensor], Path], None],
    ) -> None:
        from retromae_ds import engine as eng

        root = self.layout.checkpoints
        final, staging = self.layout.checkpoint(step), self.layout.staging(step)
        if self.rank == 0 and staging.exists():
            shutil.rmtree(staging)
        eng.barrier()
        eng.save_engine(engine, root, staging.name, {"step": step})
        write_rank_state(staging, self.rank, {**rank_state, "rng": rng_state()})
        state = eng.consolidated_state_dict(engine)
        if state is not None:
            with torch.random.fork_rng(devices=[]), quiet_transformers():
                write_models(state, staging)
        faults.crash("crash_in_save_at_step", step)  # every file written, not yet complete
        eng.barrier()
        if self.rank == 0:
            record = {"step": step, "world_size": self.world_size, **marker}
            publish(staging, final, record, self.keep_last)
        eng.barrier()

    def newest_step(self) -> int | None:
        newest = latest_complete(self.layout.checkpoints)
        return None if newest is None else read_marker(newest)["step"]

    def restore(self, engine, resume: str) -> Restored | None:
        """Load the checkpoint ``resume`` names (``auto``, ``none`` or a path) into
        ``engine`` and this process's RNG; None when there is nothing to resume."""
        from retromae_ds import engine as eng

        checkpoint = resolve_resume(resume, self.layout.root)
        if checkpoint is None:
            return None
        marker = read_marker(checkpoint)
        if marker["world_size"] != self.world_size:
            raise ValueError(
                f"{checkpoint}: saved with world size {marker['world_size']}, "
                f"this run has {self.world_size}"
            )
        eng.load_engine(engine, checkpoint.parent, checkpoint.name)
        rank_state = read_rank_state(checkpoint, self.rank)
        set_rng_state(rank_state["rng"])
        return Restored(checkpoint, marker["step"], marker, rank_state)
