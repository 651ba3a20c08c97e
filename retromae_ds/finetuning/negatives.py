"""The negatives a fine-tuning run trains on: the version to start from, the version every
rank uses (swapped at step boundaries, all ranks or none, when the refresher has published a
newer one, with the supply watched: a dead local refresher or stale negatives), waiting for
the first mined version (``negatives.mine_first``: said every ``wait_report_s``, ended by a
stop signal), and the per-rank checkpoint state (``NextVersion``). Problems are reported
through a ``note`` callable (the trainer's log)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from retromae_ds.base.errors import RunFailed
from retromae_ds.components import engine as eng
from retromae_ds.components.signals import StopAfterCheckpoint, StopRequested, StopSignals
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff


def load_negatives(root: Path, version: int, ts: ance_data.TrainingSet) -> handoff.Negatives:
    neg = handoff.load_version(root, version)
    if neg.manifest.get("data") != ts.fingerprint() or neg.num_queries != ts.num_queries:
        raise ValueError(f"{root}: version {version} was mined for other training data")
    return neg


class StaleNegatives(StopAfterCheckpoint, ValueError):
    """``negatives.on_stale stop``: the refresher died or published nothing for too long (the
    trainer saves the step's checkpoint, then fails in one line)."""


@dataclass
class NextVersion:
    """Per-rank checkpoint state: the negatives version the *next* step uses (a swap happens
    before the step's checkpoint), saved as ``negatives_version``."""

    negatives: NegativesInUse | None = None
    restored: int | None = None

    def state_dict(self) -> int:
        assert self.negatives is not None, "saved before the negatives were chosen"
        return self.negatives.current.version

    def load_state_dict(self, version: int) -> None:
        self.restored = int(version)


class NegativesInUse:
    """The negatives version every rank trains on, swapped at step boundaries (all ranks or
    none) when the refresher has published a newer one. An unreadable pointer, or a newer
    version that does not load, keeps the version in use: the problem is noted once (until it
    changes or clears) and the pointer is read again at the next check.

    It also watches the supply: rank 0's local ``refresher`` (a Popen, set once started)
    having exited, or no newer version for ``stale_after_steps`` steps, is an alarm, noted
    once (a dead refresher's alarm is the only one: stale negatives follow from it)."""

    def __init__(
        self,
        root: Path,
        ts: ance_data.TrainingSet,
        negatives: handoff.Negatives,
        dist,
        *,
        stale_after_steps: int = 0,
        start_step: int = 0,
        quiet: bool = False,
    ) -> None:
        self.root, self.ts, self.current, self.dist = root, ts, negatives, dist
        self.note: dict[str, Any] = {}  # refresh timings of a new version, for the next log row
        self.problem: str | None = None  # the last problem noted, so it is noted only once
        self.stale_after_steps = stale_after_steps
        self.quiet = quiet  # alarms are returned, not noted (the caller stops on them)
        self.refresher: subprocess.Popen | None = None
        self.refresher_log: Path | None = None
        self.fresh_since = start_step  # step the version in use was taken (or this run began)
        self.alarmed: set[str] = set()  # "dead", "stale": each noted once (stale: per version)

    def log_fields(self, step: int) -> dict[str, Any]:
        fields = {
            "negatives_version": self.current.version,
            "negatives_staleness": step - self.current.step,
            **self.note,
        }
        if self.refresher is not None:
            fields["refresher_alive"] = self.refresher.poll() is None
        self.note = {}
        return fields

    def _refresher_died(self) -> str | None:
        """Rank 0: why the local refresher is gone, or None while it runs (or there is none)."""
        if self.refresher is None or self.refresher.poll() is None:
            return None
        rc = self.refresher.returncode
        how = f"exited (killed by signal {-rc})" if rc < 0 else f"exited with status {rc}"
        last = ""
        if self.refresher_log is not None:
            try:
                with open(self.refresher_log, "rb") as f:
                    f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                    lines = f.read().decode("utf-8", "replace").strip().splitlines()
                last = f": {lines[-1].strip()}" if lines else ""
            except OSError:
                pass
        return f"the local refresher {how}{last} (log {self.refresher_log})"

    def _watch(self, step: int, died: str | None, note: Callable[[str], None]) -> str | None:
        """Note a new alarm once (unless ``quiet``); return it (None when nothing new)."""
        alarm = None
        if died is not None and "dead" not in self.alarmed:
            self.alarmed.add("dead")
            alarm = f"finetune: step {step}: {died}"
        elif (
            self.stale_after_steps
            and "dead" not in self.alarmed
            and "stale" not in self.alarmed
            and step - self.fresh_since >= self.stale_after_steps
        ):
            self.alarmed.add("stale")
            alarm = (
                f"finetune: step {step}: negatives are stale: no version newer than "
                f"v{self.current.version} for {step - self.fresh_since} steps "
                f"(negatives.stale_after); is the refresher of {self.root} running?"
            )
        if alarm is not None and not self.quiet:
            note(
                f"warning: {alarm.removeprefix('finetune: ')}; training goes on with "
                f"negatives v{self.current.version}"
            )
        return alarm

    def _report(self, problem: str | None, note: Callable[[str], None]) -> None:
        if problem is not None and problem != self.problem:
            note(problem)
        self.problem = problem

    def maybe_swap(self, step: int, note: Callable[[str], None]) -> str | None:
        """Swap to a newer published version (collective); returns a new alarm about the
        refresher (see the class), the same on every rank, or None."""
        newest, problem, died = None, None, None
        if self.dist.rank == 0:
            try:
                pointer = handoff.read_pointer(self.root)
                newest = pointer["version"] if pointer else None
            except handoff.HandoffError as exc:
                problem = f"finetune: keeping negatives v{self.current.version}: {exc}"
            died = self._refresher_died()
        newest, problem, died = eng.broadcast_object((newest, problem, died))
        if newest is None or newest <= self.current.version:
            self._report(problem, note)
            return self._watch(step, died, note)
        try:
            loaded, problem = load_negatives(self.root, newest, self.ts), None
        except (FileNotFoundError, ValueError) as exc:  # pruned, corrupt or foreign
            loaded, problem = None, f"finetune: negatives v{newest} not used: {exc}"
        # every rank swaps, or none does
        if eng.any_rank(loaded is None, self.dist.device):
            self._report(problem or f"finetune: negatives v{newest} not used on a rank", note)
            return self._watch(step, died, note)
        self._report(None, note)
        self.take(loaded, step)
        self.note = {f"refresh_{k}": v for k, v in self.current.manifest.get("timings", {}).items()}
        note(f"finetune: step {step}: negatives v{newest} (from step {self.current.step})")
        return self._watch(step, died, note)

    def take(self, negatives: handoff.Negatives, step: int) -> None:
        """Train on ``negatives`` from ``step`` on (staleness counts from here)."""
        self.current, self.fresh_since = negatives, step
        self.alarmed.discard("stale")


def start_version(
    root: Path, ts: ance_data.TrainingSet
) -> tuple[handoff.Negatives | None, str | None]:
    """Rank 0 at start-up: the version to train on first and the problem met on the way.

    The version ``CURRENT`` names; when the pointer is unreadable, or names a version that
    does not load, the newest published version that does (None when there is none).
    """
    tried, problem = None, None
    try:
        pointer = handoff.read_pointer(root)
        if pointer is None:
            return None, f"{root / handoff.POINTER}: no negatives version is published"
        tried = pointer["version"]
        return load_negatives(root, tried, ts), None
    except (FileNotFoundError, ValueError) as exc:  # HandoffError is a ValueError
        problem = str(exc)
    for version in reversed(handoff.published_versions(root)):
        if version == tried:
            continue
        try:
            loaded = load_negatives(root, version, ts)
        except (FileNotFoundError, ValueError):
            continue
        return loaded, f"{problem}; starting from negatives v{version}"
    return None, f"{problem}; no other usable negatives version in {root}"


def wait_for_mined(
    root: Path,
    after: int,
    refresher: subprocess.Popen | None,
    timeout_s: float,
    log: Path,
    report: Callable[[str], None] = print,
    *,
    stop: StopSignals | None = None,
    report_every_s: float = 60.0,
    checkpoint: Path | None = None,
    dist: Any = None,
    poll_s: float = 1.0,
) -> int:
    """The first version newer than ``after`` published in ``root`` (``negatives.mine_first``),
    waited for by every rank: rank 0 reads the pointer, and at each poll all ranks agree in one
    all-reduce on what it found, on a stop signal any rank received, on the local
    ``refresher`` having exited and on the timeout. Rank 0 says what it waits for at once and
    every ``report_every_s`` through ``report``. A stop signal (``stop``) ends the wait with
    ``StopRequested(0)``: the step-0 ``checkpoint`` is complete, so the run exits as a stopped
    run does (85) and resumes from it; a local refresher that exits first is ``RunFailed``,
    nothing within ``timeout_s`` a ``TimeoutError``. An unreadable pointer counts as nothing
    yet (reported once per distinct problem)."""
    rank = 0 if dist is None else dist.rank
    start = time.monotonic()
    next_report = start
    problem = None
    who = (
        "a refresher running elsewhere (--refresher external)"
        if refresher is None
        else f"the local refresher (pid {refresher.pid}, log {log})"
    )
    while True:
        found, died, late = -1, False, False
        if rank == 0:
            try:
                pointer = handoff.read_pointer(root)
            except handoff.HandoffError as exc:
                pointer = None
                if str(exc) != problem:
                    problem = str(exc)
                    report(f"finetune: waiting for mined negatives: {exc}")
            if pointer is not None and pointer["version"] > after:
                found = int(pointer["version"])
            died = refresher is not None and refresher.poll() is not None
            late = time.monotonic() - start > timeout_s
        stopping = stop is not None and stop.received is not None
        flags = eng.all_reduce_max(torch.tensor([int(stopping), found, int(died), int(late)]))
        stopping, found, died, late = (int(v) for v in flags.tolist())
        if stopping:
            if rank == 0:
                what = stop.received if stop and stop.received else "a stop signal on a rank"
                report(
                    f"finetune: {what} during the wait for the first mined negatives: stopped; "
                    f"the checkpoint {checkpoint} is complete: resume with --checkpoint.resume auto"
                )
            raise StopRequested(0)
        if found >= 0:
            return found
        if died:
            raise RunFailed(
                f"the local refresher exited ({refresher.returncode if refresher else '?'}) "
                f"before mining the first negatives; see {log}"
            )
        if late:
            raise TimeoutError(
                f"{root}: no mined negatives within {timeout_s:.0f} s of the step-0 checkpoint "
                "(negatives.mine_first needs a running refresher)"
                + (f"; last problem: {problem}" if problem else "")
            )
        now = time.monotonic()
        if rank == 0 and now >= next_report:
            report(_waiting_line(root, after, who, checkpoint, now - start, timeout_s))
            next_report = now + report_every_s
        time.sleep(poll_s)


def _waiting_line(
    root: Path, after: int, who: str, checkpoint: Path | None, waited: float, timeout_s: float
) -> str:
    """What the wait for the first mined negatives says every ``report_every_s``."""
    return (
        f"finetune: waiting for negatives mined from the step-0 checkpoint"
        f"{f' {checkpoint}' if checkpoint else ''}: a version newer than v{after} in "
        f"{root}, published by {who}; {waited:.0f} s so far, failing after "
        f"{timeout_s:.0f} s (negatives.mine_first_timeout_s); a stop signal ends the "
        "wait, the step-0 checkpoint kept"
    )
