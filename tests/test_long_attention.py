"""Encoder attention without an L×L padding mask (modeling/long_attention.py): the same outputs
and gradients as transformers' own sdpa and eager paths, and no L×L tensor on a padded batch."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
    RobertaConfig,
    RobertaForMaskedLM,
)

from retromae_ds.modeling.encoder import EncoderConfig, build_encoder, set_attention_dropout
from retromae_ds.modeling.load import load_pretrained
from retromae_ds.modeling.long_attention import NAME, broadcast_padding_mask, use_broadcast_mask

from helpers_model import SMALL_CONFIG, LargestTensor


def _model(kind: str, positions: int = 512, impl: str = "sdpa"):
    torch.manual_seed(0)
    if kind == "bert":
        return BertForMaskedLM(
            BertConfig(max_position_embeddings=positions, attn_implementation=impl, **SMALL_CONFIG)
        )
    return RobertaForMaskedLM(
        RobertaConfig(
            max_position_embeddings=positions + 2,
            pad_token_id=1,
            attn_implementation=impl,
            **SMALL_CONFIG,
        )
    )


def _batch(length: int, pad: int):
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, 100, (3, length), generator=g)
    mask = torch.ones_like(ids)
    for row, keep in ((1, length // 2), (2, 5)):
        mask[row, keep:], ids[row, keep:] = 0, pad
    return ids, mask


def _run(model, ids, mask):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask).logits
    (out * mask[..., None]).square().mean().backward()
    return out.detach(), {
        k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("kind,pad", [("bert", 0), ("roberta", 1)])
def test_same_outputs_and_gradients_as_sdpa_and_eager(kind, pad):
    ids, mask = _batch(300, pad)
    base = _model(kind).train()
    eager = copy.deepcopy(base)
    eager.set_attn_implementation("eager")
    ours = copy.deepcopy(base)
    assert use_broadcast_mask(ours) and ours.config._attn_implementation == NAME
    out_sdpa, g_sdpa = _run(base, ids, mask)
    out_eager, _ = _run(eager, ids, mask)
    out_ours, g_ours = _run(ours, ids, mask)
    valid = mask.bool()
    assert torch.allclose(out_ours[valid], out_sdpa[valid], atol=1e-5)
    assert torch.allclose(out_ours[valid], out_eager[valid], atol=1e-4)
    assert g_ours.keys() == g_sdpa.keys()
    for k in g_sdpa:
        assert torch.allclose(g_ours[k], g_sdpa[k], rtol=1e-4, atol=1e-6), k


def test_a_padded_long_batch_never_holds_an_l_by_l_tensor():
    length = 1024
    ids, mask = _batch(length, 0)
    plain, ours = _model("bert", length), _model("bert", length)
    use_broadcast_mask(ours)
    with LargestTensor(storage=True) as seen_plain:
        _run(plain.train(), ids, mask)
    with LargestTensor(storage=True) as seen_ours:
        _run(ours.train(), ids, mask)
    assert seen_plain.largest >= length * length  # sdpa's own path does materialise it
    assert seen_ours.largest < length * length, seen_ours.largest


def test_masks_that_vary_along_the_query_axis_pass_through():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].expand(2, 1, 4, 4)
    assert broadcast_padding_mask(causal) is causal
    padding = torch.ones(2, 1, 1, 4, dtype=torch.bool).expand(2, 1, 4, 4)
    assert broadcast_padding_mask(padding).shape == (2, 1, 1, 4)
    assert broadcast_padding_mask(None) is None


def test_loaded_and_built_encoders_use_it_and_attention_dropout_is_set(tmp_path):
    _model("roberta").save_pretrained(str(tmp_path))
    assert load_pretrained(AutoModelForMaskedLM, tmp_path).config._attn_implementation == NAME
    eager = _model("bert", impl="eager")
    assert not use_broadcast_mask(eager)  # another implementation is left alone
    model = build_encoder(EncoderConfig(name=str(tmp_path), attention_dropout=0.0), 100, 1)
    assert model.config._attn_implementation == NAME
    set_attention_dropout(model, 0.25)
    drops = [m.dropout.p for m in model.modules() if type(m).__name__.endswith("SelfAttention")]
    assert drops == [0.25, 0.25] and model.config.attention_probs_dropout_prob == 0.25
    with pytest.raises(ValueError, match="attention_dropout"):
        EncoderConfig(name="tiny", attention_dropout=1.0)


def test_a_transformers_without_the_interfaces_keeps_sdpa(monkeypatch):
    """Before transformers 4.53 there is no attention / mask interface to register with
    (the benchmark against FlagEmbedding 1.2.11 runs on 4.46.3): the model keeps ``sdpa``."""
    import sys

    from retromae_ds.modeling import long_attention

    monkeypatch.setattr(long_attention, "_registered", False)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)  # import -> ImportError
    model = _model("bert")
    assert not use_broadcast_mask(model)
    assert model.config._attn_implementation == "sdpa"
    ids, mask = _batch(16, 0)
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits).all()
