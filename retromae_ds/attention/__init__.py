"""Attention for the pre-training decoders, behind one interface.

``attend(q_BHLD, k_BHLD, v_BHLD, spec, backend)`` where ``spec`` says *which* keys each query
may see (a rule, never a stored L×L mask) and ``backend`` says *how* it is computed:

- ``reference``: SDPA with the dense boolean mask built from the rule. CPU-runnable oracle.
- ``chunked``: any rule, query chunks with visibility recomputed per chunk and a
  FlashAttention-style backward; O(B·H·chunk·L) memory, no L×L tensor (any device).
- ``window``: O(L·k) gather of the visible keys for the SEED-Encoder window (any device).
- ``flex``: PyTorch FlexAttention, compiled, with the rules as ``mask_mod`` functions and
  analytic block masks (CUDA: forward + backward; CPU: forward only, torch 2.13).

``auto`` picks per device and rule; every fast path is held against ``reference`` in tests.
The rules themselves are in ``rules``; ``specs`` carries their O(B·L) inputs per batch.
"""

from __future__ import annotations

import importlib.util

import torch

from retromae_ds.attention.chunked import chunked_attention
from retromae_ds.attention.flex import flex_attention_backend
from retromae_ds.attention.reference import reference_attention
from retromae_ds.attention.specs import MaskSpec, TwoStreamSpec, WindowSpec
from retromae_ds.attention.window import window_attention

BACKENDS = {
    "reference": reference_attention,
    "chunked": chunked_attention,
    "window": window_attention,
    "flex": flex_attention_backend,
}


def attend(q_BHLD, k_BHLD, v_BHLD, spec: MaskSpec, backend: str = "reference"):
    """Scaled dot-product attention of ``q`` over ``k``/``v`` restricted by ``spec``."""
    try:
        fn = BACKENDS[resolve_backend(backend, q_BHLD.device.type, spec)]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose from {sorted(BACKENDS)} or 'auto'"
        ) from None
    return fn(q_BHLD, k_BHLD, v_BHLD, spec)


def resolve_backend(backend: str, device_type: str, spec: MaskSpec | None = None) -> str:
    """``auto``: FlexAttention on CUDA; on other devices the window gather for a finite
    SEED-Encoder window and the chunked path for everything else (no L×L tensors anywhere)."""
    if backend != "auto":
        return backend
    if device_type == "cuda" and _flex_available():
        return "flex"
    if isinstance(spec, WindowSpec) and spec.window is not None:
        return "window"
    return "chunked"


def _flex_available() -> bool:
    if not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


__all__ = ["BACKENDS", "MaskSpec", "TwoStreamSpec", "WindowSpec", "attend", "resolve_backend"]
