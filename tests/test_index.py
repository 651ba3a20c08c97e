"""Exact search (retromae_ds.search.exact) against a numpy brute force written here.

Random Gaussian vectors make exact score ties vanishingly unlikely; the tests check that the
reference has none at the cut, so ids can be compared exactly. Ties are exercised separately,
with integer scores, on ``merge_topk`` whose tie rule (id ascending) is specified.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.search.arrays import check_matrix
from retromae_ds.search.exact import ExactIndex, search_blocks
from retromae_ds.search.faiss_backend import faiss_gpus_usable
from retromae_ds.search.merge import merge_topk

BACKENDS = ["faiss", "torch"]


def brute_force(corpus: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top k by inner product in float64, no ties allowed at the cut."""
    scores = queries.astype(np.float64) @ corpus.astype(np.float64).T
    order = np.argsort(-scores, axis=1, kind="stable")
    top = np.take_along_axis(scores, order, axis=1)
    cut = min(k, corpus.shape[0])
    assert (np.diff(top[:, : cut + 1], axis=1) < 0).all(), "test data has ties at the cut"
    return top[:, :cut], order[:, :cut]


def random_data(n: int, q: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((n, d)).astype(np.float32),
        rng.standard_normal((q, d)).astype(np.float32),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_rows", [None, 1, 7, 333])
def test_exact_topk_equals_brute_force(backend, block_rows):
    corpus, queries = random_data(1000, 23, 16, seed=1)
    ref_scores, ref_ids = brute_force(corpus, queries, 50)
    index = ExactIndex.build(corpus, backend=backend, block_rows=block_rows)
    scores, ids = index.search(queries, 50)
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    assert scores.shape == ids.shape == (23, 50)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_torch_backend_equals_faiss_backend():
    corpus, queries = random_data(2000, 40, 32, seed=2)
    faiss_scores, faiss_ids = ExactIndex.build(corpus, backend="faiss").search(queries, 100)
    torch_scores, torch_ids = ExactIndex.build(corpus, backend="torch").search(queries, 100)
    np.testing.assert_array_equal(torch_ids, faiss_ids)
    np.testing.assert_allclose(torch_scores, faiss_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adding_in_pieces_continues_ids(backend):
    corpus, queries = random_data(300, 5, 8, seed=3)
    index = ExactIndex(8, backend=backend, block_rows=64)
    for start in range(0, 300, 45):
        index.add(corpus[start : start + 45])
    assert index.ntotal == 300
    _, ref_ids = brute_force(corpus, queries, 20)
    np.testing.assert_array_equal(index.search(queries, 20)[1], ref_ids)


def test_search_blocks_equals_one_index(tmp_path):
    corpus, queries = random_data(1000, 17, 12, seed=4)
    bounds = [0, 1, 250, 251, 700, 1000]  # includes a one-row block
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        np.save(tmp_path / f"shard{i}.npy", corpus[a:b])
    blocks = (np.load(tmp_path / f"shard{i}.npy", mmap_mode="r") for i in range(len(bounds) - 1))
    scores, ids = search_blocks(queries, blocks, 60)
    ref_scores, ref_ids = ExactIndex.build(corpus).search(queries, 60)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_rows", [None, 2])
def test_k_larger_than_corpus_pads(backend, block_rows):
    corpus, queries = random_data(5, 3, 4, seed=5)
    scores, ids = ExactIndex.build(corpus, backend=backend, block_rows=block_rows).search(
        queries, 9
    )
    ref_scores, ref_ids = brute_force(corpus, queries, 9)
    np.testing.assert_array_equal(ids[:, :5], ref_ids)
    np.testing.assert_allclose(scores[:, :5], ref_scores, rtol=1e-5)
    assert (ids[:, 5:] == -1).all() and np.isneginf(scores[:, 5:]).all()


def test_search_blocks_k_larger_than_corpus():
    corpus, queries = random_data(6, 2, 4, seed=6)
    scores, ids = search_blocks(queries, [corpus[:4], corpus[4:]], 10)
    _, ref_ids = brute_force(corpus, queries, 10)
    np.testing.assert_array_equal(ids[:, :6], ref_ids)
    assert (ids[:, 6:] == -1).all() and np.isneginf(scores[:, 6:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_index_returns_padding(backend):
    scores, ids = ExactIndex(4, backend=backend).search(np.ones((2, 4), np.float32), 3)
    assert ids.shape == (2, 3) and (ids == -1).all() and np.isneginf(scores).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_queries_gives_empty_result(backend):
    corpus, _ = random_data(10, 1, 4, seed=11)
    scores, ids = ExactIndex.build(corpus, backend=backend).search(np.empty((0, 4), np.float32), 3)
    assert scores.shape == ids.shape == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_equals_normalised_inner_product(backend):
    corpus, queries = random_data(400, 9, 16, seed=7)
    corpus *= np.random.default_rng(0).uniform(0.1, 10, (400, 1)).astype(np.float32)
    unit = corpus / np.linalg.norm(corpus, axis=1, keepdims=True)
    unit_q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    ref_scores, ref_ids = brute_force(unit, unit_q, 25)
    scores, ids = ExactIndex.build(corpus, metric="cosine", backend=backend).search(queries, 25)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert np.abs(scores).max() <= 1 + 1e-5


def test_cosine_zero_vector_is_not_nan():
    corpus = np.zeros((3, 4), np.float32)
    corpus[1, 0] = 2.0
    scores, ids = ExactIndex.build(corpus, metric="cosine").search(np.eye(4, dtype=np.float32), 3)
    assert np.isfinite(scores).all()
    assert ids[0, 0] == 1 and scores[0, 0] == pytest.approx(1.0)


def test_torch_tensors_are_accepted():
    corpus, queries = random_data(200, 4, 8, seed=8)
    _, ref_ids = brute_force(corpus, queries, 10)
    for backend in BACKENDS:
        index = ExactIndex.build(torch.from_numpy(corpus), backend=backend)
        np.testing.assert_array_equal(index.search(torch.from_numpy(queries), 10)[1], ref_ids)


def test_clear_errors_for_bad_input():
    index = ExactIndex.build(np.ones((3, 4), np.float32))
    with pytest.raises(TypeError, match="float64.*float32"):
        index.search(np.ones((2, 4)), 1)
    with pytest.raises(TypeError, match="float32"):
        index.add(torch.ones(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"2-D.*\(4,\).*x\[None, :\]"):
        index.search(np.ones(4, np.float32), 1)
    with pytest.raises(ValueError, match="dimension 5.*dimension 4"):
        index.search(np.ones((2, 5), np.float32), 1)
    with pytest.raises(ValueError, match="dimension 3.*dimension 4"):
        index.add(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="positive integer"):
        index.search(np.ones((2, 4), np.float32), 0)
    with pytest.raises(TypeError, match="numpy array or torch tensor"):
        check_matrix([[1.0, 2.0]], "queries")
    with pytest.raises(ValueError, match="metric"):
        ExactIndex(4, metric="l2")
    with pytest.raises(ValueError, match="backend"):
        ExactIndex(4, backend="annoy")
    with pytest.raises(ValueError, match="block 1 have dimension 3"):
        blocks = [np.ones((2, 4), np.float32), np.ones((2, 3), np.float32)]
        search_blocks(np.ones((1, 4), np.float32), blocks, 1)


def reference_topk_with_ties(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Score descending, then id ascending, written as a plain per-row sort."""
    out_s, out_i = [], []
    for row in scores:
        ranked = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
        out_s.append([row[j] for j in ranked])
        out_i.append(ranked)
    return np.array(out_s, dtype=np.float32), np.array(out_i, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 40),
    k=st.integers(1, 45),
    split=st.integers(1, 39),
    seed=st.integers(0, 2**16),
)
def test_merge_topk_matches_sorted_reference_with_ties(n, k, split, seed):
    split = min(split, n - 1)
    rng = np.random.default_rng(seed)
    scores = rng.integers(-3, 4, size=(3, n)).astype(np.float32)  # many ties
    ref_s, ref_i = reference_topk_with_ties(scores, k)
    part_a = reference_topk_with_ties(scores[:, :split], k)
    part_b = reference_topk_with_ties(scores[:, split:], k)
    merged_s, merged_i = merge_topk(part_a[0], part_a[1], part_b[0], part_b[1] + split, k)
    width = min(k, n)
    np.testing.assert_array_equal(merged_i[:, :width], ref_i)
    np.testing.assert_array_equal(merged_s[:, :width], ref_s)
    assert (merged_i[:, width:] == -1).all() and merged_i.shape == (3, k)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_torch_backend_on_gpu_equals_cpu():
    corpus, queries = random_data(5000, 64, 64, seed=9)
    _, ref_ids = brute_force(corpus, queries, 100)
    index = ExactIndex.build(corpus, backend="torch", device="cuda", block_rows=1500)
    np.testing.assert_array_equal(index.search(queries, 100)[1], ref_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not faiss_gpus_usable(), reason="needs faiss built with GPU support")
def test_faiss_gpu_equals_brute_force():
    corpus, queries = random_data(5000, 64, 64, seed=10)
    _, ref_ids = brute_force(corpus, queries, 100)
    np.testing.assert_array_equal(ExactIndex.build(corpus).search(queries, 100)[1], ref_ids)
