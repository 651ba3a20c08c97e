"""Approximate nearest-neighbour search through a faiss ``index_factory`` index: IVF lists
(``IVF4096,Flat``), PQ codes (``IVF4096,PQ96``), an HNSW graph (``HNSW32,Flat``), an HNSW
coarse quantiser (``IVF65536_HNSW32,Flat``) or any other string faiss understands.

``ApproximateIndex`` keeps ``ExactIndex``'s contract (``add`` appends with ids continuing
from ``ntotal``; ``search(queries_QD, k)`` gives ``(scores_QK float32, ids_QK int64)`` best
first, -inf / -1 in empty slots; metric ``ip`` or ``cosine``). An index that needs training
is trained at its first ``add`` on a sample of those vectors (``train_size`` rows drawn with
``seed``, so the same vectors give the same index). faiss-gpu is used when usable
(``faiss_backend``), else faiss-cpu. Every error is a ``SettingError`` naming the setting at
fault (``index.spelled_as``: as the command that read it spells it): a string faiss cannot
parse, PQ sub-quantisers that do not divide the dimension, too few training vectors for the
lists or codes asked, ``nprobe`` / ``ef_search`` that do not fit the index.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import numpy as np

from retromae_ds.search import faiss_backend as fb
from retromae_ds.search.arrays import (
    Matrix,
    Metric,
    check_k,
    check_matrix,
    check_metric,
    l2_normalize,
    to_numpy,
)
from retromae_ds.search.index import IndexChoice, SettingError, Spelling
from retromae_ds.search.kinds import MIN_TRAIN_PER_CENTROID
from retromae_ds.search.merge import pad_topk

AUTO_TRAIN_PER_CENTROID = 64
"""``train_size`` 0 samples this many vectors per centroid (at most all of them)."""
AUTO_NPROBE_DIVISOR = 8
"""``nprobe`` 0 probes 1/8 of the lists (at least 1): recall@200 0.90 at 20,000 MiniLM
vectors and 512 lists (benchmarks/bench_search.py), 0.964 at 1,000,000 and 4,096 lists
(benchmarks/bench_search_scale.py; 1.4x exact's speed there, 1/32 of the lists: 0.905 at
5.9x). Kept for recall; docs/ance.md has the table."""
AUTO_EF_PER_K = 4
"""``ef_search`` 0 keeps 4·k candidates in HNSW's list for k results: at 1,000,000 MiniLM
vectors, k 200, recall@200 0.955 at 8.3x exact's speed (2·k: 0.932 at 15.7x;
benchmarks/bench_search_scale.py)."""
AUTO_EF_PER_NPROBE = 2
"""An HNSW coarse quantiser's ``ef_search`` 0: 2·nprobe candidates for the nprobe lists."""
AUTO_EF_MIN = 64

_TRANSFORMS = re.compile(r"(PCA|OPQ|RR|ITQ|L2norm)")


def auto_nprobe(nlist: int) -> int:
    """Lists probed when ``nprobe`` is 0: 1/8 of them, at least 1."""
    return max(1, nlist // AUTO_NPROBE_DIVISOR)


def auto_ef_search(k: int, *, quantizer: bool = False) -> int:
    """HNSW candidate list when ``ef_search`` is 0, for ``k`` results wanted (or, for an
    HNSW coarse quantiser, ``k`` lists probed)."""
    return max(AUTO_EF_MIN, (AUTO_EF_PER_NPROBE if quantizer else AUTO_EF_PER_K) * k)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class ApproximateIndex:
    """Top-k search by inner product or cosine through a faiss ``index_factory`` index (an
    ``index.Index``; its scores are the index's own, approximate for PQ codes).

    Args:
        dim: vector dimension.
        factory: the faiss ``index_factory`` string (``"IVF512,Flat"``, ``"HNSW32,Flat"``, ...).
        metric: ``"ip"`` or ``"cosine"`` (vectors and queries are L2-normalised copies).
        nprobe: IVF lists probed per query (0: ``auto_nprobe``).
        ef_search: HNSW candidate-list size (0: ``auto_ef_search`` of each search's k).
        train_size: vectors sampled to train lists or codes (0: 64 per centroid, at most all).
        seed: seeds that sample (faiss's k-means has its own fixed seed).
        gpu: use faiss-gpu (None: when usable).
        given: the ``index`` setting it was built from, as errors name it (``'ivf'
            (IVF32,Flat)``; None: the factory string).
        strict: ``nprobe`` / ``ef_search`` given for an index without lists / graph is an
            error (False: ignored, for an index ``auto`` picked).
    """

    def __init__(
        self,
        dim: int,
        factory: str,
        *,
        metric: Metric = "ip",
        nprobe: int = 0,
        ef_search: int = 0,
        train_size: int = 0,
        seed: int = 0,
        gpu: bool | None = None,
        given: str | None = None,
        strict: bool = True,
    ) -> None:
        self.exact = False
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if min(nprobe, ef_search, train_size) < 0:  # settings: checked by kinds.index_setting
            raise ValueError("nprobe, ef_search and train_size must be >= 0 (0: auto)")
        check_metric(metric)
        self.dim, self.factory, self.metric, self.seed = dim, factory, metric, seed
        self.given = factory if given is None else given
        self.choice: IndexChoice | None = None
        self._index = self._new_index()
        self.layout = fb.describe(self._index)
        self.nprobe = self._check_nprobe(nprobe, strict)
        self.ef_search = self._check_ef_search(ef_search, strict)
        self.train_size = train_size
        self.use_gpu = fb.faiss_gpus_usable() if gpu is None else gpu
        self.on_gpu = False
        self._placed = False  # moved to the GPUs (or found to have no GPU version) yet

    # ------------------------------------------------------------------- checks
    def label(self, n: Spelling) -> str:
        """How errors name the index: ``index 'ivf' (IVF32,Flat)``, ``index`` spelled by
        ``n``."""
        given, factory = self.given, self.factory
        return f"{n('index')} {given!r}" + ("" if given == factory else f" ({factory})")

    def _new_index(self):
        pq = re.search(r"(?<![A-Za-z])PQ(\d+)", self.factory)
        if pq and not _TRANSFORMS.search(self.factory) and self.dim % int(pq.group(1)):
            raise self._pq_error(int(pq.group(1)))
        try:
            return fb.new_index(self.factory, self.dim)
        except ValueError as exc:
            if "subquantizers" in str(exc) and pq:
                raise self._pq_error(int(pq.group(1))) from None
            why = str(exc)
            raise SettingError(
                lambda n: (
                    f"{self.label(n)}: faiss cannot build it for dimension {self.dim}: "
                    f"{why} (see faiss's index_factory syntax, or use auto, flat, ivf, ivfpq, hnsw)"
                )
            ) from None

    def _pq_error(self, m: int) -> SettingError:
        return SettingError(
            lambda n: (
                f"{self.label(n)}: {m} PQ sub-quantisers do not divide the dimension "
                f"{self.dim} (pick a divisor of {self.dim}: {', '.join(map(str, divisors(self.dim)))})"
            )
        )

    def _check_nprobe(self, nprobe: int, strict: bool) -> int:
        nlist = self.layout.nlist
        if not nlist:
            if nprobe and strict:
                raise SettingError(
                    lambda n: f"{n('nprobe')} applies to IVF indexes; {self.label(n)} has no lists"
                )
            return 0
        if nprobe > nlist:
            raise SettingError(
                lambda n: f"{n('nprobe')} {nprobe} exceeds the {nlist} lists of {self.label(n)}"
            )
        return nprobe or auto_nprobe(nlist)

    def _check_ef_search(self, ef_search: int, strict: bool) -> int:
        if ef_search and strict and not (self.layout.hnsw or self.layout.hnsw_quantizer):
            raise SettingError(
                lambda n: (
                    f"{n('ef_search')} applies to HNSW indexes; {self.label(n)} has no HNSW graph"
                )
            )
        return ef_search

    def training_need(self) -> tuple[int, str]:
        """(the fewest training vectors this index accepts, what it trains)."""
        if self.layout.trained:
            return 0, ""
        centroids, what = 1, "its transform"
        if self.layout.nlist:
            centroids, what = self.layout.nlist, f"{self.layout.nlist} IVF lists"
        if self.layout.pq_m and 2**self.layout.pq_nbits > centroids:
            centroids = 2**self.layout.pq_nbits
            what = f"{centroids} centroids per PQ sub-quantiser"
        return MIN_TRAIN_PER_CENTROID * centroids, what

    def training_vectors(self, n: int) -> int:
        """How many of ``n`` vectors training samples (0: none needed); an error naming the
        setting at fault when that is too few."""
        need, what = self.training_need()
        if not need:
            return 0
        per = f"{MIN_TRAIN_PER_CENTROID} per centroid of {what}"
        if self.train_size and self.train_size < need:
            raise SettingError(
                lambda s: (
                    f"{s('train_size')} {self.train_size} is too few for {self.label(s)}: "
                    f"it needs at least {need} training vectors ({per}); raise it or set 0 (auto)"
                )
            )
        if n < need:
            raise SettingError(
                lambda s: (
                    f"{self.label(s)} needs at least {need} training vectors ({per}), the "
                    f"corpus has {n}: ask for fewer lists or codes, or use 'ivf' / 'ivfpq', which "
                    "size them to the corpus"
                )
            )
        want = self.train_size or need // MIN_TRAIN_PER_CENTROID * AUTO_TRAIN_PER_CENTROID
        return min(n, want)

    # ------------------------------------------------------------------- index
    @property
    def ntotal(self) -> int:
        return int(self._index.ntotal)

    @property
    def is_trained(self) -> bool:
        return bool(self._index.is_trained)

    def train(self, embeddings_ND: Matrix) -> None:
        """Train on a sample of ``embeddings_ND`` (``train_size`` rows drawn with ``seed``)."""
        x = to_numpy(self._prepare(embeddings_ND))
        count = self.training_vectors(len(x))
        if count < len(x):
            rows = np.sort(np.random.default_rng(self.seed).choice(len(x), count, replace=False))
            x = x[rows]
        try:
            self._index = fb.train(self._index, x, self.use_gpu)
        except ValueError as exc:
            why, count = str(exc), len(x)
            raise SettingError(
                lambda n: f"{self.label(n)}: training on {count} vectors failed: {why}"
            ) from None

    def add(self, embeddings_ND: Matrix) -> None:
        """Append vectors (training on them first when the index is untrained)."""
        x = self._prepare(embeddings_ND)
        if not self.is_trained:
            self.train(x)  # already normalised: _prepare again is a no-op
        if not self._placed:
            if self.use_gpu:
                self._index, self.on_gpu = fb.to_gpus(self._index)
            self._placed = True
        fb.add(self._index, x)

    def search(self, queries_QD: Matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores_QK, ids_QK)``, best first; slots beyond what was found hold -inf / -1."""
        q = self._prepare(queries_QD, "queries")
        k = check_k(k)
        n = self.ntotal
        if not n or not q.shape[0]:
            empty = (np.empty((q.shape[0], 0), np.float32), np.empty((q.shape[0], 0), np.int64))
            return pad_topk(*empty, k)
        width = min(k, n)
        fb.check_gpu_k(max(width, self.nprobe), self.on_gpu)
        ef = self.ef_search_for(width)
        fb.set_search_parameters(
            self._index, self.on_gpu, self.layout, nprobe=self.nprobe, ef_search=ef
        )
        return pad_topk(*fb.search(self._index, q, width), k)

    def search_parts(
        self,
        queries_QD: Matrix,
        parts: Iterable[Matrix],
        k: int,
        *,
        query_batch: int | None = None,
        filled: Callable[[], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every part added (the index holds them all), ``filled`` called, then the queries
        searched ``query_batch`` at a time (``Index.search_parts``)."""
        if self.ntotal:
            raise ValueError("search_parts: the index must be empty (ids start at 0)")
        for part in parts:
            self.add(part)
        if filled is not None:
            filled()
        k = check_k(k)
        scores = np.empty((len(queries_QD), k), dtype=np.float32)
        ids = np.empty((len(queries_QD), k), dtype=np.int64)
        step = query_batch or max(1, len(queries_QD))
        for start in range(0, len(queries_QD), step):
            batch = slice(start, start + step)
            scores[batch], ids[batch] = self.search(queries_QD[batch], k)
        return scores, ids

    def ef_search_for(self, k: int) -> int:
        """The HNSW candidate list a search for ``k`` results uses: ``ef_search``, or when it
        is 0 (auto) ``auto_ef_search`` of k (an HNSW coarse quantiser: of ``nprobe``); 0
        without an HNSW graph."""
        if self.ef_search or not (self.layout.hnsw or self.layout.hnsw_quantizer):
            return self.ef_search
        if self.layout.hnsw_quantizer:
            return auto_ef_search(self.nprobe, quantizer=True)
        return auto_ef_search(k)

    def nbytes(self) -> int:
        """Bytes of the index as faiss serialises it: codes or vectors, lists, graph links."""
        return fb.index_bytes(self._index, self.on_gpu)

    def _prepare(self, x: Matrix, name: str = "embeddings") -> Matrix:
        x = check_matrix(x, name, self.dim)
        return l2_normalize(x) if self.metric == "cosine" else x
