"""The refresher's stages, each leaving its output in ``negatives/.work/v{N}`` before the next
starts (``retromae_ds.ance.refresher`` runs them for every new checkpoint):

1. ``encode_stage``: every rank encodes its contiguous part of the passages
   (``passages_rank{r}.npy``, reused when a killed refresher left it complete) and of the
   queries (``queries_rank{r}.npy``), or loads them from the embedding cache;
2. ``search_stage``: every rank searches all queries in its own part with the index
   ``refresh.index`` names (``retromae_ds.search``; what it resolved to in
   ``index_rank{r}.json``) into ``topk_rank{r}.npz``, so no rank ever holds the whole corpus
   embedding matrix;
3. ``merge_stage``: rank 0 merges the ranks' top-K lists into ``ranking.npz`` (``RANKING``),
   which ``publish.mine_and_publish`` turns into a version.

``Group`` is the refresher's own set of ranks (torchrun, srun); ``Job`` one version in work.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from retromae_ds import faults, sbert
from retromae_ds.ance import data as ance_data
from retromae_ds.ance import handoff
from retromae_ds.ance.embed_cache import EmbeddingCache, folder_digest, rows_digest
from retromae_ds.ance.mining import positive_scores
from retromae_ds.ance.model import load_body
from retromae_ds.ance.publish import Ranking
from retromae_ds.ance.refresh_config import RefreshConfig
from retromae_ds.components.layout import ENCODER, QUERY_ENCODER
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.eval.encode import pool, resolve_device
from retromae_ds.fsutil import atomic_save_npy, atomic_write_text
from retromae_ds.special_tokens import SpecialIds

if TYPE_CHECKING:
    from retromae_ds.search.build import IndexChoice


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
    amp_dtype: torch.dtype | None = None,
    desc: str = "encode",
    progress: bool = True,
) -> np.ndarray:
    """Embeddings float32 ``[len(rows), D]`` of shard rows (``[CLS] row [SEP]``), in order.

    Rows are taken in windows of 64 batches, each sorted by length so padding stays small.
    """
    device = next(model.parameters()).device
    out = np.empty((len(rows), model.config.hidden_size), dtype=np.float32)
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
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
                emb = pool(hidden, mask, pooling).float()
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


def index_choice(cfg: RefreshConfig, n: int, dim: int) -> IndexChoice:
    """What ``refresh.index`` and its settings resolve to for ``n`` passages of ``dim``, or a
    ValueError naming the setting at fault."""
    from retromae_ds.search.build import resolve_index  # faiss: loaded by the refresher only

    return resolve_index(
        cfg.index,
        n=n,
        dim=dim,
        backend=cfg.search_backend,
        nprobe=cfg.nprobe,
        ef_search=cfg.ef_search,
        train_size=cfg.train_size,
        prefix="refresh.",
    )


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

    def part(self, name: str, rank: int | None = None) -> Path:
        return self.work / f"{name}_rank{self.group.rank if rank is None else rank:05d}"


def open_work(root: Path, version: int, meta: dict[str, Any], group: Group) -> Path:
    """``root/.work/v{version}``, kept when it holds parts of the same checkpoint and ranks
    (``meta.json``), otherwise started over; every other version's work folder removed."""
    work = root / ".work" / f"v{version}"
    if group.rank == 0:
        if (work / "meta.json").is_file() and read_json(work / "meta.json") != meta:
            shutil.rmtree(work)  # parts of another checkpoint (or unknown ones): start over
        for other in (root / ".work").glob("v*") if (root / ".work").is_dir() else []:
            if other != work:
                shutil.rmtree(other, ignore_errors=True)
        with writing(work / "meta.json", "the refresher's work folder"):
            work.mkdir(parents=True, exist_ok=True)
            atomic_write_text(work / "meta.json", json.dumps(meta))
    group.barrier()
    return work


def encode_stage(job: Job) -> tuple[np.ndarray, np.ndarray, int]:
    """Every rank: its contiguous part of the passages (``passages_rank{r}.npy``, reused when
    a killed refresher left it complete) and of the queries (``queries_rank{r}.npy``), from
    the embedding cache when it holds them; returns (its passages, all queries, the index of
    its first passage)."""
    cfg, ts, group, timings = job.cfg, job.ts, job.group, job.timings
    t0 = time.perf_counter()
    device = pick_device(cfg, group.local_rank)
    encoder_dir = job.checkpoint / ENCODER
    spec = sbert.read_spec(encoder_dir)
    passage_model = load_body(encoder_dir).to(device)
    query_dir = job.checkpoint / QUERY_ENCODER
    query_model = load_body(query_dir).to(device) if query_dir.is_dir() else passage_model
    use_bf16 = cfg.bf16 and (device.type == "cuda" or cfg.bf16_cpu)
    amp = torch.bfloat16 if use_bf16 else None
    timings["load_s"] = time.perf_counter() - t0
    common = dict(
        pooling=spec.pooling,
        normalize=spec.normalize,
        batch_size=cfg.batch_size,
        amp_dtype=amp,
        progress=cfg.progress,
    )
    if group.rank == 0:
        print(
            f"refresh: v{job.version} from {job.checkpoint.name} (step {job.step}): encoding "
            f"{ts.num_passages} passages on {group.world} rank(s)",
            file=sys.stderr,
            flush=True,
        )

    lo, hi = split(ts.num_passages, group.world, group.rank)
    qlo, qhi = split(ts.num_queries, group.world, group.rank)
    index_choice(cfg, hi - lo, passage_model.config.hidden_size)  # bad settings: before encoding
    cache = EmbeddingCache(cfg.cache_dir)
    keys: dict[str, dict[str, Any]] = {}
    if cache.enabled:
        t0 = time.perf_counter()
        base = {
            "data": ts.fingerprint(),
            "pooling": spec.pooling,
            "normalize": spec.normalize,
            "autocast": str(amp),
            "device": device.type,
        }
        passage_digest = folder_digest(encoder_dir)
        keys["passages"] = {
            **base,
            "encoder": passage_digest,
            "rows": rows_digest(ts.passage_rows[lo:hi]),
        }
        keys["queries"] = {
            **base,
            "encoder": folder_digest(query_dir) if query_dir.is_dir() else passage_digest,
            "rows": rows_digest(ts.query_rows[qlo:qhi]),
        }
        timings["cache_key_s"] = time.perf_counter() - t0

    def encode(what: str, model: torch.nn.Module, texts: Any, rows: np.ndarray) -> np.ndarray:
        """``rows`` encoded, or loaded from the embedding cache (and stored there on a miss)."""
        key = cache.key({"texts": what, **keys[what]}) if cache.enabled else ""
        found = cache.load(key, (len(rows), model.config.hidden_size)) if key else None
        job.cached[what] = "off" if not key else "miss" if found is None else "hit"
        if found is not None:
            return found
        out = encode_rows(model, texts, rows, ts.special, desc=f"{what} r{group.rank}", **common)
        if key:
            try:
                cache.save(key, out, {"texts": what, **keys[what]})
            except OSError as exc:  # the cache only saves time: say so and go on without it
                job.cached[what] = "not stored"
                print(
                    f"refresh: embedding cache {cfg.cache_dir}: not stored "
                    f"({handoff.write_error(Path(cfg.cache_dir), exc, 'embeddings')})",
                    file=sys.stderr,
                    flush=True,
                )
        return out

    t0 = time.perf_counter()
    part_file = job.part("passages").with_suffix(".npy")
    if part_file.is_file():  # left complete by a refresher killed later in this version
        passages = np.load(part_file)
        job.cached["passages"] = "resumed"
    else:
        passages = encode("passages", passage_model, ts.corpus, ts.passage_rows[lo:hi])
        save_part(part_file, passages, "passage embeddings")
    timings["encode_passages_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    query_part = encode("queries", query_model, ts.queries, ts.query_rows[qlo:qhi])
    save_part(job.part("queries").with_suffix(".npy"), query_part, "query embeddings")
    group.barrier()
    queries = np.concatenate(
        [np.load(job.part("queries", r).with_suffix(".npy")) for r in range(group.world)]
    )
    timings["encode_queries_s"] = time.perf_counter() - t0
    return passages, queries, lo


def search_stage(job: Job, passages: np.ndarray, queries: np.ndarray, lo: int) -> None:
    """Every rank: all queries against its own passages with the index ``refresh.index``
    names (``retromae_ds.search``; an approximate one's top-K rescored exactly, so the
    false-negative filter compares exact scores), top-K with global passage indices and the
    scores of the positives it holds, written to ``topk_rank{r}.npz`` (what the index
    resolved to: ``index_rank{r}.json``); no rank ever holds the whole corpus embedding
    matrix."""
    from retromae_ds.search.build import build_index
    from retromae_ds.search.exact import rescore

    cfg, timings = job.cfg, job.timings
    t0 = time.perf_counter()
    choice = index_choice(cfg, len(passages), passages.shape[1])
    record = job.part("index").with_suffix(".json")
    with writing(record, "the index record"):
        atomic_write_text(record, json.dumps(choice.record()))
    index = build_index(
        cfg.index,
        dim=passages.shape[1],
        n=len(passages),
        backend=cfg.search_backend,
        # the torch backend searches on the refresher's own device (its GPU for this rank)
        device=pick_device(cfg, job.group.local_rank),
        nprobe=cfg.nprobe,
        ef_search=cfg.ef_search,
        train_size=cfg.train_size,
        seed=cfg.mining.seed,
        prefix="refresh.",
    )
    index.add(passages)
    timings["index_build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    k = min(cfg.mining.top_k, max(1, len(passages)))
    scores_parts, ids_parts = [], []
    q_step = 4096
    for s in tqdm(
        range(0, len(queries), q_step),
        desc=f"search r{job.group.rank}",
        unit="batch",
        disable=not cfg.progress,
    ):
        sc, ix = index.search(queries[s : s + q_step], k)
        if not choice.exact:
            sc, ix = rescore(queries[s : s + q_step], passages, ix)
        scores_parts.append(sc)
        ids_parts.append(np.where(ix >= 0, ix + lo, -1))
    scores = np.concatenate(scores_parts) if scores_parts else np.zeros((0, k), np.float32)
    ids = np.concatenate(ids_parts) if ids_parts else np.zeros((0, k), np.int64)
    pos_scores = positive_scores(queries, passages, lo, job.ts.positives)
    topk = job.part("topk").with_suffix(".npz")
    with writing(topk, "the search results", topk.with_name(f".{topk.name}")):
        Ranking(ids=ids, scores=scores, positives=pos_scores).save(topk)
    timings["search_s"] = time.perf_counter() - t0


def merge_stage(job: Job) -> Ranking:
    """Rank 0: the ranks' top-K lists merged into one (``merge_topk``) and the positives'
    scores joined (each pair was scored on one rank), written to ``ranking.npz``."""
    from retromae_ds.search.merge import merge_topk

    t0 = time.perf_counter()
    merged = Ranking.load(job.part("topk", 0).with_suffix(".npz"))
    scores, ids, pos_scores = merged.scores, merged.ids, merged.positives
    for r in range(1, job.group.world):
        part = Ranking.load(job.part("topk", r).with_suffix(".npz"))
        scores, ids = merge_topk(scores, ids, part.scores, part.ids, job.cfg.mining.top_k)
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
