"""The decoder visibility rules, materialised: which keys each query row may attend to.

These are the rules every attention backend implements: the reference path builds them as
B×L×L booleans, the chunked path a block of query rows at a time, and FlexAttention re-states
them as ``mask_mod`` functions (``retromae_ds.attention.flex``) that tests hold against these.

Two-stream visibility (RetroMAE enhanced decoding), for batch row ``b``, query position
``i`` and key position ``j``::

    visible = j == 0                                   # the sentence embedding, always
           or (j < length_b and j != i                 # real token, not the query itself
               and hash(seed_b, i, word_b[j]) >= ratio * 2**32)   # word kept for query i

Whole words are hidden together because the hash (``retromae_ds.hashing.hash3``) takes the
word id, not the position; each query row draws independently because the hash takes ``i``.

Window visibility (SEED-Encoder weak decoder): decoder position ``t`` holds token ``t-1``
(teacher forcing) and sees position 0 plus the positions holding the previous ``window``
tokens, ``t-window+1 .. t``, among the real tokens; ``window=None`` is full causal.
"""

from __future__ import annotations

import torch

from retromae_ds.hashing import MASK32, as_int32_bits, keep_int32, mix32_int32_, two_stream_row_hash


def two_stream_tables(
    word_ids_BL: torch.Tensor, seeds_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The O(B·L) int32 tables the two-stream rule reads: (row hash prefix, word ids)."""
    L = word_ids_BL.shape[1]
    row = as_int32_bits(two_stream_row_hash(seeds_B, L))
    words = as_int32_bits(word_ids_BL.long().clamp_min(0) & MASK32)
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
