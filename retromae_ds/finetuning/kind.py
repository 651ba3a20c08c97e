"""What a kind of fine-tuned model hands the fine-tuning job (``finetune --model.kind``).

The job (``retromae_ds.finetune``) looks the kind up once by name (``MODEL_KINDS`` there) and
composes what it returns with the shared pieces: the BEIR data and its negatives versions, the
``BatchBuilder`` that draws each query's positive and hard negatives, the one ``Trainer``. A
kind says which settings it refuses (at config time), builds its model, turns the builder's
batches into its own, writes its Hugging Face folders at each checkpoint, and says what a
step counts; the Trainer never learns its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


@dataclass
class ModelPieces:
    """One kind's model and the parts of the job that depend on it."""

    model: nn.Module
    batches: Callable[[Callable[..., Batch]], Callable[..., Batch]]
    """The ``BatchBuilder`` (``finetuning.batches``) -> what builds this model's batches
    (same arguments: queries, epoch, negatives version), still a pure function of them."""
    write_models: Callable[[dict[str, torch.Tensor], Path], None]
    """The consolidated state dict -> Hugging Face folders in a checkpoint's staging folder."""
    counts: Callable[[Batch], dict[str, torch.Tensor | int]]
    """Per micro-batch counts (``training.loop.Hooks.counts``)."""
    marker: dict[str, Any]
    """What each checkpoint's completion record says of the model (``objective``:
    ``contrastive`` for every fine-tuned kind, which tells them from pre-training runs)."""
    note: str
    """One log line: the model's settings as resolved."""


@dataclass(frozen=True)
class ModelKind:
    """A kind of fine-tuned model: ``check(cfg)`` refuses, in one line, settings that make no
    sense for it (the ``FinetuneConfig``, at config time); ``build(cfg, init_dir,
    tokenizer_fingerprint)`` makes its pieces."""

    check: Callable[[Any], None]
    build: Callable[[Any, Path, dict[str, Any]], ModelPieces]
