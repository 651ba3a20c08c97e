"""Mask specifications: the *rules* deciding which keys a query sees, as small tensors.

A spec carries O(B·L) data (word ids, lengths, seeds); backends either materialise the rule
(reference, chunked: :mod:`retromae_ds.attention.rules`) or evaluate it per block inside a
kernel (FlexAttention).

A spec is made per batch and shared by every query chunk and every decoder layer of that
batch, so what the backends derive from it once per batch is cached on the spec, in declared
fields that are neither constructor arguments nor part of ``repr``/``==``: the two-stream
tables (:meth:`TwoStreamSpec.tables`) and the FlexAttention block masks per (length, device)
(:meth:`MaskSpec.block_mask`). The caches live and die with the spec, i.e. with the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from retromae_ds.attention.packing import Packing
from retromae_ds.attention.rules import (
    two_stream_tables,
    two_stream_visible_rows,
    window_visible_rows,
)


@dataclass
class MaskSpec:
    """Base class: ``rows(start, stop, L)`` returns the visibility of query rows
    ``start:stop`` against L keys, B×(stop-start)×L bool (True = attend); ``dense(L)`` is all
    rows, for the reference path."""

    _block_masks: dict[tuple[int, str], Any] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Block masks built by :meth:`block_mask`, by (L, device)."""

    def rows(self, start: int, stop: int, L: int) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def dense(self, L: int) -> torch.Tensor:
        return self.rows(0, L, L)

    def block_mask(
        self, L: int, device: torch.device, build: Callable[[MaskSpec, int, torch.device], Any]
    ) -> Any:
        """``build(self, L, device)`` once per (L, device); later calls (the other layers of
        the batch) get the same block mask."""
        key = (L, str(device))
        if key not in self._block_masks:
            self._block_masks[key] = build(self, L, device)
        return self._block_masks[key]


@dataclass
class TwoStreamSpec(MaskSpec):
    """RetroMAE enhanced decoding: see :mod:`retromae_ds.attention.rules` for the exact rule."""

    word_ids_BL: torch.Tensor
    lengths_B: torch.Tensor
    seeds_B: torch.Tensor
    ratio: float
    packing: Packing | None = None
    """Packed rows: where each document lies (``seeds_B`` then holds each position's
    document's seed, B×L: ``Packing.per_position``; ``lengths_B`` is unused). Per position,
    not per document, so that a compiled decoder sees no dimension of the document count
    (which dynamo would tie to the row count whenever the two happen to be equal)."""
    _tables: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """The O(B·L) tables of :meth:`tables`, once computed."""

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``rules.two_stream_tables`` of this batch, computed on first use and kept."""
        if self._tables is None:
            self._tables = two_stream_tables(self.word_ids_BL, self.seeds_B, self.packing)
        return self._tables

    def rows(self, start: int, stop: int, L: int) -> torch.Tensor:
        if self.word_ids_BL.shape[1] != L:
            raise ValueError(
                f"spec covers {self.word_ids_BL.shape[1]} positions, attention has {L}"
            )
        return two_stream_visible_rows(
            self.word_ids_BL,
            self.lengths_B,
            self.seeds_B,
            self.ratio,
            start,
            stop,
            self.tables(),
            self.packing,
        )


@dataclass
class WindowSpec(MaskSpec):
    """SEED-Encoder weak decoder: position 0 plus the previous ``window`` token positions
    (``None``: full causal). See ``retromae_ds.attention.rules.window_visible_dense``."""

    lengths_B: torch.Tensor
    window: int | None
    packing: Packing | None = None
    """Packed rows: where each document lies (``lengths_B`` is then unused)."""

    def rows(self, start: int, stop: int, L: int) -> torch.Tensor:
        return window_visible_rows(self.lengths_B, L, self.window, start, stop, self.packing)
