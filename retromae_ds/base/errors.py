"""How every ``retromae-ds`` command reports an error a user can act on: one line,
``retromae-ds COMMAND: error: ...``, exit 2 for bad input (ValueError) and 1 for a problem of
the machine or the files (OSError: missing, unreadable, read-only, full disk), never a
traceback unless ``RETROMAE_DS_DEBUG`` is set to a true value (``1``, ``true``, ``yes``,
``on``; ``0``, ``false``, ``no``, ``off`` and empty mean off).

Also the one place that recognises a full disk behind a failed write
(:func:`disk_full_error`): torch's zip writer reports it as ``unexpected pos ...`` and
safetensors as an I/O error, neither naming the folder.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEBUG_ENV = "RETROMAE_DS_DEBUG"
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)
"""Errors whose message is the whole story; anything else is a bug and keeps its traceback."""


class RunFailed(RuntimeError):
    """A run stopped for a reason its message states whole (a helper process died, a wait
    timed out): reported in one line like bad input, exit 1."""


JOB_ERRORS: tuple[type[BaseException], ...] = (*USER_ERRORS, RunFailed)
"""What a training job (pretrain, finetune) reports in one line: bad input and a failed run;
any other error is a bug and keeps its traceback."""


def debug_enabled() -> bool:
    """Whether ``RETROMAE_DS_DEBUG`` asks for tracebacks (unset, empty or ``0`` do not)."""
    value = os.environ.get(DEBUG_ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (``OSError``s as ``PATH: reason``)."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        text = f"{exc.filename}: {exc.strerror}"
        if exc.filename2:
            text += f" (-> {exc.filename2})"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def report(prog: str, exc: BaseException) -> int:
    """Print ``PROG: error: MESSAGE`` on stderr; the exit status for ``exc``."""
    print(f"{prog}: error: {one_line(exc)}", file=sys.stderr, flush=True)
    return 2 if isinstance(exc, ValueError) else 1


def run_reporting(
    prog: str,
    func: Callable[..., Any],
    *args: Any,
    errors: tuple[type[BaseException], ...] = USER_ERRORS,
) -> int:
    """``func(*args)`` (its int result, 0 for None), or one error line and its exit status
    for ``errors``; the traceback instead when debugging is on."""
    try:
        result = func(*args)
    except errors as exc:
        if debug_enabled():
            raise
        return report(prog, exc)
    return result if isinstance(result, int) else 0


# --------------------------------------------------------------------------- full disks
class DiskFull(OSError):
    """A write failed because the filesystem holding ``folder`` is full."""

    def __init__(self, message: str, folder: Path) -> None:
        super().__init__(errno.ENOSPC, message)
        self.folder = folder

    def __str__(self) -> str:
        return self.strerror


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def _errno_in_chain(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(folder: str | Path) -> int | None:
    """Free bytes on the filesystem of ``folder`` (its nearest existing parent)."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def disk_full_error(
    exc: BaseException, folder: str | Path, what: str, needed: int | None = None
) -> DiskFull | None:
    """A :class:`DiskFull` naming ``folder``, the free space and (when known) about how much
    ``what`` needs, if ``exc`` came from a full disk; None otherwise.

    A full disk is an ``ENOSPC``/``EDQUOT`` anywhere in the exception's chain, or a write
    error of a library that hides the errno (torch's ``unexpected pos``) while less space is
    free than the write needed (or under 1 MB when that is unknown).
    """
    folder = Path(folder)
    free = free_bytes(folder)
    hidden = isinstance(exc, (RuntimeError, OSError)) and free is not None
    if not _errno_in_chain(exc) and not (hidden and free < max(needed or 0, 2**20)):
        return None
    need = f"needs about {_mb(needed)}, " if needed else ""
    have = f"{_mb(free)} free" if free is not None else "free space unknown"
    return DiskFull(
        f"{folder}: no space left on device while writing {what} ({need}{have})", folder
    )
