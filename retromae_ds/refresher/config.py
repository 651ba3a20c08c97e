"""Settings of hard-negative mining (``MiningConfig``: what a negatives version holds) and of
the asynchronous refresher process (``RefreshConfig``: where, how fast, when to stop, with its
``mining`` section).

Shared by the trainer (its ``refresh`` section, whose ``mining`` the BM25 version is mined
with too), the refresher process and the study, so it lives apart from all three.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from retromae_ds.base.config import resumable
from retromae_ds.refresher.embed_shards import DTYPES
from retromae_ds.refresher.mining import STRATEGIES
from retromae_ds.search.index import IndexChoice, spelled_as
from retromae_ds.search.kinds import IndexSetting, index_setting

if TYPE_CHECKING:
    import torch

    from retromae_ds.search.index import Index


@dataclass(kw_only=True)
class MiningConfig:
    """From a ranking to the negatives a version holds (``publish.mine_and_publish``); the
    same for BM25's first version and every model-mined one, recorded in each manifest."""

    top_k: int = 200
    """Passages retrieved per training query before positives are removed."""
    num_negatives: int = 8
    """Negatives written per query; the trainer draws its ``negatives.n_hard`` per step from
    them (at most this many are distinct)."""
    strategy: str = "random"
    """``random``: n drawn from the top-K; ``top``: the n best ranked."""
    skip_top: int = 0
    """Skip this many top-ranked non-positives first (likely unlabelled positives)."""
    max_score_ratio: float = 0.0
    """Drop candidates scoring above this fraction of the query's (lowest) positive score as
    likely unlabelled positives, e.g. 0.95 (0: off; model-mined versions only, BM25's v0 uses
    skip_top alone)."""
    absolute_margin: float | None = None
    """Drop candidates whose score plus this exceeds the query's lowest positive score
    (sentence-transformers' ``absolute_margin``; 0: a negative never scores above a
    positive; model-mined versions only; none: off)."""
    max_score: float | None = None
    """Drop candidates scoring above this (sentence-transformers' ``max_score``; model-mined
    versions only; none: off)."""
    min_score: float | None = None
    """Drop candidates scoring below this (sentence-transformers' ``min_score``; model-mined
    versions only; none: off)."""
    seed: int = 0
    """Seeds the sampling of negatives (BM25's version uses seed, version N of a model
    seed + N)."""
    ignore_identical_ids: bool = True
    """Never mine a query's own document (the passage whose id is the query's) as its
    negative, as ``eval --ignore_identical_ids`` (BEIR's default) never retrieves it: in sets
    whose queries sit in the corpus under their own id (ArguAna, Quora) it tops every such
    query's ranking. Each manifest counts the drops (``identical_ids``). false: mined like
    any other passage."""

    OPTIONS: ClassVar[str] = "refresh.mining."
    """How the command that reads these settings spells them (the trainer's
    ``--refresh.mining.top_k``; ``retromae-ds refresh``: ``--mining.top_k``), for errors."""

    def __post_init__(self) -> None:
        opt = self.OPTIONS
        if self.strategy not in STRATEGIES:
            raise ValueError(f"{opt}strategy must be one of {STRATEGIES}, not {self.strategy!r}")
        for name in ("top_k", "num_negatives"):
            if getattr(self, name) < 1:
                raise ValueError(f"{opt}{name} must be >= 1, not {getattr(self, name)}")
        if self.skip_top < 0:
            raise ValueError(f"{opt}skip_top must be >= 0, not {self.skip_top}")
        if self.skip_top >= self.top_k:
            raise ValueError(
                f"{opt}skip_top {self.skip_top} skips every one of the {opt}top_k "
                f"{self.top_k} ranked passages, so every negative would be random: lower "
                f"{opt}skip_top below {opt}top_k, or raise {opt}top_k"
            )
        if not 0 <= self.max_score_ratio <= 1:
            raise ValueError(f"{opt}max_score_ratio must be in [0, 1], not {self.max_score_ratio}")


REFRESH_MODES = ("full", "pool")
"""``refresh.mode``: encode the whole corpus every version, or re-score a candidate pool."""


MINING_FIELDS = ("top_k", "num_negatives", "strategy", "skip_top", "max_score_ratio", "seed")
"""The mining settings that sat at the top of the refresh section before they had their own."""


@dataclass(kw_only=True)
class RefreshConfig:
    """The refresher process (``retromae-ds refresh``; the trainer's ``refresh`` section)."""

    RENAMED: ClassVar[dict[str, str]] = {
        name: f"mining.{name}" for name in (*MINING_FIELDS, "ignore_identical_ids")
    }
    """The mining settings sat at the top of this section before they had their own.
    ``ignore_identical_ids`` is here too, as ``eval`` spells its option: ``refresh
    --ignore_identical_ids false`` reaches ``mining.ignore_identical_ids`` with a note."""
    OPTIONS: ClassVar[str] = "refresh."
    """How the command that reads these settings spells them in errors: ``refresh.`` for
    the trainer's section (``--refresh.index``); ``RefresherConfig``, the ``refresh``
    command's own, spells them bare (``--index``)."""

    run_dir: str = resumable("")
    """The trainer's run folder (checkpoints/ is read, negatives/ is written); the trainer
    writes its own into the refresher's config file (refresh_config.json)."""
    data_dir: str = ""
    """The prepared training data (default RUN/data, written by the trainer)."""
    mining: MiningConfig = field(default_factory=MiningConfig)
    """What each version holds (also BM25's first version, which the trainer mines)."""
    index: str = "auto"
    """The index each refresher rank searches its part of the passages with
    (``retromae_ds.search``): ``flat`` (exact), ``ivf`` (IVF{L},Flat: L the power of two
    nearest 4·√N, N the rank's passages, at most one list per 39 training vectors),
    ``ivfpq`` (the same lists holding PQ codes: 96 bytes a vector at 384 or 768
    dimensions), ``hnsw`` (HNSW32,Flat), any faiss index_factory string taken as written
    (``IVF65536,PQ64``, ``HNSW32,Flat``), or ``auto``: flat below 200,000 passages a rank,
    ivf up to 5M, above that IVF with the power of two nearest 16·√N lists and an HNSW
    coarse quantiser; always flat with ``search_backend torch``. Approximate indexes' scores
    are recomputed exactly for the top-K they return (docs/ance.md, "Index choice")."""
    search_backend: str = "auto"
    """auto / faiss (GPU when usable, else CPU) / torch (exact matmul + top-k on the
    refresher's device; exact search only, so ``index`` flat or auto)."""
    nprobe: int = 0
    """IVF lists probed per query (0: auto, 1/8 of the lists); at most the index's lists."""
    ef_search: int = 0
    """HNSW candidate-list size per query (0: auto, 4 × mining.top_k and at least 64; for an
    HNSW coarse quantiser 2 × nprobe); HNSW indexes only."""
    train_size: int = 0
    """Passages sampled (seed ``mining.seed``) to train an IVF or PQ index (0: auto, 64 per
    list or PQ code, at most all); fewer than 39 per list or code is an error."""
    batch_size: int = 128
    """Texts per forward pass."""
    shard_rows: int = 65536
    """Passages per embedding shard (``retromae_ds.refresher.embed_shards``): each shard is encoded
    and written whole (temp + rename, with a manifest and its sha256), the refresher's ranks
    split the shards, a killed refresher keeps the shards it finished, and encoding holds one
    shard in memory at a time (65,536 × 768 float32: 192 MiB)."""
    embedding_dtype: str = "float32"
    """How embedding shards are stored: ``float32``, or ``float16`` (half the disk, searched
    as float32; on 20,000 MiniLM vectors recall@200 0.9999 against float32, docs/ance.md)."""
    device: str = resumable("auto")
    """auto (CUDA when available), cpu, cuda:1, ..."""
    bf16: bool = True
    """Encode under bf16 autocast on CUDA (ignored on CPU unless ``bf16_cpu``)."""
    bf16_cpu: bool = False
    """Also encode under bf16 autocast on CPU (≈ 2× faster where the CPU has AVX512-BF16 or
    AMX; slower where it has neither)."""
    threads: int = resumable(0)
    """Torch CPU threads of each refresher rank while the trainer trains (0: torch's default,
    one per core). A CPU refresher beside a CPU trainer on the same cores: 1, so the two do
    not oversubscribe them (benchmarks/bench_ance.py). A step-0 checkpoint (``mine_first``:
    the trainer waits) is always encoded with torch's default."""
    cache_dir: str = ""
    """Embedding cache shared between runs (``retromae_ds.refresher.embed_cache``): embeddings are
    stored under the sha256 of the encoder's files, the data, the rows, pooling and precision,
    and loaded instead of encoded when a run meets the same again, e.g. the step-0 checkpoint
    of every seed from one init. Empty: off. Never evicted; safe to delete."""
    poll_s: float = resumable(5.0)
    """Seconds between looks for a new checkpoint."""
    min_new_steps: int = 1
    """Refresh only from a checkpoint at least this many steps after the last version's."""
    max_versions: int = resumable(0)
    """Stop after publishing this many versions (0: no limit)."""
    idle_timeout_s: float = resumable(0.0)
    """Stop after this long without a new checkpoint (0: wait while the trainer runs)."""
    wait_report_s: float = resumable(60.0)
    """While waiting (for the trainer's data, its first negatives, a newer checkpoint), say
    what for every this many seconds."""
    keep_last: int = 0
    """Keep only the newest k versions (0: all; exact resume of an old checkpoint needs its version)."""
    progress: bool = resumable(True)
    """Show progress bars while encoding and searching."""
    timeout_s: int = 1800
    """Collective timeout between the refresher's own ranks."""
    parent_pid: int = resumable(0)
    """Stop when this process (the trainer, for its ``--refresher local`` subprocess) is gone
    (0: no such process). The trainer passes it on the command line, never in
    refresh_config.json, which other refreshers of the run read too."""
    teacher: str = ""
    """A cross-encoder (folder, checkpoint or run folder) that scores every version's
    positives and negatives as it is published (``refresher.teacher``: distillation's online
    teacher; ``finetune --distill.teacher`` sets it). Empty: versions carry no scores."""
    teacher_batch_size: int = 64
    """Pairs per cross-encoder forward pass."""
    teacher_max_length: int | None = None
    """Tokens per (query, passage) pair (none: the cross-encoder's own, else 512)."""
    teacher_bf16: bool = False
    """Score under bf16 autocast: about 2× the pairs per second on a CPU with AMX or
    AVX512-BF16 (and on CUDA); the logits move in the second or third digit."""
    mode: str = "full"
    """``full``: every version encodes the whole corpus and searches it. ``pool``: a version
    may instead re-score a candidate pool (``retromae_ds.refresher.candidate_pool``): each
    training query's top ``pool_k`` from the last full refresh (kept as
    ``negatives/pools/v{N}.npy`` with its sha256), re-scored exactly with the new
    checkpoint's towers and pooling, which encode only the queries and the pool's passages
    (cost ∝ queries × ``pool_k``, at most the corpus); the best ``mining.top_k`` go through
    the same mining and publication. Each manifest's ``candidate_pool`` records the mode,
    K', the pool's version and why a version was mined in full. Measured on SciFact in
    benchmarks/bench_candidate_pool.py."""
    pool_k: int = 0
    """K' of ``mode pool``: candidates kept per training query by a full refresh (and BM25's
    v0) and re-scored by the versions after it (0: ``mining.top_k``). A version re-ranks
    them and keeps ``mining.top_k``; a pool narrower than this (another ``pool_k``) is
    refreshed in full."""
    pool_full_every: int = 4
    """``mode pool``: a version is mined in full when the pool it would re-score was written
    this many versions before it or more (4: one full refresh, then three pool versions; 1:
    every version in full; 0: only when no usable pool exists). A pool is the previous
    model's neighbourhood: it never holds passages the newer model moved close, so a pool
    re-scored for ever goes stale."""
    pool_from_bm25: bool = False
    """``mode pool``: BM25's v0 top-``pool_k`` may serve as the first pool (no version then
    encodes the corpus before ``pool_full_every``). Off: the first model version is mined in
    full, so the pool is a dense model's neighbourhood, not the passages sharing words with
    the query."""

    def __post_init__(self) -> None:
        opt = self.OPTIONS
        self.index_setting = self._index_setting()
        for name in ("parent_pid", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{opt}{name} must be >= 0, got {getattr(self, name)}")
        if self.wait_report_s <= 0:
            raise ValueError(f"{opt}wait_report_s must be > 0, got {self.wait_report_s}")
        for name in ("shard_rows", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{opt}{name} must be >= 1, got {getattr(self, name)}")
        if self.mode not in REFRESH_MODES:
            raise ValueError(f"{opt}mode must be one of {REFRESH_MODES}, not {self.mode!r}")
        for name in ("pool_k", "pool_full_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{opt}{name} must be >= 0, not {getattr(self, name)}")
        if self.embedding_dtype not in DTYPES:
            raise ValueError(
                f"{opt}embedding_dtype must be one of {DTYPES}, not {self.embedding_dtype!r}"
            )

    def option(self, setting: str) -> str:
        """How this section spells ``retromae_ds.search``'s setting ``setting`` (``nprobe``
        -> ``refresh.nprobe``; the search ``backend`` is ``search_backend``)."""
        return self.OPTIONS + ("search_backend" if setting == "backend" else setting)

    def _index_setting(self) -> IndexSetting:
        """``index`` and its companions checked, once: the ``IndexSetting`` the refresher
        builds each rank's index from (the name of a search backend, which ``index`` held
        before ``search_backend`` existed, said as such)."""
        if self.index in ("faiss", "torch") and self.search_backend in ("auto", "faiss", "torch"):
            index, backend = self.option("index"), self.option("backend")
            raise ValueError(
                f"{index} names the index type now (auto, flat, ivf, ivfpq, hnsw or a faiss "
                f"index_factory string); the search backend {self.index!r} is {backend}: "
                f"--{backend} {self.index}"
            )
        with spelled_as(self.option):
            return index_setting(
                self.index, backend=self.search_backend, nprobe=self.nprobe,
                ef_search=self.ef_search, train_size=self.train_size,
            )  # fmt: skip

    def build_index(
        self, n: int, dim: int, k: int = 0, device: str | torch.device | None = None
    ) -> Index:
        """The empty index a refresher rank searches ``n`` passages of ``dim`` with (``k``:
        the results each search asks for), built once; a ValueError naming the option at
        fault as this section spells it when the corpus cannot satisfy the setting. Loads
        faiss (the refresher only)."""
        from retromae_ds.search.build import build  # faiss: loaded by the refresher only

        with spelled_as(self.option):
            return build(
                self.index_setting, n=n, dim=dim, k=k, device=device, seed=self.mining.seed
            )

    def index_choice(self, n: int, dim: int, k: int = 0) -> IndexChoice:
        """What ``index`` resolves to for ``n`` passages of ``dim`` (``build_index``'s
        ``choice``)."""
        choice = self.build_index(n, dim, k).choice
        assert choice is not None
        return choice


@dataclass(kw_only=True)
class RefresherMiningConfig(MiningConfig):
    """What each version holds (``RefresherConfig.mining``: ``--mining.top_k``)."""

    OPTIONS: ClassVar[str] = "mining."


@dataclass(kw_only=True)
class RefresherConfig(RefreshConfig):
    """The settings of ``retromae-ds refresh`` (and ``python -m retromae_ds.refresh``,
    which the trainer's local refresher and slurm/finetune.sh run): ``RefreshConfig``'s, read
    without the trainer's ``refresh.`` prefix (``--index``, ``--mining.top_k``), and so named
    in its errors."""

    OPTIONS: ClassVar[str] = ""
    mining: RefresherMiningConfig = field(default_factory=RefresherMiningConfig)
    """What each version holds (also BM25's first version, which the trainer mines)."""


PATH_FIELDS = ("run_dir", "data_dir", "cache_dir")
"""The folders a refresh section names: relative ones are relative to where it was given."""


def with_absolute_paths(settings: dict[str, Any]) -> dict[str, Any]:
    """A ``refresh`` section as a mapping (``to_dict``), its folders (``PATH_FIELDS``) made
    absolute against the current directory (normalised, symlinks kept): what the trainer
    writes into ``RUN/refresh_config.json``, which refreshers started from anywhere read (a
    Slurm step, ``retromae-ds refresh --config RUN/refresh_config.json`` in another folder).
    Empty settings stay empty (their defaults)."""
    out = dict(settings)
    for name in PATH_FIELDS:
        if out.get(name):
            out[name] = os.path.abspath(os.fspath(out[name]))
    return out


def mining_settings(cfg: MiningConfig) -> dict[str, Any]:
    """The settings that decide which negatives a version holds (recorded in its manifest;
    the score filters only when set, so a manifest without them reads as before)."""
    settings = {
        "top_k": cfg.top_k,
        "num_negatives": cfg.num_negatives,
        "strategy": cfg.strategy,
        "skip_top": cfg.skip_top,
        "max_score_ratio": cfg.max_score_ratio,
        "ignore_identical_ids": cfg.ignore_identical_ids,
    }
    for name in SCORE_FILTERS:
        if getattr(cfg, name) is not None:
            settings[name] = getattr(cfg, name)
    return settings


SCORE_FILTERS = ("absolute_margin", "max_score", "min_score")
"""``MiningConfig``'s sentence-transformers filters (``refresher.filters``), off by default."""
