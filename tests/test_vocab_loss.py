"""The chunked linear + cross-entropy (modeling/vocab_loss.py) against the plain head: same loss,
accuracy and gradients, and no tensor of N×V elements ever created."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import RobertaConfig, RobertaForMaskedLM

from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel
from retromae_ds.modeling.vocab_loss import head_parts, linear_cross_entropy

from helpers_model import SPECIAL, LargestTensor, batch_of


def _problem(n=37, h=16, v=50, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    return x, w, b, t


def _plain(x, w, b, t):
    logits = x @ w.t() + (b if b is not None else 0)
    return F.cross_entropy(logits.float(), t), int((logits.argmax(-1) == t).sum())


@pytest.mark.parametrize("chunk", [1, 8, 37, 100, 0])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_the_plain_loss_and_gradients_in_fp32(chunk, bias):
    x, w, b, t = _problem()
    b = b if bias else None
    plain, plain_correct = _plain(x, w, b, t)
    (2.5 * plain).backward()  # a non-unit incoming gradient is scaled through
    want = [p.grad.clone() for p in (x, w, b) if p is not None]
    for p in (x, w, b):
        if p is not None:
            p.grad = None
    loss, correct = linear_cross_entropy(x, w, b, t, chunk)
    (2.5 * loss).backward()
    assert torch.allclose(loss, plain, rtol=1e-6, atol=1e-6)
    assert int(correct) == plain_correct
    got = [p.grad for p in (x, w, b) if p is not None]
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype and torch.allclose(g, e, rtol=1e-5, atol=1e-6)


def test_bf16_matches_the_plain_bf16_path_within_its_precision():
    x, w, b, t = _problem(n=64, h=32, v=300, dtype=torch.bfloat16)
    plain, _ = _plain(x, w, b, t)
    plain.backward()
    want = [p.grad.float() for p in (x, w, b)]
    for p in (x, w, b):
        p.grad = None
    loss, _ = linear_cross_entropy(x, w, b, t, 16)
    loss.backward()
    assert abs(loss.item() - plain.item()) < 1e-2 * plain.item()
    for p, e in zip((x, w, b), want, strict=True):
        assert p.grad.dtype == torch.bfloat16
        err = (p.grad.float() - e).norm() / e.norm()
        assert err < 2e-2, err


def test_only_what_needs_a_gradient_gets_one_and_no_grad_works():
    x, w, b, t = _problem()
    w.requires_grad_(False)
    loss, _ = linear_cross_entropy(x, w, b, t, 8)
    loss.backward()
    assert x.grad is not None and b.grad is not None and w.grad is None
    with torch.no_grad():
        again, _ = linear_cross_entropy(x, w, b, t, 8)
    assert torch.allclose(again, loss.detach())


def test_no_n_by_v_tensor_is_created_forward_or_backward():
    n, h, v, chunk = 512, 8, 1000, 16
    x, w, b, t = _problem(n=n, h=h, v=v)
    with LargestTensor() as chunked:
        loss, _ = linear_cross_entropy(x, w, b, t, chunk)
        loss.backward()
    with LargestTensor() as plain:
        _plain(x, w, b, t)[0].backward()
    assert plain.largest >= n * v  # the detector sees the plain path's logits
    assert chunked.largest <= max(chunk * v, v * h, n * h), chunked.largest


def _roberta_encoder():
    torch.manual_seed(0)
    cfg = RobertaConfig(
        vocab_size=SPECIAL.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=66,
        pad_token_id=SPECIAL.pad,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return RobertaForMaskedLM(cfg)


def _bert_encoder():
    torch.manual_seed(0)
    return build_encoder(EncoderConfig(name="tiny", dropout=0.0), SPECIAL.vocab_size, SPECIAL.pad)


@pytest.mark.parametrize("objective", ["retromae", "dupmae", "seed", "mlm"])
@pytest.mark.parametrize("make", [_bert_encoder, _roberta_encoder])
def test_pretraining_loss_and_gradients_equal_the_plain_head(objective, make):
    encoder = make()
    assert head_parts(encoder.cls if hasattr(encoder, "cls") else encoder.lm_head) is not None
    batch = batch_of([9, 40, 17])
    results = []
    for head in ("plain", "chunked"):
        torch.manual_seed(1)
        model = PretrainModel(
            copy.deepcopy(encoder), ObjectiveConfig(name=objective, head=head, head_chunk=7)
        )
        out = model(batch)
        out["loss"].backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((out, grads))
    (plain, g_plain), (chunked, g_chunked) = results
    for key in plain:
        assert torch.allclose(plain[key].float(), chunked[key].float(), rtol=1e-5, atol=1e-6), key
    assert g_plain.keys() == g_chunked.keys() and len(g_plain) > 10
    for k in g_plain:
        assert torch.allclose(g_plain[k], g_chunked[k], rtol=1e-4, atol=1e-6), k


def test_an_unknown_head_is_refused_with_the_way_out():
    encoder = _bert_encoder()
    encoder.cls = torch.nn.Sequential(torch.nn.Linear(128, SPECIAL.vocab_size))
    with pytest.raises(ValueError, match="head plain"):
        PretrainModel(encoder, ObjectiveConfig())
    PretrainModel(encoder, ObjectiveConfig(head="plain"))  # the plain path takes any head
    with pytest.raises(ValueError, match="objective.head"):
        ObjectiveConfig(head="fused")
