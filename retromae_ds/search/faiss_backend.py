"""The one module that imports faiss: flat inner-product blocks for ``ExactIndex``, and for
``ApproximateIndex`` the ``index_factory`` indexes (built, described, trained, moved to GPUs,
tuned per search, measured), with faiss's errors turned into one readable line.

GPUs are used when faiss was built with them and torch sees CUDA too (``faiss_gpus_usable``):
a flat block is replicated or sharded over all of them; an approximate index is trained on
the first GPU and then cloned to all of them, or stays on the CPU where faiss has no GPU
version of it (HNSW graphs, for one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import faiss
import numpy as np
import torch

from retromae_ds.search.arrays import Matrix, to_numpy

FAISS_GPU_MAX_K = 2048
"""faiss's GPU k-selection limit (for k and for IVF's nprobe)."""


def faiss_gpus_usable() -> bool:
    """True when faiss was built with GPU support, sees a GPU, and torch sees CUDA too."""
    return (
        hasattr(faiss, "StandardGpuResources")
        and faiss.get_num_gpus() > 0
        and torch.cuda.is_available()
    )


def set_threads(threads: int) -> None:
    """faiss's OpenMP threads (the same runtime as torch's where torch was imported first)."""
    faiss.omp_set_num_threads(threads)


def faiss_message(exc: BaseException) -> str:
    """faiss's own reason, without the C++ function signature and source location."""
    text = " ".join(str(exc).split())
    found = re.search(r"Error in .*? at \S+:\d+: (?:Error: )?(.*)", text)
    return re.sub(r"^'[^']*' failed: ", "", found.group(1) if found else text)


def check_gpu_k(k: int, on_gpu: bool) -> None:
    if on_gpu and k > FAISS_GPU_MAX_K:
        raise ValueError(
            f"faiss on GPU searches at most k={FAISS_GPU_MAX_K}; got k={k} "
            "(use backend='torch' for deeper exact searches)"
        )


class FlatBlock:
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
        self.index.add(to_numpy(x_ND))

    def search(self, q_QD: Matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
        check_gpu_k(k, self.on_gpu)
        scores, ids = self.index.search(to_numpy(q_QD), k)
        return scores, ids.astype(np.int64, copy=False)


# --------------------------------------------------------------------------- factory indexes
@dataclass(frozen=True)
class Layout:
    """What an ``index_factory`` string built: the parts the settings and checks refer to."""

    nlist: int
    """IVF lists (0: no IVF)."""
    hnsw: bool
    """The vectors sit in an HNSW graph (``HNSW32,Flat``)."""
    hnsw_quantizer: bool
    """The IVF coarse quantiser is an HNSW graph (``IVF65536_HNSW32,Flat``)."""
    pq_m: int
    """PQ sub-quantisers (0: no PQ codes)."""
    pq_nbits: int
    """Bits per PQ code (2**nbits centroids per sub-quantiser)."""
    trained: bool
    """False when the index must see training vectors before vectors are added."""


def new_index(factory: str, dim: int) -> faiss.Index:
    """An empty inner-product index from a faiss ``index_factory`` string; faiss's error
    (an unparseable string, sizes that do not fit ``dim``) as a ValueError of one line."""
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(faiss_message(exc)) from None
    for part in _parts(index):
        if getattr(part, "do_polysemous_training", False):
            # codes re-ordered for Hamming pre-filtering, which nothing here uses: it took
            # 95 % of an IVF-PQ's training time (9 s of 9.4 s at 4,000 vectors)
            part.do_polysemous_training = False
    return index


def _parts(index: faiss.Index) -> list[faiss.Index]:
    """``index`` and the indexes it wraps (pre-transforms, refinement, id maps, IVF and HNSW
    storage), each downcast to its concrete class."""
    out, todo = [], [index]
    while todo:
        part = faiss.downcast_index(todo.pop())
        out.append(part)
        for attr in ("index", "base_index", "storage"):
            inner = getattr(part, attr, None)
            if isinstance(inner, faiss.Index):
                todo.append(inner)
    return out


def describe(index: faiss.Index) -> Layout:
    """The ``Layout`` of a CPU faiss index."""
    parts = _parts(index)
    ivf = faiss.try_extract_index_ivf(index)
    codes = [p.pq for p in parts if isinstance(getattr(p, "pq", None), faiss.ProductQuantizer)]
    pq = codes[0] if codes else None
    return Layout(
        nlist=int(ivf.nlist) if ivf is not None else 0,
        hnsw=any(isinstance(p, faiss.IndexHNSW) for p in parts),
        hnsw_quantizer=ivf is not None
        and isinstance(faiss.downcast_index(ivf.quantizer), faiss.IndexHNSW),
        pq_m=int(pq.M) if pq is not None else 0,
        pq_nbits=int(pq.nbits) if pq is not None else 0,
        trained=bool(index.is_trained),
    )


def train(index: faiss.Index, x_ND: np.ndarray, use_gpu: bool) -> faiss.Index:
    """``index`` (CPU) trained on ``x_ND``, on the first GPU when asked and faiss has a GPU
    version of it (the trained index comes back to the CPU, to be cloned to every GPU with
    the same lists); faiss's errors as a ValueError of one line."""
    x = to_numpy(x_ND)
    try:
        if use_gpu:
            resources = faiss.StandardGpuResources()
            try:
                on_gpu = faiss.index_cpu_to_gpu(resources, 0, index)
            except RuntimeError:
                on_gpu = None  # no GPU version of this index: train on the CPU
            if on_gpu is not None:
                on_gpu.train(x)
                return faiss.index_gpu_to_cpu(on_gpu)
        index.train(x)
        return index
    except RuntimeError as exc:
        raise ValueError(faiss_message(exc)) from None


def to_gpus(index: faiss.Index) -> tuple[faiss.Index, bool]:
    """(``index`` cloned to every GPU, True), or (``index``, False) where faiss has no GPU
    version of it; PQ indexes whose lookup tables do not fit the GPU's shared memory retry
    with float16 tables."""
    for float16 in (False, True):
        options = faiss.GpuMultipleClonerOptions()
        options.shard = faiss.get_num_gpus() > 1
        options.useFloat16 = float16
        try:
            return faiss.index_cpu_to_all_gpus(index, co=options), True
        except RuntimeError:
            continue
    return index, False


def set_search_parameters(
    index: faiss.Index, on_gpu: bool, layout: Layout, *, nprobe: int = 0, ef_search: int = 0
) -> None:
    """IVF lists probed and HNSW candidate-list size (of the graph, or of an IVF's HNSW coarse
    quantiser) for the next searches of ``index`` (``layout``: its CPU original's); 0 leaves
    a parameter as it is."""
    space = faiss.GpuParameterSpace() if on_gpu else faiss.ParameterSpace()
    if nprobe and layout.nlist:
        space.set_index_parameter(index, "nprobe", nprobe)
    if ef_search and layout.hnsw_quantizer:
        try:
            space.set_index_parameter(index, "quantizer_efSearch", ef_search)
        except RuntimeError:
            if not on_gpu:
                raise  # on a GPU the clone may have replaced the graph by a flat quantiser
    elif ef_search and layout.hnsw:
        space.set_index_parameter(index, "efSearch", ef_search)


def search(index: faiss.Index, q_QD: Matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scores_QK float32, ids_QK int64)``; faiss's empty slots become -inf / -1."""
    scores, ids = index.search(to_numpy(q_QD), k)
    ids = ids.astype(np.int64, copy=False)
    return np.where(ids < 0, -np.inf, scores).astype(np.float32, copy=False), ids


def add(index: faiss.Index, x_ND: Matrix) -> None:
    index.add(to_numpy(x_ND))


def index_bytes(index: faiss.Index, on_gpu: bool) -> int:
    """Bytes of the index as faiss serialises it (vectors or codes, lists, graph links)."""
    cpu = faiss.index_gpu_to_cpu(index) if on_gpu else index
    return int(faiss.serialize_index(cpu).nbytes)
