"""A tiny vocabulary, collated batches over it and a functional layer norm for the loss tests.

Shared by ``test_model`` (RetroMAE) and ``test_seed_encoder`` (SEED-Encoder), whose
re-implementations of the papers' formulas run on batches made by the real collator.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from retromae_ds.data.collate import MaskingConfig, PretrainCollator
from retromae_ds.tokens import SpecialIds

SPECIAL = SpecialIds(cls=2, sep=3, pad=0, mask=4, all=(0, 1, 2, 3, 4), vocab_size=60)


def batch_of(rows: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """A collated batch of random texts with ``rows`` tokens each (about 60 % word starts)."""
    rng = np.random.default_rng(seed)
    items = []
    for index, n in enumerate(rows):
        ids = rng.integers(5, SPECIAL.vocab_size, n).astype(np.int32)
        starts = (rng.random(n) < 0.6).astype(np.uint8)
        items.append((index, ids, starts))
    return PretrainCollator(SPECIAL, MaskingConfig(), 64)(items)


def layer_norm(x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    """``ln(x)`` spelled out with ``F.layer_norm``."""
    return F.layer_norm(x, x.shape[-1:], ln.weight, ln.bias, ln.eps)
