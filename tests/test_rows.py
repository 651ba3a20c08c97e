"""Pure functions of tokenization, chunking and packing: properties against straightforward
per-document implementations written here."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.data.rows import (
    build_batch,
    chunk_cuts,
    make_backend,
    pack_rows,
    tokenize_documents,
)
from retromae_ds.data.tokenizer import backend_json

from synthetic import synthetic_texts


@st.composite
def documents(draw):
    n_docs = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, 60), min_size=n_docs, max_size=n_docs))
    starts = []
    for n in lengths:
        flags = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        if n:
            flags[0] = True
        starts.extend(flags)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.asarray(starts, dtype=np.uint8), offsets


@settings(max_examples=200, deadline=None)
@given(documents(), st.integers(1, 20))
def test_chunks_partition_each_document_within_limit(docs, limit):
    word_starts, offsets = docs
    cuts = chunk_cuts(word_starts, offsets, limit)
    assert cuts[0] == 0 and cuts[-1] == offsets[-1]
    assert np.all(np.diff(cuts) > 0) or len(cuts) == 1
    assert np.all(np.diff(cuts) <= limit)
    # every non-empty document boundary is a cut, and no row spans two documents
    nonempty_starts = offsets[:-1][np.diff(offsets) > 0]
    assert set(nonempty_starts.tolist()) <= set(cuts.tolist())
    doc_of_row_start = np.searchsorted(offsets, cuts[:-1], side="right") - 1
    doc_of_row_end = np.searchsorted(offsets, cuts[1:] - 1, side="right") - 1
    assert np.array_equal(doc_of_row_start, doc_of_row_end)


@settings(max_examples=200, deadline=None)
@given(documents(), st.integers(1, 20))
def test_chunk_cuts_keep_words_whole_when_a_word_start_is_in_reach(docs, limit):
    word_starts, offsets = docs
    cuts = set(chunk_cuts(word_starts, offsets, limit).tolist())
    for d in range(len(offsets) - 1):
        begin, end = int(offsets[d]), int(offsets[d + 1])
        pos = begin
        while end - pos > limit:
            window = [j for j in range(pos + 1, pos + limit + 1) if word_starts[j]]
            expected = window[-1] if window else pos + limit
            assert expected in cuts
            pos = expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), max_size=40), st.integers(30, 64))
def test_pack_rows_is_greedy_and_within_limit(lengths, limit):
    packs = pack_rows(np.asarray(lengths, dtype=np.int64), limit)
    assert np.all(np.diff(packs) >= 0) and (len(packs) == 0 or packs[0] == 0)
    assert np.all(np.diff(packs) <= 1)
    totals = np.bincount(packs, weights=lengths) if len(packs) else np.zeros(0)
    assert np.all(totals <= limit)
    # greedy: the first row of the next pack did not fit into the previous pack
    for p in range(1, len(totals)):
        first_next = lengths[int(np.flatnonzero(packs == p)[0])]
        assert totals[p - 1] + first_next > limit


def test_word_starts_follow_the_tokenizers_word_ids(tokenizer):
    texts = synthetic_texts(50, seed=3)
    backend = make_backend(backend_json(tokenizer))
    docs = tokenize_documents(backend, texts, batch_size=7)
    for d, text in enumerate(texts):
        enc = backend.encode(text, add_special_tokens=False)
        a, b = docs.offsets[d], docs.offsets[d + 1]
        assert docs.ids[a:b].tolist() == enc.ids
        expected = [
            1 if i == 0 or w != enc.word_ids[i - 1] else 0 for i, w in enumerate(enc.word_ids)
        ]
        assert docs.word_starts[a:b].tolist() == expected
    assert docs.word_starts.sum() < len(docs.ids), "sub-word pieces exist, so some flags are 0"


def test_special_token_text_in_documents_is_not_a_special_id(tokenizer):
    backend = make_backend(backend_json(tokenizer))
    docs = tokenize_documents(backend, ["a [SEP] b [CLS] [MASK] c"])
    special = {tokenizer.sep_token_id, tokenizer.cls_token_id, tokenizer.mask_token_id}
    assert not special & set(docs.ids.tolist())


def test_build_batch_rows_concatenate_back_to_documents(tokenizer):
    texts = synthetic_texts(40, seed=4)
    backend = make_backend(backend_json(tokenizer))
    docs = tokenize_documents(backend, texts)
    ids = [f"d{i}" for i in range(len(texts))]
    batch, counts = build_batch(docs, ids, limit=10, pack=False)
    table = batch.to_pydict()
    assert counts["tokens"] == len(docs.ids)
    assert counts["empty_documents"] == sum(1 for t in texts if not t)
    rebuilt: dict[str, list[int]] = {}
    for doc_id, chunk, row in zip(
        table["doc_id"], table["chunk_index"], table["input_ids"], strict=True
    ):
        assert chunk == len(rebuilt.get(doc_id, []))
        assert 0 < len(row) <= 10
        rebuilt.setdefault(doc_id, []).append(row)
    for d, doc_id in enumerate(ids):
        a, b = docs.offsets[d], docs.offsets[d + 1]
        got = [t for row in rebuilt.get(doc_id, []) for t in row]
        assert got == docs.ids[a:b].tolist()


TRICKY = [
    "",
    "##hash ## # tags#inside and ### more",
    "[SEP] [CLS] literal [MASK] tokens",
    "naïve café Ünïcödé, 中文字符 and emoji 🤗🚀 mixed",
    "a" * 150 + " overlong words become [UNK] " + "b" * 120,
    "don't stop-words, e.g. U.S.A. 3.14159 $100",
    "tabs\tand\nnewlines\r\n  spaces",
]


def _real_texts() -> list[str]:
    from helpers_data import SHARED_DATA

    wiki = SHARED_DATA / "wikitext2" / "wiki.test.raw"
    return wiki.read_text(encoding="utf-8").splitlines()[:400] if wiki.is_file() else []


def _tokenizers(tokenizer):

    from retromae_ds.data.tokenizer import load_tokenizer

    found = [tokenizer]
    from retromae_recipes.common import find_minilm

    minilm = find_minilm()
    if minilm is not None:  # the real bert-base-uncased vocabulary
        found.append(load_tokenizer(minilm))
    return found


def test_wordpiece_fast_path_equals_the_word_id_path(tokenizer):
    from retromae_ds.data.rows import continuation_mask

    texts = TRICKY + synthetic_texts(100, seed=9) + _real_texts()
    for tok in _tokenizers(tokenizer):
        backend = make_backend(backend_json(tok))
        mask = continuation_mask(backend)
        assert mask is not None, "WordPiece behind BERT's pre-tokenizer takes the fast path"
        fast = tokenize_documents(backend, texts, continuation=mask)
        slow = tokenize_documents(backend, texts, continuation=None)
        assert np.array_equal(fast.offsets, slow.offsets)
        assert np.array_equal(fast.ids, slow.ids)
        assert np.array_equal(fast.word_starts, slow.word_starts)


def test_other_tokenizers_use_word_ids():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from retromae_ds.data.rows import continuation_mask

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert continuation_mask(bpe) is None
