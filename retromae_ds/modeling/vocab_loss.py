"""Cross-entropy over the vocabulary without the N×V logits: a chunked linear + cross-entropy.

The MLM head's last layer projects every predicted position onto the vocabulary. RetroMAE's
decoder predicts every token, so one step holds B×L×V logits (fp32 for the loss): 1 GB per
sample at L = 8,192 with BERT's 30,522 entries, 2 GB for 32 samples at 512, plus as much again
for their gradient. ``linear_cross_entropy`` computes the same loss chunk by chunk: each chunk's
logits live only while its loss and its gradients (with respect to the features, the
projection and its bias) are computed, in the forward pass; the backward pass only scales the
stored gradients by the incoming one. Peak extra memory is one chunk's logits (in fp32 one
buffer that every chunk reuses; in bf16 the logits and their fp32 log-softmax) and the fp32
gradient of the projection (V×H, what its own gradient needs anyway), independent of N.
Each chunk's logits are passed over few times: the bias enters the product as one more input
column (so [dW, db] is one product too), one row-wise log-softmax, in place, gives the loss
and, exponentiated in place, the softmax, and the mean's 1/N scales the small gradients once.
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
        n, H = x_NH.shape
        V, dev = weight_VH.shape[0], x_NH.device
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        want_b = want_b and bias_V is not None
        grads = want_x or want_w or want_b
        # the bias as one more input column: [x, 1] @ [W, b].T is the biased product (no
        # pass over the logits to add it) and d.T @ [x, 1] is [dW, db] (none to sum it)
        biased = bias_V is not None
        w_aug = torch.cat([weight_VH, bias_V[:, None].to(weight_VH.dtype)], 1) if biased else None
        ones = x_NH.new_ones(min(chunk, n), 1) if biased else None
        grad_x = torch.empty_like(x_NH) if want_x else None
        grad_wb = (
            torch.zeros((V, H + biased), dtype=torch.float32, device=dev)
            if want_w or want_b
            else None
        )
        # fp32: every chunk's logits are written into one buffer and turned into log p there
        fp32 = x_NH.dtype == torch.float32 and weight_VH.dtype == torch.float32
        buf = torch.empty((min(chunk, n), V), dtype=torch.float32, device=dev) if fp32 else None
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        correct = torch.zeros((), dtype=torch.long, device=dev)
        rows = torch.arange(min(chunk, n), device=dev)
        for start in range(0, n, chunk):
            x = x_NH[start : start + chunk]
            t = targets_N[start : start + chunk]
            r = rows[: len(t)]
            if biased:
                x = torch.cat([x, ones[: len(t)]], 1)
            w = w_aug if biased else weight_VH
            if buf is not None:
                logits = torch.mm(x, w.t(), out=buf[: len(t)])
                correct += (logits.argmax(-1) == t).sum()
                # one row-wise pass (the row stays in cache) turns the logits into log p
                log_p = torch._log_softmax(logits, -1, False, out=logits)
            else:
                logits = x @ w.t()
                correct += (logits.argmax(-1) == t).sum()
                log_p = torch.log_softmax(logits.float(), dim=-1)
            del logits
            loss -= log_p[r, t].sum()
            if not grads:
                continue
            # d(sum of losses)/d logits = softmax - onehot, in place of log p; the 1/n of the
            # mean is applied once to the (small) gradients after the loop
            d = log_p.exp_()
            d[r, t] -= 1.0
            if want_x:
                grad_x[start : start + chunk] = (d.to(weight_VH.dtype) @ weight_VH).to(x_NH.dtype)
            if grad_wb is not None:
                if fp32:
                    grad_wb.addmm_(d.t(), x)
                else:
                    grad_wb += d.t().to(x.dtype) @ x
            del d, log_p
        for g in (grad_x, grad_wb):
            if g is not None:
                g /= n
        grad_w = grad_wb[:, :H] if want_w else None
        grad_b = grad_wb[:, H] if want_b else None
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
