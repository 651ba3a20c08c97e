"""Tests of the memory-mapped shard reader (``ShardDataset``).

Cheapest first: synthetic shard folders written with ``helpers_shards`` (exact expected rows,
odd layouts, broken files), then a real preprocessing run over a small text written here,
whose samples are held against an independent tokenization of the same documents, then
pickling and DataLoader worker processes.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.data import schema
from retromae_ds.data.dataset import Batch, ShardDataset
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
from retromae_ds.data.rows import make_backend, tokenize_documents
from retromae_ds.data.tokenizer import (
    backend_json,
    fingerprint,
    load_tokenizer,
    train_wordpiece,
)

from helpers_shards import (
    SYNTHETIC_TOKENIZER,
    ShardRows,
    expected_samples,
    random_rows,
    write_corpus,
    write_shard,
)

MAX_LENGTH = 24  # short rows, so that long documents are cut into several chunks
LIMIT = MAX_LENGTH - 2  # [CLS] ... [SEP]
FEW = settings(max_examples=60, deadline=None)


def assert_sample(sample, ids, word_starts):
    assert sample.input_ids.dtype == np.int32 and sample.word_starts.dtype == np.uint8
    assert np.array_equal(sample.input_ids, ids)
    assert np.array_equal(sample.word_starts, word_starts)


def copy_corpus(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_manifest(folder: Path, **changes) -> None:
    path = folder / schema.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


# =========================================================================== synthetic shards
@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Three unpacked shards, one of them empty, and the rows that went in."""
    rng = np.random.default_rng(0)
    shards = [
        random_rows(rng, 40, 0, 30, doc_prefix="a"),  # includes zero-length rows
        random_rows(rng, 0, 1, 5),
        random_rows(rng, 25, 1, 30, doc_prefix="c"),
    ]
    folder = tmp_path_factory.mktemp("synthetic")
    write_corpus(folder, shards)
    return folder, shards


def test_synthetic_rows_read_back_exactly(synthetic):
    folder, shards = synthetic
    ds = ShardDataset(folder)
    expected = expected_samples(shards, packed=False)
    assert len(ds) == len(expected) == 65
    for i, (ids, starts) in enumerate(expected):
        sample = ds[i]
        assert_sample(sample, ids, starts)
        assert sample.segment_lengths.tolist() == [len(ids)]
    assert ds.source(0) == [("a0", 0)]
    assert ds.source(40) == [("c0", 0)]  # the empty middle shard is skipped


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("record_batches", [0, 1, 3])
def test_shards_of_several_or_no_record_batches(tmp_path, packed, record_batches):
    """Our tool writes one record batch per shard; other writers may write several (the
    reader combines them) or none for an empty shard."""
    rng = np.random.default_rng(record_batches)
    n_rows = 0 if record_batches == 0 else 30
    shards = [
        random_rows(rng, 20, 1, 12, pack_limit=30),
        random_rows(rng, n_rows, 1, 12, pack_limit=30),
    ]
    write_corpus(tmp_path, shards, packed=packed, record_batches=[1, record_batches])
    ds = ShardDataset(tmp_path)
    expected = expected_samples(shards, packed)
    assert len(ds) == len(expected)
    for i, (ids, starts) in enumerate(expected):
        assert_sample(ds[i], ids, starts)
    batch = ds.get_batch(np.arange(len(ds))[::-1])
    assert np.array_equal(batch.input_ids, np.concatenate([e[0] for e in expected[::-1]]))


def test_shard_of_another_schema_version_is_refused_naming_it(tmp_path):
    rows = random_rows(np.random.default_rng(1), 5, 1, 5)
    write_corpus(tmp_path, [rows])
    path = tmp_path / "shards" / "part-000000.arrow"
    other = schema.SHARD_SCHEMA.with_metadata({b"retromae_ds.schema_version": b"99"})
    entry = write_shard(path, rows, arrow_schema=other)
    rewrite_manifest(tmp_path, shards=[entry])
    with pytest.raises(ValueError, match=r"part-000000\.arrow.*99"):
        ShardDataset(tmp_path)[0]


def test_shard_with_other_columns_is_refused(tmp_path):
    rows = random_rows(np.random.default_rng(2), 5, 1, 5)
    write_corpus(tmp_path, [rows])
    # same names and version, but input_ids as int64: a reader that took it would misread ids
    wide = pa.schema(
        [pa.field(schema.INPUT_IDS, pa.list_(pa.int64()), nullable=False)]
        + [schema.SHARD_SCHEMA.field(i) for i in range(1, len(schema.SHARD_SCHEMA))],
        metadata=schema.SHARD_SCHEMA.metadata,
    )
    entry = write_shard(tmp_path / "shards" / "part-000000.arrow", rows, arrow_schema=wide)
    rewrite_manifest(tmp_path, shards=[entry])
    with pytest.raises(ValueError, match=r"(?s)part-000000\.arrow.*differ"):
        ShardDataset(tmp_path)[0]


def test_empty_corpus(tmp_path):
    write_corpus(tmp_path, [ShardRows(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1))])
    ds = ShardDataset(tmp_path, require_rows=False)
    assert len(ds) == 0
    with pytest.raises(IndexError):
        ds[0]
    batch = ds.get_batch([])
    assert batch.input_ids.size == 0 and batch.offsets.tolist() == [0]


# =========================================================================== a real corpus
WORDS = (
    "retrieval encoder decoder masked sentence embedding passage query negative positive "
    "gradient optimizer checkpoint shard manifest sampler epoch rank replica attention window "
    "stream the of and a to in is"
).split()
RARE = ["internationalization", "counterrevolutionary", "naïve", "co-operation", "e.g.", "42"]


def corpus_documents(n: int = 240, seed: int = 7) -> list[tuple[str, str]]:
    """(id, text) pairs: short and long documents, empty ones, words a small WordPiece
    vocabulary must split into pieces (so that word_starts has zeros)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        if i % 23 == 4:
            k = 0
        elif i % 6 == 0:
            k = rng.randint(40, 120)  # several rows of LIMIT tokens
        else:
            k = rng.randint(1, 25)
        words = [
            rng.choice(RARE)
            if rng.random() < 0.1
            else "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(5, 12)))
            if rng.random() < 0.1  # unseen words: WordPiece splits them into pieces
            else rng.choice(WORDS)
            for _ in range(k)
        ]
        docs.append((f"doc-{i}", " ".join(words)))
    return docs


@pytest.fixture(scope="module")
def documents() -> list[tuple[str, str]]:
    return corpus_documents()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, documents) -> Path:
    work = tmp_path_factory.mktemp("real")
    source = work / "docs.jsonl"
    source.write_text(
        "".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in documents), encoding="utf-8"
    )
    out = work / "out"
    run_preprocess(
        PreprocessConfig(
            inputs=[str(source)],
            out=str(out),
            train_tokenizer=300,
            max_length=MAX_LENGTH,
            shard_size=3000,  # several shards
            workers=1,
            progress=False,
        )
    )
    return out


@pytest.fixture(scope="module")
def packed_corpus(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("packed") / "out"
    run_preprocess(
        PreprocessConfig(
            inputs=[str(corpus.parent / "docs.jsonl")],
            out=str(out),
            tokenizer=str(corpus / "tokenizer"),
            max_length=MAX_LENGTH,
            shard_size=3000,
            pack=True,
            workers=1,
            progress=False,
        )
    )
    return out


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return load_tokenizer(corpus / "tokenizer")


@pytest.fixture(scope="module")
def tokenized(tokenizer, documents):
    """What the tokenize module makes of every document (the oracle for the shard contents)."""
    return tokenize_documents(make_backend(backend_json(tokenizer)), [t for _, t in documents])


@pytest.fixture(scope="module")
def ds(corpus) -> ShardDataset:
    return ShardDataset(corpus)


@pytest.fixture(scope="module")
def packed_ds(packed_corpus) -> ShardDataset:
    return ShardDataset(packed_corpus)


def test_helper_manifest_has_the_layout_merge_writes(tmp_path, corpus):
    real = json.loads((corpus / schema.MANIFEST_NAME).read_text())
    mine = write_corpus(tmp_path, [random_rows(np.random.default_rng(0), 3, 1, 4)])
    assert set(mine) == set(real)
    assert set(mine["counts"]) == set(real["counts"])
    assert set(mine["shards"][0]) == set(real["shards"][0])
    assert set(SYNTHETIC_TOKENIZER) == set(real["tokenizer"])
    assert real["max_tokens_per_row"] == LIMIT


def test_corpus_shape(ds, corpus, documents):
    manifest = json.loads((corpus / schema.MANIFEST_NAME).read_text())
    assert len(manifest["shards"]) >= 3
    assert len(ds) == manifest["counts"]["rows"]
    assert manifest["counts"]["documents"] == len(documents)
    assert sum(1 for _, t in documents if not t) == manifest["counts"]["empty_documents"] > 0
    assert len(ds) > len(documents)  # long documents were chunked


def test_samples_are_the_documents_tokens_in_order(ds, documents, tokenized):
    """Reading every row in order and regrouping by (doc_id, chunk_index) gives back exactly
    what the tokenize module made of each document; empty documents have no rows."""
    rows_of: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    order = []
    for i in range(len(ds)):
        sample = ds[i]
        [(doc_id, chunk)] = ds.source(i)
        assert 1 <= len(sample.input_ids) <= LIMIT
        assert sample.segment_lengths.tolist() == [len(sample.input_ids)]
        rows_of.setdefault(doc_id, []).append((chunk, sample.input_ids, sample.word_starts))
        order.append((doc_id, chunk))
    expected_order = []
    for d, (doc_id, _) in enumerate(documents):
        a, b = int(tokenized.offsets[d]), int(tokenized.offsets[d + 1])
        if a == b:
            assert doc_id not in rows_of
            continue
        rows = rows_of[doc_id]
        assert [c for c, _, _ in rows] == list(range(len(rows)))
        assert np.array_equal(np.concatenate([r[1] for r in rows]), tokenized.ids[a:b])
        assert np.array_equal(np.concatenate([r[2] for r in rows]), tokenized.word_starts[a:b])
        expected_order.extend((doc_id, c) for c in range(len(rows)))
    assert order == expected_order
    assert (tokenized.word_starts == 0).sum() > 0  # the word-start column is not all ones


def test_ids_agree_with_the_hugging_face_tokenizer(ds, documents, tokenizer):
    """Independent oracle: the fast tokenizer's own ids and word ids for each document."""
    by_doc: dict[str, list[np.ndarray]] = {}
    starts_by_doc: dict[str, list[np.ndarray]] = {}
    for i in range(len(ds)):
        [(doc_id, _)] = ds.source(i)
        by_doc.setdefault(doc_id, []).append(ds[i].input_ids)
        starts_by_doc.setdefault(doc_id, []).append(ds[i].word_starts)
    for doc_id, text in documents[:80]:
        if not text:
            continue
        enc = tokenizer(text, add_special_tokens=False)
        words = enc.word_ids()
        starts = [1] + [int(words[j] != words[j - 1]) for j in range(1, len(words))]
        assert np.concatenate(by_doc[doc_id]).tolist() == enc["input_ids"]
        assert np.concatenate(starts_by_doc[doc_id]).tolist() == starts


@FEW
@given(data=st.data())
def test_get_batch_equals_stacked_getitem(ds, data):
    n = len(ds)
    indices = data.draw(st.lists(st.integers(-n, n - 1), max_size=40))
    batch = ds.get_batch(indices)
    samples = [ds[i] for i in indices]
    lengths = [len(s.input_ids) for s in samples]
    assert batch.offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert batch.lengths.tolist() == lengths
    if samples:
        assert np.array_equal(batch.input_ids, np.concatenate([s.input_ids for s in samples]))
        assert np.array_equal(batch.word_starts, np.concatenate([s.word_starts for s in samples]))
    assert batch.input_ids.dtype == np.int32 and batch.word_starts.dtype == np.uint8
    assert np.array_equal(ds.get_batch(np.asarray(indices)).input_ids, batch.input_ids)


def test_padded_batch(ds):
    indices = [3, 0, -1, 7, 3]
    batch = ds.get_batch(indices)
    width = max(len(ds[i].input_ids) for i in indices)
    for length in (None, width, width + 5):
        ids, starts = batch.padded(pad_id=-7, length=length)
        expected_width = width if length is None else length
        assert ids.shape == starts.shape == (len(indices), expected_width)
        assert ids.dtype == np.int32 and starts.dtype == np.uint8
        for row, i in enumerate(indices):
            sample = ds[i]
            k = len(sample.input_ids)
            assert ids[row, :k].tolist() == sample.input_ids.tolist()
            assert (ids[row, k:] == -7).all()
            assert starts[row, :k].tolist() == sample.word_starts.tolist()
            assert (starts[row, k:] == 0).all()
    with pytest.raises(ValueError, match="exceeds"):
        batch.padded(pad_id=0, length=width - 1)
    empty = Batch(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64))
    assert empty.padded(0)[0].shape == (0, 0)


def test_negative_and_out_of_range_indices(ds):
    n = len(ds)
    assert_sample(ds[-1], ds[n - 1].input_ids, ds[n - 1].word_starts)
    assert_sample(ds[-n], ds[0].input_ids, ds[0].word_starts)
    assert ds.source(-1) == ds.source(n - 1)
    assert_sample(ds[np.int64(2)], ds[2].input_ids, ds[2].word_starts)
    for bad in (n, n + 10, -n - 1):
        with pytest.raises(IndexError):
            ds[bad]
        with pytest.raises(IndexError):
            ds.get_batch([0, bad])


def test_samples_are_views_of_the_mapped_shards(ds, corpus):
    """Zero copy: every sample's arrays lie inside one shard's memory map (white-box: the
    maps are reached through the private ``_shard``) and cannot be written to."""
    num_shards = len(json.loads((corpus / schema.MANIFEST_NAME).read_text())["shards"])
    maps = [np.frombuffer(ds._shard(k)._map, dtype=np.uint8) for k in range(num_shards)]
    for i in range(0, len(ds), 7):
        sample = ds[i]
        for array in (sample.input_ids, sample.word_starts):
            assert not array.flags.writeable
            assert array.base is not None
            assert sum(np.shares_memory(array, m) for m in maps) == 1


# --------------------------------------------------------------------------- packed
def test_packed_samples_cover_all_rows_in_order(ds, packed_ds, packed_corpus):
    """Packs are consecutive rows (the rows of the unpacked run of the same input), never
    longer than the row limit, and greedy: the next row of the same shard did not fit."""
    manifest = json.loads((packed_corpus / schema.MANIFEST_NAME).read_text())
    assert manifest["packed"] and len(packed_ds) == manifest["counts"]["packs"]
    assert len(packed_ds) < len(ds)
    shard_ends = set(np.cumsum([s["packs"] for s in manifest["shards"]]).tolist())
    row = 0
    for p in range(len(packed_ds)):
        sample = packed_ds[p]
        segments = sample.segment_lengths.tolist()
        assert 1 <= len(sample.input_ids) == sum(segments) <= LIMIT
        expected = [ds[row + j] for j in range(len(segments))]
        assert segments == [len(s.input_ids) for s in expected]
        assert_sample(
            sample,
            np.concatenate([s.input_ids for s in expected]),
            np.concatenate([s.word_starts for s in expected]),
        )
        assert packed_ds.source(p) == [ds.source(row + j)[0] for j in range(len(segments))]
        row += len(segments)
        if p + 1 not in shard_ends:
            assert sum(segments) + packed_ds[p + 1].segment_lengths[0] > LIMIT
    assert row == len(ds)


def test_packed_get_batch_equals_stacked_getitem(packed_ds):
    rng = np.random.default_rng(3)
    indices = rng.integers(-len(packed_ds), len(packed_ds), size=60)
    batch = packed_ds.get_batch(indices)
    for b, i in enumerate(indices.tolist()):
        part = batch.input_ids[batch.offsets[b] : batch.offsets[b + 1]]
        assert np.array_equal(part, packed_ds[i].input_ids)


# --------------------------------------------------------------------------- manifest problems
def test_missing_manifest_names_the_path(tmp_path, corpus):
    folder = copy_corpus(corpus, tmp_path / "c")
    (folder / schema.MANIFEST_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=str(folder / schema.MANIFEST_NAME)):
        ShardDataset(folder)


def test_invalid_manifest_json(tmp_path, corpus):
    folder = copy_corpus(corpus, tmp_path / "c")
    (folder / schema.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ShardDataset(folder)


@pytest.mark.parametrize("version", [0, schema.SCHEMA_VERSION + 1, None, "1"])
def test_wrong_schema_version(tmp_path, corpus, version):
    folder = copy_corpus(corpus, tmp_path / "c")
    rewrite_manifest(folder, schema_version=version)
    with pytest.raises(ValueError, match="schema_version"):
        ShardDataset(folder)


def test_tokenizer_fingerprint_is_checked(tmp_path, corpus, tokenizer, documents):
    assert len(ShardDataset(corpus, tokenizer=tokenizer)) > 0
    assert len(ShardDataset(corpus, tokenizer=fingerprint(tokenizer))) > 0
    other = train_wordpiece([t for _, t in documents], 60, tmp_path / "tok60")
    mine, theirs = fingerprint(tokenizer), fingerprint(other)
    differing = [k for k in mine if mine[k] != theirs[k]]
    assert "vocab_size" in differing  # precondition: the second tokenizer really differs
    with pytest.raises(ValueError, match="another tokenizer") as info:
        ShardDataset(corpus, tokenizer=other)
    for key in differing:
        assert key in str(info.value)
    # one changed special-token id alone is enough, and is named
    moved = {**mine, "special_token_ids": {**mine["special_token_ids"], "mask": 999}}
    with pytest.raises(ValueError, match="special_token_ids"):
        ShardDataset(corpus, tokenizer=moved)


def test_changed_shard_bytes_fail_verification(tmp_path, corpus):
    folder = copy_corpus(corpus, tmp_path / "c")
    path = folder / "shards" / "part-000001.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(data))
    ShardDataset(folder)  # without verify only the sizes are checked
    with pytest.raises(ValueError, match=r"part-000001\.arrow.*sha256"):
        ShardDataset(folder, verify=True)
    assert len(ShardDataset(corpus, verify=True)) > 0  # the intact corpus verifies


def test_truncated_shard_is_named(tmp_path, corpus):
    folder = copy_corpus(corpus, tmp_path / "c")
    path = folder / "shards" / "part-000002.arrow"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=str(path)):
        ShardDataset(folder)


def test_missing_shard_is_named(tmp_path, corpus):
    folder = copy_corpus(corpus, tmp_path / "c")
    path = folder / "shards" / "part-000000.arrow"
    path.unlink()
    with pytest.raises(FileNotFoundError, match=str(path)):
        ShardDataset(folder)


# A shard that matches the manifest's size but is not a readable Arrow file (damaged footer;
# checked only with verify=True) must fail on first access naming the file, not with pyarrow's
# bare "Not an Arrow file": in a corpus of thousands of shards the name is what matters.
def test_unreadable_shard_error_names_the_file(tmp_path, corpus):
    folder = copy_corpus(corpus, tmp_path / "c")
    path = folder / "shards" / "part-000001.arrow"
    data = bytearray(path.read_bytes())
    data[-6:] = b"XXXXXX"  # the trailing "ARROW1" magic
    path.write_bytes(bytes(data))
    manifest = json.loads((folder / schema.MANIFEST_NAME).read_text())
    first = manifest["shards"][0]["rows"]
    ds = ShardDataset(folder)
    with pytest.raises(Exception, match=r"part-000001\.arrow"):
        ds[first]


# --------------------------------------------------------------------------- processes
def test_pickled_dataset_reads_the_same(ds):
    ds[0]  # open maps first: they must not travel in the pickle
    clone = pickle.loads(pickle.dumps(ds))
    for i in range(len(ds)):
        assert_sample(clone[i], ds[i].input_ids, ds[i].word_starts)


class WorkerView(torch.utils.data.Dataset):
    """Reads sample i both ways inside a DataLoader worker, and says which process it is."""

    def __init__(self, ds: ShardDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        sample = self.ds[i]
        batch = self.ds.get_batch([i, -1 - i])
        return i, sample.input_ids.copy(), sample.word_starts.copy(), batch, os.getpid()


def keep_list(items):
    return items


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_what_the_main_process_reads(corpus, context):
    ds = ShardDataset(corpus)
    ds[len(ds) - 1]  # the parent holds open maps when the workers fork
    loader = torch.utils.data.DataLoader(
        WorkerView(ds),
        batch_size=16,
        num_workers=2,
        collate_fn=keep_list,
        multiprocessing_context=context,
    )
    seen, pids = [], set()
    for items in loader:
        for i, ids, starts, batch, pid in items:
            pids.add(pid)
            seen.append(i)
            assert_sample(ds[i], ids, starts)
            expected = ds.get_batch([i, -1 - i])
            assert np.array_equal(batch.input_ids, expected.input_ids)
            assert np.array_equal(batch.offsets, expected.offsets)
    assert seen == list(range(len(ds)))
    assert os.getpid() not in pids and len(pids) == 2
