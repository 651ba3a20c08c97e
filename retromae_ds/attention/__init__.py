"""Attention for the pre-training decoders, behind one interface.

``attend(q_BHLD, k_BHLD, v_BHLD, spec, backend)`` where ``spec`` says *which* keys each query
may see (a rule, never a stored L×L mask) and ``backend`` says *how* it is computed:

- ``reference``: SDPA with the dense boolean mask built from the rule. CPU-runnable oracle.
- ``window``: O(L·k) gather of the visible keys for the SEED-Encoder window (any device).
- further fast paths (FlexAttention) plug in here and are held against ``reference``.
"""

from __future__ import annotations

from retromae_ds.attention.reference import reference_attention
from retromae_ds.attention.specs import MaskSpec, TwoStreamSpec, WindowSpec
from retromae_ds.attention.window import window_attention

BACKENDS = {"reference": reference_attention, "window": window_attention}


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
    """``auto`` picks the fastest backend available for the rule on the device."""
    if backend != "auto":
        return backend
    if isinstance(spec, WindowSpec) and spec.window is not None:
        return "window"
    return "reference"


__all__ = ["BACKENDS", "MaskSpec", "TwoStreamSpec", "WindowSpec", "attend", "resolve_backend"]
