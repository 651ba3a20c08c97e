"""The run folder: one object naming every file and folder a run writes.

Pre-training, fine-tuning, the refresher, export and the study all find each other's files
through :class:`RunLayout` (and a checkpoint's contents through the names below), so the
layout is written down once::

    RUN/
        config.json              the resolved training config (rank 0, every start)
        ds_config.json           the DeepSpeed dict it implies
        metrics.jsonl            one row per logged step; tensorboard/ the same for TensorBoard
        metrics.superseded.jsonl rows a stopped run logged after its last checkpoint, moved out
                                 by the run that resumed (so metrics.jsonl never repeats a step)
        checkpoints/
            step_00000100/       complete (see retromae_ds.components.checkpoint)
                COMPLETE         completion record, written last
                rank_00000.pt    per-rank state: sampler, RNG, task state
                run_config.json  the resolved training config that wrote it (the authority
                                 a resume is checked against; listed in COMPLETE)
                encoder/         the encoder as a Hugging Face folder
                query_encoder/   fine-tuning with separate towers only
                <DeepSpeed files>
            step_00000200.partial/   being written, or left by a crash: never read
            step_00000300.corrupt/   set aside by a resume (never read again; counted at
            step_00000300.superseded/  every start, deleted by --checkpoint.prune_set_aside)
        data/                    fine-tuning: the tokenized BEIR split (retromae_ds.finetuning.data)
        negatives/               fine-tuning: versioned hard negatives (retromae_ds.finetuning.handoff)
        refresh_config.json      fine-tuning: the refresher's settings, for any refresher
        refresher.log            the local refresher's output
        refresh_metrics.jsonl    the refresher's timings per published version
        FINISHED                 fine-tuning reached max_steps (the refresher may stop)
        .lock                    held by the run writing here (retromae_ds.components.run_lock)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

COMPLETE = "COMPLETE"
"""A checkpoint's completion record; a checkpoint without it is not a checkpoint."""
ENCODER = "encoder"
"""The encoder inside a checkpoint, as a Hugging Face folder."""
QUERY_ENCODER = "query_encoder"
"""The query tower inside a fine-tuning checkpoint whose towers are not shared."""
RUN_CONFIG = "run_config.json"
"""Inside a checkpoint: the resolved config of the run that wrote it (listed in its record)."""
PARTIAL_SUFFIX = ".partial"
STEP_DIR = re.compile(r"^step_(\d{8})$")
PARTIAL_DIR = re.compile(r"^step_(\d{8})\.partial$")
SET_ASIDE_DIR = re.compile(r"^step_(\d{8})(?:\.\d+)?\.(corrupt|superseded)$")
"""A step folder a resume set aside (``checkpoint.set_aside``): kept for the user, never read."""


def step_tag(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"step_{step:08d}"


def rank_state_file(checkpoint: Path, rank: int) -> Path:
    return Path(checkpoint) / f"rank_{rank:05d}.pt"


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run folder (nothing is created by naming it)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def ds_config(self) -> Path:
        return self.root / "ds_config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def metrics_superseded(self) -> Path:
        return self.root / "metrics.superseded.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_tag(step)

    def staging(self, step: int) -> Path:
        return self.checkpoints / (step_tag(step) + PARTIAL_SUFFIX)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def negatives(self) -> Path:
        return self.root / "negatives"

    @property
    def refresh_config(self) -> Path:
        return self.root / "refresh_config.json"

    @property
    def refresher_log(self) -> Path:
        return self.root / "refresher.log"

    @property
    def refresh_metrics(self) -> Path:
        return self.root / "refresh_metrics.jsonl"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def finished(self) -> Path:
        return self.root / "FINISHED"
