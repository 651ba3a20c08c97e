"""The decoder visibility rules, materialised: which keys each query row may attend to.

These are the rules every attention backend implements: the reference path builds them as
B×L×L booleans, the chunked path a block of query rows at a time, and FlexAttention re-states
them as ``mask_mod`` functions (``retromae_ds.attention.flex``) that tests hold against these.

Two-stream visibility (RetroMAE enhanced decoding), for batch row ``b``, query position
``i`` and key position ``j``::

    visible = j == 0                                   # the sentence embedding, always
           or (j < length_b and j != i                 # real token, not the query itself
               and hash(seed_b, i, word_b[j]) >= ratio * 2**32)   # word kept for query i

Whole words are hidden together because the hash (``retromae_ds.base.hashing.hash3``) takes the
word id, not the position; each query row draws independently because the hash takes ``i``.

Window visibility (SEED-Encoder weak decoder): decoder position ``t`` holds token ``t-1``
(teacher forcing) and sees position 0 plus the positions holding the previous ``window``
tokens, ``t-window+1 .. t``, among the real tokens; ``window=None`` is full causal.

Packed rows (``retromae_ds.attention.packing``): both rules are evaluated per document, with
``i`` and ``t`` counted from the document's first position, its own seed, keys of its own
document only, and that first position (its sentence embedding) in place of position 0.
"""

from __future__ import annotations

import torch

from retromae_ds.attention.packing import Packing
from retromae_ds.base.hashing import (
    MASK32,
    as_int32_bits,
    keep_int32,
    mix32_int32_,
    two_stream_query_hash,
    two_stream_row_hash,
)


def query_hash(seeds: torch.Tensor, L: int, packing: Packing | None = None) -> torch.Tensor:
    """B×L int64: the hash prefix of every query position. Unpacked: row b's seed
    (``seeds`` B) and position i; packed: its document's seed (``seeds`` B×L,
    ``Packing.per_position``) and its position inside that document."""
    if packing is None:
        return two_stream_row_hash(seeds, L)
    return two_stream_query_hash(seeds, packing.position_ids_BL)


def two_stream_tables(
    word_ids_BL: torch.Tensor, seeds_B: torch.Tensor, packing: Packing | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The O(B·L) int32 tables the two-stream rule reads: (query hash prefix, word ids)."""
    L = word_ids_BL.shape[1]
    row = as_int32_bits(query_hash(seeds_B, L, packing))
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
    packing: Packing | None = None,
) -> torch.Tensor:
    """Visibility of query rows ``start:stop`` against all L keys: B×(stop-start)×L bool.

    Computes ``hash3(seed_b, i, word_b[j])`` as ``mix32(row_hash[b, i] ^ word_b[j])`` with
    the int32 form of the last mix: one int32 and one bool temporary of B×c×L. ``tables``
    (from :func:`two_stream_tables`) saves recomputing the O(B·L) inputs for every chunk.
    With ``packing``, ``seeds_B`` holds each position's document's seed (B×L) and
    ``lengths_B`` is unused.
    """
    B, L = word_ids_BL.shape
    device = word_ids_BL.device
    if tables is None:
        tables = two_stream_tables(word_ids_BL, seeds_B, packing)
    row, words = tables
    h = row[:, start:stop].view(B, -1, 1) ^ words.view(B, 1, L)
    visible = keep_int32(mix32_int32_(h), ratio)
    del h
    i = torch.arange(start, stop, device=device).view(1, -1, 1)
    j = torch.arange(L, device=device).view(1, 1, L)
    if packing is None:
        visible &= j < lengths_B.long().view(B, 1, 1)
    else:
        visible &= packing.same_document(start, stop)
    visible &= j != i
    visible |= j == _first_key(packing, start, stop, device)
    return visible


def _first_key(packing: Packing | None, start: int, stop: int, device: torch.device):
    """The key every query row sees: position 0, or the first position of the query's
    document in a packed row (B×c×1)."""
    if packing is None:
        return 0
    return packing.starts()[:, start:stop, None]


def two_stream_visible_dense(
    word_ids_BL: torch.Tensor,
    lengths_B: torch.Tensor,
    seeds_B: torch.Tensor,
    ratio: float,
    packing: Packing | None = None,
) -> torch.Tensor:
    """The reference B×L×L boolean visibility (True = may attend). Reference path only."""
    L = word_ids_BL.shape[1]
    return two_stream_visible_rows(word_ids_BL, lengths_B, seeds_B, ratio, 0, L, packing=packing)


def window_visible_rows(
    lengths_B: torch.Tensor,
    L: int,
    window: int | None,
    start: int,
    stop: int,
    packing: Packing | None = None,
) -> torch.Tensor:
    """Rows ``start:stop`` of :func:`window_visible_dense`: B×(stop-start)×L bool. With
    ``packing``, each document's own window (``lengths_B`` unused)."""
    device = lengths_B.device if packing is None else packing.doc_ids_BL.device
    t = torch.arange(start, stop, device=device).view(1, -1, 1)
    j = torch.arange(L, device=device).view(1, 1, L)
    if packing is None:
        real = j < lengths_B.long().view(-1, 1, 1)
    else:
        real = packing.same_document(start, stop)
    band = j <= t if window is None else (j <= t) & (j > t - window)
    return (j == _first_key(packing, start, stop, device)) | (real & band)


def window_visible_dense(
    lengths_B: torch.Tensor, L: int, window: int | None, packing: Packing | None = None
) -> torch.Tensor:
    """Reference B×L×L visibility of the SEED-Encoder decoder (True = may attend).

    Decoder position t holds token t-1 (teacher forcing) and predicts token t. It sees
    position 0 (the sentence embedding) and the positions holding the previous ``window``
    tokens, t-window+1 .. t; ``window=None`` is the full-causal "strong decoder" ablation.
    """
    return window_visible_rows(lengths_B, L, window, 0, L, packing)
