"""Crash-safe file writes shared by every stage: a file is either absent or complete.

Files made here get the permissions an ordinary ``open`` would give them (``0o666 & ~umask``),
not ``tempfile``'s private 0600: manifests, checkpoint records and exports are read by
teammates and serving jobs under other users.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A file to write ``path`` through: a unique temporary file in the same folder (the
    permissions of an ordinary ``open``), fsynced and renamed over ``path`` when the block
    ends, removed when it raises. ``mode``: ``w`` (UTF-8 text) or ``wb``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        chmod_as_created(fd)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` through a unique temporary file in the same folder, fsync, then rename."""
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """``obj`` as JSON (indent 2, a final newline) through :func:`atomic_write_text`."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``os.umask`` alone
    must set it to read it, which races with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_as_created(fd_or_path: int | str | Path, *, folder: bool = False) -> None:
    """Give a ``tempfile.mkstemp`` file (or ``mkdtemp`` folder, ``folder=True``) the mode
    ``open``/``mkdir`` would have: ``0o666 & ~umask`` (``0o777 & ~umask``)."""
    mode = (0o777 if folder else 0o666) & ~current_umask()
    if isinstance(fd_or_path, int):
        os.fchmod(fd_or_path, mode)
    else:
        os.chmod(fd_or_path, mode)


def chmod_tree_as_created(folder: str | Path) -> None:
    """``chmod_as_created`` over a folder and everything below it: for trees written by
    libraries that stage through ``tempfile`` (transformers' safetensors save gives 0600)."""
    chmod_as_created(folder, folder=True)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            chmod_as_created(Path(root, name), folder=True)
        for name in files:
            chmod_as_created(Path(root, name))


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save_npy(path: str | Path, array: Any) -> None:
    """``numpy.save`` through a per-process temporary file, fsync, then rename."""
    import numpy as np

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no temporary behind
        raise


class _HashingWriter:
    """A binary file whose written bytes are hashed on the way (``numpy.lib.format`` writes
    through ``write`` when the object is not a real file)."""

    def __init__(self, f: Any) -> None:
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.f.write(data)


def atomic_save_npy_hashed(
    path: str | Path, array: Any, before_rename: Any = None
) -> tuple[str, int]:
    """``atomic_save_npy`` returning (sha256, size) of the file's bytes, hashed as they are
    written (no second read). ``before_rename()``, when given, runs between the fsync and the
    rename (a fault-injection point)."""
    import numpy as np

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            np.lib.format.write_array(writer, np.ascontiguousarray(array), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no temporary behind
        raise
    return writer.digest.hexdigest(), writer.size


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
