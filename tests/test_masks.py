"""Tests of the counter-based hash (``retromae_ds.base.hashing``) and the RetroMAE two-stream
visibility (``retromae_ds.attention.rules``).

Cheapest first: ``mix32``/``hash3`` against a plain Python-int lowbias32 written here (and numpy
against torch), ``threshold`` at its edges, the hash's uniformity; then the B×L×L visibility on
batches made by the real ``PretrainCollator``: the rule itself against a Python-loop oracle,
its structural guarantees (column 0, diagonal, padding, whole words), its statistics (hidden
share, independence of query rows), and that it is a pure function of (seed, epoch, sample
index, sample content). Statistical bounds are many binomial standard deviations wide and the
inputs are fixed, so nothing here is flaky.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.attention.rules import two_stream_visible_dense
from retromae_ds.base.hashing import MASK32, hash3, mix32, threshold
from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.data.collate import MaskingConfig, PretrainCollator

FEW = settings(max_examples=40, deadline=None)
SOME = settings(max_examples=100, deadline=None)

# bert-base-uncased ids: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103
BERT = SpecialIds(cls=101, sep=102, pad=0, mask=103, all=(0, 100, 101, 102, 103), vocab_size=30522)
FIRST_REGULAR = 999

u32 = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------- oracles
def lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32, spelled out on Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    x ^= x >> 16
    return x


def hash3_py(a: int, b: int, c: int) -> int:
    """The documented composition: lowbias32 chained over (a ^ golden ratio), b, c."""
    h = lowbias32((a ^ 0x9E3779B9) % 2**32)
    h = lowbias32(h ^ (b % 2**32))
    return lowbias32(h ^ (c % 2**32))


def visible_py(word_ids: list[int], length: int, seed: int, ratio: float) -> np.ndarray:
    """The visibility rule of the design, one (i, j) at a time."""
    L = len(word_ids)
    cut = round(ratio * 2**32)
    out = np.zeros((L, L), dtype=bool)
    for i in range(L):
        for j in range(L):
            if j == 0:
                out[i, j] = True
            elif j < length and j != i:
                out[i, j] = hash3_py(seed, i, word_ids[j]) >= cut
    return out


# --------------------------------------------------------------------------- batches
def make_sample(rng: np.random.Generator, n: int, p_start: float) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(FIRST_REGULAR, BERT.vocab_size, n).astype(np.int32)
    starts = (rng.random(n) < p_start).astype(np.uint8)
    return ids, starts


@st.composite
def batches(draw, max_rows: int = 5, max_tokens: int = 60, min_tokens: int = 0):
    """Items ``(global index, ids, word_starts)`` as ``IndexedSamples`` yields them."""
    rows = draw(st.integers(1, max_rows))
    indices = draw(st.lists(st.integers(0, 2**40), min_size=rows, max_size=rows, unique=True))
    rng = np.random.default_rng(draw(u32))
    items = []
    for index in indices:
        n = draw(st.integers(min_tokens, max_tokens))
        items.append((index, *make_sample(rng, n, draw(st.sampled_from([0.2, 0.7, 1.0])))))
    return items


def collate(items, *, seed=0, epoch=0, decoder_ratio=0.5, max_length=4096):
    del decoder_ratio  # the decoder's ratio is the attention rule's (visibility), not the batch's
    collator = PretrainCollator(BERT, MaskingConfig(), max_length, seed=seed)
    collator.epoch = epoch
    return collator(items)


def visibility(batch, ratio: float) -> torch.Tensor:
    return two_stream_visible_dense(
        batch["word_ids"], batch["lengths"], batch["decoder_seed"], ratio
    )


def one_long_sample(n_words: int, tokens_per_word: int, index: int = 7):
    """A sample whose every word has ``tokens_per_word`` tokens (so each word has a position
    other than any given query position)."""
    rng = np.random.default_rng(index)
    n = n_words * tokens_per_word
    ids = rng.integers(FIRST_REGULAR, BERT.vocab_size, n).astype(np.int32)
    starts = np.zeros(n, dtype=np.uint8)
    starts[::tokens_per_word] = 1
    return index, ids, starts


def hidden_words(vis_LL: torch.Tensor, word_ids_L: torch.Tensor, length: int) -> np.ndarray:
    """hidden[i - 1, w - 1] for query rows i in 1..length-1 and content words w (SEP, the
    last word, left out), each read at a position of w other than i; -1 where w has no such
    position (a one-token word seen from its own position)."""
    word = word_ids_L[:length].numpy()
    n_words = int(word.max()) - 1
    vis = vis_LL[:length, :length].numpy()
    out = np.full((length - 1, n_words), -1, dtype=np.int64)
    for w in range(1, n_words + 1):
        pos = np.flatnonzero(word == w)
        first = np.full(length - 1, pos[0])
        if len(pos) > 1:
            first[pos[0] - 1] = pos[1]  # query row pos[0] reads the word's second position
        rows = np.arange(1, length)
        usable = first != rows
        out[usable, w - 1] = ~vis[rows[usable], first[usable]]
    return out


# =========================================================================== the hash
@SOME
@given(xs=st.lists(u32, min_size=1, max_size=50))
def test_mix32_is_lowbias32_on_python_ints_numpy_and_torch(xs):
    expected = [lowbias32(x) for x in xs]
    assert [mix32(x) for x in xs] == expected
    as_numpy = mix32(np.array(xs, dtype=np.int64))
    as_torch = mix32(torch.tensor(xs, dtype=torch.int64))
    assert as_numpy.dtype == np.int64 and as_torch.dtype == torch.int64
    assert as_numpy.tolist() == expected
    assert as_torch.tolist() == expected


@SOME
@given(a=u32, b=u32, c=u32)
def test_hash3_matches_python_ints(a, b, c):
    expected = hash3_py(a, b, c)
    assert hash3(a, b, c) == expected
    assert hash3(np.int64(a), np.int64(b), np.int64(c)) == expected
    assert int(hash3(torch.tensor(a), torch.tensor(b), torch.tensor(c))) == expected


@FEW
@given(
    a=st.lists(u32, min_size=1, max_size=4),
    b=st.lists(u32, min_size=1, max_size=5),
    c=st.lists(u32, min_size=1, max_size=6),
)
def test_hash3_broadcasts_like_elementwise_calls_in_numpy_and_torch(a, b, c):
    a_np = np.array(a, dtype=np.int64).reshape(-1, 1, 1)
    b_np = np.array(b, dtype=np.int64).reshape(1, -1, 1)
    c_np = np.array(c, dtype=np.int64).reshape(1, 1, -1)
    expected = np.array([[[hash3_py(x, y, z) for z in c] for y in b] for x in a])
    got_np = hash3(a_np, b_np, c_np)
    got_torch = hash3(torch.from_numpy(a_np), torch.from_numpy(b_np), torch.from_numpy(c_np))
    assert np.array_equal(got_np, expected)
    assert np.array_equal(got_torch.numpy(), expected)


def test_hash_values_stay_in_32_bits_at_the_extremes():
    edge = [0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    x = np.array(edge, dtype=np.int64)
    for out in (mix32(x), hash3(x[:, None, None], x[None, :, None], x[None, None, :])):
        assert out.min() >= 0 and out.max() <= MASK32
    assert mix32(np.int64(0)) == 0  # lowbias32 fixes 0: documents the seeding need (golden)
    assert hash3(0, 0, 0) != 0


def test_mix32_is_a_bijection_on_a_block():
    x = np.arange(2**18, dtype=np.int64) * 16411  # spread over the 32-bit range
    assert len(np.unique(mix32(x))) == len(x)


# --------------------------------------------------------------------------- threshold
def test_threshold_edges():
    assert threshold(0.0) == 0
    assert threshold(1.0) == 2**32
    assert threshold(0.5) == 2**31
    assert threshold(1e-12) == round(1e-12 * 2**32)
    assert threshold(np.float64(0.25)) == 2**30
    h = hash3(np.int64(5), np.arange(10_000), np.int64(3))
    assert not (h < threshold(0.0)).any()  # ratio 0 hides nothing
    assert (h < threshold(1.0)).all()  # ratio 1 hides everything


@pytest.mark.parametrize("bad", [-1e-9, -1.0, 1.0 + 1e-9, 2.0, float("nan"), float("inf")])
def test_threshold_rejects_ratios_outside_the_unit_interval(bad):
    with pytest.raises(ValueError):
        threshold(bad)


@SOME
@given(r=st.floats(0.0, 1.0), s=st.floats(0.0, 1.0))
def test_threshold_is_the_ratio_in_32_bit_units_and_monotone(r, s):
    t = threshold(r)
    assert isinstance(t, int) and 0 <= t <= 2**32
    assert abs(t - r * 2**32) <= 0.5  # r * 2**32 is exact in float64
    if r <= s:
        assert threshold(r) <= threshold(s)


# --------------------------------------------------------------------------- uniformity
@pytest.mark.parametrize("seed", [0, 1, 123456789, 2**32 - 1])
def test_hash3_is_roughly_uniform_on_counter_inputs(seed):
    # the way the collator and kernels use it: a fixed seed, small consecutive counters
    i = np.arange(512, dtype=np.int64)[:, None]
    w = np.arange(512, dtype=np.int64)[None, :]
    h = hash3(np.int64(seed), i, w).ravel()
    n = h.size
    for bucket in (h >> 24, h & 0xFF, (h >> 12) & 0xFF):  # high, low and middle bits
        counts = np.bincount(bucket, minlength=256)
        expected = n / 256
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 255 + 8 * math.sqrt(2 * 255), chi2  # 255 dof: mean 255, sd 22.6
    bits = (h[:, None] >> np.arange(32)) & 1
    assert np.abs(bits.mean(0) - 0.5).max() < 6 * 0.5 / math.sqrt(n)


@pytest.mark.parametrize("ratio", [0.15, 0.3, 0.5, 0.9])
def test_share_below_threshold_is_the_ratio(ratio):
    h = hash3(np.int64(42), np.arange(400)[:, None], np.arange(1000)[None, :])
    share = float((h < threshold(ratio)).mean())
    assert abs(share - ratio) < 6 * math.sqrt(ratio * (1 - ratio) / h.size)


def test_flipping_one_input_bit_flips_half_the_output_bits():
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 2**32, 20_000, dtype=np.int64) for _ in range(3))
    base = hash3(a, b, c)
    for bit in (0, 7, 31):
        changed = base ^ hash3(a, b, c ^ (1 << bit))
        flipped = np.unpackbits(changed.astype(">u4").view(np.uint8)).mean()
        assert abs(flipped - 0.5) < 0.01, (bit, flipped)


# =========================================================================== visibility
@FEW
@given(
    items=batches(max_rows=4, max_tokens=40), seed=u32, ratio=st.sampled_from([0.0, 0.5, 0.8, 1.0])
)
def test_visibility_matches_a_python_loop_oracle(items, seed, ratio):
    batch = collate(items, seed=seed, decoder_ratio=ratio)
    vis = visibility(batch, ratio)
    B, L = batch["word_ids"].shape
    assert vis.shape == (B, L, L) and vis.dtype == torch.bool
    for b in range(B):
        expected = visible_py(
            batch["word_ids"][b].tolist(),
            int(batch["lengths"][b]),
            int(batch["decoder_seed"][b]),
            ratio,
        )
        assert np.array_equal(vis[b].numpy(), expected)


@SOME
@given(items=batches(), seed=u32, epoch=st.integers(0, 100), ratio=st.floats(0.0, 1.0))
def test_visibility_structure(items, seed, epoch, ratio):
    batch = collate(items, seed=seed, epoch=epoch, decoder_ratio=ratio)
    vis = visibility(batch, ratio)
    B, L, _ = vis.shape
    lengths = batch["lengths"]
    i = torch.arange(L)
    # the sentence embedding: visible from every query row, padding rows included
    assert vis[:, :, 0].all()
    # no query position sees itself (except the sentence embedding at 0, which is column 0)
    assert not vis[:, i[1:], i[1:]].any()
    # padding columns are never visible, from any row
    padding_col = i.view(1, 1, L) >= lengths.view(B, 1, 1)
    assert not (vis & padding_col).any()
    # whole words: for query i, every position j != i of a word has the same visibility
    word_ids = batch["word_ids"]
    for b in range(B):
        for w in range(1, int(word_ids[b].max()) + 1):
            pos = torch.nonzero(word_ids[b] == w).ravel()
            if len(pos) < 2:
                continue
            sub = vis[b][:, pos].clone()  # L × |pos|
            is_self = i.view(L, 1) == pos.view(1, -1)
            seen_any = (sub & ~is_self).any(1)
            hidden_any = (~sub & ~is_self).any(1)
            mixed = seen_any & hidden_any
            assert not mixed.any(), (b, w, torch.nonzero(mixed).ravel()[:5])


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.7])
def test_hidden_share_per_row_is_the_decoder_ratio(ratio):
    items = [one_long_sample(150, 2, index=k) for k in range(6)]
    batch = collate(items, seed=11, decoder_ratio=ratio)
    vis = visibility(batch, ratio)
    shares, trials = [], 0
    for b in range(len(items)):
        hidden = hidden_words(vis[b], batch["word_ids"][b], int(batch["lengths"][b]))
        assert (hidden >= 0).all()  # every word had a second position
        shares.append(hidden.mean(1))
        trials += hidden.size
    shares = np.concatenate(shares)
    words = hidden.shape[1]
    sd_row = math.sqrt(ratio * (1 - ratio) / words)
    assert abs(shares.mean() - ratio) < 6 * math.sqrt(ratio * (1 - ratio) / trials)
    assert np.abs(shares - ratio).max() < 6 * sd_row  # every single query row, too
    assert 0.7 < shares.var() / sd_row**2 < 1.4  # binomial spread: rows draw independently


def test_query_rows_draw_independently():
    """The original reuses a pool of 128/256 masks, so rows of a 600-token text repeat; here
    every row is its own draw, and rows are uncorrelated."""
    items = [one_long_sample(300, 2)]
    batch = collate(items, seed=3, decoder_ratio=0.5)
    vis = visibility(batch, 0.5)
    hidden = hidden_words(vis[0], batch["word_ids"][0], int(batch["lengths"][0])).astype(float)
    rows, words = hidden.shape
    assert len(np.unique(hidden, axis=0)) == rows
    corr = np.corrcoef(hidden)
    off = corr[~np.eye(rows, dtype=bool)]
    sd = 1 / math.sqrt(words)
    assert abs(off.mean()) < 0.01
    assert np.abs(off).max() < 8 * sd
    assert 0.8 < off.var() / sd**2 < 1.25
    agree = (hidden[1:] == hidden[:-1]).mean()
    assert abs(agree - 0.5) < 6 * math.sqrt(0.25 / hidden[1:].size)


def test_identical_texts_at_different_indices_get_different_masks():
    _, ids, starts = one_long_sample(60, 1)
    indices = [0, 1, 2**32, 2**32 + 1]  # the high half of an index counts too
    batch = collate([(k, ids, starts) for k in indices], decoder_ratio=0.5)
    vis = visibility(batch, 0.5)
    assert len(set(batch["decoder_seed"].tolist())) == len(indices)
    for a in range(len(indices)):
        for b in range(a):
            assert not torch.equal(vis[a], vis[b])
            assert not torch.equal(batch["labels"][a], batch["labels"][b])


# --------------------------------------------------------------------------- purity
@FEW
@given(items=batches(min_tokens=10), seed=u32, epoch=st.integers(0, 10**6))
def test_same_seed_epoch_index_and_content_give_identical_batches(items, seed, epoch):
    a = collate(items, seed=seed, epoch=epoch)
    copies = [(index, ids.copy(), starts.copy()) for index, ids, starts in items]
    b = collate(copies, seed=seed, epoch=epoch)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(visibility(a, 0.5), visibility(b, 0.5))


@FEW
@given(items=batches(min_tokens=10), seed=u32, epoch=st.integers(0, 10**6))
def test_another_epoch_or_seed_gives_other_masks(items, seed, epoch):
    base = collate(items, seed=seed, epoch=epoch)
    vis = visibility(base, 0.5)
    for other in (
        collate(items, seed=seed, epoch=epoch + 1),
        collate(items, seed=(seed + 1) % 2**32, epoch=epoch),
    ):
        assert torch.equal(other["original_ids"], base["original_ids"])  # same content
        assert (other["decoder_seed"] != base["decoder_seed"]).all()
        # >= 10 tokens per row: two independent draws coincide with negligible probability
        assert not torch.equal(visibility(other, 0.5), vis)


@FEW
@given(
    items=batches(max_rows=6),
    data=st.data(),
    seed=u32,
    epoch=st.integers(0, 1000),
    ratio=st.sampled_from([0.3, 0.5]),
)
def test_a_row_does_not_depend_on_its_batch(items, data, seed, epoch, ratio):
    alone = {}
    for index, ids, starts in items:  # each sample collated alone, the reference
        batch = collate([(index, ids, starts)], seed=seed, epoch=epoch, decoder_ratio=ratio)
        alone[index] = (batch, visibility(batch, ratio))
    # the same samples, shuffled, with a random subset and a long stranger to change the width
    order = data.draw(st.permutations(items))
    keep = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
    chosen = [it for it, k in zip(order, keep, strict=True) if k] or [order[0]]
    stranger = (2**41 + 5, *make_sample(np.random.default_rng(seed), 90, 0.5))
    mixed_items = chosen[: len(chosen) // 2] + [stranger] + chosen[len(chosen) // 2 :]
    mixed = collate(mixed_items, seed=seed, epoch=epoch, decoder_ratio=ratio)
    mixed_vis = visibility(mixed, ratio)
    for row, (index, _, _) in enumerate(mixed_items):
        if index not in alone:
            continue
        ref, ref_vis = alone[index]
        n = int(ref["lengths"][0])
        assert int(mixed["lengths"][row]) == n
        assert torch.equal(mixed_vis[row, :n, :n], ref_vis[0, :n, :n])
        for key in ("input_ids", "labels", "original_ids", "decoder_labels", "word_ids"):
            assert torch.equal(mixed[key][row, :n], ref[key][0, :n]), key
        assert mixed["decoder_seed"][row] == ref["decoder_seed"][0]


# ================================================================ the fused paths' rule
@FEW
@given(
    items=batches(max_rows=4, max_tokens=150),
    seed=u32,
    epoch=st.integers(0, 5),
    ratio=st.sampled_from([0.3, 0.5, 0.7]),
)
def test_flex_mask_mod_equals_the_collators_reference_mask_bit_for_bit(items, seed, epoch, ratio):
    """The FlexAttention mask_mod (evaluated by FlexAttention's own ``create_mask``) and the
    chunked path's row blocks reproduce the reference B×L×L mask of a real collated batch."""
    from torch.nn.attention.flex_attention import create_mask

    from retromae_ds.attention import TwoStreamSpec
    from retromae_ds.attention.flex import mask_mod_for

    batch = collate(items, seed=seed, epoch=epoch, decoder_ratio=ratio)
    spec = TwoStreamSpec(batch["word_ids"], batch["lengths"], batch["decoder_seed"], ratio)
    B, L = batch["word_ids"].shape
    reference = visibility(batch, ratio)
    flex = create_mask(mask_mod_for(spec, L, torch.device("cpu")), B, None, L, L, device="cpu")
    assert torch.equal(flex[:, 0], reference)
    rows = torch.cat([spec.rows(s, min(L, s + 7), L) for s in range(0, L, 7)], dim=1)
    assert torch.equal(rows, reference)
    b = 0
    expected = visible_py(
        batch["word_ids"][b].tolist(),
        int(batch["lengths"][b]),
        int(batch["decoder_seed"][b]),
        ratio,
    )
    assert np.array_equal(flex[b, 0].numpy(), expected)


@SOME
@given(xs=st.lists(u32, min_size=1, max_size=300))
def test_int32_mix_equals_the_int64_mix(xs):
    from retromae_ds.base.hashing import as_int32_bits, keep_int32, mix32_int32_

    x = torch.tensor(xs, dtype=torch.int64)
    h = mix32_int32_(as_int32_bits(x))
    assert torch.equal(h.long() & MASK32, mix32(x))
    for ratio in (0.0, 0.3, 0.5, 1.0):
        assert torch.equal(keep_int32(h, ratio), mix32(x) >= threshold(ratio))
