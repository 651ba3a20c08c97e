"""Checkpoints that a crash cannot corrupt, and selection of the one to resume from.

Layout under ``RUN/checkpoints``::

    step_00000100/            complete: renamed into place only after every rank finished
        COMPLETE              marker (JSON: step, world size, ...) written before the rename
        <DeepSpeed files>     module, optimizer and scheduler state (any ZeRO stage)
        rank_00000.pt ...     per-rank state: RNG states, sampler position
        encoder/              the encoder as a Hugging Face folder (consolidated by rank 0)
    step_00000200.partial/    being written (or left by a crash): never selected

Every rank writes into ``step_N.partial``; after a barrier rank 0 writes the marker and renames
the folder, then prunes old checkpoints (keep-last-k). DeepSpeed's own ``latest`` file is not
written: it is updated by rank 0 before the other ranks finish. ``--resume auto`` takes the
newest folder with a marker.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retromae_ds.fsutil import atomic_write_text, fsync_dir

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and (path / MARKER).is_file():
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_complete(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """``none`` -> None; ``auto`` -> newest complete checkpoint of the run (or None);
    a path -> that checkpoint, which must be complete."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_complete(run_dir / "checkpoints")
    path = Path(resume)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    return path


def read_marker(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MARKER).read_text())


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
    path = staging / f"rank_{rank:05d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def read_rank_state(ckpt: Path, rank: int) -> dict[str, Any]:
    path = ckpt / f"rank_{rank:05d}.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; was the checkpoint written with another world size?"
        )
    return torch.load(path, weights_only=False)


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
    newest = int(_STEP_DIR.match(done[-1].name).group(1)) if done else -1
    for path in root.glob("step_*.partial"):
        m = re.match(r"^step_(\d{8})\.partial$", path.name)
        if m and int(m.group(1)) <= newest:
            shutil.rmtree(path, ignore_errors=True)
