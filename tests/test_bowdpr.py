"""bowdpr ("Drop your Decoder"): the [CLS] vector's bag-of-words loss against a plain loop
written here, packed rows the same as padded ones, no parameter beyond the encoder's, and
training with exact resume through ``retromae-ds pretrain --model.objective.name bowdpr``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_train import metrics, pretrain
from helpers_train import synthetic_shards as make_shards

from retromae_ds.components import checkpoint as ckpt
from retromae_ds.data.collate import MaskingConfig, PretrainCollator
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

from helpers_model import SPECIAL

UNK = 1  # in SPECIAL.all: an [UNK] inside a text is no ordinary token


def _model(**settings) -> PretrainModel:
    torch.manual_seed(0)
    encoder = build_encoder(
        EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0),
        SPECIAL.vocab_size,
        SPECIAL.pad,
    )
    return PretrainModel(encoder, ObjectiveConfig(name="bowdpr", **settings))


def _items() -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Repeated tokens, an [UNK] inside a text, a text with no token at all, a long one."""
    rng = np.random.default_rng(3)
    texts = [[5, 6, 5, 7, 5, 6], [8, UNK, 9, 9], [], list(rng.integers(5, SPECIAL.vocab_size, 40))]
    return [
        (i, np.asarray(t, dtype=np.int32), np.ones(len(t), dtype=np.uint8))
        for i, t in enumerate(texts)
    ]


def reference_loss(model: PretrainModel, batch: dict[str, torch.Tensor]) -> float:
    """The paper's loss spelled out per document (padded rows): the MLM head at [CLS] of the
    masked input's final hidden states, then -(1/|T|) Σ over the distinct ordinary tokens of
    log softmax; the mean over documents with at least one ordinary token."""
    enc = model.encoder
    hidden = enc.bert(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    per_doc = []
    for b in range(hidden.shape[0]):
        original = batch["original_ids"][b].tolist()[: int(batch["lengths"][b])]
        distinct = {t for t in original if t not in SPECIAL.all}
        if distinct:
            log_p = torch.log_softmax(enc.cls(hidden[b, 0][None])[0], -1)
            per_doc.append(-sum(log_p[t] for t in distinct) / len(distinct))
    return float(sum(per_doc) / len(per_doc))


@pytest.mark.parametrize("pack", [False, True])
def test_the_loss_equals_a_plain_loop_and_packing_changes_nothing(pack):
    items = _items()
    padded = PretrainCollator(SPECIAL, MaskingConfig(), 64)(items)
    batch = PretrainCollator(SPECIAL, MaskingConfig(), 64, pack=pack)(items)
    assert batch["input_ids"].shape[0] == (1 if pack else 4)  # packed: all in one row
    model = _model(decoder_weight=0.7).eval()
    with torch.no_grad():
        out = model(batch)
        expected = reference_loss(model, padded)
        straight = model(padded)
    assert "decoder_loss" not in out
    assert float(out["bow_loss"]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert float(out["loss"]) == pytest.approx(
        float(out["mlm_loss"]) + 0.7 * float(out["bow_loss"]), rel=1e-6
    )
    assert float(out["bow_loss"]) == pytest.approx(float(straight["bow_loss"]), rel=1e-5)
    assert 0.0 <= float(out["bow_recall"]) <= 1.0


def test_packed_gradients_equal_padded_ones():
    items = _items()
    grads = []
    for pack in (False, True):
        model = _model(mlm_weight=0.0).eval()
        model(PretrainCollator(SPECIAL, MaskingConfig(), 64, pack=pack)(items))["loss"].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_it_has_no_decoder_and_no_parameter_beyond_the_encoders():
    model = _model()
    assert not hasattr(model, "decoder")
    assert all(name.startswith("encoder.") for name in model.state_dict())


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_dir) -> Path:
    return make_shards(tmp_path_factory.mktemp("bowdpr_shards"), tokenizer_dir, 300, seed=8)


def test_bowdpr_trains_and_resumes_exactly(tmp_path, shards):
    common = ["--max_steps", "6", "--log_every", "1", "--model.objective.name", "bowdpr"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    pretrain(straight, shards, *common)
    rows = metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["bow_loss"] < rows[0]["bow_loss"] and "decoder_loss" not in rows[-1]
    assert ckpt.read_marker(ckpt.latest_complete(straight / "checkpoints"))["objective"] == "bowdpr"
    pretrain(resumed, shards, *common, "--stop_at_step", "3")
    pretrain(resumed, shards, *common)
    keys = ("loss", "mlm_loss", "bow_loss", "bow_recall", "lr")
    again = metrics(resumed)
    assert [r["step"] for r in again] == list(range(1, 7))
    for a, b in zip(rows, again, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (a, b)
