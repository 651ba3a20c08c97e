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


def two_stream_row_hash(seeds_B: torch.Tensor, L: int) -> torch.Tensor:
    """The per-(row, query) prefix of ``hash3(seed_b, i, word)``: B×L int64, O(B·L) work.

    ``hash3(a, b, c) == mix32(two_stream_row_hash(a)[i] ^ c)``, so a kernel needs one mix per
    (query, key) pair once this small table is computed.
    """
    i = torch.arange(L, device=seeds_B.device).view(1, L)
    h = mix32((seeds_B.long().view(-1, 1) ^ _GOLDEN) & MASK32)
    return mix32((h ^ i) & MASK32)


def _as_int32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) → int32 tensors with the same 32 bits."""
    x = x.long()
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def mix32_int32_(x: torch.Tensor) -> torch.Tensor:
    """``mix32`` in place on an int32 tensor holding uint32 bit patterns.

    Four to six times faster than the int64 form on CPU and half the memory: the
    multiplications wrap modulo 2**32 (two's complement), and logical shifts are arithmetic
    shifts with the sign-extended bits masked off. Bit-for-bit equal to ``mix32`` (tested).
    """
    x ^= (x >> 16) & 0xFFFF
    x *= _C1 - 2**32 if _C1 >= 2**31 else _C1
    x ^= (x >> 15) & 0x1FFFF
    x *= _C2 - 2**32 if _C2 >= 2**31 else _C2
    x ^= (x >> 16) & 0xFFFF
    return x


def keep_int32(h: torch.Tensor, ratio: float) -> torch.Tensor:
    """``h >= threshold(ratio)`` for int32 tensors holding uint32 bit patterns."""
    cut = threshold(ratio)
    if cut >= 2**32:
        return torch.zeros(h.shape, dtype=torch.bool, device=h.device)
    # flipping the sign bit maps unsigned order onto signed order
    return (h ^ -(2**31)) >= cut - 2**31


def two_stream_tables(
    word_ids_BL: torch.Tensor, seeds_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The O(B·L) int32 tables the two-stream rule reads: (row hash prefix, word ids)."""
    L = word_ids_BL.shape[1]
    row = _as_int32_bits(two_stream_row_hash(seeds_B, L))
    words = _as_int32_bits(word_ids_BL.long().clamp_min(0) & MASK32)
    return row, words


def two_stream_visible_rows(
    word_ids_BL: torch.Tensor,
    lengths_B: torch.Tensor,
    seeds_B: torch.Tensor,
    ratio: float,
    start: int,
    stop: int,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Visibility of query rows ``start:stop`` against all L keys: B×(stop-start)×L bool.

    Computes ``hash3(seed_b, i, word_b[j])`` as ``mix32(row_hash[b, i] ^ word_b[j])`` with
    the int32 form of the last mix: one int32 and one bool temporary of B×c×L. ``tables``
    (from :func:`two_stream_tables`) saves recomputing the O(B·L) inputs for every chunk.
    """
    B, L = word_ids_BL.shape
    device = word_ids_BL.device
    row, words = tables if tables is not None else two_stream_tables(word_ids_BL, seeds_B)
    h = row[:, start:stop].view(B, -1, 1) ^ words.view(B, 1, L)
    visible = keep_int32(mix32_int32_(h), ratio)
    del h
    i = torch.arange(start, stop, device=device).view(1, -1, 1)
    j = torch.arange(L, device=device).view(1, 1, L)
    visible &= j < lengths_B.long().view(B, 1, 1)
    visible &= j != i
    visible |= j == 0
    return visible


def two_stream_visible_dense(
    word_ids_BL: torch.Tensor, lengths_B: torch.Tensor, seeds_B: torch.Tensor, ratio: float
) -> torch.Tensor:
    """The reference B×L×L boolean visibility (True = may attend). Reference path only."""
    L = word_ids_BL.shape[1]
    return two_stream_visible_rows(word_ids_BL, lengths_B, seeds_B, ratio, 0, L)


def window_visible_rows(
    lengths_B: torch.Tensor, L: int, window: int | None, start: int, stop: int
) -> torch.Tensor:
    """Rows ``start:stop`` of :func:`window_visible_dense`: B×(stop-start)×L bool."""
    device = lengths_B.device
    t = torch.arange(start, stop, device=device).view(1, -1, 1)
    j = torch.arange(L, device=device).view(1, 1, L)
    real = j < lengths_B.long().view(-1, 1, 1)
    band = j <= t if window is None else (j <= t) & (j > t - window)
    return (j == 0) | (real & band)


def window_visible_dense(lengths_B: torch.Tensor, L: int, window: int | None) -> torch.Tensor:
    """Reference B×L×L visibility of the SEED-Encoder decoder (True = may attend).

    Decoder position t holds token t-1 (teacher forcing) and predicts token t. It sees
    position 0 (the sentence embedding) and the positions holding the previous ``window``
    tokens, t-window+1 .. t; ``window=None`` is the full-causal "strong decoder" ablation.
    """
    return window_visible_rows(lengths_B, L, window, 0, L)
