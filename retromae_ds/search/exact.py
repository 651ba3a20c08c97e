"""Exact (brute-force) nearest-neighbour search over dense embeddings, by inner product or cosine.

``ExactIndex`` holds float32 vectors (``add`` appends, ids are row positions in order of
addition) and answers ``search(queries_QD, k)`` with ``(scores_QK float32, ids_QK int64)``, best
first. Backends: ``"faiss"`` (flat inner-product index, ``faiss_backend.FlatBlock``; on GPUs
when faiss was built with them and torch sees CUDA, else faiss-cpu) and ``"torch"`` (matmul +
topk on any torch device, the plain reference and a GPU path without faiss-gpu).
``block_rows`` splits the vectors into several indexes searched one after another with their
top-k merged, so a corpus larger than one index (or one GPU) still gets an exact answer;
``search_blocks`` does the same over an iterable of arrays loaded one at a time (e.g.
memory-mapped embedding shards). ``rescore`` gives candidates found by an approximate index
their exact scores.

Conventions: ``k`` may exceed the number of vectors, missing slots have id ``-1`` and score
``-inf``. Ties: merged results (several blocks) order equal scores by id ascending; within one
index the backend's order stands, and which of several exactly equal scores make the cut at
``k`` is up to the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from retromae_ds.search.arrays import (
    BACKENDS,
    Backend,
    Matrix,
    Metric,
    check_k,
    check_matrix,
    check_metric,
    l2_normalize,
)
from retromae_ds.search.faiss_backend import FlatBlock
from retromae_ds.search.index import IndexChoice
from retromae_ds.search.merge import merge_topk, pad_topk

_TORCH_SCORE_BYTES = 2**28  # bound on one [query batch, block rows] float32 score matrix


class _TorchBlock:
    """Vectors in one tensor on ``device``; search is matmul + topk over query batches."""

    def __init__(self, dim: int, device: torch.device) -> None:
        self.device = device
        self.data_ND = torch.empty((0, dim), dtype=torch.float32, device=device)
        self._pending: list[torch.Tensor] = []  # concatenated once, at the next search

    @property
    def ntotal(self) -> int:
        return self.data_ND.shape[0] + sum(p.shape[0] for p in self._pending)

    def add(self, x_ND: Matrix) -> None:
        if isinstance(x_ND, torch.Tensor):
            self._pending.append(x_ND.detach().to(self.device, torch.float32, copy=True))
        else:  # torch.tensor copies, so read-only (memory-mapped) input is fine
            self._pending.append(torch.tensor(x_ND, dtype=torch.float32, device=self.device))

    def search(self, q_QD: Matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self._pending:
            self.data_ND = torch.cat([self.data_ND, *self._pending])
            self._pending = []
        if isinstance(q_QD, torch.Tensor):
            q = q_QD.detach().to(self.device, torch.float32)
        else:
            q = torch.tensor(q_QD, dtype=torch.float32, device=self.device)
        step = max(1, _TORCH_SCORE_BYTES // (4 * max(1, self.data_ND.shape[0])))
        scores, ids = [], []
        with torch.inference_mode():
            for start in range(0, q.shape[0], step):
                top = torch.topk(q[start : start + step] @ self.data_ND.T, k, dim=1)
                scores.append(top.values.cpu())
                ids.append(top.indices.cpu())
        return torch.cat(scores).numpy(), torch.cat(ids).numpy().astype(np.int64)


class ExactIndex:
    """Exact top-k search by inner product (``metric="ip"``) or cosine similarity (an
    ``index.Index``: no training, exact scores).

    Args:
        dim: vector dimension.
        metric: ``"ip"`` or ``"cosine"`` (vectors and queries are L2-normalised copies).
        backend: ``"faiss"``, ``"torch"``, or ``"auto"`` (faiss, on GPUs when usable).
        device: torch backend only; default ``"cuda"`` when available, else ``"cpu"``.
        block_rows: at most this many vectors per underlying index (None: one index). Results
            are exact whatever the value; it bounds the memory of one index.
    """

    def __init__(
        self,
        dim: int,
        *,
        metric: Metric = "ip",
        backend: Backend = "auto",
        device: str | torch.device | None = None,
        block_rows: int | None = None,
    ) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        check_metric(metric)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto', 'faiss' or 'torch', got {backend!r}")
        if block_rows is not None and block_rows < 1:
            raise ValueError(f"block_rows must be >= 1 or None, got {block_rows}")
        self.dim, self.metric, self.block_rows = dim, metric, block_rows
        self.exact = True
        self.choice: IndexChoice | None = None
        self.backend = "faiss" if backend == "auto" else backend
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._blocks: list[FlatBlock | _TorchBlock] = []

    @classmethod
    def build(cls, embeddings_ND: Matrix, **kwargs) -> ExactIndex:
        """An index holding ``embeddings_ND`` (ids 0..N-1); kwargs as for the constructor."""
        embeddings_ND = check_matrix(embeddings_ND, "embeddings")
        index = cls(embeddings_ND.shape[1], **kwargs)
        index.add(embeddings_ND)
        return index

    @property
    def ntotal(self) -> int:
        return sum(b.ntotal for b in self._blocks)

    def training_vectors(self, n: int) -> int:
        """No training: 0."""
        return 0

    def train(self, embeddings_ND: Matrix) -> None:
        """Nothing to train."""

    def _new_block(self) -> FlatBlock | _TorchBlock:
        if self.backend == "faiss":
            return FlatBlock(self.dim)
        return _TorchBlock(self.dim, self.device)

    def add(self, embeddings_ND: Matrix) -> None:
        """Append vectors; their ids continue from ``ntotal``."""
        x = check_matrix(embeddings_ND, "embeddings", self.dim)
        if self.metric == "cosine":
            x = l2_normalize(x)
        start = 0
        while start < x.shape[0]:
            if not self._blocks or (
                self.block_rows is not None and self._blocks[-1].ntotal >= self.block_rows
            ):
                self._blocks.append(self._new_block())
            room = x.shape[0] - start
            if self.block_rows is not None:
                room = min(room, self.block_rows - self._blocks[-1].ntotal)
            self._blocks[-1].add(x[start : start + room])
            start += room

    def search(self, queries_QD: Matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores_QK, ids_QK)``, best first; slots beyond ``ntotal`` hold -inf / -1."""
        q = check_matrix(queries_QD, "queries", self.dim)
        k = check_k(k)
        if self.metric == "cosine":
            q = l2_normalize(q)
        scores = np.empty((q.shape[0], 0), dtype=np.float32)
        ids = np.empty((q.shape[0], 0), dtype=np.int64)
        offset = 0
        for block in self._blocks:
            n = block.ntotal
            if n and q.shape[0]:
                block_scores, block_ids = block.search(q, min(k, n))
                block_ids = np.where(block_ids >= 0, block_ids + offset, -1)
                if ids.shape[1] == 0:  # one index: keep the backend's order, skip the merge
                    scores, ids = block_scores, block_ids
                else:
                    scores, ids = merge_topk(scores, ids, block_scores, block_ids, k)
            offset += n
        return pad_topk(scores, ids, k)

    def search_parts(
        self,
        queries_QD: Matrix,
        parts: Iterable[Matrix],
        k: int,
        *,
        query_batch: int | None = None,
        filled: Callable[[], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``search_blocks`` over ``parts`` with this index's metric, backend and device: one
        part held at a time, never added (``filled`` is not called)."""
        if self.ntotal:
            raise ValueError("search_parts: the index must be empty (ids start at 0)")
        return search_blocks(
            queries_QD, parts, k, metric=self.metric, backend=self.backend, device=self.device,
            query_batch=query_batch,
        )  # fmt: skip


def search_blocks(
    queries_QD: Matrix,
    blocks: Iterable[Matrix],
    k: int,
    *,
    metric: Metric = "ip",
    backend: Backend = "auto",
    device: str | torch.device | None = None,
    query_batch: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k over the concatenation of ``blocks``, holding one block at a time.

    ``blocks`` may be a generator that loads each (e.g. ``np.load(path, mmap_mode="r")``);
    returned ids are row positions in the concatenation. ``query_batch`` searches and merges
    that many queries at a time (None: all at once), which bounds the temporaries of the
    merge to ``[query_batch, 2k]``; the running ``[Q, k]`` result is held throughout.
    """
    q = check_matrix(queries_QD, "queries")
    k = check_k(k)
    if query_batch is not None and query_batch < 1:
        raise ValueError(f"query_batch must be >= 1 or None, got {query_batch}")
    scores = np.full((q.shape[0], k), -np.inf, dtype=np.float32)
    ids = np.full((q.shape[0], k), -1, dtype=np.int64)
    step = query_batch or max(1, q.shape[0])
    offset = 0
    for i, block in enumerate(blocks):
        block = check_matrix(block, f"block {i}", q.shape[1])
        index = ExactIndex(q.shape[1], metric=metric, backend=backend, device=device)
        index.add(block)
        for start in range(0, q.shape[0], step):
            rows = slice(start, start + step)
            block_scores, block_ids = index.search(q[rows], k)
            block_ids = np.where(block_ids >= 0, block_ids + offset, -1)
            scores[rows], ids[rows] = merge_topk(
                scores[rows], ids[rows], block_scores, block_ids, k
            )
        offset += block.shape[0]
        del index  # frees the block's (GPU) memory before the next one is loaded
    return scores, ids


def rescore(
    queries_QD: np.ndarray,
    vectors_ND: np.ndarray,
    ids_QK: np.ndarray,
    *,
    metric: Metric = "ip",
    offset: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact scores of the candidates ``ids_QK`` (rows ``ids - offset`` of ``vectors_ND``; -1:
    none), each row re-sorted by them: score descending, id ascending, missing slots last.

    An index that ranks by compressed codes (PQ) returns approximate scores; the refresher's
    false-negative filter compares candidates' scores with the positives' exact ones, so it
    gets these. Works in query batches, so memory stays at about 64 MiB of gathered vectors.
    ``vectors_ND`` may also be any object whose ``[row_ids]`` gives those rows as a float32
    ``[n, D]`` array (the refresher's memory-mapped embedding shards: ``ShardRows``).
    """
    check_metric(metric)
    queries_QD = check_matrix(queries_QD, "queries")
    if isinstance(vectors_ND, (np.ndarray, torch.Tensor)):
        vectors_ND = check_matrix(vectors_ND, "vectors", queries_QD.shape[1])
    k = ids_QK.shape[1]
    scores = np.full(ids_QK.shape, -np.inf, dtype=np.float32)
    step = max(1, 2**26 // (4 * max(1, k * queries_QD.shape[1])))
    for start in range(0, len(ids_QK), step):
        ids = ids_QK[start : start + step]
        q = np.asarray(queries_QD[start : start + step], dtype=np.float32)
        rows = np.where(ids >= 0, ids - offset, 0)
        cand_QKD = np.asarray(vectors_ND[rows.ravel()], dtype=np.float32).reshape(*ids.shape, -1)
        if metric == "cosine":
            q = l2_normalize(q)
            cand_QKD = l2_normalize(cand_QKD.reshape(-1, cand_QKD.shape[-1])).reshape(
                cand_QKD.shape
            )
        exact = np.einsum("qd,qkd->qk", q, cand_QKD).astype(np.float32)
        scores[start : start + step] = np.where(ids >= 0, exact, -np.inf)
    padding = ids_QK < 0
    order = np.lexsort((ids_QK, -scores, padding), axis=1)
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids_QK, order, 1)
