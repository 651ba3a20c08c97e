"""An exclusive ``flock`` on a lock file that names its holder (host, pid, start time).

The one mechanism behind "one writer per run folder" (``components.run_lock``: ``RUN/.lock``) and
"one refresher per negatives folder" (``refresher.process``: ``negatives/.refresher.lock``). The
kernel drops the lock when its process dies, so a crashed holder leaves no stale lock: the
next one takes it over and says whose it was. On a filesystem without ``flock`` support the
caller goes on with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        return {}


def describe(holder: dict) -> str:
    """``pid P on HOST since TIME`` (or that the holder left no details)."""
    if not holder:
        return "a process that left no details"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')} since {since}"


def acquire(path: Path, *, what: str) -> tuple[int | None, str | None]:
    """Lock ``path`` (created if missing) without waiting.

    Returns ``(fd, None)`` when locked, ``(None, holder)`` when another live process holds
    it (``holder`` describes it), ``(None, None)`` when the filesystem cannot lock (warned on
    stderr, naming ``what`` the lock protects). Other OS errors propagate.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = describe(_holder(fd))
        os.close(fd)
        return None, holder
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            print(
                f"warning: {path}: this filesystem cannot lock ({exc.strerror}); make sure "
                f"one {what} at a time runs",
                file=sys.stderr,
            )
            return None, None
        raise
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    previous = _holder(fd)
    if previous.get("pid") and (previous.get("pid"), previous.get("host")) != (
        me["pid"],
        me["host"],
    ):
        print(
            f"{path}: taking over from {describe(previous)}, which ended without releasing it",
            file=sys.stderr,
        )
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
    except OSError:
        pass  # a full disk: the lock holds all the same, only its holder goes unnamed
    return fd, None


def release(fd: int | None) -> None:
    """Give the lock back; a clean end leaves no holder to report."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
