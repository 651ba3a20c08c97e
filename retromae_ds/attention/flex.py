"""FlexAttention backend: the decoder rules as ``mask_mod`` functions plus analytic block masks.

- Two-stream (RetroMAE): the ``mask_mod`` recomputes visibility from O(B·L) tensors: a
  per-(row, query) hash prefix (``hashing.two_stream_row_hash``, derived from the row's seed),
  the word ids and the lengths. One ``mix32`` per (query, key) inside the kernel; no L×L
  tensor exists. (Feeding the full three-round ``hash3`` to the CPU compiler made Inductor's
  code generation run for more than 15 minutes here; with the prefix table it compiles in
  about 6 s.)
- Window (SEED-Encoder): index arithmetic; its block mask lists key block 0 plus the one or two
  blocks holding the previous k positions, so almost every block is skipped.
- Block masks are computed from the rule at block granularity (B×nQ×nK integers), never by
  evaluating the rule on every (query, key) pair the way ``create_block_mask`` does, and built
  once per batch: ``MaskSpec.block_mask`` keeps them on the spec, which all decoder layers of a
  batch share.
- Packed rows (``retromae_ds.attention.packing``): the same rules per document; the block
  mask lists the blocks whose document ranges overlap (each document's blocks against
  themselves), so attention across documents is skipped block by block.

FlexAttention in torch 2.13 has a compiled forward on CPU but no backward there; this backend
therefore refuses CPU inputs that require gradients (``auto`` picks ``chunked`` for training on
CPU). On CUDA it runs compiled, forward and backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from retromae_ds.attention.rules import query_hash
from retromae_ds.attention.specs import MaskSpec, TwoStreamSpec, WindowSpec
from retromae_ds.base.hashing import MASK32, mix32, threshold, two_stream_row_hash

BLOCK = 128


@dataclass(frozen=True)
class FlexRule:
    """One spec type's rule for FlexAttention: its ``mask_mod`` for padded rows and for
    packed rows, and its block visibility for padded rows (packed rows share
    ``_packed_blocks``). ``FLEX_RULES`` maps the spec type to it: a new decoder rule adds one
    entry here, and nothing else in this module changes."""

    mask_mod: Callable[[Any, int, torch.device], Callable]
    packed_mask_mod: Callable[[Any, int, torch.device], Callable]
    blocks: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def mask_mod_for(spec: MaskSpec, L: int, device: torch.device):
    """The spec's rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""
    rule = flex_rule(spec)
    if getattr(spec, "packing", None) is not None:
        return rule.packed_mask_mod(spec, L, device)
    return rule.mask_mod(spec, L, device)


def flex_rule(spec: MaskSpec) -> FlexRule:
    """The ``FLEX_RULES`` entry of ``spec``'s type (or of a base class); TypeError for none."""
    for kind in type(spec).__mro__:
        if kind in FLEX_RULES:
            return FLEX_RULES[kind]
    raise TypeError(f"no FlexAttention rule for {type(spec).__name__}")


def _checked_words(spec: TwoStreamSpec, L: int, device: torch.device) -> torch.Tensor:
    if spec.word_ids_BL.shape[1] != L:
        raise ValueError(f"spec covers {spec.word_ids_BL.shape[1]} positions, attention has {L}")
    return spec.word_ids_BL.to(device).long().clamp_min(0)


def _two_stream_mask_mod(spec: TwoStreamSpec, L: int, device: torch.device):
    lengths = spec.lengths_B.to(device).long()
    words = _checked_words(spec, L, device)
    row_hash = two_stream_row_hash(spec.seeds_B.to(device), L)
    # The threshold travels as a tensor, like every other input of the rule, not as a
    # Python int: on CUDA a changed int closure becomes a kernel argument once Dynamo
    # makes it dynamic, and ratios >= 0.5 (thresholds >= 2**31) then kept the wrong keys
    # (found by scripts/gpu_check.sh on an H200: flex vs reference, ratios 0.5 and 0.7).
    cut = torch.tensor(threshold(spec.ratio), device=device, dtype=torch.long)

    def two_stream(b, h, q_idx, kv_idx):
        keep = mix32((row_hash[b, q_idx] ^ words[b, kv_idx]) & MASK32) >= cut
        return (kv_idx == 0) | ((kv_idx < lengths[b]) & (kv_idx != q_idx) & keep)

    return two_stream


def _window_mask_mod(spec: WindowSpec, L: int, device: torch.device):
    lengths = spec.lengths_B.to(device).long()
    window = spec.window

    def causal_window(b, h, q_idx, kv_idx):
        band = kv_idx <= q_idx
        if window is not None:
            band = band & (kv_idx > q_idx - window)
        return (kv_idx == 0) | ((kv_idx < lengths[b]) & band)

    return causal_window


def _packed_two_stream_mask_mod(spec: TwoStreamSpec, L: int, device: torch.device):
    """Packed rows: each document's own rule (``retromae_ds.attention.packing``), with the
    key every query sees at its document's first position instead of position 0."""
    packing = spec.packing.to(device)
    docs, starts = packing.doc_ids_BL.long(), packing.starts()
    words = _checked_words(spec, L, device)
    row_hash = query_hash(spec.seeds_B.to(device), L, packing)
    cut = torch.tensor(threshold(spec.ratio), device=device, dtype=torch.long)

    def packed_two_stream(b, h, q_idx, kv_idx):
        keep = mix32((row_hash[b, q_idx] ^ words[b, kv_idx]) & MASK32) >= cut
        same = (docs[b, kv_idx] == docs[b, q_idx]) & (docs[b, kv_idx] >= 0)
        return (kv_idx == starts[b, q_idx]) | (same & (kv_idx != q_idx) & keep)

    return packed_two_stream


def _packed_window_mask_mod(spec: WindowSpec, L: int, device: torch.device):
    packing = spec.packing.to(device)
    docs, starts = packing.doc_ids_BL.long(), packing.starts()
    window = spec.window

    def packed_window(b, h, q_idx, kv_idx):
        band = kv_idx <= q_idx
        if window is not None:
            band = band & (kv_idx > q_idx - window)
        same = (docs[b, kv_idx] == docs[b, q_idx]) & (docs[b, kv_idx] >= 0)
        return (kv_idx == starts[b, q_idx]) | (same & band)

    return packed_window


def _packed_blocks(spec: MaskSpec, L: int, device: torch.device, block: int) -> torch.Tensor:
    """B×nQ×nK: blocks whose query and key document ranges overlap, plus the diagonal (a
    padding query sees itself). Every visible pair of a packed rule lies in one document, so
    this covers them all."""
    docs = spec.packing.doc_ids_BL.to(device).long()
    B, n = docs.shape[0], -(-L // block)
    padded = torch.full((B, n * block), -1, dtype=torch.long, device=device)
    padded[:, :L] = docs
    blocks = padded.view(B, n, block)
    real = blocks >= 0
    lo = torch.where(real, blocks, torch.full_like(blocks, 2**62)).amin(-1)  # B, n
    hi = blocks.amax(-1)  # -1 when the block holds no document
    overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    return overlap | torch.eye(n, dtype=torch.bool, device=device)


def block_visibility(
    spec: MaskSpec, L: int, device: torch.device, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, full): B×nQ×nK booleans: does block (q-block, k-block) hold a visible pair, and
    are all its pairs visible. ``any`` is a superset of the true coverage; ``full`` is exact
    or conservative (False), so the kernel applies ``mask_mod`` wherever it is unsure."""
    rule = flex_rule(spec)
    if getattr(spec, "packing", None) is not None:
        any_ = _packed_blocks(spec, L, device, block)
        return any_, torch.zeros_like(any_)
    lengths = spec.lengths_B.to(device).long().view(-1, 1, 1)
    n = -(-L // block)
    qb = torch.arange(n, device=device).view(1, n, 1)
    kb = torch.arange(n, device=device).view(1, 1, n)
    q_first, q_last = qb * block, torch.clamp_max(qb * block + block - 1, L - 1)
    k_first, k_last = kb * block, torch.clamp_max(kb * block + block - 1, L - 1)
    any_, full = rule.blocks(spec, lengths - 1, L, (q_first, q_last), (k_first, k_last), kb)
    any_ = any_.expand(lengths.shape[0], n, n)
    full = full.expand(lengths.shape[0], n, n) & any_
    return any_, full


def _two_stream_blocks(spec, last_real, L, queries, keys, kb):
    """Key positions 1..last_real are real tokens; the diagonal and the hashed words are
    never all kept, so no block is full."""
    any_ = (kb == 0) | (keys[0] <= last_real)
    return any_, torch.zeros_like(any_)


def _window_blocks(spec, last_real, L, queries, keys, kb):
    (q_first, q_last), (k_first, k_last) = queries, keys
    lo = (q_first - spec.window + 1).clamp_min(1) if spec.window is not None else 1
    hi = torch.minimum(q_last, last_real)
    any_ = (kb == 0) | ((k_first <= hi) & (k_last >= lo))
    if spec.window is None:
        # every pair visible when the block lies wholly before the first query row and
        # inside the real tokens
        return any_, (k_last <= q_first) & (k_last <= last_real)
    return any_, torch.zeros_like(any_)


FLEX_RULES: dict[type, FlexRule] = {
    TwoStreamSpec: FlexRule(_two_stream_mask_mod, _packed_two_stream_mask_mod, _two_stream_blocks),
    WindowSpec: FlexRule(_window_mask_mod, _packed_window_mask_mod, _window_blocks),
}


def _listing(blocks_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block booleans → (num_blocks B×1×nQ, indices B×1×nQ×nK) with listed blocks first."""
    num = blocks_BQK.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~blocks_BQK).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None].contiguous(), order[:, None].contiguous()


def build_block_mask(spec: MaskSpec, L: int, device: torch.device, block: int = BLOCK):
    """The FlexAttention ``BlockMask`` of ``spec`` for length ``L``, from block arithmetic."""
    from torch.nn.attention.flex_attention import BlockMask

    any_, full = block_visibility(spec, L, device, block)
    partial = any_ & ~full
    kv_num, kv_idx = _listing(partial)
    full_num, full_idx = _listing(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=mask_mod_for(spec, L, device),
        seq_lengths=(L, L),
    )


@functools.cache
def _compiled_flex(device_type: str):
    """Compiled ``flex_attention``. On CPU with static shapes: Inductor's CPU template for
    FlexAttention generated C++ that does not compile (``cur_qSplitSize8`` undeclared) once
    automatic dynamic shapes kicked in after a recompilation (torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)


def flex_attention_backend(
    q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, spec: MaskSpec
) -> torch.Tensor:
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHLD, k_BHLD, v_BHLD))
    if q_BHLD.device.type == "cpu" and needs_grad:
        raise NotImplementedError(
            "FlexAttention has no backward on CPU (torch 2.13): use attention backend "
            "'chunked' or 'window' for CPU training ('auto' chooses for you)"
        )
    L = k_BHLD.shape[2]
    block_mask = spec.block_mask(L, q_BHLD.device, build_block_mask)  # once per batch
    return _compiled_flex(q_BHLD.device.type)(q_BHLD, k_BHLD, v_BHLD, block_mask=block_mask)
