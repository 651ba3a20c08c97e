"""Attention for the pre-training decoders, behind one interface.

``attend(q_BHLD, k_BHLD, v_BHLD, spec, backend)`` where ``spec`` says *which* keys each query
may see (a rule, never a stored L×L mask) and ``backend`` says *how* it is computed:

- ``reference``: SDPA with the dense boolean mask built from the rule. CPU-runnable oracle.
- fast paths (FlexAttention, windowed) plug in here and are held against ``reference``.
"""

from __future__ import annotations

from retromae_ds.attention.reference import reference_attention
from retromae_ds.attention.specs import MaskSpec, TwoStreamSpec, WindowSpec

BACKENDS = {"reference": reference_attention}


def attend(q_BHLD, k_BHLD, v_BHLD, spec: MaskSpec, backend: str = "reference"):
    """Scaled dot-product attention of ``q`` over ``k``/``v`` restricted by ``spec``."""
    try:
        fn = BACKENDS[resolve_backend(backend, q_BHLD.device.type)]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose from {sorted(BACKENDS)} or 'auto'"
        ) from None
    return fn(q_BHLD, k_BHLD, v_BHLD, spec)


def resolve_backend(backend: str, device_type: str) -> str:
    """``auto`` picks the fastest backend available on the device."""
    if backend != "auto":
        return backend
    return "reference"


__all__ = ["BACKENDS", "MaskSpec", "TwoStreamSpec", "WindowSpec", "attend", "resolve_backend"]
