"""Exact (brute-force) nearest-neighbour search over dense embeddings, by inner product or cosine.

The only module that imports faiss. ``ExactIndex`` holds float32 vectors (``add`` appends, ids
are row positions in order of addition) and answers ``search(queries_QD, k)`` with
``(scores_QK float32, ids_QK int64)``, best first. Backends: ``"faiss"`` (flat inner-product
index; on GPUs when faiss was built with them and torch sees CUDA, else faiss-cpu) and
``"torch"`` (matmul + topk on any torch device, the plain reference and a GPU path without
faiss-gpu). ``block_rows`` splits the vectors into several indexes searched one after another
with their top-k merged, so a corpus larger than one index (or one GPU) still gets an exact
answer; ``search_blocks`` does the same over an iterable of arrays loaded one at a time (e.g.
memory-mapped embedding shards), and ``merge_topk`` merges results computed anywhere else.

Conventions: ``k`` may exceed the number of vectors, missing slots have id ``-1`` and score
``-inf``. Ties: merged results (several blocks) order equal scores by id ascending; within one
index the backend's order stands, and which of several exactly equal scores make the cut at
``k`` is up to the backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import faiss
import numpy as np
import torch

Metric = Literal["ip", "cosine"]
Backend = Literal["auto", "faiss", "torch"]
Matrix = np.ndarray | torch.Tensor

_TORCH_SCORE_BYTES = 2**28  # bound on one [query batch, block rows] float32 score matrix
_FAISS_GPU_MAX_K = 2048  # faiss's GPU k-selection limit


def faiss_gpus_usable() -> bool:
    """True when faiss was built with GPU support, sees a GPU, and torch sees CUDA too."""
    return (
        hasattr(faiss, "StandardGpuResources")
        and faiss.get_num_gpus() > 0
        and torch.cuda.is_available()
    )


def check_matrix(x: object, name: str, dim: int | None = None) -> Matrix:
    """``x`` as a 2-D float32 numpy array or torch tensor, or a clear error saying what is wrong."""
    if isinstance(x, torch.Tensor):
        dtype_ok, dtype = x.dtype == torch.float32, str(x.dtype)
    elif isinstance(x, np.ndarray):
        dtype_ok, dtype = x.dtype == np.float32, str(x.dtype)
    else:
        raise TypeError(f"{name} must be a numpy array or torch tensor, not {type(x).__name__}")
    if not dtype_ok:
        raise TypeError(f"{name} has dtype {dtype}; expected float32 (convert with .astype)")
    if x.ndim != 2:
        hint = " (use x[None, :] for a single vector)" if x.ndim == 1 else ""
        raise ValueError(f"{name} must be 2-D [rows, dim]; got shape {tuple(x.shape)}{hint}")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"{name} have dimension {x.shape[1]}; the index holds dimension {dim}")
    return x


def l2_normalize(x: Matrix) -> Matrix:
    """Rows scaled to unit L2 norm (a copy; all-zero rows stay zero)."""
    if isinstance(x, torch.Tensor):
        return torch.nn.functional.normalize(x, dim=1)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, np.finfo(np.float32).tiny)).astype(np.float32, copy=False)


def _to_numpy(x: Matrix) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def _pad(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Widen a ``[Q, <=k]`` result to ``[Q, k]`` with -inf / -1 slots."""
    missing = k - ids.shape[1]
    if missing <= 0:
        return scores, ids
    return (
        np.hstack([scores, np.full((len(scores), missing), -np.inf, dtype=np.float32)]),
        np.hstack([ids, np.full((len(ids), missing), -1, dtype=np.int64)]),
    )


def _check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return int(k)


def merge_topk(
    scores_a: np.ndarray, ids_a: np.ndarray, scores_b: np.ndarray, ids_b: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Best ``k`` of two ``[Q, *]`` results (ids must be global), score descending, id ascending.

    Padding slots (id -1) sort last and pad the output when both inputs hold fewer than k.
    """
    scores = np.concatenate([scores_a, scores_b], axis=1).astype(np.float32, copy=False)
    ids = np.concatenate([ids_a, ids_b], axis=1).astype(np.int64, copy=False)
    padding = ids < 0
    scores = np.where(padding, -np.inf, scores)
    # lexsort: last key is primary -> padding last, then score descending, then id ascending
    order = np.lexsort((ids, -scores, padding), axis=1)[:, :k]
    return _pad(np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1), k)


class _FaissBlock:
    """One flat inner-product faiss index (replicated or sharded over all GPUs when usable)."""

    def __init__(self, dim: int) -> None:
        self.index = faiss.IndexFlatIP(dim)
        self.on_gpu = faiss_gpus_usable()
        if self.on_gpu:
            options = faiss.GpuMultipleClonerOptions()
            options.shard = faiss.get_num_gpus() > 1  # spread a big corpus over the GPUs
            self.index = faiss.index_cpu_to_all_gpus(self.index, co=options)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def add(self, x_ND: Matrix) -> None:
        self.index.add(_to_numpy(x_ND))

    def search(self, q_QD: Matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.on_gpu and k > _FAISS_GPU_MAX_K:
            raise ValueError(
                f"faiss on GPU searches at most k={_FAISS_GPU_MAX_K}; got k={k} "
                "(use backend='torch' for deeper searches)"
            )
        scores, ids = self.index.search(_to_numpy(q_QD), k)
        return scores, ids.astype(np.int64, copy=False)


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
    """Exact top-k search by inner product (``metric="ip"``) or cosine similarity.

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
        if metric not in ("ip", "cosine"):
            raise ValueError(f"metric must be 'ip' or 'cosine', got {metric!r}")
        if backend not in ("auto", "faiss", "torch"):
            raise ValueError(f"backend must be 'auto', 'faiss' or 'torch', got {backend!r}")
        if block_rows is not None and block_rows < 1:
            raise ValueError(f"block_rows must be >= 1 or None, got {block_rows}")
        self.dim, self.metric, self.block_rows = dim, metric, block_rows
        self.backend = "faiss" if backend == "auto" else backend
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._blocks: list[_FaissBlock | _TorchBlock] = []

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

    def _new_block(self) -> _FaissBlock | _TorchBlock:
        if self.backend == "faiss":
            return _FaissBlock(self.dim)
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
        k = _check_k(k)
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
        return _pad(scores, ids, k)


def search_blocks(
    queries_QD: Matrix,
    blocks: Iterable[Matrix],
    k: int,
    *,
    metric: Metric = "ip",
    backend: Backend = "auto",
    device: str | torch.device | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k over the concatenation of ``blocks``, holding one block at a time.

    ``blocks`` may be a generator that loads each (e.g. ``np.load(path, mmap_mode="r")``);
    returned ids are row positions in the concatenation.
    """
    q = check_matrix(queries_QD, "queries")
    k = _check_k(k)
    scores = np.empty((q.shape[0], 0), dtype=np.float32)
    ids = np.empty((q.shape[0], 0), dtype=np.int64)
    offset = 0
    for i, block in enumerate(blocks):
        block = check_matrix(block, f"block {i}", q.shape[1])
        index = ExactIndex(q.shape[1], metric=metric, backend=backend, device=device)
        index.add(block)
        block_scores, block_ids = index.search(q, k)
        block_ids = np.where(block_ids >= 0, block_ids + offset, -1)
        scores, ids = merge_topk(scores, ids, block_scores, block_ids, k)
        offset += block.shape[0]
        del index  # frees the block's (GPU) memory before the next one is loaded
    return _pad(scores, ids, k)
