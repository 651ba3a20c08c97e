"""A tiny vocabulary, collated batches over it and a functional layer norm for the loss tests;
a small transformers config and a probe of the largest tensor a computation creates.

Shared by ``test_model`` (RetroMAE) and ``test_seed_encoder`` (SEED-Encoder), whose
re-implementations of the papers' formulas run on batches made by the real collator.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.data.collate import MaskingConfig, PretrainCollator

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


NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def small_config(vocab_size: int = 100, hidden: int = 32, layers: int = 2, **more) -> dict:
    """Keyword arguments of a small BERT / RoBERTa / XLM-R config: ``layers`` layers of width
    ``hidden``, 2 heads, an FFN twice as wide, and ``more`` (positions, dropout, pad id)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        **more,
    )


SMALL_CONFIG = small_config(**NO_DROPOUT)
"""Keyword arguments of a small BERT / RoBERTa / XLM-R config without dropout."""


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates while active: its elements, or with
    ``storage=True`` the elements of the storage it holds (a stride-0 view counts as small)."""

    def __init__(self, storage: bool = False):
        super().__init__()
        self.storage, self.largest = storage, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                size = (
                    t.untyped_storage().nbytes() // t.element_size() if self.storage else t.numel()
                )
                self.largest = max(self.largest, size)
        return out


def tiny_bert_dir(out, tokenizer_dir):
    """A random small BERT (``small_config``, 64 positions, seed 0) with the tokenizer of
    ``tokenizer_dir``, saved as a Hugging Face folder at ``out``: the encoder the eval tests
    score."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = BertConfig(**small_config(len(tokenizer), max_position_embeddings=64))
    BertModel(config).save_pretrained(out)
    return out
