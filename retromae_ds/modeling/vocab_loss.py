"""Cross-entropy over the vocabulary without the N×V logits: a chunked linear + cross-entropy.

The MLM head's last layer projects every predicted position onto the vocabulary. RetroMAE's
decoder predicts every token, so one step holds B×L×V logits (fp32 for the loss): 1 GB per
sample at L = 8,192 with BERT's 30,522 entries, 2 GB for 32 samples at 512, plus as much again
for their gradient. ``linear_cross_entropy`` computes the same loss chunk by chunk: each chunk's
logits live only while its loss and its gradients (with respect to the features, the
projection and its bias) are computed, in the forward pass; the backward pass only scales the
stored gradients by the incoming one. Peak extra memory is one chunk's logits and the fp32
gradient of the projection (V×H, what its own gradient needs anyway), independent of N.
FLOPs are those of the plain path (three N×H×V products); the logits are never recomputed.
This is the approach of Liger-Kernel's fused linear cross-entropy, in plain PyTorch so it runs
(and is tested) on CPU as well as GPU.

``head_parts`` splits a Hugging Face MLM head (BERT's ``cls``, RoBERTa / XLM-R's ``lm_head``)
into its transform (dense, activation, LayerNorm) and its vocabulary projection.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

# one chunk's fp32 logits at most this many elements (64 MiB)
CHUNK_ELEMENTS = 1 << 24


class HeadParts:
    """An MLM head as ``transform(x)`` then ``x @ weight.T + bias``."""

    def __init__(
        self, transform: Callable[[torch.Tensor], torch.Tensor], projection: nn.Linear
    ) -> None:
        self.transform, self.projection = transform, projection

    @property
    def weight(self) -> torch.Tensor:
        return self.projection.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.projection.bias


def head_parts(head: nn.Module) -> HeadParts | None:
    """The parts of a BERT-style (``predictions.transform`` + ``predictions.decoder``) or
    RoBERTa-style (``dense`` → gelu → ``layer_norm`` → ``decoder``) MLM head; None for
    another layout (callers then use the head whole)."""
    predictions = getattr(head, "predictions", None)
    if predictions is not None:
        transform = getattr(predictions, "transform", None)
        decoder = getattr(predictions, "decoder", None)
        if isinstance(transform, nn.Module) and isinstance(decoder, nn.Linear):
            return HeadParts(transform, decoder)
        return None
    dense, norm = getattr(head, "dense", None), getattr(head, "layer_norm", None)
    decoder = getattr(head, "decoder", None)
    gelu = getattr(sys.modules.get(type(head).__module__), "gelu", None)
    linear = isinstance(dense, nn.Linear) and isinstance(decoder, nn.Linear)
    if linear and isinstance(norm, nn.LayerNorm) and gelu is not None:
        return HeadParts(lambda x: norm(gelu(dense(x))), decoder)
    return None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, weight_VH, bias_V, targets_N, chunk):  # type: ignore[override]
        n = x_NH.shape[0]
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        grads = want_x or want_w or want_b
        grad_x = torch.empty_like(x_NH) if want_x else None
        grad_w = (
            torch.zeros(weight_VH.shape, dtype=torch.float32, device=x_NH.device)
            if want_w
            else None
        )
        grad_b = (
            torch.zeros(bias_V.shape, dtype=torch.float32, device=x_NH.device)
            if want_b and bias_V is not None
            else None
        )
        loss = torch.zeros((), dtype=torch.float32, device=x_NH.device)
        correct = torch.zeros((), dtype=torch.long, device=x_NH.device)
        for start in range(0, n, chunk):
            x = x_NH[start : start + chunk]
            t = targets_N[start : start + chunk]
            logits = x @ weight_VH.t()
            if bias_V is not None:
                logits = logits + bias_V
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            correct += (logits.argmax(-1) == t).sum()
            if not grads:
                continue
            # d(mean loss)/d logits = (softmax - onehot) / n, in place of the logits
            d = logits.sub_(lse[:, None]).exp_()
            d[torch.arange(len(t), device=d.device), t] -= 1.0
            d /= n
            if want_x:
                grad_x[start : start + chunk] = (d.to(weight_VH.dtype) @ weight_VH).to(x_NH.dtype)
            if want_w:
                grad_w += d.t().to(x.dtype) @ x
            if grad_b is not None:
                grad_b += d.sum(0)
            del d, logits
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_x, grad_w, grad_b))
        )
        ctx.present = (want_x, want_w, grad_b is not None)
        ctx.dtypes = (x_NH.dtype, weight_VH.dtype, None if bias_V is None else bias_V.dtype)
        ctx.mark_non_differentiable(correct)
        return loss / n, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):  # type: ignore[override]
        out = []
        for present, g, dtype in zip(ctx.present, ctx.saved_tensors, ctx.dtypes, strict=True):
            out.append((g * grad_loss).to(dtype) if present else None)
        return out[0], out[1], out[2], None, None


def linear_cross_entropy(
    x_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy of ``x @ weight.T + bias`` against ``targets``, number of rows whose
    argmax is the target), computed ``chunk`` rows at a time (0: rows of one 64 MiB fp32 chunk)
    with the loss in fp32, as ``F.cross_entropy(logits.float(), targets)`` does."""
    if x_NH.dim() != 2 or targets_N.shape != x_NH.shape[:1]:
        raise ValueError(
            f"need x [N, H] and targets [N], got {tuple(x_NH.shape)}, {tuple(targets_N.shape)}"
        )
    chunk = chunk or max(1, CHUNK_ELEMENTS // weight_VH.shape[0])
    return _LinearCrossEntropy.apply(x_NH, weight_VH, bias_V, targets_N, chunk)
