"""The stop/requeue protocol: stop signals noted by handlers, acted on at a step boundary.

The handlers for ``stop_signals`` (SIGUSR1 and SIGTERM by default) only note the signal; at
the next optimizer-step boundary the ranks agree (an all-reduce, so a signal that reached one
rank stops all of them at the same step), write a complete checkpoint and exit with
``EXIT_REQUEUE`` (85). ``slurm/*.sh`` requeue the job on that status and the requeued job
resumes from the checkpoint (``--checkpoint.resume auto``).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

EXIT_REQUEUE = 85
"""Exit status of a run stopped by a stop signal after its checkpoint was completed: resume
it (``slurm/pretrain.sh`` runs ``scontrol requeue`` on it). Distinct from the statuses others
use: 1-2 (errors), 17 (an injected crash, ``retromae_ds.base.faults``), 124 (timeout(1)), 128+N
(killed by N)."""


def signal_number(name: str) -> signal.Signals:
    """``"SIGUSR1"`` or ``"USR1"`` -> the signal; SIGKILL and SIGSTOP cannot be handled."""
    full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    sig = getattr(signal.Signals, full, None)
    if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"stop_signals: {name!r} is not a signal that can be handled")
    return sig


class StopAfterCheckpoint(Exception):  # noqa: N818 (a mixin: the concrete error names it)
    """Mixed into an error ``Hooks.after_step`` raises to stop the run: the trainer first saves
    the checkpoint of that step (unless it has), so ``--checkpoint.resume auto`` goes on from it."""


class StopRequested(Exception):
    """The run stopped on a signal after the checkpoint of ``step`` was completed."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped by a signal after step {step} (checkpoint complete)")
        self.step = step


class StopSignals:
    """Handlers that only note that a stop signal arrived (nothing else is safe inside a
    handler); the training loop reads ``received`` at step boundaries. Restores the previous
    handlers on exit, except after a stop: then the process is on its way out with a complete
    checkpoint and ignores further stop signals, because the launcher ends the other ranks
    with SIGTERM as soon as the first one exits (srun --kill-on-bad-exit, the deepspeed
    launcher), which must not turn their status 85 into 143. Outside the main thread Python
    cannot install handlers: then inert."""

    def __init__(self, names: list[str]) -> None:
        self.signals = [signal_number(name) for name in names]
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _note(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        stopped = exc_type is not None and issubclass(exc_type, StopRequested)
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if stopped else handler)
