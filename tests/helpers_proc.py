"""This machine's processes as the kernel lists them in ``/proc``: what the tests that look
for a run's own processes (a Slurm job's steps, a trainer's refresher) read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def processes(*files: str) -> Iterator[tuple[int, dict[str, bytes]]]:
    """``(pid, {name: bytes of /proc/PID/name})`` of every process whose ``files`` can all be
    read (one that exits or is not ours to read is passed over)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            yield int(proc.name), {name: (proc / name).read_bytes() for name in files}
        except OSError:
            continue


def parent_pid(stat: bytes) -> int:
    """The parent pid in a ``/proc/PID/stat`` line (after the command name, which may hold
    spaces and parentheses)."""
    return int(stat.rsplit(b")", 1)[1].split()[1])
