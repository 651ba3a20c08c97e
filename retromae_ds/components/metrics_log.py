"""Rank-0 training log: a progress bar, metrics as JSONL and TensorBoard in the run folder.

A resumed run never repeats a step in ``metrics.jsonl``: rows that a stopped run logged after
its last checkpoint (and so are logged again by the run that resumes from it) are moved to
``metrics.superseded.jsonl`` before the first new row, and TensorBoard's events past the
checkpoint are purged the same way.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from retromae_ds.base.errors import disk_full_error
from retromae_ds.base.fsutil import atomic_write_text
from retromae_ds.components.layout import RunLayout


def read_rows(layout: RunLayout) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of a run's ``metrics.jsonl`` (none if it has none yet), split into training
    rows (those with a ``loss``) and evaluation rows (those with an ``eval/`` measure)."""
    path = layout.metrics
    if not path.exists():
        return [], []
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return train, evals


def supersede_rows(layout: RunLayout, step: int) -> int:
    """Move the rows of ``metrics.jsonl`` that a run starting at ``step`` logs again (every
    row after ``step``; every row when it starts afresh at 0), and any unreadable line (a
    crash mid-write), to ``metrics.superseded.jsonl``; returns how many lines moved."""
    if not layout.metrics.is_file():
        return 0
    kept, moved = [], []
    for line in layout.metrics.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            moved.append(line)
            continue
        (kept if step > 0 and row_step <= step else moved).append(line)
    if moved:
        with open(layout.metrics_superseded, "a", encoding="utf-8") as f:
            f.write("".join(f"{line}\n" for line in moved))
        atomic_write_text(layout.metrics, "".join(f"{line}\n" for line in kept))
    return len(moved)


class MetricsLogger:
    def __init__(
        self,
        layout: RunLayout,
        *,
        enabled: bool,
        progress: bool,
        total: int,
        initial: int = 0,
    ) -> None:
        self.enabled = enabled
        self.path = layout.metrics
        self._bar = None
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        layout.root.mkdir(parents=True, exist_ok=True)
        moved = supersede_rows(layout, initial)
        if moved:
            self.note(
                f"metrics: {moved} row(s) logged after step {initial} by a run that stopped "
                f"before checkpointing them moved to {layout.metrics_superseded.name}"
            )
        self._jsonl = open(layout.metrics, "a", encoding="utf-8")  # noqa: SIM115
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops the events of those rows too (TensorBoard's own mechanism)
            self._tb = SummaryWriter(
                str(layout.tensorboard), purge_step=initial + 1 if initial else None
            )
        except ImportError:  # tensorboard is a dependency; keep training if it is absent
            self._tb = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def log(self, row: dict[str, Any], scope: str = "train") -> None:
        """One JSONL row; its numbers also go to TensorBoard as ``SCOPE/KEY`` (a key that
        already has a ``/``, e.g. ``eval/scifact/cls/ndcg@10``, is its own tag)."""
        if not self.enabled:
            return
        try:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        except OSError as exc:
            full = disk_full_error(exc, self.path.parent, f"{self.path.name} (step {row['step']})")
            raise (full or exc) from exc
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    tag = key if "/" in key else f"{scope}/{key}"
                    self._tb.add_scalar(tag, value, row["step"])
            self._tb.flush()
        if self._bar is not None and "loss" in row:
            self._bar.set_postfix_str(
                f"loss {row['loss']:.3f}, {row['tokens_per_s']:,.0f} tok/s, lr {row['lr']:.2e}",
                refresh=False,
            )

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr, flush=True)

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        """Close every sink; one that cannot flush (a full disk) is reported, not raised, so
        the error that ended the run stays the one the user sees."""
        for name in ("_bar", "_tb", "_jsonl"):
            value = getattr(self, name)
            setattr(self, name, None)
            if value is None:
                continue
            try:
                value.close()
            except (OSError, RuntimeError) as exc:
                self.note(f"metrics: closing {name.strip('_')} failed: {exc}")
