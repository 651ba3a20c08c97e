"""SEED-Encoder: the weak decoder's window mask and its loss against a straightforward
per-position re-implementation (explicit loops, attention over the visible set only)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from retromae_ds.attention.rules import window_visible_dense
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

from helpers_model import SPECIAL, batch_of, layer_norm


def visible_positions(t: int, length: int, window: int | None) -> list[int]:
    """Position 0 (sentence embedding) and the positions holding the previous `window`
    tokens: t-window+1 .. t (position t holds token t-1)."""
    lo = 1 if window is None else max(1, t - window + 1)
    return [0] + [j for j in range(lo, t + 1) if j < length and j >= 1]


@pytest.mark.parametrize("window", [1, 2, 8, None])
def test_window_mask_is_the_stated_rule(window):
    lengths = torch.tensor([5, 12, 9])
    dense = window_visible_dense(lengths, 12, window)
    for b, length in enumerate(lengths.tolist()):
        for t in range(12):
            expected = set(visible_positions(t, length, window))
            assert set(torch.nonzero(dense[b, t]).flatten().tolist()) == expected


def reference_seed_loss(model: PretrainModel, batch, window) -> float:
    enc, emb, head = model.encoder, model.encoder.bert.embeddings, model.encoder.cls
    hidden = enc.bert(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    pos, tok_type = emb.position_embeddings.weight, emb.token_type_embeddings.weight[0]
    B, L = batch["input_ids"].shape
    terms = []
    for b in range(B):
        length = int(batch["lengths"][b])
        orig = batch["original_ids"][b]
        # the stream: CLS vector, then token t-1 at position t
        x = [hidden[b, 0]] + [
            layer_norm(emb.word_embeddings.weight[orig[t - 1]] + pos[t] + tok_type, emb.LayerNorm)
            for t in range(1, L)
        ]
        x = torch.stack(x)
        for layer in model.decoder:
            q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
            d, heads = layer.head_dim, layer.heads
            out = []
            for t in range(L):
                vis = visible_positions(t, length, window)
                head_outs = []
                for h in range(heads):
                    sl = slice(h * d, (h + 1) * d)
                    w = torch.softmax(
                        torch.stack([q[t, sl] @ k[j, sl] / math.sqrt(d) for j in vis]), 0
                    )
                    head_outs.append(sum(wi * v[j, sl] for wi, j in zip(w, vis, strict=True)))
                a = layer_norm(x[t] + layer.o_proj(torch.cat(head_outs)), layer.attn_norm)
                out.append(layer_norm(a + layer.ffn_out(F.gelu(layer.ffn_in(a))), layer.ffn_norm))
            x = torch.stack(out)
        for t in range(L):
            target = int(batch["decoder_labels"][b, t])
            if target != -100:
                terms.append(-torch.log_softmax(head(x[t][None])[0], -1)[target])
    return float(torch.stack(terms).mean())


@pytest.mark.parametrize(("window", "strong"), [(2, False), (1, False), (2, True)])
def test_seed_loss_equals_the_straightforward_decoder(window, strong):
    torch.manual_seed(0)
    encoder = build_encoder(
        EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0), SPECIAL.vocab_size, 0
    )
    objective = ObjectiveConfig(name="seed", decoder_layers=2, window=window, strong_decoder=strong)
    model = PretrainModel(encoder, objective).eval()
    batch = batch_of([9, 14, 4])
    with torch.no_grad():
        out = model(batch)
        expected = reference_seed_loss(model, batch, None if strong else window)
    assert float(out["decoder_loss"]) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert len(model.decoder) == 2


def test_the_weak_decoder_depends_on_the_sentence_embedding():
    torch.manual_seed(0)
    encoder = build_encoder(
        EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0), SPECIAL.vocab_size, 0
    )
    model = PretrainModel(encoder, ObjectiveConfig(name="seed", mlm_weight=0.0))
    model(batch_of([12, 9]))["loss"].backward()
    grad = model.encoder.bert.encoder.layer[-1].output.dense.weight.grad
    assert grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize(
    "backend,strong", [("window", False), ("chunked", False), ("chunked", True), ("auto", False)]
)
def test_seed_model_on_fast_backends_equals_reference(backend, strong):
    batch = batch_of([9, 14, 4, 30])
    losses, grads = [], []
    for name in ("reference", backend):
        torch.manual_seed(0)
        encoder = build_encoder(
            EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0),
            SPECIAL.vocab_size,
            0,
        )
        objective = ObjectiveConfig(name="seed", attention=name, strong_decoder=strong)
        model = PretrainModel(encoder, objective)
        out = model(batch)
        out["loss"].backward()
        losses.append(float(out["loss"]))
        grads.append(model.decoder[0].q_proj.weight.grad.clone())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
