"""Which attention-mask form the installed transformers takes, decided once per model class.

``encoder.encode`` hands the encoder body a ready padding mask (and packed rows their
document mask) so that transformers reads nothing back from the device to build one. Where
the body takes a 4-D mask (transformers 5; 5.25 checked) that mask is [B, 1, 1, L] boolean
(packed: [B, 1, L, L]). transformers 4 (4.45.0, the declared floor, 4.46.3 and 4.57.6
checked) refuses a 4-D mask and turns a 3-D one ([B, 1, L]; packed: [B, L, L]) into its
additive 4-D mask without a read. Either way the outputs equal that version's own 2-D path
(tests/test_guard_eval_round4.py, run at the floor by scripts/ci_floor.sh).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def takes_4d_mask(model: nn.Module) -> bool:
    """Whether the installed transformers' encoder body of ``model``'s class takes a 4-D
    attention mask (``padding_mask_4d``, the packed rows' B×1×L×L). Decided once per class, by
    a forward of a one-layer throwaway model of it (the torch seed untouched): transformers
    4 turns only a 2-D or 3-D mask into its own 4-D one, and a 4-D one is an error there ("Wrong shape for input_ids ... or attention_mask"). ``encoder.build_encoder``
    and ``load.load_pretrained`` ask when they build a model; ``encoder.encode`` at each call
    (cached)."""
    body = getattr(model, "base_model", model)
    return _takes_4d_mask(type(body), type(body.config))


@functools.cache
def _takes_4d_mask(body_class: type, config_class: type) -> bool:
    from retromae_ds.hf.util import quiet_transformers

    # RoBERTa-family positions start after their padding id (1): 2 tokens fit in 8 positions
    config = config_class(vocab_size=8, hidden_size=4, num_hidden_layers=1,
                          num_attention_heads=1, intermediate_size=4, max_position_embeddings=8)  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.no_grad(), quiet_transformers():
        probe = body_class(config).eval()
        try:
            probe(input_ids=torch.full((1, 2), 3), attention_mask=torch.ones(1, 1, 1, 2).bool())
        except ValueError:
            return False
    return True
