"""Token-level constants every layer shares: the special-token ids of a tokenizer and the
label value that losses ignore.

Defined here, below data, modeling and ance, so that each of them can import these without
reaching into another's modules (the collator, the refresher and the models all need them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IGNORE = -100
"""Label of positions that are no prediction target (PyTorch's cross-entropy ``ignore_index``)."""


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    pad: int
    mask: int
    all: tuple[int, ...]
    vocab_size: int

    @classmethod
    def from_fingerprint(cls, fp: dict[str, Any]) -> SpecialIds:
        ids = fp["special_token_ids"]
        cls_id = ids.get("cls", ids.get("bos"))
        sep_id = ids.get("sep", ids.get("eos"))
        missing = [
            n
            for n, v in (
                ("cls", cls_id),
                ("sep", sep_id),
                ("pad", ids.get("pad")),
                ("mask", ids.get("mask")),
            )
            if v is None
        ]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens needed for pre-training: {missing}")
        return cls(
            cls_id,
            sep_id,
            ids["pad"],
            ids["mask"],
            tuple(sorted(set(ids.values()))),
            fp["vocab_size"],
        )
