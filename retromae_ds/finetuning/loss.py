"""Contrastive loss of the dual encoder with in-batch negatives gathered from every rank.

``gather_with_grad(x)`` concatenates ``x`` from all ranks in rank order; its backward pass
all-reduces (sums) the incoming gradient and hands each rank the slice of its own rows, so
rank s receives the gradient of *every* rank's loss with respect to its passages (gloo has no
reduce-scatter, hence all-reduce + slice). With DeepSpeed averaging gradients over ranks,
the update equals that of one process computing the mean loss over the whole global batch
(tested with two gloo ranks against a single-process big batch).

``contrastive_loss``: query i of this rank owns passages ``i*(1+n) .. i*(1+n)+n`` of its
rank's block (its positive first, then n hard negatives). Each query is scored against all
passages of all ranks (inner product / temperature); cross-entropy on its positive. Columns
holding another positive of the same query (the same document listed for two queries, or a
query with several positives) are masked out rather than counted as negatives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        rank, world = _world()
        ctx.rank, ctx.rows = rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """``x`` of every rank concatenated in rank order (all ranks must pass the same shape);
    gradients flow back to each rank's own rows. Identity in a single process."""
    if _world()[1] == 1:
        return x
    return _GatherWithGrad.apply(x)


def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    rank, world = _world()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def contrastive_loss(
    q_BD: torch.Tensor,
    p_PD: torch.Tensor,
    passage_index_P: torch.Tensor,
    positives_BK: torch.Tensor,
    *,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over this rank's queries, their top-1 accuracy).

    ``p_PD`` holds ``B * (1 + n)`` passages (per query: positive, then n negatives);
    ``passage_index_P`` their passage indices; ``positives_BK`` each query's positives
    (passage indices, ``-1`` padded), used to mask false in-batch negatives.
    """
    batch = q_BD.shape[0]
    group = p_PD.shape[0] // batch
    if group * batch != p_PD.shape[0]:
        raise ValueError(f"{p_PD.shape[0]} passages for {batch} queries")
    rank, _ = _world()
    p_all = gather_with_grad(p_PD)  # [W*P, D]
    index_all = gather_no_grad(passage_index_P.to(p_PD.device))  # [W*P]
    scores_BN = q_BD @ p_all.T / temperature
    target_B = rank * p_PD.shape[0] + torch.arange(batch, device=q_BD.device) * group
    positives_BK = positives_BK.to(q_BD.device)
    is_positive_BN = (index_all[None, :, None] == positives_BK[:, None, :]).any(-1)
    is_positive_BN[torch.arange(batch, device=q_BD.device), target_B] = False
    scores_BN = scores_BN.masked_fill(is_positive_BN, torch.finfo(scores_BN.dtype).min)
    loss = torch.nn.functional.cross_entropy(scores_BN.float(), target_B)
    accuracy = (scores_BN.argmax(1) == target_B).float().mean()
    return loss, accuracy.detach()
