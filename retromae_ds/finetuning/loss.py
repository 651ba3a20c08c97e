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

``contrastive_loss_grads``: the same loss and its gradients to this rank's embeddings, for
GradCache's second pass (``finetuning.grad_cache``), in one piece or a chunk of queries at a
time (then no ``[B, W*P]`` score matrix is ever whole).
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
    group = _group(q_BD, p_PD)
    rank, _ = _world()
    p_all = gather_with_grad(p_PD)  # [W*P, D]
    index_all = gather_no_grad(passage_index_P.to(p_PD.device))  # [W*P]
    target_B = rank * p_PD.shape[0] + torch.arange(q_BD.shape[0], device=q_BD.device) * group
    scores_BN = _masked_scores(q_BD, p_all, index_all, positives_BK, target_B, temperature)
    loss = torch.nn.functional.cross_entropy(scores_BN.float(), target_B)
    accuracy = (scores_BN.argmax(1) == target_B).float().mean()
    return loss, accuracy.detach()


def _group(q_BD: torch.Tensor, p_PD: torch.Tensor) -> int:
    batch = q_BD.shape[0]
    group = p_PD.shape[0] // batch
    if group * batch != p_PD.shape[0]:
        raise ValueError(f"{p_PD.shape[0]} passages for {batch} queries")
    return group


def _masked_scores(q_BD, p_all, index_all, positives_BK, target_B, temperature) -> torch.Tensor:
    """Each query's scores against every passage of every rank, its other positives masked."""
    scores_BN = q_BD @ p_all.T / temperature
    positives_BK = positives_BK.to(q_BD.device)
    is_positive_BN = (index_all[None, :, None] == positives_BK[:, None, :]).any(-1)
    is_positive_BN[torch.arange(q_BD.shape[0], device=q_BD.device), target_B] = False
    return scores_BN.masked_fill(is_positive_BN, torch.finfo(scores_BN.dtype).min)


def contrastive_loss_grads(
    q_BD: torch.Tensor,
    p_PD: torch.Tensor,
    passage_index_P: torch.Tensor,
    positives_BK: torch.Tensor,
    *,
    temperature: float,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``contrastive_loss`` (loss, accuracy) with its gradients to ``q_BD`` and ``p_PD``
    (GradCache's second pass), ``chunk`` queries at a time: the scores held at once are
    ``[chunk, W*P]``, never ``[B, W*P]`` when ``chunk`` < B. The passages' gradient is summed
    over every rank's queries (one all-reduce), as the gathered loss's backward gives it."""
    group = _group(q_BD, p_PD)
    rank, world = _world()
    batch, device = q_BD.shape[0], q_BD.device
    p_all = gather_no_grad(p_PD.detach()).requires_grad_()  # [W*P, D]
    index_all = gather_no_grad(passage_index_P.to(device))
    target_B = rank * p_PD.shape[0] + torch.arange(batch, device=device) * group
    grad_q = torch.empty_like(q_BD)
    grad_p_all = torch.zeros_like(p_all, dtype=torch.float32)  # summed over chunks
    loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    for start in range(0, batch, chunk):
        rows = slice(start, start + chunk)
        q_CD = q_BD[rows].detach().requires_grad_()
        with torch.enable_grad():
            scores_CN = _masked_scores(
                q_CD, p_all, index_all, positives_BK[rows], target_B[rows], temperature
            )
            part = torch.nn.functional.cross_entropy(
                scores_CN.float(), target_B[rows], reduction="sum"
            )
            grad_q[rows], grad_p = torch.autograd.grad(part / batch, [q_CD, p_all])
        grad_p_all += grad_p
        loss += part.detach()
        correct += (scores_CN.argmax(1) == target_B[rows]).sum()
    if world > 1:
        dist.all_reduce(grad_p_all)
    rows_p = slice(rank * p_PD.shape[0], (rank + 1) * p_PD.shape[0])
    return loss / batch, correct / batch, grad_q, grad_p_all[rows_p].to(p_PD.dtype)
