"""Memory-bounded attention for any mask rule: query chunks, visibility recomputed per chunk.

The FlashAttention algorithm written with PyTorch ops, for devices where no fused kernel
(FlexAttention's backward, Triton) is available, such as CPU. The forward pass walks the
queries in chunks of ``c`` rows, evaluates the rule for those rows only (B×c×L, from the spec's
O(B·L) tensors), takes the softmax over the visible keys and keeps only the output. The
backward pass walks the chunks again, recomputing scores, visibility and probabilities (one
fused softmax per chunk), and accumulates dK/dV. Peak extra
memory is O(B·H·c·L) with c ≤ 128 instead of the reference path's B×L×L mask plus B×H×L×L scores and
probabilities; nothing of size L×L is stored between the passes.
"""

from __future__ import annotations

import math

import torch

from retromae_ds.attention.specs import MaskSpec

CHUNK_BUDGET_BYTES = 16 * 2**20
"""Target size of one chunk's float32 score tensor (B×H×c×L)."""
MAX_CHUNK_ROWS = 128
"""At most this many query rows at a time: beyond 128 tokens no tensor spans all L rows."""


def chunk_rows(B: int, H: int, L: int, budget: int = CHUNK_BUDGET_BYTES) -> int:
    """Query rows per chunk: a B×H×c×L float32 score block near ``budget``, 16 ≤ c ≤ 128."""
    return int(max(16, min(L, MAX_CHUNK_ROWS, budget // max(1, B * H * L * 4))))


def _probabilities(q_c, kT, spec: MaskSpec, start: int, stop: int, scale: float):
    """Softmax over the visible keys for query rows start:stop: B×H×c×L float32."""
    hidden = spec.rows(start, stop, kT.shape[-1]).to(q_c.device).logical_not_()[:, None]
    s = ((q_c * scale) @ kT).float()
    s.masked_fill_(hidden, float("-inf"))
    return torch.softmax(s, dim=-1)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: MaskSpec, chunk: int):  # type: ignore[override]
        L = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.empty_like(q)
        kT = k.transpose(-1, -2)
        for start in range(0, L, chunk):
            stop = min(L, start + chunk)
            p = _probabilities(q[:, :, start:stop], kT, spec, start, stop, scale)
            out[:, :, start:stop] = (p.to(v.dtype) @ v).to(out.dtype)
        ctx.save_for_backward(q, k, v, out)
        ctx.spec, ctx.chunk, ctx.scale = spec, chunk, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out = ctx.saved_tensors
        spec, chunk, scale = ctx.spec, ctx.chunk, ctx.scale
        L = q.shape[2]
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        delta = (dout.float() * out.float()).sum(dim=-1)  # B, H, L: rowsum(dP ∘ P)
        kT, vT = k.transpose(-1, -2), v.transpose(-1, -2)
        for start in range(0, L, chunk):
            stop = min(L, start + chunk)
            q_c, do_c = q[:, :, start:stop], dout[:, :, start:stop]
            p = _probabilities(q_c, kT, spec, start, stop, scale)  # recomputed, B×H×c×L
            dv += p.transpose(-1, -2).to(do_c.dtype).matmul(do_c).float()
            dp = (do_c @ vT).float()
            ds = p.mul_(dp.sub_(delta[:, :, start:stop, None])).mul_(scale)
            ds_in = ds.to(q.dtype)
            dq[:, :, start:stop] = (ds_in @ k).to(dq.dtype)
            dk += ds_in.transpose(-1, -2).matmul(q_c).float()
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def chunked_attention(
    q_BHLD: torch.Tensor,
    k_BHLD: torch.Tensor,
    v_BHLD: torch.Tensor,
    spec: MaskSpec,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v`` under ``spec``, O(B·H·chunk·L) extra memory.

    Every rule in this package keeps key 0 visible to every query, so no row is empty.
    """
    B, H, L, _ = q_BHLD.shape
    if chunk is None:
        chunk = chunk_rows(B, H, k_BHLD.shape[2])
    return _ChunkedAttention.apply(q_BHLD, k_BHLD, v_BHLD, spec, int(chunk))
