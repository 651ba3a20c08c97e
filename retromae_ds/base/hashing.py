"""Counter-based hashing: every random choice of the pre-training objectives, as pure functions.

Every random choice (which tokens the encoder masks, which words a decoder query row may not
see) is a hash of integers (a row's seed, a query position, a word id) rather than a draw from
a stateful generator. Counter-based randomness makes masks independent of DataLoader worker
count and batch composition, makes a resumed run draw exactly what the interrupted one would
have, and lets a fused attention kernel *recompute* a visibility bit from (seed, i, word_j)
instead of reading a stored L×L mask. The collator (``retromae_ds.data.collate``) and the
attention rules (``retromae_ds.attention.rules``, ``retromae_ds.attention.flex``) share these
primitives, which is what keeps their masks identical bit for bit.

The hash is 32-bit ``lowbias32`` (Chris Wellons' integer hash), evaluated in int64 with the
32-bit multiplications split into 16-bit halves so that no intermediate exceeds 2**48: the
same expression runs in numpy, in torch on any device, inside a FlexAttention ``mask_mod``,
and in Triton. ``mix32_int32_`` is the same function on int32 bit patterns with wrapping
multiplies, which the materialised (reference and chunked) visibility rows use.
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
    return two_stream_query_hash(seeds_B.long().view(-1, 1), i)


def two_stream_query_hash(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``two_stream_row_hash`` for any (seed, query position) pairs, elementwise with
    broadcasting: a packed row holds several documents, each with its own seed and its
    positions counted from its own [CLS]."""
    h = mix32((seeds.long() ^ _GOLDEN) & MASK32)
    return mix32((h ^ (positions.long() & MASK32)) & MASK32)


def as_int32_bits(x: torch.Tensor) -> torch.Tensor:
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
