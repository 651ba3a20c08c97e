"""The RetroMAE loss on a fixed batch against a straightforward re-implementation of the
paper's formulas, written here with explicit per-row, per-query loops and its own hash."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

from helpers_model import batch_of, layer_norm


def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def py_visible(seed: int, i: int, j: int, word_j: int, length: int, ratio: float) -> bool:
    """The paper's position-specific mask: CLS column always, never itself, never padding,
    other words hidden with probability ``ratio`` independently per query position."""
    if j == 0:
        return True
    if j >= length or j == i:
        return False
    h = py_mix32((seed ^ 0x9E3779B9) & 0xFFFFFFFF)
    h = py_mix32(h ^ i)
    h = py_mix32(h ^ word_j)
    return h >= round(ratio * 2**32)


def reference_loss(model: PretrainModel, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    enc = model.encoder
    emb = enc.bert.embeddings
    head = enc.cls
    hidden = enc.bert(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    # encoder MLM: mean cross-entropy over the masked positions
    terms = []
    for b, i in zip(*torch.nonzero(batch["labels"] != -100, as_tuple=True), strict=True):
        logp = torch.log_softmax(head(hidden[b, i][None])[0], -1)
        terms.append(-logp[batch["labels"][b, i]])
    mlm = torch.stack(terms).mean()

    dec = model.decoder
    heads, d = dec.heads, dec.head_dim
    pos, tok_type = emb.position_embeddings.weight, emb.token_type_embeddings.weight[0]
    dec_terms = []
    B, L = batch["input_ids"].shape
    for b in range(B):
        cls = hidden[b, 0]
        length = int(batch["lengths"][b])
        seed = int(batch["decoder_seed"][b])
        words = batch["word_ids"][b].tolist()
        # key/value stream: CLS, then embeddings of the unmasked original tokens with positions
        kv = [cls] + [
            layer_norm(
                emb.word_embeddings.weight[batch["original_ids"][b, j]] + pos[j] + tok_type,
                emb.LayerNorm,
            )
            for j in range(1, L)
        ]
        kv = torch.stack(kv)
        keys, values = dec.k_proj(kv), dec.v_proj(kv)
        for i in range(L):
            target = int(batch["decoder_labels"][b, i])
            if target == -100:
                continue
            query = layer_norm(cls + pos[i] + tok_type, emb.LayerNorm)  # H1[i]
            q = dec.q_proj(query)
            visible = [j for j in range(L) if py_visible(seed, i, j, max(words[j], 0), length, 0.5)]
            head_outs = []
            for h in range(heads):
                sl = slice(h * d, (h + 1) * d)
                scores = torch.stack([q[sl] @ keys[j, sl] / math.sqrt(d) for j in visible])
                weights = torch.softmax(scores, 0)
                head_outs.append(
                    sum(w * values[j, sl] for w, j in zip(weights, visible, strict=True))
                )
            attn = dec.o_proj(torch.cat(head_outs))
            x = layer_norm(query + attn, dec.attn_norm)
            y = layer_norm(x + dec.ffn_out(F.gelu(dec.ffn_in(x))), dec.ffn_norm)
            logp = torch.log_softmax(head(y[None])[0], -1)
            dec_terms.append(-logp[target])
    return float(mlm), float(torch.stack(dec_terms).mean())


@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
@pytest.mark.parametrize("rows", [[7, 19, 12], [30, 3]])
def test_retromae_loss_equals_the_papers_formulas(rows, backend):
    torch.manual_seed(0)
    encoder = build_encoder(
        EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0), 60, 0
    )
    objective = ObjectiveConfig(name="retromae", attention=backend)
    model = PretrainModel(encoder, objective).eval()
    batch = batch_of(rows)
    with torch.no_grad():
        out = model(batch)
        mlm, dec = reference_loss(model, batch)
    assert float(out["mlm_loss"]) == pytest.approx(mlm, rel=1e-5, abs=1e-5)
    assert float(out["decoder_loss"]) == pytest.approx(dec, rel=1e-5, abs=1e-5)
    assert float(out["loss"]) == pytest.approx(mlm + dec, rel=1e-5, abs=1e-5)


def test_loss_weights_and_mlm_control():
    torch.manual_seed(0)
    encoder = build_encoder(
        EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0), 60, 0
    )
    batch = batch_of([10, 20])
    weighted = PretrainModel(encoder, ObjectiveConfig(mlm_weight=0.5, decoder_weight=2.0)).eval()
    mlm_only = PretrainModel(encoder, ObjectiveConfig(name="mlm")).eval()
    with torch.no_grad():
        w = weighted(batch)
        m = mlm_only(batch)
    assert float(w["loss"]) == pytest.approx(
        0.5 * float(w["mlm_loss"]) + 2.0 * float(w["decoder_loss"]), rel=1e-6
    )
    assert not hasattr(mlm_only, "decoder") and "decoder_loss" not in m
    assert float(m["loss"]) == pytest.approx(float(w["mlm_loss"]), rel=1e-6)


def test_gradients_reach_encoder_through_the_decoder_alone():
    torch.manual_seed(0)
    encoder = build_encoder(
        EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0), 60, 0
    )
    model = PretrainModel(encoder, ObjectiveConfig(mlm_weight=0.0))
    model(batch_of([12, 9]))["loss"].backward()
    # the sentence embedding is the decoder's only view of the input: the encoder's last layer
    # must receive gradient from the reconstruction loss alone
    last = model.encoder.bert.encoder.layer[-1].output.dense.weight.grad
    assert last is not None and last.abs().sum() > 0


def test_gradient_checkpointing_switch_reaches_the_encoder():
    on = build_encoder(
        EncoderConfig(name="tiny", max_position_embeddings=64, gradient_checkpointing=True), 60, 0
    )
    off = build_encoder(EncoderConfig(name="tiny", max_position_embeddings=64), 60, 0)
    flag = (
        "is_activation_checkpointing"
        if hasattr(on, "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    assert getattr(on, flag) and not getattr(off, flag)


def test_retromae_training_step_is_the_same_on_every_cpu_backend():
    batch = batch_of([9, 40, 17])
    losses, grads = [], []
    for backend in ("reference", "chunked"):
        torch.manual_seed(0)
        encoder = build_encoder(
            EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0), 60, 0
        )
        model = PretrainModel(encoder, ObjectiveConfig(attention=backend))
        out = model(batch)
        out["loss"].backward()
        losses.append(float(out["loss"]))
        grads.append(
            [
                model.decoder.k_proj.weight.grad.clone(),
                model.encoder.bert.embeddings.word_embeddings.weight.grad.clone(),
            ]
        )
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_unknown_attention_backend_is_rejected_by_the_config():
    with pytest.raises(ValueError, match="objective.attention"):
        ObjectiveConfig(attention="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("objective", ["retromae", "seed"])
def test_decoders_on_flexattention_equal_reference_on_cuda(objective):
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = {k: v.cuda() for k, v in batch_of([9, 40, 17]).items()}
    losses, grads = [], []
    for backend in ("reference", "flex"):
        torch.manual_seed(0)
        encoder = build_encoder(
            EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0), 60, 0
        )
        model = PretrainModel(encoder, ObjectiveConfig(name=objective, attention=backend))
        out = model.cuda()(batch)
        out["loss"].backward()
        losses.append(float(out["loss"]))
        grads.append(model.encoder.bert.embeddings.word_embeddings.weight.grad.clone())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)
