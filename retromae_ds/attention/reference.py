"""The reference attention path: dense boolean mask + SDPA. The oracle for fast paths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retromae_ds.attention.specs import MaskSpec


def reference_attention(
    q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, spec: MaskSpec
) -> torch.Tensor:
    visible_BLL = spec.dense(k_BHLD.shape[2]).to(q_BHLD.device)
    return F.scaled_dot_product_attention(
        q_BHLD, k_BHLD, v_BHLD, attn_mask=visible_BLL[:, None, :, :]
    )
