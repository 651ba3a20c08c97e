"""Counter-based hashing and the decoder visibility rules, as pure functions.

Every random choice of the pre-training objectives is a hash of integers (a row's seed, a
query position, a word id) rather than a draw from a stateful generator. That makes masks
independent of DataLoader worker count and resumable, and lets a fused attention kernel
*recompute* a visibility bit from (seed, i, word_j) instead of reading a stored L×L mask.

The hash is 32-bit ``lowbias32`` (Chris Wellons' integer hash), evaluated in int64 with the
32-bit multiplications split into 16-bit halves so that no intermediate exceeds 2**48: the
same expression runs in numpy, in torch on any device, inside a FlexAttention ``mask_mod``,
and in Triton.

Two-stream visibility (RetroMAE enhanced decoding), for batch row ``b``, query position
``i`` and key position ``j``::

    visible = j == 0                                   # the sentence embedding, always
           or (j < length_b and j != i                 # real token, not the query itself
               and hash(seed_b, i, word_b[j]) >= ratio * 2**32)   # word kept for query i

Whole words are hidden together because the hash takes the word id, not the position; each
query row draws independently because the hash takes ``i``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2**32 for 0 <= x < 2**32 without exceeding int64 range."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: Any) -> Any:
    """lowbias32 on int64 arrays/tensors (or Python ints) holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def hash3(a: Any, b: Any, c: Any) -> Any:
    """A well-mixed 32-bit hash of three non-negative 32-bit integers (broadcasting)."""
    h = mix32((a ^ _GOLDEN) & MASK32)
    h = mix32((h ^ (b & MASK32)) & MASK32)
    return mix32((h ^ (c & MASK32)) & MASK32)


def threshold(ratio: float) -> int:
    """Hash values below this are 'hidden' with probability ``ratio``."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    return min(int(round(ratio * 2**32)), 2**32)


def row_seeds(seed: int, epoch: int, indices: np.ndarray, stream: int) -> np.ndarray:
    """Per-sample 32-bit seeds from (run seed, epoch, global sample index, stream)."""
    idx = np.asarray(indices, dtype=np.int64)
    base = hash3(np.int64(seed & MASK32), np.int64(epoch & MASK32), np.int64(stream & MASK32))
    return hash3(np.full_like(idx, base), idx & MASK32, (idx >> 32) & MASK32)


def two_stream_visible_dense(
    word_ids_BL: torch.Tensor, lengths_B: torch.Tensor, seeds_B: torch.Tensor, ratio: float
) -> torch.Tensor:
    """The reference B×L×L boolean visibility (True = may attend). Reference path only."""
    B, L = word_ids_BL.shape
    device = word_ids_BL.device
    i = torch.arange(L, device=device).view(1, L, 1)
    j = torch.arange(L, device=device).view(1, 1, L)
    word_j = word_ids_BL.long().clamp_min(0).view(B, 1, L)
    h = hash3(seeds_B.long().view(B, 1, 1), i, word_j)
    keep = h >= threshold(ratio)
    real = j < lengths_B.long().view(B, 1, 1)
    return (j == 0) | (real & (j != i) & keep)


def window_visible_dense(lengths_B: torch.Tensor, L: int, window: int | None) -> torch.Tensor:
    """Reference B×L×L visibility of the SEED-Encoder decoder (True = may attend).

    Decoder position t holds token t-1 (teacher forcing) and predicts token t. It sees
    position 0 (the sentence embedding) and the positions holding the previous ``window``
    tokens, t-window+1 .. t; ``window=None`` is the full-causal "strong decoder" ablation.
    """
    device = lengths_B.device
    t = torch.arange(L, device=device).view(1, L, 1)
    j = torch.arange(L, device=device).view(1, 1, L)
    real = j < lengths_B.long().view(-1, 1, 1)
    band = j <= t if window is None else (j <= t) & (j > t - window)
    return (j == 0) | (real & band)
