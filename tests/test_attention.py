"""Every attention backend against the reference path: outputs and input gradients (fp32,
CPU), random shapes, lengths that are not multiples of any block size, padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.attention import WindowSpec, attend, resolve_backend


def _qkv(B, H, L, D, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3)]


def _compare(spec, B, H, L, D, seed, backend):
    q, k, v = _qkv(B, H, L, D, seed)
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = attend(q, k, v, spec, "reference")
    out = attend(q2, k2, v2, spec, backend)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 4),
    H=st.integers(1, 3),
    L=st.integers(1, 70),
    D=st.sampled_from([4, 8, 16]),
    window=st.sampled_from([1, 2, 8]),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_window_backend_matches_reference(B, H, L, D, window, seed, data):
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, L), min_size=B, max_size=B)))
    _compare(WindowSpec(lengths, window), B, H, L, D, seed, "window")


def test_window_backend_refuses_other_rules():
    q, k, v = _qkv(1, 1, 8, 4, 0)
    with pytest.raises(ValueError, match="finite SEED-Encoder window"):
        attend(q, k, v, WindowSpec(torch.tensor([8]), None), "window")
    with pytest.raises(ValueError, match="unknown attention backend"):
        attend(q, k, v, WindowSpec(torch.tensor([8]), 2), "nope")


def test_auto_picks_the_window_path_for_finite_windows():
    assert resolve_backend("auto", "cpu", WindowSpec(torch.tensor([3]), 2)) == "window"
    assert resolve_backend("auto", "cpu", WindowSpec(torch.tensor([3]), None)) == "reference"
    assert resolve_backend("reference", "cpu", WindowSpec(torch.tensor([3]), 2)) == "reference"
