"""Rank-0 training log: a progress bar, metrics as JSONL and TensorBoard in the run folder."""

from __future__ import annotations

import json
import sys
from typing import Any

from retromae_ds.layout import RunLayout


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
        self._bar = None
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        layout.root.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(layout.metrics, "a", encoding="utf-8")  # noqa: SIM115
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(layout.tensorboard))
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
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
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
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
