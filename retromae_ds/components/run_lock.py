"""One writer per run folder: an exclusive lock on ``RUN/.lock`` held for a run's lifetime.

Rank 0 takes an advisory ``flock`` on the lock file before anything is written and keeps it
until the run ends; the lock file names the holder (host, pid, start time). A second run into
the same folder fails at once on every rank, naming that holder, instead of interleaving
metrics and racing on checkpoints. The kernel drops the lock when its process dies, so a
crashed run leaves no stale lock: the next run takes it over (and says whose it was). On a
filesystem without ``flock`` support the run goes on with a warning (``retromae_ds.components.holder_lock``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from retromae_ds.components import engine as eng
from retromae_ds.components import holder_lock
from retromae_ds.components.layout import RunLayout


class RunFolderBusy(ValueError):
    """Another live process holds the run folder's lock."""


class RunFolderNotWritable(ValueError):
    """The run folder (or a folder a run writes into) cannot be written."""


def check_writable(layout: RunLayout) -> None:
    """Create and remove a file in the run folder and in each of its folders a run writes
    into, so that a read-only or foreign folder fails now, naming it, instead of after the
    engine started (a permission check alone is always true for root, and a read-only mount
    says so only when written to)."""
    folders = [layout.root, layout.checkpoints, layout.tensorboard]
    files = [layout.metrics, layout.config, layout.ds_config, layout.lock]
    for path in (layout.root, *layout.root.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                raise RunFolderNotWritable(
                    f"{path}: is a file, not a folder; run_dir {layout.root} must be a folder "
                    "(a new one or an earlier run's)"
                )
            break
    try:
        layout.root.mkdir(parents=True, exist_ok=True)
        for folder in (f for f in folders if f.is_dir()):
            probe = folder / f".write-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        for file in (f for f in files if f.exists()):
            os.close(os.open(file, os.O_WRONLY | os.O_APPEND))
    except OSError as exc:
        where = exc.filename or layout.root
        raise RunFolderNotWritable(
            f"{where}: the run folder cannot be written ({exc.strerror or exc}); fix its "
            "permissions or use another run_dir"
        ) from None


def _take(layout: RunLayout) -> tuple[int | None, ValueError | None]:
    """(fd, None) when locked; (None, error) when another process holds it or the folder is
    not writable; (None, None) when this filesystem cannot lock."""
    try:
        check_writable(layout)
    except RunFolderNotWritable as exc:
        return None, exc
    fd, holder = holder_lock.acquire(layout.lock, what="run in this folder")
    if holder is not None:
        return None, RunFolderBusy(
            f"{layout.root}: another run is writing into this folder ({holder}; lock file "
            f"{layout.lock}); wait for it to end or use another run_dir"
        )
    return fd, None


@contextlib.contextmanager
def hold_run_folder(layout: RunLayout, rank: int) -> Iterator[None]:
    """Hold the run folder's lock (rank 0) for the duration; every rank raises RunFolderBusy
    when another run holds it (collective: every rank must enter)."""
    fd, problem = _take(layout) if rank == 0 else (None, None)
    problem = eng.broadcast_object(problem)
    if problem is not None:
        raise problem  # a ValueError on every rank: one line, exit 2
    try:
        yield
    finally:
        holder_lock.release(fd)
