"""O(L·k) attention for the SEED-Encoder window rule: each query gathers its k+1 visible keys.

Query t sees key 0 (the sentence embedding) and keys t-k+1 .. t (clipped to real tokens), so
instead of an L×L score matrix this path gathers a [B, H, L, k+1, D] slice of K and V, scores
k+1 keys per query (key 0 by broadcasting) and lets autograd carry the backward pass. Time and memory grow linearly
with L; nothing of size L×L is allocated. Held against the reference path in the tests.
"""

from __future__ import annotations

import math

import torch

from retromae_ds.attention.specs import MaskSpec, WindowSpec


def window_attention(
    q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, spec: MaskSpec
) -> torch.Tensor:
    if not isinstance(spec, WindowSpec) or spec.window is None:
        raise ValueError(
            "the window backend computes only a finite SEED-Encoder window (WindowSpec)"
        )
    if spec.packing is not None:
        return _packed_window_attention(q_BHLD, k_BHLD, v_BHLD, spec)
    B, H, L, D = q_BHLD.shape
    k = spec.window
    device = q_BHLD.device
    t = torch.arange(L, device=device).view(L, 1)
    offsets = torch.arange(1, k + 1, device=device).view(1, k)
    band_LK = t - k + offsets  # key positions t-k+1 .. t
    keys_LK1 = torch.cat(
        [torch.zeros(L, 1, dtype=torch.long, device=device), band_LK.clamp_min(0)], dim=1
    )
    # slot 0 is always valid; band slots need 1 <= j (and j < length, per row below)
    band_ok_LK = band_LK >= 1
    lengths = spec.lengths_B.to(device).long().view(B, 1, 1)
    valid_BLK1 = torch.cat(
        [
            torch.ones(B, L, 1, dtype=torch.bool, device=device),
            band_ok_LK.unsqueeze(0) & (band_LK.unsqueeze(0) < lengths),
        ],
        dim=2,
    )
    # Key 0 (seen by every query) is scored and mixed by broadcasting rather than gathered:
    # the backward of a gather adds the L contributions one at a time in the input's dtype
    # (in bf16 key 0's gradient drifted 5-7x further from the fp32 truth than the reference
    # path's), while a broadcast's backward is a sum with a float accumulator.
    k_sel = k_BHLD[:, :, keys_LK1[:, 1:]]  # B, H, L, k, D
    v_sel = v_BHLD[:, :, keys_LK1[:, 1:]]
    scale = 1.0 / math.sqrt(D)
    score0 = torch.einsum("bhld,bhd->bhl", q_BHLD, k_BHLD[:, :, 0]).unsqueeze(-1) * scale
    scores = torch.cat([score0, torch.einsum("bhld,bhlkd->bhlk", q_BHLD, k_sel) * scale], dim=-1)
    scores = scores.masked_fill(~valid_BLK1.unsqueeze(1), float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q_BHLD.dtype)
    out0 = weights[..., :1] * v_BHLD[:, :, :1]
    return out0 + torch.einsum("bhlk,bhlkd->bhld", weights[..., 1:], v_sel)


def _packed_window_attention(
    q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, spec: WindowSpec
) -> torch.Tensor:
    """Packed rows: query t's k+1 keys are its document's first position and t-k+1 .. t
    (those after that first position), gathered per row since the first position differs
    from document to document. The first key is gathered too, not broadcast (see above: in
    bf16 its gradient sums in the input's dtype)."""
    B, H, L, D = q_BHLD.shape
    k = spec.window
    device = q_BHLD.device
    starts_BL = spec.packing.to(device).starts()
    t = torch.arange(L, device=device).view(1, L, 1)
    band_1LK = t - k + torch.arange(1, k + 1, device=device).view(1, 1, k)
    valid_BLK = band_1LK > starts_BL[:, :, None]  # inside the document, after its first key
    keys_BLK1 = torch.cat([starts_BL[:, :, None], band_1LK.clamp_min(0).expand(B, L, k)], dim=2)
    valid_BLK1 = torch.cat([torch.ones_like(valid_BLK[..., :1]), valid_BLK], dim=2)
    index = keys_BLK1.reshape(B, 1, L * (k + 1), 1).expand(B, H, L * (k + 1), D)
    k_sel = k_BHLD.gather(2, index).view(B, H, L, k + 1, D)
    v_sel = v_BHLD.gather(2, index).view(B, H, L, k + 1, D)
    scores = torch.einsum("bhld,bhlkd->bhlk", q_BHLD, k_sel) / math.sqrt(D)
    scores = scores.masked_fill(~valid_BLK1.unsqueeze(1), float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q_BHLD.dtype)
    return torch.einsum("bhlk,bhlkd->bhld", weights, v_sel)
