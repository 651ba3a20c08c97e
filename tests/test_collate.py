"""Tests of the pre-training collator (``retromae_ds.data.collate``): encoder masking and the
RetroMAE decoder fields.

Cheapest first: the layout of every field against a plain Python construction written here
(word ids, lengths, padding, decoder labels); the encoder's whole-word masking (exact word
count, whole words, labels, specials by id, 80/10/10, no 512-token cap); RoBERTa-style special
ids; bad inputs; then a real preprocessing run whose samples are collated in DataLoader worker
processes and in the main process, which must agree bit for bit. Statistical bounds are many
binomial standard deviations wide on fixed inputs, so nothing here is flaky.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.utils.data
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from retromae_ds.attention.rules import two_stream_visible_dense
from retromae_ds.base.special_tokens import IGNORE, SpecialIds
from retromae_ds.data.collate import IndexedSamples, MaskingConfig, PretrainCollator
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
from retromae_ds.data.tokenizer import fingerprint

from synthetic import synthetic_texts

FEW = settings(max_examples=40, deadline=None)
SOME = settings(max_examples=80, deadline=None)

# bert-base-uncased: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103
BERT = SpecialIds(cls=101, sep=102, pad=0, mask=103, all=(0, 100, 101, 102, 103), vocab_size=30522)
# roberta-base: <s> 0 (cls and bos), <pad> 1, </s> 2 (sep and eos), <unk> 3, <mask> 50264
ROBERTA_FINGERPRINT = {
    "class": "RobertaTokenizer",
    "vocab_size": 50265,
    "vocab_sha256": "0" * 64,
    "special_token_ids": {
        "cls": 0,
        "sep": 2,
        "pad": 1,
        "mask": 50264,
        "unk": 3,
        "bos": 0,
        "eos": 2,
    },
}
ROBERTA = SpecialIds.from_fingerprint(ROBERTA_FINGERPRINT)

u32 = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------- helpers
def regular_ids(special: SpecialIds) -> np.ndarray:
    return np.setdiff1d(np.arange(special.vocab_size), special.all)


def make_sample(rng, special: SpecialIds, n: int, p_start: float):
    ids = rng.choice(regular_ids(special), n).astype(np.int32)
    starts = (rng.random(n) < p_start).astype(np.uint8)
    return ids, starts


@st.composite
def batches(draw, special: SpecialIds = BERT, max_rows: int = 5, max_tokens: int = 80):
    rows = draw(st.integers(1, max_rows))
    indices = draw(st.lists(st.integers(0, 2**40), min_size=rows, max_size=rows, unique=True))
    rng = np.random.default_rng(draw(u32))
    return [
        (
            index,
            *make_sample(
                rng, special, draw(st.integers(0, max_tokens)), draw(st.sampled_from([0.3, 0.8, 1]))
            ),
        )
        for index in indices
    ]


def collate(items, special=BERT, *, seed=0, epoch=0, max_length=8192, **masking):
    collator = PretrainCollator(special, MaskingConfig(**masking), max_length, seed=seed)
    collator.epoch = epoch
    return collator(items)


def expected_word_ids(starts: np.ndarray) -> list[int]:
    """Content word numbers 1.. from word-start flags; a chunk's first token starts a word."""
    words, current = [], 0
    for k, flag in enumerate(starts.tolist()):
        if flag or k == 0:
            current += 1
        words.append(current)
    return words


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


# =========================================================================== layout
@SOME
@given(items=batches(), seed=u32, epoch=st.integers(0, 100))
def test_fields_layout_against_a_python_construction(items, seed, epoch):
    batch = collate(items, seed=seed, epoch=epoch)
    B = len(items)
    width = -(-max(len(ids) + 2 for _, ids, _ in items) // 8) * 8
    flat = {"label_positions": "labels", "decoder_label_positions": "decoder_labels"}
    for key, value in batch.items():
        assert value.dtype == torch.int64, key
        if key in flat:  # where the labels are, flat and row-major
            labels = batch[flat[key]].flatten()
            assert value.tolist() == torch.nonzero(labels != IGNORE).flatten().tolist(), key
            continue
        assert value.shape == (
            (B,) if key in ("sample_index", "lengths", "decoder_seed") else (B, width)
        ), key
    assert batch["sample_index"].tolist() == [index for index, _, _ in items]
    for b, (_, ids, starts) in enumerate(items):
        n = len(ids)
        words = expected_word_ids(starts)
        n_words = words[-1] if words else 0
        pad = width - n - 2
        assert int(batch["lengths"][b]) == n + 2
        assert batch["attention_mask"][b].tolist() == [1] * (n + 2) + [0] * pad
        original = [BERT.cls, *ids.tolist(), BERT.sep] + [BERT.pad] * pad
        assert batch["original_ids"][b].tolist() == original
        assert batch["word_ids"][b].tolist() == [0, *words, n_words + 1] + [-1] * pad
        # decoder targets: every real token except the specials
        assert batch["decoder_labels"][b].tolist() == [IGNORE, *ids.tolist()] + [IGNORE] * (pad + 1)
        # the encoder input differs from the original only where a label is set
        changed = batch["input_ids"][b] != batch["original_ids"][b]
        assert not (changed & (batch["labels"][b] == IGNORE)).any()


def test_without_decoder_only_the_encoder_fields_are_made():
    rng = np.random.default_rng(8)
    items = [(k, *make_sample(rng, BERT, 50, 0.6)) for k in range(3)]
    full = collate(items)
    collator = PretrainCollator(BERT, MaskingConfig(), 8192, decoder=False)
    encoder_only = collator(items)
    assert set(encoder_only) == {
        "input_ids",
        "attention_mask",
        "labels",
        "label_positions",
        "sample_index",
    }
    for key, value in encoder_only.items():
        assert torch.equal(value, full[key]), key


def test_empty_sample_and_single_token_rows():
    rng = np.random.default_rng(0)
    items = [(0, *make_sample(rng, BERT, 0, 1.0)), (1, *make_sample(rng, BERT, 1, 0.0))]
    batch = collate(items, encoder_ratio=1.0)
    assert batch["original_ids"][0, :3].tolist() == [BERT.cls, BERT.sep, BERT.pad]
    assert batch["word_ids"][0, :3].tolist() == [0, 1, -1]
    assert (batch["labels"][0] == IGNORE).all() and (batch["decoder_labels"][0] == IGNORE).all()
    assert batch["word_ids"][1, :4].tolist() == [0, 1, 2, -1]  # forced word start
    assert batch["labels"][1, 1] == items[1][1][0]  # ratio 1: the only word is masked


# =========================================================================== encoder masking
@SOME
@given(items=batches(), seed=u32, epoch=st.integers(0, 100), ratio=st.floats(0.0, 1.0))
def test_exactly_round_ratio_times_words_whole_words_are_masked(items, seed, epoch, ratio):
    batch = collate(items, seed=seed, epoch=epoch, encoder_ratio=ratio)
    for b, (_, ids, starts) in enumerate(items):
        n = len(ids)
        words = np.array(expected_word_ids(starts), dtype=np.int64)
        labels = batch["labels"][b].numpy()
        inputs = batch["input_ids"][b].numpy()
        masked = labels[1 : n + 1] != IGNORE
        # specials and padding are never masked: no label and the input keeps them
        assert labels[0] == IGNORE and (labels[n + 1 :] == IGNORE).all()
        assert inputs[0] == BERT.cls and inputs[n + 1] == BERT.sep
        assert (inputs[n + 2 :] == BERT.pad).all()
        # labels are the original ids exactly where masked
        assert np.array_equal(labels[1 : n + 1][masked], ids[masked])
        assert np.array_equal(inputs[1 : n + 1][~masked], ids[~masked])
        # whole words: a word is masked in all its tokens or in none
        n_words = int(words.max()) if n else 0
        per_word = np.bincount(words[masked], minlength=n_words + 1)[1:]
        size = np.bincount(words, minlength=n_words + 1)[1:]
        assert np.all((per_word == 0) | (per_word == size))
        assert int((per_word > 0).sum()) == round_half_up(ratio * n_words)


@FEW
@given(items=batches(max_rows=3), seed=u32, epoch=st.integers(0, 100))
def test_masked_words_are_a_uniform_choice(items, seed, epoch):
    """Across epochs every word gets masked sometimes: the choice is not, say, the first k."""
    items = [(index, ids, starts) for index, ids, starts in items if len(ids) >= 4]
    if not items:
        return
    ever = [np.zeros(len(ids), dtype=bool) for _, ids, _ in items]
    for e in range(epoch, epoch + 60):
        batch = collate(items, seed=seed, epoch=e, encoder_ratio=0.5)
        for b, (_, ids, _) in enumerate(items):
            ever[b] |= batch["labels"][b, 1 : len(ids) + 1].numpy() != IGNORE
    for row in ever:  # P(a word never masked in 60 epochs at ratio ~0.5) < 1e-12
        assert row.all()


def test_masking_proportions_80_10_10():
    rng = np.random.default_rng(1)
    items = [(k, *make_sample(rng, BERT, 2000, 0.75)) for k in range(40)]
    batch = collate(items, seed=5, encoder_ratio=0.3)
    labelled = batch["labels"] != IGNORE
    inputs, original = batch["input_ids"][labelled], batch["original_ids"][labelled]
    n = int(labelled.sum())
    assert n > 20_000
    as_mask = float((inputs == BERT.mask).float().mean())
    kept = float((inputs == original).float().mean())
    random = float(((inputs != BERT.mask) & (inputs != original)).float().mean())
    hit_own = 1 / len(regular_ids(BERT))  # a random replacement may draw the token itself
    for share, p in ((as_mask, 0.8), (kept, 0.1 + 0.1 * hit_own), (random, 0.1 * (1 - hit_own))):
        assert abs(share - p) < 6 * math.sqrt(p * (1 - p) / n), (share, p)


def test_masking_proportions_follow_the_config():
    rng = np.random.default_rng(2)
    items = [(k, *make_sample(rng, BERT, 1000, 0.75)) for k in range(30)]
    batch = collate(items, seed=9, encoder_ratio=0.4, replace_mask=0.5, replace_random=0.3)
    labelled = batch["labels"] != IGNORE
    inputs, original = batch["input_ids"][labelled], batch["original_ids"][labelled]
    n = int(labelled.sum())
    for share, p in (
        (float((inputs == BERT.mask).float().mean()), 0.5),
        (float(((inputs != BERT.mask) & (inputs != original)).float().mean()), 0.3),
    ):
        assert abs(share - p) < 6 * math.sqrt(p * (1 - p) / n) + 1e-4, (share, p)


def test_special_tokens_are_never_random_replacements(tokenizer):
    """With a 200-token vocabulary, 5 of them special, ~2.5 % of random draws would be special
    if the replacement set were the whole vocabulary."""
    special = SpecialIds.from_fingerprint(fingerprint(tokenizer))
    rng = np.random.default_rng(3)
    items = [(k, *make_sample(rng, special, 500, 0.7)) for k in range(40)]
    batch = collate(items, special, seed=1, encoder_ratio=0.5, replace_mask=0.0, replace_random=1.0)
    labelled = batch["labels"] != IGNORE
    replaced = batch["input_ids"][labelled]
    assert len(replaced) > 5000
    assert not np.isin(replaced.numpy(), special.all).any()
    # and the draws cover the regular vocabulary
    assert len(np.unique(replaced.numpy())) > 0.95 * len(regular_ids(special))
    # no special token anywhere but at its place
    inputs = batch["input_ids"]
    real = batch["attention_mask"].bool()
    real[:, 0] = False
    real[torch.arange(len(items)), batch["lengths"] - 1] = False
    assert not np.isin(inputs[real].numpy(), special.all).any()


def test_no_cap_at_512_masked_tokens():
    rng = np.random.default_rng(4)
    ids, starts = make_sample(rng, BERT, 4000, 0.75)
    n_words = expected_word_ids(starts)[-1]
    batch = collate([(0, ids, starts), (1, *make_sample(rng, BERT, 30, 0.75))], encoder_ratio=0.3)
    masked = batch["labels"][0] != IGNORE
    masked_words = torch.unique(batch["word_ids"][0][masked])
    assert len(masked_words) == round_half_up(0.3 * n_words) > 512
    assert int(masked.sum()) > 1000
    assert int(masked[3000:].sum()) > 100  # the end of a long row is masked like the start


def test_another_epoch_masks_other_words():
    rng = np.random.default_rng(5)
    items = [(k, *make_sample(rng, BERT, 300, 0.7)) for k in range(4)]
    a, b = collate(items, epoch=0), collate(items, epoch=1)
    c = collate(items, seed=1)
    for other in (b, c):
        assert not torch.equal(a["labels"] != IGNORE, other["labels"] != IGNORE)
        assert not torch.equal(a["input_ids"], other["input_ids"])
        assert torch.equal(a["original_ids"], other["original_ids"])


# =========================================================================== special ids
def test_special_ids_from_fingerprints():
    assert (ROBERTA.cls, ROBERTA.sep, ROBERTA.pad, ROBERTA.mask) == (0, 2, 1, 50264)
    assert ROBERTA.all == (0, 1, 2, 3, 50264)
    bos_eos = {
        **ROBERTA_FINGERPRINT,
        "special_token_ids": {"bos": 5, "eos": 6, "pad": 7, "mask": 8},
    }
    got = SpecialIds.from_fingerprint(bos_eos)
    assert (got.cls, got.sep, got.pad, got.mask) == (5, 6, 7, 8)
    no_mask = {**ROBERTA_FINGERPRINT, "special_token_ids": {"cls": 0, "sep": 2, "pad": 1}}
    with pytest.raises(ValueError, match="mask"):
        SpecialIds.from_fingerprint(no_mask)


@FEW
@given(items=batches(special=ROBERTA), seed=u32, ratio=st.floats(0.0, 1.0))
def test_roberta_special_ids_are_handled_by_id(items, seed, ratio):
    """``<s>`` is id 0 and not called [CLS]: the original (string-matched specials) masked it
    and hid the sentence embedding from the decoder; here positions, not strings, decide."""
    batch = collate(items, ROBERTA, seed=seed, encoder_ratio=ratio)
    lengths = batch["lengths"]
    B, L = batch["input_ids"].shape
    assert (batch["input_ids"][:, 0] == 0).all() and (batch["labels"][:, 0] == IGNORE).all()
    assert (batch["decoder_labels"][:, 0] == IGNORE).all()
    assert (batch["original_ids"][torch.arange(B), lengths - 1] == 2).all()
    padding = torch.arange(L) >= lengths[:, None]
    assert (batch["original_ids"][padding] == 1).all()
    vis = two_stream_visible_dense(batch["word_ids"], lengths, batch["decoder_seed"], 0.5)
    assert vis[:, :, 0].all()  # the sentence embedding is visible to every query
    replaced = batch["input_ids"][(batch["labels"] != IGNORE)]
    assert not np.isin(replaced.numpy(), [0, 1, 2, 3]).any()
    # the same content under BERT ids is masked at the same positions, with the same visibility
    # (content that holds one of BERT's own special ids is not the same content under BERT)
    assume(not any(np.isin(ids, BERT.all).any() for _, ids, _ in items))
    as_bert = collate(items, BERT, seed=seed, encoder_ratio=ratio)
    assert torch.equal(as_bert["labels"] != IGNORE, batch["labels"] != IGNORE)
    assert torch.equal(as_bert["word_ids"], batch["word_ids"])
    assert torch.equal(as_bert["decoder_seed"], batch["decoder_seed"])


# =========================================================================== bad input
def test_bad_inputs_are_rejected():
    rng = np.random.default_rng(6)
    collator = PretrainCollator(BERT, MaskingConfig(), max_length=32)
    with pytest.raises(ValueError, match="empty"):
        collator([])
    with pytest.raises(ValueError, match="max_length"):
        collator([(0, *make_sample(rng, BERT, 31, 0.5))])
    collator([(0, *make_sample(rng, BERT, 30, 0.5))])  # exactly fits with [CLS]/[SEP]
    for bad in (
        {"encoder_ratio": 1.5},
        {"replace_mask": 0.9, "replace_random": 0.2},
    ):
        with pytest.raises(ValueError):
            MaskingConfig(**bad)


@pytest.mark.parametrize(("max_length", "n"), [(512, 510), (64, 62), (100, 98), (514, 512), (3, 1)])
def test_padded_width_never_exceeds_max_length(max_length, n):
    # Rounding the width up to a multiple of 8 must stop at max_length: a model whose position
    # table is exactly max_length long would otherwise index past it (a bug found and fixed).
    rng = np.random.default_rng(n)
    collator = PretrainCollator(BERT, MaskingConfig(), max_length)
    batch = collator([(0, *make_sample(rng, BERT, n, 0.5))])
    assert n + 2 <= batch["input_ids"].shape[1] <= max_length


def test_unk_inside_the_text_is_never_an_encoder_target(tokenizer):
    # [UNK] is a special id that preprocessing keeps inside the text; words holding it must not
    # be masked or counted (as Hugging Face's collators exclude every special id).
    special = SpecialIds.from_fingerprint(fingerprint(tokenizer))
    unk = tokenizer.unk_token_id
    assert unk in special.all
    rng = np.random.default_rng(7)
    items = []
    for k in range(20):
        ids, _ = make_sample(rng, special, 60, 1.0)
        ids[::3] = unk  # a third of the words are [UNK], as in text full of unseen symbols
        items.append((k, ids, np.ones(60, dtype=np.uint8)))
    batch = collate(items, special, encoder_ratio=0.5)
    at_unk = batch["original_ids"] == unk
    assert int(at_unk.sum()) == 400
    assert not (batch["labels"][at_unk] != IGNORE).any()
    assert (batch["input_ids"][at_unk] == unk).all()


# =========================================================================== DataLoader workers
@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_dir):
    work = tmp_path_factory.mktemp("collate_shards")
    source = work / "docs.jsonl"
    texts = synthetic_texts(150, seed=7)
    source.write_text(
        "".join(json.dumps({"_id": str(k), "text": t}) + "\n" for k, t in enumerate(texts)),
        encoding="utf-8",
    )
    out = work / "out"
    run_preprocess(
        PreprocessConfig(
            inputs=[str(source)],
            out=str(out),
            tokenizer=str(tokenizer_dir),
            progress=False,
            max_length=64,
        )
    )
    return ShardDataset(out)


def all_batches(dataset, special, *, workers: int, epoch: int, batch_size: int = 8):
    collator = PretrainCollator(special, MaskingConfig(), 64, seed=17)
    collator.epoch = epoch
    loader = torch.utils.data.DataLoader(
        IndexedSamples(dataset),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=collator,
    )
    return list(loader)


def test_dataloader_workers_give_the_main_process_batches(shards, tokenizer):
    special = SpecialIds.from_fingerprint(shards.manifest["tokenizer"])
    assert special == SpecialIds.from_fingerprint(fingerprint(tokenizer))
    assert len(shards) > 100
    main = all_batches(shards, special, workers=0, epoch=1)
    workers = all_batches(shards, special, workers=2, epoch=1)
    assert len(main) == len(workers) == -(-len(shards) // 8)
    for a, b in zip(main, workers, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    # real rows carry real words, and the collated content is the stored content
    sample = shards[0]
    n = len(sample.input_ids)
    assert main[0]["original_ids"][0, 1 : n + 1].tolist() == sample.input_ids.tolist()
    assert main[0]["word_ids"][0, 1 : n + 1].tolist() == expected_word_ids(sample.word_starts)
    # another epoch: same content, other masks
    other = all_batches(shards, special, workers=2, epoch=2)
    assert all(
        torch.equal(a["original_ids"], b["original_ids"]) for a, b in zip(main, other, strict=True)
    )
    assert not all(torch.equal(a["labels"], b["labels"]) for a, b in zip(main, other, strict=True))


def test_batch_size_does_not_change_a_samples_masks(shards):
    special = SpecialIds.from_fingerprint(shards.manifest["tokenizer"])
    big = all_batches(shards, special, workers=0, epoch=3, batch_size=16)
    small = all_batches(shards, special, workers=0, epoch=3, batch_size=5)

    def per_sample(batches):
        rows = {}
        for batch in batches:
            for b, index in enumerate(batch["sample_index"].tolist()):
                n = int(batch["lengths"][b])
                rows[index] = tuple(
                    batch[k][b, :n].tolist() for k in ("input_ids", "labels", "word_ids")
                ) + (int(batch["decoder_seed"][b]),)
        return rows

    assert per_sample(big) == per_sample(small)
