"""The hard negatives a fine-tuning run is fed (``negatives.*``): the version it starts on
(restored from its checkpoint, else the pointer, falling back past an unreadable one), the
swap to a newer version every ``refresh_every`` steps, the local refresher rank 0 starts and
stops, and the wait for the first version mined from the initial encoder
(``negatives.mine_first``). ``finetune`` hands its parts to the trainer as plain callables:
``resume_state`` (what a checkpoint keeps), ``marker`` and ``log_fields`` (what a checkpoint
record and a log row say), ``after_step`` (the swap; a supply gone stale raises
``StaleNegatives``, after which the trainer saves that step's checkpoint and stops).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retromae_ds.base.config import resumable
from retromae_ds.components import engine as eng
from retromae_ds.components.layout import RunLayout
from retromae_ds.components.signals import StopSignals
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.local_refresher import start_local_refresher, stop_local_refresher
from retromae_ds.finetuning.negatives import (
    NegativesInUse,
    NextVersion,
    StaleNegatives,
    load_negatives,
    start_version,
    wait_for_mined,
)


@dataclass(kw_only=True)
class NegativesConfig:
    n_hard: int = 3
    """Hard negatives per query in each batch, drawn from the ``refresh.mining.num_negatives``
    each version holds per query (at most that many are distinct)."""
    refresh_every: int = 50
    """Look for a newer negatives version every M steps."""
    mine_first: bool = False
    """ANCE's start: save a step-0 checkpoint and train only once the refresher has published
    negatives mined with the initial encoder (BM25 negatives are then never trained on)."""
    mine_first_timeout_s: float = resumable(3600.0)
    """How long to wait for those first mined negatives before failing."""
    wait_report_s: float = resumable(60.0)
    """While waiting for those first mined negatives, say what is awaited this often."""
    stale_after: int = resumable(0)
    """Report the negatives as stale once no newer version has come for this many looks
    (``refresh_every`` steps each) since the version in use was taken or this process
    started: a refresher that died or hangs elsewhere (0: off). A dead local refresher is
    reported whatever this is."""
    on_stale: str = resumable("warn")
    """warn: one warning, training goes on with the version in use; stop: save a checkpoint of
    that step, then fail in one line (``--checkpoint.resume auto`` goes on from it)."""

    def __post_init__(self) -> None:
        if self.stale_after < 0:
            raise ValueError(f"negatives.stale_after must be >= 0, got {self.stale_after}")
        if self.on_stale not in ("warn", "stop"):
            raise ValueError(f"negatives.on_stale must be warn or stop, not {self.on_stale!r}")
        if self.mine_first_timeout_s <= 0 or self.wait_report_s <= 0:
            raise ValueError(
                "negatives.mine_first_timeout_s and negatives.wait_report_s must be > 0, not "
                f"{self.mine_first_timeout_s} and {self.wait_report_s}"
            )


class NegativesFeed:
    """The negatives of one fine-tuning run on this rank (see the module doc)."""

    def __init__(
        self,
        cfg: NegativesConfig,
        layout: RunLayout,
        ts: ance_data.TrainingSet,
        dist: eng.DistInfo,
        note: Callable[[str], None],
    ) -> None:
        self.cfg, self.layout, self.ts, self.dist, self.note = cfg, layout, ts, dist, note
        self.root = layout.negatives
        self.next_version = NextVersion()
        self.in_use: NegativesInUse | None = None
        self.refresher: subprocess.Popen | None = None

    def resume_state(self) -> dict[str, NextVersion]:
        """What a checkpoint keeps per rank: the version the next step uses."""
        return {"negatives_version": self.next_version}

    def start(self, restored: bool, step: int) -> tuple[int, str | None]:
        """Choose the version training starts on at ``step`` (``restored``: the one the
        checkpoint recorded; else rank 0 reads the pointer, falling back past an unreadable
        one, and every rank takes its answer); returns (version, the problem met or None)."""
        start, problem = None, None
        if restored:
            version = self.next_version.restored
        else:
            if self.dist.rank == 0:
                start, problem = start_version(self.root, self.ts)
            version, problem = eng.broadcast_object((start.version if start else None, problem))
            if version is None:
                raise handoff.HandoffError(f"finetune: no usable negatives: {problem}")
        if start is None or start.version != version:
            start = load_negatives(self.root, version, self.ts)
        self.in_use = NegativesInUse(
            self.root,
            self.ts,
            start,
            self.dist,
            stale_after_steps=self.cfg.stale_after * self.cfg.refresh_every,
            start_step=step,
            quiet=self.cfg.on_stale == "stop",
        )
        self.next_version.negatives = self.in_use
        return version, problem

    @property
    def negatives(self) -> NegativesInUse:
        assert self.in_use is not None, "start() first"
        return self.in_use

    def marker(self) -> dict[str, Any]:
        return {"negatives_version": self.negatives.current.version}

    def log_fields(self, step: int) -> dict[str, Any]:
        return self.negatives.log_fields(step)

    def after_step(self, step: int) -> None:
        """Every ``refresh_every`` steps: take a newer version when one is published (all
        ranks or none). A supply gone stale with ``on_stale stop`` raises ``StaleNegatives``
        (the trainer saves this step's checkpoint first)."""
        if step % self.cfg.refresh_every:
            return
        alarm = self.negatives.maybe_swap(step, self.note)
        if alarm is not None and self.cfg.on_stale == "stop":
            raise StaleNegatives(
                f"{alarm}; stopped (negatives.on_stale stop) after saving the checkpoint of "
                f"step {step}: resume with --checkpoint.resume auto once a refresher can publish"
            )

    # -- the local refresher and the first mined version ----------------------------------
    def start_local_refresher(self, refresh_file: Path) -> None:
        """Rank 0 (the caller's to check): start the refresher process reading
        ``refresh_file`` beside the trainer, watched for dying by the negatives in use."""
        self.refresher = start_local_refresher(refresh_file, self.layout.refresher_log)
        self.negatives.refresher = self.refresher
        self.negatives.refresher_log = self.layout.refresher_log

    def stop_local_refresher(self) -> None:
        stop_local_refresher(self.refresher)

    def wait_for_first_mined(self, stop: StopSignals) -> int:
        """Every rank: wait for the first version mined from the step-0 checkpoint, take it
        at step 0 and return its number (``wait_for_mined``)."""
        version = wait_for_mined(
            self.root,
            self.negatives.current.version,
            self.refresher,
            self.cfg.mine_first_timeout_s,
            self.layout.refresher_log,
            self.note,
            stop=stop,
            report_every_s=self.cfg.wait_report_s,
            checkpoint=self.layout.checkpoint(0),
            dist=self.dist,
        )
        self.negatives.take(load_negatives(self.root, version, self.ts), 0)
        self.note(f"finetune: step 0: negatives v{version} mined from the initial encoder")
        return version
