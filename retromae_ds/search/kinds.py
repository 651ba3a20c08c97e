"""Which index: the ``index`` setting checked once (``index_setting`` -> ``IndexSetting``, which
``build.build`` sizes to a corpus), its named kinds, the ``auto`` rule by corpus size, and the
faiss ``index_factory`` string each name stands for. Pure arithmetic (no faiss), so a command's
config checks its settings without loading faiss.

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
from dataclasses import dataclass

from retromae_ds.search.index import EXACT, SettingError

KINDS = ("auto", "flat", "ivf", "ivfpq", "hnsw")
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
BACKENDS = ("auto", "faiss", "torch")


@dataclass(frozen=True)
class IndexSetting:
    """An ``index`` setting and its companions, checked (``index_setting``): everything that
    can be said without the vectors holds. ``build.build`` sizes it to a corpus and returns
    the empty index it names."""

    index: str
    """A kind (``KINDS``) or a faiss ``index_factory`` string, as given."""
    backend: str = "auto"
    """``auto``, ``faiss`` or ``torch`` (exact search only)."""
    nprobe: int = 0
    """IVF lists probed per query (0: auto)."""
    ef_search: int = 0
    """HNSW candidate-list size (0: auto)."""
    train_size: int = 0
    """Vectors sampled to train lists or codes (0: auto)."""

    @property
    def exact(self) -> bool:
        """Exact search whatever the corpus (``auto`` decides by size: False)."""
        return self.index in ("flat", EXACT)


def index_setting(
    index: str, *, backend: str = "auto", nprobe: int = 0, ef_search: int = 0, train_size: int = 0
) -> IndexSetting:
    """The checked ``IndexSetting``: a known kind or something shaped like a factory string,
    a known backend, counts >= 0, no ``nprobe`` / ``ef_search`` for exact search and no
    approximate index on the exact-only torch backend; else a ``SettingError``."""
    if backend not in BACKENDS:
        raise SettingError(
            lambda n: f"{n('backend')} must be auto, faiss or torch, not {backend!r}"
        )
    if not isinstance(index, str) or (index not in KINDS and not _FACTORY.fullmatch(index)):
        raise SettingError(
            lambda n: (
                f"{n('index')} must be auto, flat, ivf, ivfpq, hnsw or a faiss "
                f"index_factory string such as 'IVF4096,PQ32' or 'HNSW32,Flat', not {index!r}"
            )
        )
    counts = {"nprobe": nprobe, "ef_search": ef_search, "train_size": train_size}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SettingError(lambda n, name=name, value=value: (
                f"{n(name)} must be >= 0 (0: auto), got {value!r}"
            ))  # fmt: skip
    setting = IndexSetting(index, backend, nprobe, ef_search, train_size)
    if setting.exact:
        for name in ("nprobe", "ef_search"):
            if counts[name]:
                raise SettingError(
                    lambda n, name=name: (
                        f"{n(name)} applies to approximate indexes; "
                        f"{n('index')} {index!r} searches exactly"
                    )
                )
    if backend == "torch" and index not in ("auto", "flat", EXACT):
        raise SettingError(
            lambda n: (
                f"{n('index')} {index!r} is approximate, and {n('backend')} torch "
                f"searches exactly only: use {n('backend')} auto or faiss for it, or {n('index')} "
                "flat (or auto) with torch"
            )
        )
    return setting


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
