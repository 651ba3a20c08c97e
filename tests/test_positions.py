"""Position extension (modeling/positions.py): BERT and RoBERTa-style checkpoints read longer
inputs, keep their outputs for inputs that fit the old length, and save / load back at N."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
    RobertaConfig,
    RobertaForMaskedLM,
    XLMRobertaConfig,
    XLMRobertaForMaskedLM,
)

from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.positions import extend_positions, position_offset, usable_positions

from helpers_model import SMALL_CONFIG


def _bert():
    torch.manual_seed(0)
    return BertForMaskedLM(
        BertConfig(max_position_embeddings=64, pad_token_id=0, **SMALL_CONFIG)
    ).eval()


def _roberta():
    torch.manual_seed(0)
    # RoBERTa numbers positions from padding_idx + 1: 66 rows, 64 usable positions
    return RobertaForMaskedLM(
        RobertaConfig(max_position_embeddings=66, pad_token_id=1, **SMALL_CONFIG)
    ).eval()


def _xlmr():
    torch.manual_seed(0)
    return XLMRobertaForMaskedLM(
        XLMRobertaConfig(max_position_embeddings=66, pad_token_id=1, **SMALL_CONFIG)
    ).eval()


def _inputs(length: int, batch: int = 2, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, 100, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0  # the second row padded: padding must behave as before
    ids[1, length // 2 :] = pad
    return ids, mask


@pytest.mark.parametrize("make,pad,offset", [(_bert, 0, 0), (_roberta, 1, 2), (_xlmr, 1, 2)])
def test_extension_keeps_short_inputs_exactly_and_reads_long_ones(make, pad, offset):
    model = make()
    assert position_offset(model) == offset and usable_positions(model) == 64
    short = [_inputs(n, pad=pad) for n in (5, 64)]
    with torch.no_grad():
        before = [model(input_ids=i, attention_mask=m).logits for i, m in short]
    old = model.base_model.embeddings.position_embeddings.weight.detach().clone()

    assert extend_positions(model, 200)
    assert usable_positions(model) == 200
    assert model.config.max_position_embeddings == 200 + offset
    new = model.base_model.embeddings.position_embeddings.weight.detach()
    assert new.shape == (200 + offset, 32)
    # the offset rows kept, every new position a copy of the trained one at p mod 64
    assert torch.equal(new[:offset], old[:offset])
    for p in (0, 63, 64, 100, 199):
        assert torch.equal(new[offset + p], old[offset + p % 64]), p
    with torch.no_grad():
        after = [model(input_ids=i, attention_mask=m).logits for i, m in short]
        for b, a in zip(before, after, strict=True):
            assert torch.equal(b, a)
        ids, mask = _inputs(200, pad=pad)
        long_out = model(input_ids=ids, attention_mask=mask).logits
    assert long_out.shape == (2, 200, 100) and torch.isfinite(long_out).all()
    assert not extend_positions(model, 150)  # already long enough: unchanged
    assert usable_positions(model) == 200


@pytest.mark.parametrize("make,pad", [(_bert, 0), (_roberta, 1), (_xlmr, 1)])
def test_extended_model_saves_and_loads_back_at_n(tmp_path, make, pad):
    model = make()
    extend_positions(model, 150)
    model.save_pretrained(str(tmp_path))
    loaded = AutoModelForMaskedLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    assert usable_positions(loaded) == 150
    ids, mask = _inputs(150, pad=pad)
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=ids, attention_mask=mask).logits,
            loaded(input_ids=ids, attention_mask=mask).logits,
        )


def test_the_encoder_config_extends_a_checkpoint_and_a_too_short_model_is_refused(tmp_path):
    _roberta().save_pretrained(str(tmp_path / "ckpt"))
    cfg = EncoderConfig(name=str(tmp_path / "ckpt"), max_positions=300)
    model = build_encoder(cfg, vocab_size=100, pad_id=1)
    assert usable_positions(model) == 300 and model.config.max_position_embeddings == 302
    plain = build_encoder(EncoderConfig(name=str(tmp_path / "ckpt")), vocab_size=100, pad_id=1)
    assert usable_positions(plain) == 64
    preset = build_encoder(EncoderConfig(name="tiny", max_positions=1024), 100, 0)
    assert usable_positions(preset) == 1024
    with pytest.raises(ValueError, match="max_positions"):
        EncoderConfig(name="tiny", max_positions=-1)


def test_only_absolute_positions_are_extended():
    model = _bert()
    model.config.position_embedding_type = "relative_key"
    with pytest.raises(ValueError, match="relative_key"):
        extend_positions(model, 128)
