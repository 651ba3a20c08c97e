"""Mask specifications: the *rules* deciding which keys a query sees, as small tensors.

A spec carries O(B·L) data (word ids, lengths, seeds); backends either materialise the rule
(reference) or evaluate it per block inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retromae_ds.masks import two_stream_tables, two_stream_visible_rows, window_visible_rows


@dataclass
class MaskSpec:
    """Base class: ``rows(start, stop, L)`` returns the visibility of query rows
    ``start:stop`` against L keys, B×(stop-start)×L bool (True = attend); ``dense(L)`` is all
    rows, for the reference path."""

    def rows(self, start: int, stop: int, L: int) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def dense(self, L: int) -> torch.Tensor:
        return self.rows(0, L, L)


@dataclass
class TwoStreamSpec(MaskSpec):
    """RetroMAE enhanced decoding: see ``retromae_ds.masks`` for the exact rule."""

    word_ids_BL: torch.Tensor
    lengths_B: torch.Tensor
    seeds_B: torch.Tensor
    ratio: float

    def rows(self, start: int, stop: int, L: int) -> torch.Tensor:
        if self.word_ids_BL.shape[1] != L:
            raise ValueError(
                f"spec covers {self.word_ids_BL.shape[1]} positions, attention has {L}"
            )
        tables = self.__dict__.get("_tables")
        if tables is None:  # computed once per spec (per batch), shared by chunks and layers
            tables = self.__dict__["_tables"] = two_stream_tables(self.word_ids_BL, self.seeds_B)
        return two_stream_visible_rows(
            self.word_ids_BL, self.lengths_B, self.seeds_B, self.ratio, start, stop, tables
        )


@dataclass
class WindowSpec(MaskSpec):
    """SEED-Encoder weak decoder: position 0 plus the previous ``window`` token positions
    (``None``: full causal). See ``retromae_ds.masks.window_visible_dense``."""

    lengths_B: torch.Tensor
    window: int | None

    def rows(self, start: int, stop: int, L: int) -> torch.Tensor:
        return window_visible_rows(self.lengths_B, L, self.window, start, stop)
