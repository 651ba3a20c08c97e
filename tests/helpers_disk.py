"""A real full disk for the fault-injection tests: a small tmpfs mounted for one test, and
ballast that leaves a chosen number of bytes free on it.

Mounting needs root (CI and the developers' machines run as root); elsewhere the tests that
use it skip, saying why. Nothing here fakes ``ENOSPC``: the kernel reports it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(size: str = "64m") -> Iterator[Path]:
    """A fresh tmpfs of ``size`` (mount's syntax: ``64m``) mounted on a new folder; unmounted
    and removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a full-disk test mounts a small tmpfs, which needs root")
    folder = Path(tempfile.mkdtemp(prefix="retromae-ds-disk-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def fill(folder: Path, leave: int) -> Path:
    """Write ``folder/BALLAST`` so that about ``leave`` bytes stay free on its filesystem;
    delete the file to give the space back."""
    ballast = folder / "BALLAST"
    remaining = shutil.disk_usage(folder).free - leave
    block = b"\0" * (1 << 20)
    with open(ballast, "ab") as f:
        while remaining > 0:
            n = min(len(block), remaining)
            f.write(block[:n])
            remaining -= n
    return ballast


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free
