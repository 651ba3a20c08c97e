"""The refresher's stages, each leaving its output in ``negatives/.work/v{N}`` before the next
starts (``retromae_ds.refresher.process`` runs them for every new checkpoint):

1. ``encode_stage``: the passages in shards of ``refresh.shard_rows``
   (``passages/shard_{s}.npy`` + its manifest, ``embed_shards``), each rank a contiguous run
   of them, one shard in memory at a time; a shard a killed refresher left complete for the
   same encoder and corpus is kept, any other is encoded again. Shards come from the
   embedding cache when it holds them. The queries: each rank its contiguous part
   (``queries_rank{r}.npy``);
2. ``search_stage``: every rank verifies its shards' checksums (a shard that fails is deleted
   and the stages run again, so it is never searched), then searches all queries in them
   with the index ``refresh.index`` names (``retromae_ds.search``; what it resolved to in
   ``index_rank{r}.json``): exact search shard by shard, memory-mapped, merging the top-K
   (``search_blocks``); an approximate index trained on a sample gathered from the shards and
   filled shard by shard. The rank's top-K goes to ``topk_rank{r}.npz``;
3. ``merge_stage``: rank 0 merges the ranks' top-K lists into ``ranking.npz`` (``RANKING``),
   which ``publish.mine_and_publish`` turns into a version.

``Group`` is the refresher's own set of ranks (torchrun, srun); ``Job`` one version in work.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from retromae_ds.base import faults
from retromae_ds.base.fsutil import atomic_save_npy, atomic_write_text
from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.components.layout import ENCODER, QUERY_ENCODER
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.model import load_tower
from retromae_ds.hf import sbert
from retromae_ds.hf.pooling import get_pooling
from retromae_ds.modeling.bow import bow_vectors
from retromae_ds.refresher import embed_shards
from retromae_ds.refresher.config import RefreshConfig
from retromae_ds.refresher.embed_cache import EmbeddingCache, folder_digest, rows_digest
from retromae_ds.refresher.embed_shards import PASSAGES, Shard, ShardRows
from retromae_ds.refresher.mining import positive_scores
from retromae_ds.refresher.publish import Ranking
from retromae_ds.retrieval.encode import resolve_device

if TYPE_CHECKING:
    from retromae_ds.search.index import Index, IndexChoice


# --------------------------------------------------------------------------- encoding
def encode_rows(
    model: torch.nn.Module,
    ds: ShardDataset,
    rows: np.ndarray,
    special: SpecialIds,
    *,
    pooling: str,
    normalize: bool,
    batch_size: int,
    bow_topk: int = sbert.DEFAULT_BOW_TOPK,
    amp_dtype: torch.dtype | None = None,
    desc: str = "encode",
    progress: bool = True,
) -> np.ndarray:
    """Embeddings float32 ``[len(rows), D]`` of shard rows (``[CLS] row [SEP]``), in order.
    The DupMAE poolings read ``model``'s MLM head (``load_tower(..., head=True)``): D is
    the pooling's ``dim`` (``hf.pooling``), the ordinary-token vector keeping ``bow_topk``
    entries.

    Rows are taken in windows of 64 batches, each sorted by length so padding stays small.
    """
    device = next(model.parameters()).device
    pool = get_pooling(pooling)
    head = pool.needs_head
    body = model.base_model if head else model
    config = model.config
    dim = pool.dim(config.hidden_size, config.vocab_size)
    special_ids = torch.tensor(sorted(special.all), dtype=torch.long)
    out = np.empty((len(rows), dim), dtype=np.float32)
    was_training = model.training
    model.eval()
    window = batch_size * 64
    with (
        torch.inference_mode(),
        tqdm(total=len(rows), desc=desc, unit="text", disable=not progress) as bar,
    ):
        for w0 in range(0, len(rows), window):
            chunk = rows[w0 : w0 + window]
            order = np.argsort(-ds.get_batch(chunk).lengths, kind="stable")
            for b0 in range(0, len(order), batch_size):
                sel = order[b0 : b0 + batch_size]
                ids, mask = ance_data.token_batch(ds, chunk[sel], special)
                ids, mask = ids.to(device), mask.to(device)
                bow = None
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state
                    if head:
                        bow = bow_vectors(model, hidden, ids, mask, special_ids, bow_topk)
                emb = pool(hidden, mask, bow).float()
                if normalize:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
                out[w0 + sel] = emb.cpu().numpy()
                bar.update(len(sel))
                faults.pause("sleep_after_encode_batch_s")
    model.train(was_training)
    return out


def split(n: int, parts: int, part: int) -> tuple[int, int]:
    """Contiguous slice ``part`` of ``parts`` over ``range(n)``."""
    return n * part // parts, n * (part + 1) // parts


# --------------------------------------------------------------------------- distributed
class Group:
    """Rank/world from the environment (torchrun, srun); a process group only with >1 rank."""

    def __init__(self, timeout_s: int) -> None:
        from retromae_ds.components import engine as eng

        self.rank = eng.env_int("RANK", "SLURM_PROCID", default=0)
        self.world = eng.env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
        self.local_rank = eng.env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
        if self.world > 1:
            self.info = eng.setup_distributed(timeout_s)

    def broadcast(self, obj: Any) -> Any:
        from retromae_ds.components import engine as eng

        return obj if self.world == 1 else eng.broadcast_object(obj)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (every rank must call it)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


@contextlib.contextmanager
def writing(path: Path, what: str, *leftovers: Path) -> Iterator[None]:
    """Re-raise an ``OSError`` of the writes inside as ``handoff.NegativesWriteError`` naming
    ``path`` (and the space left on a full disk), after removing the hidden ``leftovers`` the
    write may have left (temporaries that would hold on to the little space there is)."""
    try:
        yield
    except OSError as exc:
        for leftover in leftovers:
            for found in leftover.parent.glob(leftover.name):
                found.unlink(missing_ok=True)
        raise handoff.write_error(path, exc, what) from exc


def save_part(path: Path, array: np.ndarray, what: str) -> None:
    """``atomic_save_npy`` naming the file when it fails, leaving no temporary behind."""
    with writing(path, what, path.with_name(f".{path.name}.tmp*")):
        atomic_save_npy(path, array)


def read_json(path: Path) -> Any:
    """The JSON in ``path``, None when it cannot be read or parsed (a file left empty by a
    full disk before the writes were atomic)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- one refresh
def pick_device(cfg: RefreshConfig, local_rank: int) -> torch.device:
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return device


def index_choice(cfg: RefreshConfig, n: int, dim: int, k: int = 0) -> IndexChoice:
    """What ``refresh.index`` and its settings resolve to for ``n`` passages of ``dim`` (with
    ``k``, searches for ``k`` results: ``ef_search`` auto as the value they use), or a
    ValueError naming the setting at fault as the running command spells it."""
    return cfg.index_choice(n, dim, k)


def rank_index(job: Job, shards: list[Shard]) -> Index:
    """The empty index this rank searches its ``shards`` with (``refresh.index``, checked
    when the config was read, sized to the shards' passages and built once: before encoding,
    so a setting the corpus cannot satisfy stops the refresh then); a ValueError naming the
    option at fault."""
    n = sum(shard.rows for shard in shards)
    k = min(job.top_k(), max(1, n))
    device = pick_device(job.cfg, job.group.local_rank)  # torch backend: this rank's device
    return job.cfg.build_index(n, job.dim, k, device)


QUERY_BATCH = 4096
"""Queries searched (and their top-K merged) at a time."""
MAX_ENCODE_ROUNDS = 3
"""Encode → verify rounds before shards that keep failing their checksums stop the refresh."""
SHARD_BYTES = 256 * 2**20
"""Most float32 embedding bytes one passage shard holds: ``refresh.shard_rows`` (65,536 ×
768 dims: 192 MiB) is lowered to fit where the vectors are wider (DupMAE's, the vocabulary's
size: 2,189 passages a shard at |V| 30,522 + 128)."""


@dataclass
class Job:
    """One version being mined: what every stage reads, and where it leaves its files
    (``negatives/.work/v{N}``: each stage's output is there before the next stage starts)."""

    cfg: RefreshConfig
    ts: ance_data.TrainingSet
    checkpoint: Path
    version: int
    step: int
    group: Group
    work: Path
    timings: dict[str, float] = field(default_factory=dict)
    cached: dict[str, str] = field(default_factory=dict)
    shard_source: dict[int, str] = field(default_factory=dict)
    """This rank's passage shards by index: ``encoded``, ``cached`` (from the embedding
    cache) or ``resumed`` (left complete by a killed refresher), as first made in this
    refresh (a later round keeps what an earlier one wrote)."""
    shard_cache: dict[int, str] = field(default_factory=dict)
    """The embedding cache's answer per shard: resumed, hit, miss, off or not stored."""
    redone: int = 0
    """Shards of this rank encoded again: another identity, or a failed checksum."""
    index: Index | None = None
    """The empty index this rank's search stage fills (``rank_index``), built before its
    shards are encoded; None once searched, or for a rank without shards."""
    passages: np.ndarray | None = None
    """The passages the shards hold, sorted (a candidate-pool version: the pool's union,
    ``candidate_pool``); None: the whole corpus, shard s holding passages s·R .. (s+1)·R."""
    search_k: int = 0
    """Candidates kept per query by the search and the merge (a full refresh that writes a
    candidate pool keeps K'); 0: ``mining.top_k``."""
    encoder_dir: Path | None = None
    """The one tower's folder when it is not a checkpoint's ``encoder/`` (``retromae-ds
    mine`` on a Hugging Face folder: no separate query tower); None: the checkpoint's."""
    spec_override: sbert.EmbeddingSpec | None = None
    """The pooling and normalisation to encode with (``mine --pooling``); None: the tower's
    own sentence-transformers files."""

    @property
    def tower_dir(self) -> Path:
        """The passage tower's folder."""
        return self.encoder_dir or self.checkpoint / ENCODER

    def top_k(self) -> int:
        return self.search_k or self.cfg.mining.top_k

    def num_encoded(self) -> int:
        """Passages this version encodes: the corpus, or a candidate pool's union."""
        return self.ts.num_passages if self.passages is None else len(self.passages)

    def shard_counts(self) -> dict[str, int]:
        counts = {"encoded": 0, "cached": 0, "resumed": 0}
        for source in self.shard_source.values():
            counts[source] += 1
        return {**counts, "redone": self.redone}

    def part(self, name: str, rank: int | None = None) -> Path:
        return self.work / f"{name}_rank{self.group.rank if rank is None else rank:05d}"

    @functools.cached_property
    def spec(self) -> sbert.EmbeddingSpec:
        """How the checkpoint's passage encoder pools (its sentence-transformers files)."""
        return self.spec_override or sbert.read_spec(self.tower_dir)

    @functools.cached_property
    def dim(self) -> int:
        """Entries of one embedding: the hidden size, or DupMAE's vocabulary-sized vectors."""
        config = read_json(self.tower_dir / "config.json")
        return get_pooling(self.spec.pooling).dim(config["hidden_size"], config["vocab_size"])

    def shard_rows(self) -> int:
        """Passages per shard: ``refresh.shard_rows``, fewer where a shard of float32
        embeddings would pass ``SHARD_BYTES`` (DupMAE's vectors)."""
        return max(1, min(self.cfg.shard_rows, SHARD_BYTES // (4 * self.dim)))

    def shards(self) -> list[Shard]:
        """Every passage shard of this version (``shard_rows()`` each)."""
        return embed_shards.layout(self.work / PASSAGES, self.num_encoded(), self.shard_rows())

    def my_shards(self) -> list[Shard]:
        """This rank's contiguous run of shards (the first ranks get the longer runs, so
        rank 0, whose index record the manifest quotes, has one whenever there is one)."""
        shards, world, rank = self.shards(), self.group.world, self.group.rank
        return shards[-(-len(shards) * rank // world) : -(-len(shards) * (rank + 1) // world)]


def open_work(
    root: Path, version: int, meta: dict[str, Any], group: Group, shards: list[Shard]
) -> Path:
    """``root/.work/v{version}``, kept when it holds parts of the same checkpoint and ranks
    (``meta.json``), otherwise started over except for its embedding shards, whose manifests
    say for themselves what they hold (``embed_shards``; ``shards``: this version's layout,
    files of other shards and temporaries are removed); every other version's work folder
    removed."""
    work = root / ".work" / f"v{version}"
    if group.rank == 0:
        if (work / "meta.json").is_file() and read_json(work / "meta.json") != meta:
            for path in work.iterdir():  # parts of another checkpoint (or unknown ones)
                if path.name != PASSAGES:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        for other in (root / ".work").glob("v*") if (root / ".work").is_dir() else []:
            if other != work:
                shutil.rmtree(other, ignore_errors=True)
        embed_shards.clean(work / PASSAGES, shards)
        with writing(work / "meta.json", "the refresher's work folder"):
            work.mkdir(parents=True, exist_ok=True)
            atomic_write_text(work / "meta.json", json.dumps(meta))
    group.barrier()
    return work


@dataclass
class Towers:
    """A checkpoint's encoders on the refresher's device, and what makes their vectors."""

    passages: torch.nn.Module
    queries: torch.nn.Module
    """The query tower (the passage tower when the checkpoint has one shared encoder)."""
    query_dir: Path | None
    """The query tower's folder (None: shared)."""
    amp: torch.dtype | None
    device: torch.device
    settings: dict[str, Any]
    """Pooling (and DupMAE's top-k), normalisation, autocast, device: a cache key's part."""

    @classmethod
    def load(cls, job: Job) -> Towers:
        cfg, spec = job.cfg, job.spec
        device = pick_device(cfg, job.group.local_rank)
        head = get_pooling(spec.pooling).needs_head  # DupMAE: the MLM head pools
        passages = load_tower(job.tower_dir, head=head).to(device)
        query_dir = job.checkpoint / QUERY_ENCODER
        shared = job.encoder_dir is not None or not query_dir.is_dir()
        queries = passages if shared else load_tower(query_dir, head=head).to(device)
        amp = torch.bfloat16 if cfg.bf16 and (device.type == "cuda" or cfg.bf16_cpu) else None
        settings = {
            "pooling": spec.pooling,
            **({"bow_topk": spec.bow_topk} if head else {}),
            "normalize": spec.normalize,
            "autocast": str(amp),
            "device": device.type,
        }
        return cls(passages, queries, None if shared else query_dir, amp, device, settings)


class CachedEncoder:
    """Rows encoded with a tower, or loaded from the embedding cache (``refresh.cache_dir``,
    content-addressed by ``key``) and stored there on a miss."""

    def __init__(self, job: Job, towers: Towers) -> None:
        self.job, self.towers = job, towers
        self.cache = EmbeddingCache(job.cfg.cache_dir)

    def __call__(
        self, what: str, model: torch.nn.Module, texts: Any, rows: np.ndarray, key: dict[str, Any]
    ) -> tuple[np.ndarray, str]:
        """(``rows`` embedded, the cache's answer: hit, miss, off or not stored), in the
        dtype ``key`` names (float32 by default)."""
        job, cache, spec = self.job, self.cache, self.job.spec
        dtype = key.get("dtype", "float32")
        digest = cache.key(key) if cache.enabled else ""
        found = cache.load(digest, (len(rows), job.dim), dtype) if digest else None
        if found is not None:
            return found, "hit"
        out = encode_rows(
            model, texts, rows, job.ts.special, pooling=spec.pooling, normalize=spec.normalize,
            batch_size=job.cfg.batch_size, bow_topk=spec.bow_topk, amp_dtype=self.towers.amp,
            desc=f"{what} r{job.group.rank}", progress=job.cfg.progress,
        ).astype(dtype, copy=False)  # fmt: skip
        if not digest:
            return out, "off"
        try:
            cache.save(digest, out, key)
        except OSError as exc:  # the cache only saves time: say so and go on without it
            folder = Path(job.cfg.cache_dir)
            print(
                f"refresh: embedding cache {folder}: not stored "
                f"({handoff.write_error(folder, exc, 'embeddings')})",
                file=sys.stderr,
                flush=True,
            )
            return out, "not stored"
        return out, "miss"


def encode_stage(job: Job) -> tuple[np.ndarray, list[Shard]]:
    """Every rank: its contiguous run of passage shards (``embed_shards``), each encoded and
    written whole with one shard in memory at a time (kept when a killed refresher left it
    complete for this encoder and corpus; from the embedding cache when it holds it), and
    its part of the queries (``queries_rank{r}.npy``); returns (all queries, its shards)."""
    cfg, group, timings = job.cfg, job.group, job.timings
    t0 = time.perf_counter()
    towers = Towers.load(job)
    timings["load_s"] = time.perf_counter() - t0
    shards = job.my_shards()
    if group.rank == 0:
        print(
            f"refresh: v{job.version} from {job.checkpoint.name} (step {job.step}): encoding "
            f"{_what_passages(job)} ({len(job.shards())} shard(s) of up to "
            f"{job.shard_rows()}, {cfg.embedding_dtype}, {job.dim} entries) on {group.world} "
            "rank(s)",
            file=sys.stderr,
            flush=True,
        )
    if shards and job.passages is None:  # bad settings: before encoding
        job.index = rank_index(job, shards)
    t0 = time.perf_counter()
    passage_digest = folder_digest(job.tower_dir)
    timings["encoder_digest_s"] = time.perf_counter() - t0
    encoder = CachedEncoder(job, towers)
    t0 = time.perf_counter()
    _encode_passage_shards(job, shards, towers, encoder, passage_digest)
    timings["encode_passages_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    queries = _encode_queries(job, towers, encoder, passage_digest)
    timings["encode_queries_s"] = time.perf_counter() - t0
    return queries, shards


def _encode_passage_shards(
    job: Job, shards: list[Shard], towers: Towers, encoder: CachedEncoder, digest: str
) -> None:
    """This rank's passage shards written whole, one in memory at a time; a shard left
    complete for the same identity (encoder ``digest``, corpus, settings) is kept."""
    ts = job.ts
    identity = {
        "encoder": digest,
        "corpus": embed_shards.corpus_digest(ts.fingerprint()),
        **towers.settings,
        "dtype": job.cfg.embedding_dtype,
    }
    if job.passages is not None:  # a candidate pool's union: these rows, not the corpus's
        identity["passages"] = rows_digest(job.passages)
    for shard in shards:
        problem = embed_shards.why_not_reusable(shard, identity, job.dim)
        if problem is None:  # complete: left by a refresher killed later in this version
            job.shard_source.setdefault(shard.index, "resumed")
            job.shard_cache.setdefault(shard.index, "resumed")
            continue
        if problem:
            print(
                f"refresh: {shard.npy}: {problem}; encoding it again", file=sys.stderr, flush=True
            )
            job.redone += 1
        where = slice(shard.lo, shard.hi)
        rows = ts.passage_rows[where if job.passages is None else job.passages[where]]
        key = {
            "texts": "passages", "data": ts.fingerprint(), **towers.settings, "encoder": digest,
            "rows": rows_digest(rows), "dtype": job.cfg.embedding_dtype,
        }  # fmt: skip
        # the token shards mapped for this embedding shard alone: their pages leave the
        # resident set with it, so what encoding holds does not grow with the corpus read
        corpus = ShardDataset(ts.corpus.folder)
        array, answer = encoder("passages", towers.passages, corpus, rows, key)
        del corpus
        job.shard_source[shard.index] = "cached" if answer == "hit" else "encoded"
        job.shard_cache[shard.index] = answer
        with writing(shard.npy, "passage embeddings"):
            embed_shards.write(
                shard, array, identity, {"checkpoint": job.checkpoint.name, "step": job.step}
            )
        del array  # one shard in memory at a time
    job.cached["passages"] = embed_shards.stats_line(list(job.shard_cache.values()) or ["none"])


def _encode_queries(
    job: Job, towers: Towers, encoder: CachedEncoder, passage_digest: str
) -> np.ndarray:
    """Every query embedded: each rank its contiguous part (``queries_rank{r}.npy``), then
    all parts read back by every rank."""
    ts, group = job.ts, job.group
    qlo, qhi = split(ts.num_queries, group.world, group.rank)
    rows = ts.query_rows[qlo:qhi]
    digest = ""
    if encoder.cache.enabled:
        digest = folder_digest(towers.query_dir) if towers.query_dir else passage_digest
    key = {
        "texts": "queries", "data": ts.fingerprint(), **towers.settings, "encoder": digest,
        "rows": rows_digest(rows),
    }  # fmt: skip
    part, job.cached["queries"] = encoder("queries", towers.queries, ts.queries, rows, key)
    save_part(job.part("queries").with_suffix(".npy"), part, "query embeddings")
    group.barrier()
    return np.concatenate(
        [np.load(job.part("queries", r).with_suffix(".npy")) for r in range(group.world)]
    )


def _what_passages(job: Job) -> str:
    if job.passages is None:
        return f"{job.ts.num_passages} passages"
    return f"the candidate pool's {len(job.passages)} of {job.ts.num_passages} passages"


def verify_stage(job: Job, shards: list[Shard]) -> list[Shard]:
    """The shards of ``shards`` whose bytes fail their checksum, deleted (each said in one
    line) so that the next encode stage writes them again; none of them is ever searched."""
    if job.group.rank == 0:
        print(
            f"refresh: v{job.version}: verifying and searching {_what_passages(job)}",
            file=sys.stderr,
            flush=True,
        )
    faults.pause("sleep_before_search_s")
    t0 = time.perf_counter()
    bad = []
    for shard in shards:
        problem = embed_shards.verify(shard)
        if problem:
            print(
                f"refresh: {shard.npy} {problem}; encoding it again (never searched)",
                file=sys.stderr,
                flush=True,
            )
            embed_shards.remove(shard)
            bad.append(shard)
    job.redone += len(bad)
    job.timings["verify_s"] = job.timings.get("verify_s", 0.0) + time.perf_counter() - t0
    return bad


def search_stage(job: Job, queries: np.ndarray, shards: list[Shard]) -> None:
    """Every rank: all queries against its (verified) shards with the index
    ``refresh.index`` names (``rank_index``, an ``Index`` of ``retromae_ds.search``), the
    shards given to its ``search_parts`` one at a time, memory-mapped: exact search shard by
    shard, the top-K merged exactly; an approximate index trained on a sample gathered from
    the shards, filled shard by shard and its top-K rescored exactly (so the false-negative
    filter compares exact scores). Top-K with global passage indices and the scores of the
    positives it holds go to ``topk_rank{r}.npz`` (what the index resolved to:
    ``index_rank{r}.json``). Held at once: the queries ``[Q, D]``, the running top-K
    ``[Q, K]``, one shard (or, approximate, the index itself)."""
    from retromae_ds.search.exact import rescore

    cfg, timings = job.cfg, job.timings
    faults.crash("crash_in_refresh_at", "search")
    t0 = time.perf_counter()
    n = sum(shard.rows for shard in shards)
    lo = shards[0].lo if shards else 0
    rows = ShardRows(shards, queries.shape[1])
    k = min(job.top_k(), max(1, n))
    index = (job.index or rank_index(job, shards)) if shards else None  # none without shards
    job.index = None
    record = job.part("index").with_suffix(".json")
    with writing(record, "the index record"):
        atomic_write_text(record, json.dumps(index.choice.record() if index else None))
    if index is None:
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        ids = np.full((len(queries), k), -1, dtype=np.int64)
    else:
        count = index.training_vectors(n)
        if count:  # the sample ApproximateIndex.train would draw from all n vectors
            sample = np.arange(n)
            if count < n:
                sample = np.sort(np.random.default_rng(cfg.mining.seed).choice(n, count, False))
            index.train(rows[sample])
            del sample
        bar = dict(desc=f"search r{job.group.rank}", unit="shard", disable=not cfg.progress)
        parts = (embed_shards.as_float32(embed_shards.open_shard(s)) for s in tqdm(shards, **bar))

        def built() -> None:  # an index that holds the shards: they are all in it now
            timings["index_build_s"] = time.perf_counter() - t0

        scores, ids = index.search_parts(queries, parts, k, query_batch=QUERY_BATCH, filled=built)
        if not index.exact:  # approximate scores (PQ codes): the exact ones of its top-K
            for s in range(0, len(queries), QUERY_BATCH):
                batch = slice(s, s + QUERY_BATCH)
                scores[batch], ids[batch] = rescore(queries[batch], rows, ids[batch])
        del index
    ids = np.where(ids >= 0, ids + lo, -1)
    pos_scores = positive_scores(queries, rows, lo, job.ts.positives)
    topk = job.part("topk").with_suffix(".npz")
    with writing(topk, "the search results", topk.with_name(f".{topk.name}")):
        Ranking(ids=ids, scores=scores, positives=pos_scores).save(topk)
    timings["search_s"] = time.perf_counter() - t0


def encode_verified(job: Job, search: Callable[..., None] = search_stage) -> None:
    """Encode, verify, search (every rank): a shard that fails its checksum when the search
    stage opens it is deleted and the stages run again, which encode only what is missing;
    shards that keep failing (a disk that does not keep what is written) stop the refresh.
    ``search``: ``search_stage``, or a pool version's ``candidate_pool.rescore_stage``."""
    for _ in range(MAX_ENCODE_ROUNDS):
        queries, shards = encode_stage(job)
        bad = verify_stage(job, shards)
        if not any(job.group.gather(bool(bad))):
            search(job, queries, shards)
            return
        del queries
    folder = job.work / embed_shards.PASSAGES
    raise handoff.NegativesWriteError(
        f"{folder}: embedding shards failed their checksums {MAX_ENCODE_ROUNDS} times in a row "
        "right after being written: the disk does not keep what is written there"
    )


def merge_stage(job: Job) -> Ranking:
    """Rank 0: the ranks' top-K lists merged into one (``merge_topk``) and the positives'
    scores joined (each pair was scored on one rank), written to ``ranking.npz``."""
    from retromae_ds.search.merge import merge_topk

    t0 = time.perf_counter()
    merged = Ranking.load(job.part("topk", 0).with_suffix(".npz"))
    scores, ids, pos_scores = merged.scores, merged.ids, merged.positives
    for r in range(1, job.group.world):
        part = Ranking.load(job.part("topk", r).with_suffix(".npz"))
        scores, ids = merge_topk(scores, ids, part.scores, part.ids, job.top_k())
        pos_scores = np.fmin(pos_scores, part.positives)
    ranking = Ranking(ids=ids, scores=scores, positives=pos_scores)
    path = job.work / RANKING
    with writing(path, "the merged ranking", path.with_name(f".{path.name}")):
        ranking.save(path)
    job.timings["merge_s"] = time.perf_counter() - t0
    return ranking


RANKING = "ranking.npz"
"""The merged ranking of a version in its work folder: a refresher restarted after it was
written mines and publishes from it without encoding again."""
