"""Which index: the named kinds of the ``index`` setting, the ``auto`` rule by corpus size, and
the faiss ``index_factory`` string each name stands for. Pure arithmetic (no faiss), so the
refresher's config checks its settings without loading faiss.

Kinds: ``flat`` (exact), ``ivf`` (inverted lists, exact scores within the probed lists),
``ivfpq`` (inverted lists of PQ codes: a few bytes a vector), ``hnsw`` (a graph over the
vectors), ``auto``, or any faiss ``index_factory`` string (``IVF4096,PQ32``, ``HNSW32,Flat``),
which is taken as written. With N the vectors one index holds (a refresher rank's part) and T
the training vectors (``train_size``, else N):

- ``ivf``: ``IVF{L},Flat``, L the power of two nearest 4·√N, at most T/39 (faiss's k-means
  wants 39 training vectors per list);
- ``ivfpq``: ``IVF{L},PQ{m}`` with L as for ``ivf`` and m sub-quantisers of 8 bits, m the
  largest size faiss-gpu supports (1, 2, 3, 4, 8, 12, ..., 48, 56, 64, 96) that divides the
  dimension and is at most dim/4: 96 bytes of codes a vector at 384 or 768 dimensions;
  fewer bits (``PQ{m}x{b}``) when T < 39·256 leaves too few vectors for 256 codes;
- ``hnsw``: ``HNSW32,Flat`` (M = 32 links a node: d·4 + 32·2·4 bytes a vector), no training;
- ``auto``: ``flat`` below 200,000 vectors (exact search costs at most seconds per thousand
  queries there), ``ivf`` from 200,000 to 5M, and from 5M ``IVF{L}_HNSW32,Flat``, L the
  power of two nearest 16·√N with an HNSW coarse quantiser (faiss's guide: 65,536 lists
  between 1M and 10M vectors, the quantiser a graph so that assigning N vectors to that many
  lists stays cheap); always ``flat`` with the torch backend, which searches exactly only.
"""

from __future__ import annotations

import math
import re

KINDS = ("auto", "flat", "ivf", "ivfpq", "hnsw")
EXACT = "Flat"
"""The factory string of exact search (``ExactIndex``)."""
AUTO_FLAT_BELOW = 200_000
AUTO_HNSW_QUANTIZER_FROM = 5_000_000
LISTS_PER_SQRT_N = 4
LISTS_PER_SQRT_N_HNSW = 16
HNSW_M = 32
PQ_DIMS_PER_CODE = 4
GPU_PQ_SIZES = (1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96)
"""Sub-quantiser counts faiss-gpu's IVF-PQ supports (8-bit codes)."""
MIN_TRAIN_PER_CENTROID = 39
"""faiss's k-means warns below 39 training vectors per centroid; below it is an error here."""
_FACTORY = re.compile(r"[A-Z][A-Za-z0-9_,.=+\-]*")


def check_index_setting(index: str, backend: str, prefix: str = "") -> None:
    """What can be said of an ``index`` / ``search_backend`` pair without the vectors: a known
    kind or something shaped like a factory string, a known backend, and no approximate
    index on the exact-only torch backend."""
    if backend not in ("auto", "faiss", "torch"):
        raise ValueError(f"{prefix}search_backend must be auto, faiss or torch, not {backend!r}")
    if index in ("faiss", "torch"):
        raise ValueError(
            f"{prefix}index names the index type now (auto, flat, ivf, ivfpq, hnsw or a faiss "
            f"index_factory string); the search backend {index!r} is "
            f"{prefix}search_backend: --{prefix}search_backend {index}"
        )
    if index not in KINDS and not _FACTORY.fullmatch(index):
        raise ValueError(
            f"{prefix}index must be auto, flat, ivf, ivfpq, hnsw or a faiss index_factory "
            f"string such as 'IVF4096,PQ32' or 'HNSW32,Flat', not {index!r}"
        )
    if backend == "torch" and index not in ("auto", "flat", EXACT):
        raise ValueError(
            f"{prefix}index {index!r} is approximate, and {prefix}search_backend torch searches "
            f"exactly only: use {prefix}search_backend auto or faiss for it, or {prefix}index "
            "flat (or auto) with torch"
        )


def nearest_power_of_two(x: float) -> int:
    """2**round(log2 x), at least 1."""
    return 2 ** max(0, round(math.log2(max(x, 1.0))))


def ivf_lists(n: int, train: int, per_sqrt_n: int = LISTS_PER_SQRT_N) -> int:
    """IVF lists for ``n`` vectors with ``train`` training vectors: the power of two nearest
    ``per_sqrt_n``·√n, at most the largest power of two with 39 training vectors each."""
    cap = max(1, train // MIN_TRAIN_PER_CENTROID)
    lists = nearest_power_of_two(per_sqrt_n * math.sqrt(max(n, 1)))
    return min(lists, 2 ** int(math.log2(cap)))


def pq_shape(dim: int, train: int) -> tuple[int, int]:
    """(sub-quantisers, bits each) of ``ivfpq``: the largest of ``GPU_PQ_SIZES`` dividing
    ``dim`` and at most dim/4; 8 bits, fewer when ``train`` holds under 39 vectors per code."""
    fits = [m for m in GPU_PQ_SIZES if dim % m == 0 and m <= max(1, dim // PQ_DIMS_PER_CODE)]
    m = max(fits)
    bits = min(8, int(math.log2(max(2, train // MIN_TRAIN_PER_CENTROID))))
    return m, bits


def factory_for(kind: str, n: int, dim: int, train_size: int = 0, backend: str = "auto") -> str:
    """The faiss ``index_factory`` string ``kind`` stands for at ``n`` vectors of ``dim``
    (``EXACT`` for exact search); a factory string is returned as written."""
    train = train_size or n
    if kind == "auto":
        if backend == "torch" or n < AUTO_FLAT_BELOW:
            return EXACT
        if n < AUTO_HNSW_QUANTIZER_FROM:
            return f"IVF{ivf_lists(n, train)},Flat"
        return f"IVF{ivf_lists(n, train, LISTS_PER_SQRT_N_HNSW)}_HNSW{HNSW_M},Flat"
    if kind == "flat":
        return EXACT
    if kind == "ivf":
        return f"IVF{ivf_lists(n, train)},Flat"
    if kind == "ivfpq":
        m, bits = pq_shape(dim, train)
        return f"IVF{ivf_lists(n, train)},PQ{m}" + ("" if bits == 8 else f"x{bits}")
    if kind == "hnsw":
        return f"HNSW{HNSW_M},Flat"
    return kind
