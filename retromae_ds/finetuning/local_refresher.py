"""The local refresher: ``retromae-ds refresh`` as one plain process beside the trainer's rank
0 (``--refresher local``), with its own log, ended with the trainer however the trainer ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal a process gets when the thread that created it exits."""


def die_with(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn``: the child gets SIGTERM when its parent dies (Linux; elsewhere None,
    and the refresher's own ``--parent_pid`` polling does it). The signal follows the parent
    *thread*: the trainer starts the refresher from its main thread, which lives as long as
    the process. libc is looked up here, in the parent: the forked child of a threaded
    process must not import anything."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_signal() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return set_signal


def start_local_refresher(cfg_file: Path, log_file: Path) -> subprocess.Popen:
    """``retromae-ds refresh`` as one plain process beside rank 0, with its own log; it ends
    when this process ends, however it ends (a ``kill -9`` included)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
        and k not in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
        and not k.startswith(("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    }
    log = open(log_file, "ab")  # noqa: SIM115 (lives as long as the process)
    me = os.getpid()
    cmd = [sys.executable, "-m", "retromae_ds.refresh", "--config", str(cfg_file)]
    return subprocess.Popen(
        [*cmd, "--parent_pid", str(me)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with(me),  # noqa: PLW1509
    )


def stop_local_refresher(proc: subprocess.Popen | None) -> None:
    """Stop a local refresher (SIGTERM, then SIGKILL after 30 s); nothing if it has ended."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()  # a refresher killed anywhere leaves no visible partial version
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
