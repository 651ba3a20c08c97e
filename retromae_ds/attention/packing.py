"""Packed rows: several documents share one row of the batch, and nothing crosses between them.

A packed batch (``PretrainCollator(pack=True)``) lays its documents end to end in rows of at
most ``max_length`` positions instead of one document per row padded to the longest. Two
O(B·L) tensors say where each document lies:

- ``doc_ids_BL``: the document of every position (its index in the batch), ``-1`` at padding;
- ``position_ids_BL``: the position inside its document, 0 at the document's [CLS] (and 0 at
  padding).

Every rule of this package becomes the rule of each document alone: the encoder attends
within its document (``encoder_mask``), the decoders' position-specific visibility is
evaluated in the document's own positions and seed, and the key that every query of an
unpacked row sees (position 0, the sentence embedding) becomes the document's first position
(``starts``). A padding query sees itself only, so no softmax row is empty; its output is
never a prediction. ``tests/test_packing.py`` holds packed rows against each document alone,
rule by rule and loss by loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Where the documents of a packed batch lie (see the module doc)."""

    doc_ids_BL: torch.Tensor
    """The document of each position (an index into the batch's documents), -1 at padding."""
    position_ids_BL: torch.Tensor
    """Each position's offset from its document's first position (0 at padding)."""

    def to(self, device: torch.device | str) -> Packing:
        return Packing(self.doc_ids_BL.to(device), self.position_ids_BL.to(device))

    def starts(self) -> torch.Tensor:
        """B×L: the position of each position's document's first token ([CLS]), the key every
        query of that document sees; a padding position's own position."""
        L = self.position_ids_BL.shape[1]
        i = torch.arange(L, device=self.position_ids_BL.device).view(1, L)
        return i - self.position_ids_BL.long()

    def is_first(self) -> torch.Tensor:
        """B×L bool: the positions holding a document's [CLS]."""
        return (self.position_ids_BL == 0) & (self.doc_ids_BL >= 0)

    def same_document(self, start: int, stop: int) -> torch.Tensor:
        """B×(stop-start)×L bool: query rows ``start:stop`` and keys of one (real) document."""
        docs = self.doc_ids_BL.long()
        keys = docs[:, None, :]
        return (docs[:, start:stop, None] == keys) & (keys >= 0)

    def per_position(self, per_document: torch.Tensor) -> torch.Tensor:
        """B×L: each position's value of a per-document tensor (a padding position gets
        document 0's; no rule reads it there)."""
        return per_document[self.doc_ids_BL.long().clamp_min(0)]

    def encoder_mask(self) -> torch.Tensor:
        """The encoder's B×1×L×L boolean mask (True: attend): keys of the query's own
        document; a padding query its own position."""
        L = self.doc_ids_BL.shape[1]
        visible = self.same_document(0, L)
        visible |= torch.eye(L, dtype=torch.bool, device=visible.device)
        return visible[:, None]


def packing_of(batch: dict[str, torch.Tensor]) -> Packing | None:
    """The batch's ``Packing`` when the collator packed it (``doc_ids``), else None."""
    if "doc_ids" not in batch:
        return None
    return Packing(batch["doc_ids"], batch["position_ids"])
