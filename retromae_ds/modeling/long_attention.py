"""Encoder self-attention at long L without an L×L padding mask.

transformers' SDPA path builds a padded batch's bidirectional mask as a real [B, 1, L, L]
boolean tensor, which ``scaled_dot_product_attention`` may convert again (at L = 8,192:
64 MiB per sample as bool, 256 MiB as fp32) and the fused kernels then read. The padding mask
is the same for every query row, so a [B, 1, 1, L] mask says the same thing, broadcasts inside
the kernels (CPU flash, CUDA memory-efficient / cuDNN) and costs B×L.
``use_broadcast_mask(model)`` switches a transformers model from ``sdpa`` to
``sdpa_broadcast_mask``, registered with transformers' attention and mask interfaces: the
mask of a plain bidirectional model is built for one query row (transformers' own
``sdpa_mask``, so padding and offsets mean what they mean there), and a [B, H, L, L] view that
is constant along the query axis is cut to one row; outputs are those of ``sdpa``. Masks that
vary along the query axis (causal, or ones combined with other mask functions) are built and
passed as before.

The fused kernels also need attention dropout 0 on CPU (with dropout PyTorch falls back to
the math path, which keeps the L×L probabilities for the backward pass: 7.6 GB for a
two-layer 128-wide model at 8,192 tokens, against 0.45 GB without);
``EncoderConfig.attention_dropout`` sets it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAME = "sdpa_broadcast_mask"
_registered = False


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, broadcast_padding_mask(attention_mask), **kwargs
    )


def broadcast_padding_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``mask[:, :, :1]`` when ``mask`` is a [B, H, L, L] view constant along the query axis
    (stride 0 there: an expanded padding mask), else ``mask`` itself."""
    if mask is None or mask.dim() != 4 or mask.shape[2] <= 1 or mask.stride(2) != 0:
        return mask
    return mask[:, :, :1]


def register() -> bool:
    """Make ``sdpa_broadcast_mask`` known to transformers (idempotent); False when this
    transformers has no attention / mask interfaces to register with (before 4.53)."""
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import (
            AttentionMaskInterface,
            bidirectional_mask_function,
            sdpa_mask,
        )
    except ImportError:
        return False

    def mask(*, q_length: int, mask_function: Any, **kwargs: Any) -> torch.Tensor | None:
        # a bidirectional mask (padding alone) is the same for every query: build one row
        if mask_function is bidirectional_mask_function:
            q_length = 1
        return sdpa_mask(q_length=q_length, mask_function=mask_function, **kwargs)

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, mask)
    _registered = True
    return True


def use_broadcast_mask(model: nn.Module) -> bool:
    """Switch ``model`` from ``sdpa`` to ``sdpa_broadcast_mask``; False (unchanged) when it
    uses another implementation (eager, flash_attention_2, flex_attention, ...) or when
    transformers is too old to register it with (the model keeps ``sdpa`` and its full mask,
    a memory cost at long L only)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not register() or not hasattr(model, "set_attn_implementation"):
        return False
    model.set_attn_implementation(NAME)
    return True
