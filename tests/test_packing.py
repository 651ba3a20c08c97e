"""Packed rows against each document alone: the layout, the collator, every decoder rule and
attention backend, and the objectives' losses and gradients.

A packed batch must train exactly what the padded batch of the same documents trains: the
same tokens masked, the same visibility inside each document and none across documents, the
same loss per real token (to float rounding: sums run in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.attention import TwoStreamSpec, WindowSpec, attend
from retromae_ds.attention.flex import block_visibility, mask_mod_for
from retromae_ds.attention.packing import Packing, packing_of
from retromae_ds.attention.rules import two_stream_visible_dense, window_visible_dense
from retromae_ds.data.collate import MaskingConfig, PackedLayout, PretrainCollator
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

from helpers_model import SMALL_CONFIG, SPECIAL

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none visible to torch)")


def _items(lengths: list[int], seed: int = 0) -> list[tuple[int, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    items = []
    for index, n in enumerate(lengths):
        ids = rng.integers(5, SPECIAL.vocab_size, n).astype(np.int32)
        starts = (rng.random(n) < 0.6).astype(np.uint8)
        items.append((100 + index, ids, starts))
    return items


def _batches(lengths, max_length=64, seed=0, decoder=True):
    """(padded, packed) batches of the same documents."""
    items = _items(lengths, seed)
    plain = PretrainCollator(SPECIAL, MaskingConfig(), max_length, seed=seed, decoder=decoder)
    packed = PretrainCollator(
        SPECIAL, MaskingConfig(), max_length, seed=seed, decoder=decoder, pack=True
    )
    return plain(items), packed(items)


def _placement(packed: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(row, offset, length) of each document, read back from ``doc_ids``."""
    docs = packed["doc_ids"]
    out = []
    for d in range(len(packed["sample_index"])):
        rows, cols = torch.nonzero(docs == d, as_tuple=True)
        assert len(set(rows.tolist())) == 1, f"document {d} spans rows"
        first, n = int(cols.min()), len(cols)
        assert cols.tolist() == list(range(first, first + n)), f"document {d} is not contiguous"
        out.append((int(rows[0]), first, n))
    return out


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    capacity=st.integers(64, 200),
    multiple=st.sampled_from([1, 8]),
)
def test_first_fit_layout_places_every_document_once_within_capacity(lengths, capacity, multiple):
    lengths = np.asarray(lengths, dtype=np.int64)
    layout = PackedLayout.first_fit(lengths, capacity, multiple)
    R, W = layout.shape
    assert capacity >= W and (W % multiple == 0 or capacity == W)
    assert len(lengths) >= R
    used = np.zeros((R, W), dtype=np.int64)
    for r, o, n in zip(layout.rows, layout.offsets, lengths, strict=True):
        assert o + n <= W
        used[r, o : o + n] += 1
    assert used.max() == 1 and used.sum() == lengths.sum()
    # first fit decreasing: a document opened a new row only when it fit no earlier row
    first_of_row = {}
    for d in np.lexsort((np.arange(len(lengths)), -lengths)):
        first_of_row.setdefault(int(layout.rows[d]), int(d))
    for r, d in first_of_row.items():
        for earlier in range(r):
            before = lengths[(layout.rows == earlier) & (lengths > lengths[d])].sum() + sum(
                lengths[e]
                for e in range(len(lengths))
                if layout.rows[e] == earlier and lengths[e] == lengths[d] and e < d
            )
            assert before + lengths[d] > capacity
    docs = layout.doc_ids
    assert (docs >= 0).sum() == lengths.sum()
    assert (layout.position_ids[docs >= 0] < capacity).all()


def test_packed_batch_holds_each_document_exactly_as_the_padded_batch():
    lengths = [5, 40, 12, 3, 60, 7, 22, 9, 1, 30]
    plain, packed = _batches(lengths)
    B, L = plain["input_ids"].shape
    R, W = packed["input_ids"].shape
    assert R < B and R * W < B * L
    assert torch.equal(plain["sample_index"], packed["sample_index"])
    assert torch.equal(plain["decoder_seed"], packed["decoder_seed"])
    assert int(packed["attention_mask"].sum()) == int(plain["attention_mask"].sum())
    for d, (r, o, n) in enumerate(_placement(packed)):
        assert n == int(plain["lengths"][d])
        assert torch.equal(packed["position_ids"][r, o : o + n], torch.arange(n))
        for key in ("input_ids", "labels", "original_ids", "decoder_labels", "word_ids"):
            assert torch.equal(packed[key][r, o : o + n], plain[key][d, :n]), key
    for positions, labels in (
        ("label_positions", "labels"),
        ("decoder_label_positions", "decoder_labels"),
    ):
        flat = packed[labels].flatten()
        assert torch.equal(
            flat[packed[positions]].sort().values, plain[labels][plain[labels] >= 0].sort().values
        )
        assert torch.equal(packed[positions], torch.nonzero(flat >= 0).flatten())


RULES = [("two_stream", r) for r in (0.3, 0.5, 0.7)] + [("window", w) for w in (1, 2, 8, None)]


def _specs(rule, param, plain, packed):
    if rule == "two_stream":
        return (
            TwoStreamSpec(plain["word_ids"], plain["lengths"], plain["decoder_seed"], param),
            TwoStreamSpec(
                packed["word_ids"],
                packed["lengths"],
                packing_of(packed).per_position(packed["decoder_seed"]),
                param,
                packing_of(packed),
            ),
        )
    return (
        WindowSpec(plain["lengths"], param),
        WindowSpec(packed["lengths"], param, packing_of(packed)),
    )


@pytest.mark.parametrize("rule,param", RULES)
def test_packed_rules_are_each_documents_own_rule_and_nothing_across(rule, param):
    plain, packed = _batches([5, 40, 12, 3, 60, 7, 22, 9, 1, 30], seed=3)
    alone, together = _specs(rule, param, plain, packed)
    L, W = plain["input_ids"].shape[1], packed["input_ids"].shape[1]
    dense_alone, dense_packed = alone.dense(L), together.dense(W)
    covered = torch.zeros_like(dense_packed)
    for d, (r, o, n) in enumerate(_placement(packed)):
        assert torch.equal(dense_packed[r, o : o + n, o : o + n], dense_alone[d, :n, :n])
        assert dense_packed[r, o : o + n].sum() == dense_alone[d, :n, :n].sum()  # nothing else
        covered[r, o : o + n] = True
    # a padding query sees itself only
    pad = ~covered.any(-1)
    rows, queries = torch.nonzero(pad, as_tuple=True)
    assert torch.equal(dense_packed[rows, queries], torch.nn.functional.one_hot(queries, W).bool())


def test_the_rule_functions_take_packing_and_agree_with_the_specs():
    plain, packed = _batches([9, 30, 4, 17], seed=1)
    packing, W = packing_of(packed), packed["input_ids"].shape[1]
    seeds = packing.per_position(packed["decoder_seed"])
    spec = TwoStreamSpec(packed["word_ids"], packed["lengths"], seeds, 0.5, packing)
    assert torch.equal(
        spec.dense(W),
        two_stream_visible_dense(packed["word_ids"], packed["lengths"], seeds, 0.5, packing),
    )
    assert torch.equal(
        WindowSpec(packed["lengths"], 2, packing).dense(W),
        window_visible_dense(packed["lengths"], W, 2, packing),
    )


@pytest.mark.parametrize("rule,param", RULES)
def test_flex_packed_mask_mod_and_block_mask_cover_the_rule(rule, param):
    plain, packed = _batches([5, 40, 12, 3, 60, 7, 22, 9, 1, 30, 64, 50], max_length=160, seed=4)
    _, spec = _specs(rule, param, plain, packed)
    R, W = packed["input_ids"].shape
    dense = spec.dense(W)
    mod = mask_mod_for(spec, W, torch.device("cpu"))
    b = torch.arange(R).view(R, 1, 1)
    q = torch.arange(W).view(1, W, 1)
    kv = torch.arange(W).view(1, 1, W)
    assert torch.equal(mod(b, torch.zeros((), dtype=torch.long), q, kv).expand_as(dense), dense)
    block = 16
    any_, full = block_visibility(spec, W, torch.device("cpu"), block)
    n = -(-W // block)
    padded = torch.zeros(R, n * block, n * block, dtype=torch.bool)
    padded[:, :W, :W] = dense
    seen = padded.view(R, n, block, n, block).any(4).any(2)
    assert not (seen & ~any_).any(), "a visible pair lies in a block the block mask skips"
    assert not full.any()
    # documents apart: most blocks skipped
    assert any_.sum() < any_.numel()


def _qkv(B, H, L, D, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).requires_grad_(True) for _ in range(3)]


@pytest.mark.parametrize(
    "rule,param,backend",
    [("two_stream", 0.5, "chunked"), ("two_stream", 0.3, "chunked")]
    + [("window", w, "chunked") for w in (2, None)]
    + [("window", w, "window") for w in (1, 2, 8)],
)
def test_packed_backends_equal_reference_forward_and_backward(rule, param, backend):
    plain, packed = _batches([5, 40, 12, 3, 60, 7, 22, 9, 1, 30], seed=5)
    _, spec = _specs(rule, param, plain, packed)
    R, W = packed["input_ids"].shape
    q, k, v = _qkv(R, 2, W, 8, seed=7)
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = attend(q, k, v, spec, "reference")
    out = attend(q2, k2, v2, spec, backend)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rule,param", [("two_stream", 0.5), ("window", 2)])
def test_flex_packed_forward_equals_reference_on_cpu(rule, param):
    plain, packed = _batches([5, 40, 12, 3, 60, 7, 22, 9, 1, 30], seed=6)
    _, spec = _specs(rule, param, plain, packed)
    R, W = packed["input_ids"].shape
    with torch.no_grad():
        q, k, v = (x.detach() for x in _qkv(R, 2, W, 8, seed=8))
        ref = attend(q, k, v, spec, "reference")
        out = attend(q, k, v, spec, "flex")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _model(name, backend, family="bert", seed=0):
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(seed)
    if family == "bert":
        encoder = BertForMaskedLM(BertConfig(**SMALL_CONFIG))
    else:
        encoder = RobertaForMaskedLM(
            RobertaConfig(**SMALL_CONFIG, max_position_embeddings=130, pad_token_id=1)
        )
    return PretrainModel(encoder, ObjectiveConfig(name=name, attention=backend)).eval()


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(batch)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize(
    "name,backend,family",
    [
        ("retromae", "chunked", "bert"),
        ("retromae", "reference", "bert"),
        ("retromae", "chunked", "roberta"),
        ("seed", "window", "bert"),
        ("seed", "chunked", "roberta"),
        ("mlm", "auto", "bert"),
        ("dupmae", "chunked", "bert"),
        ("dupmae", "reference", "roberta"),
    ],
)
def test_packed_loss_per_real_token_and_gradients_equal_the_padded_batch(name, backend, family):
    plain, packed = _batches([5, 40, 12, 3, 60, 7, 22, 9, 1, 30], seed=2, decoder=name != "mlm")
    model = _model(name, backend, family)
    out_plain, grads_plain = _loss_and_grads(model, plain)
    out_packed, grads_packed = _loss_and_grads(model, packed)
    keys = ("mlm_accuracy", "decoder_accuracy", "bow_loss", "bow_recall")
    for key in ("loss", "mlm_loss", "decoder_loss", *keys):
        if key in out_plain:
            torch.testing.assert_close(out_packed[key], out_plain[key], rtol=1e-5, atol=1e-6)
    assert grads_plain.keys() == grads_packed.keys()
    for n in grads_plain:
        torch.testing.assert_close(grads_packed[n], grads_plain[n], rtol=1e-4, atol=1e-6, msg=n)


def test_documents_in_one_row_do_not_see_each_other():
    """Change one document's tokens: the other documents of its row keep their states."""
    from retromae_ds.modeling.encoder import encode

    _, packed = _batches([20, 25, 10], max_length=64, seed=9)
    model = _model("retromae", "chunked")
    packing = packing_of(packed)
    assert packed["input_ids"].shape[0] == 1  # all three share a row
    with torch.no_grad():
        before = encode(model.encoder, packed["input_ids"], packed["attention_mask"], packing)
        changed = packed["input_ids"].clone()
        changed[packed["doc_ids"] == 1] = 7
        after = encode(model.encoder, changed, packed["attention_mask"], packing)
    other = packed["doc_ids"][0] != 1
    torch.testing.assert_close(after[0, other], before[0, other], rtol=0, atol=0)
    assert not torch.allclose(after[0, ~other], before[0, ~other])


def test_eager_attention_gets_an_additive_packed_mask():
    from retromae_ds.modeling.encoder import encode

    plain, packed = _batches([20, 25, 10], max_length=64, seed=9)
    model = _model("mlm", "auto")
    model.encoder.set_attn_implementation("eager")
    with torch.no_grad():
        alone = encode(model.encoder, plain["input_ids"], plain["attention_mask"])
        together = encode(
            model.encoder, packed["input_ids"], packed["attention_mask"], packing_of(packed)
        )
    for d, (r, o, n) in enumerate(_placement(packed)):
        torch.testing.assert_close(together[r, o : o + n], alone[d, :n], rtol=1e-5, atol=1e-5)


def test_packing_dataclass_starts_and_firsts():
    p = Packing(torch.tensor([[0, 0, 0, 1, 1, -1]]), torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert p.starts().tolist() == [[0, 0, 0, 3, 3, 5]]
    assert p.is_first().tolist() == [[True, False, False, True, False, False]]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["retromae", "seed"])
def test_packed_decoders_on_flexattention_equal_reference_on_cuda(name):
    plain, packed = _batches([5, 40, 12, 3, 60, 7, 22, 9, 1, 30], seed=2)
    batch = {k: v.cuda() for k, v in packed.items()}
    losses = {}
    for backend in ("reference", "flex"):
        model = _model(name, backend).cuda()
        out, grads = _loss_and_grads(model, batch)
        losses[backend] = (out["loss"].detach(), grads)
    torch.testing.assert_close(losses["flex"][0], losses["reference"][0], rtol=1e-4, atol=1e-5)
    for n, g in losses["reference"][1].items():
        torch.testing.assert_close(losses["flex"][1][n], g, rtol=1e-3, atol=1e-4, msg=n)
