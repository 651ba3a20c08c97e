"""DupMAE's bag-of-words task and retrieval vector: the MLM head over every ordinary token,
max-pooled per document.

DupMAE (Xiao et al., "RetroMAE v2: Duplex Masked Auto-Encoder For Pre-Training
Retrieval-Oriented Language Models", 2022; ACL 2023 as RetroMAE-2) trains the ordinary tokens'
final hidden states beside RetroMAE's [CLS] decoder: the MLM head (transform + vocabulary
projection, shared with the MLM task) maps each ordinary position to |V| logits, the maximum
over the document's ordinary positions gives one vocabulary-sized vector ``e_OT``, and its
softmax must predict the document's bag of words. For document d with ordinary tokens
x_1..x_n (n counts repeats) and T_d their distinct ids:

    L_bow(d) = -(1 / n) · Σ_{t ∈ T_d} log softmax(e_OT(d))[t]

and ``bow_loss`` is the mean of L_bow over the batch's documents that have an ordinary token.
This is the reference code's loss (staoxiao/RetroMAE ``src/pretrain``: the collator gives each
distinct token the weight 1/len(tokens), the model takes -Σ weight · log_softmax): each
distinct token once, divided by the token count with repeats, so a document that repeats
words weighs a little less than a mean over its distinct tokens would. "Ordinary" is a
non-special, non-padding position (the RetroMAE decoder's targets); the reference code pools
over every attended position but [CLS], its [SEP] included, and counts an [UNK] of the text as
a word: we leave out every special id, as the issue and the paper's "ordinary tokens" say. The
pooled logits come from the same forward pass as the MLM loss (the encoder's masked input), as
in the reference code.

Memory: the plain way holds N×V logits (N ordinary positions: 16 × 512 × 30,522 fp32 is 1 GB,
and autograd keeps it for the backward pass). ``max_pooled_logits`` never does: it computes
the logits ``chunk`` rows at a time into one reused buffer and keeps, per document and
vocabulary entry, the running maximum and the row that attained it; the backward pass routes
each document's gradient to that row, chunk by chunk. Peak extra memory, independent of N:
about 3.5 chunks' worth of fp32 logits (the buffer, the running maxima gathered per row, the
int32 row numbers and a boolean; the default chunk holds 64 MiB of logits: about 220 MiB),
D×V fp32 maxima and int32 rows, and the fp32 gradient of the projection (V×H). FLOPs are the
plain path's (N×H×V for the forward, twice that for the backward).

At retrieval time (``bow_vectors``) the same max-pool over each text's ordinary tokens, on the
unmasked text, gives the DupMAE vector, reduced as the paper does by sparsification: only its
``topk`` largest entries are kept, the others set to 0 (the paper keeps the top-k entries of
``e_OT`` with their indices; it also projects [CLS] to 384 dimensions with a layer learnt in
fine-tuning, which is not done here: see docs/dupmae.md).
"""

from __future__ import annotations

import torch
from torch import nn

from retromae_ds.modeling.encoder import mlm_head
from retromae_ds.modeling.vocab_loss import CHUNK_ELEMENTS, HeadParts, head_parts

NO_ROW = -1
"""``best`` of a (document, entry) pair whose document has no ordinary position."""


def _head_logits(
    x_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``x @ weight.T + bias`` (into ``out`` when given): the product in the weight's
    dtype, as both max-pools compute it."""
    if x_NH.dtype == torch.float32 and weight_VH.dtype == torch.float32:
        logits = torch.mm(x_NH, weight_VH.t(), out=out) if out is not None else x_NH @ weight_VH.t()
    else:
        product = x_NH.to(weight_VH.dtype) @ weight_VH.t()
        logits = out.copy_(product) if out is not None else product.float()
    if bias_V is not None:
        logits += bias_V.float()
    return logits


class _MaxPooledLogits(torch.autograd.Function):
    """max over the rows of each group of ``x @ W.T + b``, chunk by chunk (see the module doc)."""

    @staticmethod
    def forward(ctx, x_NH, weight_VH, bias_V, group_N, groups, chunk):  # type: ignore[override]
        n, V, dev = x_NH.shape[0], weight_VH.shape[0], x_NH.device
        pooled_GV = torch.full((groups, V), float("-inf"), dtype=torch.float32, device=dev)
        best_GV = torch.full((groups, V), NO_ROW, dtype=torch.int32, device=dev)
        buf = torch.empty((min(chunk, n), V), dtype=torch.float32, device=dev)
        for start in range(0, n, chunk):
            x = x_NH[start : start + chunk]
            g = group_N[start : start + chunk]
            logits = _head_logits(x, weight_VH, bias_V, out=buf[: len(g)])
            index = g[:, None].expand(-1, V)
            pooled_GV.scatter_reduce_(0, index, logits, "amax")
            # rows come in increasing order: a row reaching the running maximum now is the
            # last (or only) row to reach it so far, and a later chunk overrides it only by
            # reaching the maximum too
            rows = torch.arange(start, start + len(g), dtype=torch.int32, device=dev)
            hit = torch.where(logits == pooled_GV.gather(0, index), rows[:, None], NO_ROW)
            best_GV.scatter_reduce_(0, index, hit, "amax")
            del hit
        pooled_GV.masked_fill_(best_GV == NO_ROW, 0.0)  # a group without rows: zeros
        ctx.save_for_backward(x_NH, weight_VH, group_N, best_GV)
        ctx.has_bias, ctx.chunk = bias_V is not None, chunk
        ctx.bias_dtype = None if bias_V is None else bias_V.dtype
        ctx.mark_non_differentiable(best_GV)
        return pooled_GV, best_GV

    @staticmethod
    def backward(ctx, grad_GV, _grad_best):  # type: ignore[override]
        x_NH, weight_VH, group_N, best_GV = ctx.saved_tensors
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        n, dev = x_NH.shape[0], x_NH.device
        grad_GV = grad_GV.float()
        grad_x = torch.empty_like(x_NH) if want_x else None
        grad_w = torch.zeros(weight_VH.shape, dtype=torch.float32, device=dev) if want_w else None
        for start in range(0, n, ctx.chunk):
            g = group_N[start : start + ctx.chunk]
            rows = torch.arange(start, start + len(g), dtype=torch.int32, device=dev)
            # d pooled[g, v] / d logits[row, v] = 1 where row is the one that attained it
            d = torch.where(best_GV[g] == rows[:, None], grad_GV[g], 0.0)
            if want_x:
                grad_x[start : start + ctx.chunk] = (d.to(weight_VH.dtype) @ weight_VH).to(
                    x_NH.dtype
                )
            if want_w:
                grad_w += d.t() @ x_NH[start : start + ctx.chunk].float()
        # every (group, entry) that has a row gets the bias once
        grad_b = (
            torch.where(best_GV != NO_ROW, grad_GV, 0.0).sum(0).to(ctx.bias_dtype)
            if want_b and ctx.has_bias
            else None
        )
        grad_w = grad_w.to(weight_VH.dtype) if grad_w is not None else None
        return grad_x, grad_w, grad_b, None, None, None


def max_pooled_logits(
    x_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    group_N: torch.Tensor,
    groups: int,
    chunk: int = 0,
) -> torch.Tensor:
    """fp32 ``[groups, V]``: for each group g, the entry-wise maximum of ``x[i] @ weight.T +
    bias`` over the rows i with ``group[i] == g`` (0 for a group without rows), computed
    ``chunk`` rows at a time (0: the rows of one 64 MiB fp32 chunk); the gradient goes to the
    row that attained each maximum (the last such row on a tie)."""
    if x_NH.dim() != 2 or group_N.shape != x_NH.shape[:1]:
        raise ValueError(
            f"need x [N, H] and group [N], got {tuple(x_NH.shape)}, {tuple(group_N.shape)}"
        )
    V = weight_VH.shape[0]
    if x_NH.shape[0] == 0:  # no row at all: every group's vector is zeros (keeps the graph)
        return x_NH.sum().float() * 0.0 + torch.zeros(groups, V, device=x_NH.device)
    chunk = chunk or max(1, CHUNK_ELEMENTS // V)
    pooled, _ = _MaxPooledLogits.apply(x_NH, weight_VH, bias_V, group_N.long(), groups, chunk)
    return pooled


def max_pooled_logits_plain(
    logits_NV: torch.Tensor, group_N: torch.Tensor, groups: int
) -> torch.Tensor:
    """The same maximum from logits already computed (the plain head path: N×V held), with
    the same gradient: to the last row attaining each maximum. (Ties are real: an entry whose
    projection row is zero, like BERT's [PAD], has one logit for every row.)"""
    V, dev = logits_NV.shape[1], logits_NV.device
    logits_NV = logits_NV.float()
    if len(group_N) == 0:
        return logits_NV.sum() * 0.0 + torch.zeros(groups, V, device=dev)
    index = group_N.long()[:, None].expand(-1, V)
    with torch.no_grad():
        peak = torch.full((groups, V), float("-inf"), device=dev)
        peak = peak.scatter_reduce(0, index, logits_NV, "amax")
        rows = torch.arange(len(group_N), device=dev)[:, None].expand(-1, V)
        hit = torch.where(logits_NV == peak.gather(0, index), rows, NO_ROW)
        best = torch.full((groups, V), NO_ROW, device=dev).scatter_reduce(0, index, hit, "amax")
    pooled = logits_NV.gather(0, best.clamp_min(0))
    return torch.where(best != NO_ROW, pooled, 0.0)


def bow_loss(
    pooled_DV: torch.Tensor, tokens_N: torch.Tensor, doc_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bag-of-words loss of the module doc, the detached share of each document's
    distinct tokens found among its |T_d| largest entries), from the pooled logits ``[D, V]`` and
    each ordinary token with its document. No read from the device: every size is known."""
    D, V = pooled_DV.shape
    bag_DV = bag_of_words(tokens_N, doc_N, D, V, pooled_DV.device)
    count_D = torch.zeros(D, dtype=torch.float32, device=pooled_DV.device).index_add_(
        0, doc_N.long(), torch.ones_like(doc_N, dtype=torch.float32)
    )
    log_p = torch.log_softmax(pooled_DV.float(), dim=-1)
    per_doc = -(bag_DV * log_p).sum(-1) / count_D.clamp_min(1.0)
    has = (count_D > 0).float()
    loss = (per_doc * has).sum() / has.sum().clamp_min(1.0)
    return loss, bag_recall(pooled_DV, bag_DV, has)


def bag_of_words(
    tokens_N: torch.Tensor, doc_N: torch.Tensor, D: int, V: int, device: torch.device
) -> torch.Tensor:
    """``[D, V]`` fp32: 1 where document d holds token t (each distinct token once)."""
    bag_DV = torch.zeros((D, V), dtype=torch.float32, device=device)
    bag_DV[doc_N.long(), tokens_N.long()] = 1.0  # distinct tokens: a repeat writes the same 1
    return bag_DV


@torch.no_grad()
def bag_recall(logits_DV: torch.Tensor, bag_DV: torch.Tensor, has_D: torch.Tensor) -> torch.Tensor:
    """The share of each document's distinct tokens found among the |T_d| largest entries of
    its logits (ties at the |T_d|-th value count as found), averaged over the documents with
    ``has_D`` 1: a training-progress figure."""
    distinct_D = bag_DV.sum(-1)
    ranked_DV = logits_DV.detach().float().sort(dim=-1, descending=True).values
    kth_D1 = ranked_DV.gather(1, (distinct_D.long() - 1).clamp_min(0)[:, None])
    hits_D = ((logits_DV.detach() >= kth_D1) & (bag_DV > 0)).sum(-1)
    found = hits_D / distinct_D.clamp_min(1.0)
    return (found * has_D).sum() / has_D.sum().clamp_min(1.0)


def pooled_vocabulary(
    model: nn.Module,
    hidden_NH: torch.Tensor,
    group_N: torch.Tensor,
    groups: int,
    *,
    chunked: bool = True,
    chunk: int = 0,
) -> torch.Tensor:
    """``[groups, V]``: the max over each group's rows of the MLM head of masked-LM ``model``
    applied to ``hidden`` (final hidden states of ordinary positions). ``chunked`` never holds
    the N×V logits (a head ``head_parts`` cannot split is applied whole)."""
    head = mlm_head(model)
    parts = head_parts(head) if chunked else None
    if parts is None:
        return max_pooled_logits_plain(head(hidden_NH), group_N, groups)
    return max_pooled_logits(
        parts.transform(hidden_NH), parts.weight, parts.bias, group_N, groups, chunk
    )


def ordinary_positions(
    input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, special_ids: torch.Tensor
) -> torch.Tensor:
    """B×L bool: the positions of real, non-special tokens."""
    return attention_mask_BL.bool() & ~torch.isin(input_ids_BL, special_ids)


def sparsify(vectors_BV: torch.Tensor, topk: int) -> torch.Tensor:
    """Each row's ``topk`` largest entries kept, the others 0 (``topk`` 0 or >= V: the rows)."""
    if topk <= 0 or topk >= vectors_BV.shape[-1]:
        return vectors_BV
    values, index = vectors_BV.topk(topk, dim=-1)
    return torch.zeros_like(vectors_BV).scatter(-1, index, values)


def bow_vectors(
    model: nn.Module,
    hidden_BLH: torch.Tensor,
    input_ids_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    special_ids: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """DupMAE's ordinary-token vectors fp32 ``[B, V]`` of a batch of texts: the max-pooled
    MLM-head logits of each text's ordinary positions (zeros for a text without one), only
    the ``topk`` largest entries kept. Every position goes through the head, a non-ordinary
    one into a group of its own that is dropped: no read from the device (a GPU never waits
    for a count), at the cost of the padding's share of the head's FLOPs. Differentiable
    (fine-tuning trains through it); where no gradient is wanted (evaluation, export, the
    refresher) the maximum is a masked dense reduction over positions instead
    (``_masked_max_logits``: the same values, none of the gradient's bookkeeping)."""
    B, L, H = hidden_BLH.shape
    ordinary = ordinary_positions(input_ids_BL, attention_mask_BL, special_ids.to(input_ids_BL))
    head = mlm_head(model)
    parts = head_parts(head)
    if parts is not None and not _needs_grad(hidden_BLH, head):
        return sparsify(_masked_max_logits(parts, hidden_BLH, ordinary), topk)
    rows_BL = torch.arange(B, device=hidden_BLH.device)[:, None].expand(B, L)
    group_N = torch.where(ordinary, rows_BL, B).flatten()
    pooled = pooled_vocabulary(model, hidden_BLH.reshape(B * L, H), group_N, B + 1)[:B]
    return sparsify(pooled, topk)


def _needs_grad(hidden_BLH: torch.Tensor, head: nn.Module) -> bool:
    """Whether autograd wants a gradient from the head's output (training, fine-tuning)."""
    if not torch.is_grad_enabled():
        return False
    return hidden_BLH.requires_grad or any(p.requires_grad for p in head.parameters())


@torch.no_grad()
def _masked_max_logits(
    parts: HeadParts, hidden_BLH: torch.Tensor, ordinary_BL: torch.Tensor
) -> torch.Tensor:
    """fp32 ``[B, V]``: per text, the entry-wise maximum of the MLM head's logits over its
    ordinary positions (0 for a text without one), the logits computed as
    ``max_pooled_logits`` computes them, a block of texts (or of one text's positions) at a
    time, at most ``CHUNK_ELEMENTS`` logits per block. No gradient, no row bookkeeping."""
    B, L, H = hidden_BLH.shape
    weight_VH, bias_V = parts.weight, parts.bias
    V, dev = weight_VH.shape[0], hidden_BLH.device
    texts = max(1, CHUNK_ELEMENTS // (L * V))  # texts per block
    span = L if texts > 1 or L * V <= CHUNK_ELEMENTS else max(1, CHUNK_ELEMENTS // V)
    out_BV = torch.full((B, V), float("-inf"), dtype=torch.float32, device=dev)
    for t0 in range(0, B, texts):
        t1 = min(B, t0 + texts)
        for p0 in range(0, L, span):
            p1 = min(L, p0 + span)
            x_NH = parts.transform(hidden_BLH[t0:t1, p0:p1].reshape(-1, H))
            logits = _head_logits(x_NH, weight_VH, bias_V).view(t1 - t0, p1 - p0, V)
            logits.masked_fill_(~ordinary_BL[t0:t1, p0:p1, None], float("-inf"))
            torch.maximum(out_BV[t0:t1], logits.amax(1), out=out_BV[t0:t1])
    return out_BV.masked_fill_(~ordinary_BL.any(1)[:, None], 0.0)


def head_weights(model: nn.Module) -> list[nn.Parameter]:
    """The MLM head's vocabulary projection (and bias) that ``max_pooled_logits`` reads
    outside the head's own forward (ZeRO-3 must gather them: ``external_parameters``)."""
    parts = head_parts(mlm_head(model))
    if parts is None:
        return []
    return [p for p in (parts.weight, parts.bias) if isinstance(p, nn.Parameter)]
