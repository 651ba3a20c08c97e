"""The asynchronous hard-negative refresher: ``retromae-ds refresh --run_dir RUN [...]``.

Also ``python -m retromae_ds.ance.refresher``. A separate process (or Slurm job step, or the
trainer's ``--refresher local`` subprocess) that loops:

1. wait for a *complete* trainer checkpoint newer than the one behind the current negatives;
2. load its encoder(s) (``checkpoint/encoder``, ``query_encoder`` when not shared);
3. encode the passages in batches, each rank its own contiguous part, written to
   ``negatives/.work/v{N}/passages_rank{r}.npy`` (temp + rename; a restarted refresher reuses
   complete parts of the same checkpoint); the queries likewise, split over the ranks.
   With ``cache_dir`` the embeddings are looked up first by content (``embed_cache``: the
   encoder's files, the data, the rows, pooling, precision), so runs from the same init
   encode its step-0 checkpoint once between them;
4. each rank searches all queries in its own part (``retromae_ds.index``: faiss, on GPUs when
   usable, or exact torch matmul + top-k), so no rank ever holds the whole corpus embedding
   matrix; rank 0 merges the ranks' top-K lists (``merge_topk``, ``[Q, K]`` each);
5. removes every positive, samples n negatives per query (``mining.mine``) and publishes
   ``negatives/v{N}.arrow`` + manifest + the ``CURRENT`` pointer (``handoff.publish``).

Versions continue from the last published one after a restart; a refresher killed at any
point leaves only the hidden ``.work`` folder, never a visible partial version. An unreadable
``CURRENT`` pointer is reported (once) and treated as "current version unknown": the next
checkpoint is mined into the version after the highest published one, whose publication
replaces the bad pointer. It exits when the trainer has written ``RUN/FINISHED`` (after this
refresher started) and no newer checkpoint is waiting, after ``max_versions`` versions, or
after ``idle_timeout_s`` without a new checkpoint. Timings per version go to
``RUN/refresh_metrics.jsonl`` and the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from retromae_ds import checkpoint as ckpt
from retromae_ds import faults, sbert
from retromae_ds.ance import data as ance_data
from retromae_ds.ance import handoff
from retromae_ds.ance.embed_cache import EmbeddingCache, folder_digest, rows_digest
from retromae_ds.ance.mining import drop_likely_positives, min_per_query, mine, positive_scores
from retromae_ds.ance.model import load_body
from retromae_ds.ance.refresh_config import RefreshConfig, mining_settings
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.eval.encode import pool, resolve_device
from retromae_ds.fsutil import atomic_save_npy
from retromae_ds.layout import ENCODER, QUERY_ENCODER, RunLayout
from retromae_ds.tokens import SpecialIds


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


def _split(n: int, parts: int, part: int) -> tuple[int, int]:
    """Contiguous slice ``part`` of ``parts`` over ``range(n)``."""
    return n * part // parts, n * (part + 1) // parts


# --------------------------------------------------------------------------- distributed
class _Group:
    """Rank/world from the environment (torchrun, srun); a process group only with >1 rank."""

    def __init__(self, timeout_s: int) -> None:
        from retromae_ds import engine as eng

        self.rank = eng.env_int("RANK", "SLURM_PROCID", default=0)
        self.world = eng.env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
        self.local_rank = eng.env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
        if self.world > 1:
            self.info = eng.setup_distributed(timeout_s)

    def broadcast(self, obj: Any) -> Any:
        from retromae_ds import engine as eng

        return obj if self.world == 1 else eng.broadcast_object(obj)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


# --------------------------------------------------------------------------- one refresh
def _pick_device(cfg: RefreshConfig, local_rank: int) -> torch.device:
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return device


def refresh_once(
    cfg: RefreshConfig,
    ts: ance_data.TrainingSet,
    checkpoint: Path,
    version: int,
    group: _Group,
) -> dict[str, Any] | None:
    """Mine and publish version ``version`` from ``checkpoint``; returns the manifest
    (rank 0) or None. Every rank calls it."""
    from retromae_ds.index import ExactIndex, merge_topk

    layout = RunLayout(cfg.run_dir)
    root = layout.negatives
    work = root / ".work" / f"v{version}"
    step = ckpt.read_marker(checkpoint)["step"]
    meta = {"checkpoint": str(checkpoint), "step": step, "world_size": group.world}
    if group.rank == 0:
        if (work / "meta.json").is_file() and json.loads((work / "meta.json").read_text()) != meta:
            shutil.rmtree(work)  # parts of another checkpoint: start over
        for other in (root / ".work").glob("v*") if (root / ".work").is_dir() else []:
            if other != work:
                shutil.rmtree(other, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        (work / "meta.json").write_text(json.dumps(meta))
    group.barrier()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    device = _pick_device(cfg, group.local_rank)
    encoder_dir = checkpoint / ENCODER
    spec = sbert.read_spec(encoder_dir)
    passage_model = load_body(encoder_dir).to(device)
    query_dir = checkpoint / QUERY_ENCODER
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
            f"refresh: v{version} from {checkpoint.name} (step {step}): encoding "
            f"{ts.num_passages} passages on {group.world} rank(s)",
            file=sys.stderr,
            flush=True,
        )

    lo, hi = _split(ts.num_passages, group.world, group.rank)
    qlo, qhi = _split(ts.num_queries, group.world, group.rank)
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
    cached: dict[str, str] = {}

    def encode(what: str, model: torch.nn.Module, texts: Any, rows: np.ndarray) -> np.ndarray:
        """``rows`` encoded, or loaded from the embedding cache (and stored there on a miss)."""
        key = cache.key({"texts": what, **keys[what]}) if cache.enabled else ""
        found = cache.load(key, (len(rows), model.config.hidden_size)) if key else None
        cached[what] = "off" if not key else "miss" if found is None else "hit"
        if found is not None:
            return found
        out = encode_rows(model, texts, rows, ts.special, desc=f"{what} r{group.rank}", **common)
        if key:
            cache.save(key, out, {"texts": what, **keys[what]})
        return out

    t0 = time.perf_counter()
    part_file = work / f"passages_rank{group.rank:05d}.npy"
    if part_file.is_file():  # left complete by a refresher killed later in this version
        passages = np.load(part_file)
        cached["passages"] = "resumed"
    else:
        passages = encode("passages", passage_model, ts.corpus, ts.passage_rows[lo:hi])
        atomic_save_npy(part_file, passages)
    timings["encode_passages_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    query_part = encode("queries", query_model, ts.queries, ts.query_rows[qlo:qhi])
    atomic_save_npy(work / f"queries_rank{group.rank:05d}.npy", query_part)
    group.barrier()
    queries = np.concatenate(
        [np.load(work / f"queries_rank{r:05d}.npy") for r in range(group.world)]
    )
    timings["encode_queries_s"] = time.perf_counter() - t0
    del passage_model, query_model

    t0 = time.perf_counter()
    index = ExactIndex(passages.shape[1], backend=cfg.index)
    index.add(passages)
    timings["index_build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    k = min(cfg.top_k, max(1, hi - lo))
    scores_parts, ids_parts = [], []
    q_step = 4096
    for s in tqdm(
        range(0, len(queries), q_step),
        desc=f"search r{group.rank}",
        unit="batch",
        disable=not cfg.progress,
    ):
        sc, ix = index.search(queries[s : s + q_step], k)
        scores_parts.append(sc)
        ids_parts.append(np.where(ix >= 0, ix + lo, -1))
    scores = np.concatenate(scores_parts) if scores_parts else np.zeros((0, k), np.float32)
    ids = np.concatenate(ids_parts) if ids_parts else np.zeros((0, k), np.int64)
    pos_scores = positive_scores(queries, passages, lo, ts.positives)
    del index, passages
    np.savez(work / f".topk_rank{group.rank:05d}.npz", scores=scores, ids=ids, positives=pos_scores)
    os.replace(work / f".topk_rank{group.rank:05d}.npz", work / f"topk_rank{group.rank:05d}.npz")
    timings["search_s"] = time.perf_counter() - t0
    group.barrier()
    manifest = None
    if group.rank == 0:
        t0 = time.perf_counter()
        merged_scores, merged_ids = scores, ids
        for r in range(1, group.world):
            part = np.load(work / f"topk_rank{r:05d}.npz")
            merged_scores, merged_ids = merge_topk(
                merged_scores, merged_ids, part["scores"], part["ids"], cfg.top_k
            )
            pos_scores = np.fmin(pos_scores, part["positives"])  # each pair on one rank
        filtered = None
        if cfg.max_score_ratio > 0:
            merged_ids, dropped = drop_likely_positives(
                merged_ids,
                merged_scores,
                min_per_query(pos_scores, ts.positives),
                cfg.max_score_ratio,
            )
            filtered = {
                "dropped": int(dropped.sum()),
                "queries_with_drops": int((dropped > 0).sum()),
                "mean_per_query": round(float(dropped.mean()), 3),
            }
        negatives = mine(
            merged_ids,
            ts.positives,
            cfg.num_negatives,
            strategy=cfg.strategy,
            skip_top=cfg.skip_top,
            seed=cfg.seed + version,
            num_passages=ts.num_passages,
        )
        timings["mine_s"] = time.perf_counter() - t0
        timings["passages_per_s"] = ts.num_passages / max(timings["encode_passages_s"], 1e-9)
        rounded = {k: round(v, 3) for k, v in timings.items()}
        handoff.publish(
            root,
            version,
            negatives,
            step=step,
            meta={
                "source": "model",
                "checkpoint": checkpoint.name,
                "data": ts.fingerprint(),
                "settings": mining_settings(cfg),
                "false_negative_filter": filtered,
                "ranks": group.world,
                "embedding_cache": cached,
                "timings": rounded,
            },
            keep_last=cfg.keep_last,
        )
        manifest = json.loads(handoff.manifest_file(root, version).read_text())
        with open(layout.refresh_metrics, "a", encoding="utf-8") as f:
            dropped = {"false_negatives_dropped": filtered["dropped"]} if filtered else {}
            f.write(json.dumps({"version": version, "step": step, **rounded, **dropped}) + "\n")
        shutil.rmtree(work, ignore_errors=True)
        print(
            f"refresh: published v{version} (step {step}) {rounded}; embedding cache {cached}",
            file=sys.stderr,
            flush=True,
        )
    group.barrier()
    return manifest


# --------------------------------------------------------------------------- the loop
def _set_threads(cfg: RefreshConfig, step: int, all_threads: int) -> None:
    """``cfg.threads`` torch threads while the trainer trains; all of them for a step-0
    checkpoint, whose negatives the trainer waits for (``negatives.mine_first``)."""
    want = all_threads if step == 0 or not cfg.threads else cfg.threads
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    print(
        f"refresh: {want} torch CPU threads (step {step}; default {all_threads})",
        file=sys.stderr,
        flush=True,
    )


def run_refresher(cfg: RefreshConfig) -> int:
    """Refresh until told to stop (see the module docstring); returns versions published."""
    if not cfg.run_dir:
        raise ValueError("refresh: --run_dir is required")
    all_threads = torch.get_num_threads()
    started = time.time()
    group = _Group(cfg.timeout_s)
    layout = RunLayout(cfg.run_dir)
    data_dir = Path(cfg.data_dir or layout.data)
    published = 0
    last_new = time.monotonic()
    ts = None
    reported: set[str] = set()  # pointer problems already printed
    while True:
        action: dict[str, Any] = {"do": "wait"}
        if group.rank == 0:
            action = _next_action(cfg, layout, data_dir, started, last_new, reported)
        action = group.broadcast(action)
        if action["do"] == "stop":
            if group.rank == 0:
                print(f"refresh: stopping ({action['why']})", file=sys.stderr, flush=True)
            return published
        if action["do"] == "wait":
            time.sleep(cfg.poll_s)
            continue
        if ts is None:
            ts = ance_data.load(data_dir)
        _set_threads(cfg, action["step"], all_threads)
        try:
            refresh_once(cfg, ts, Path(action["checkpoint"]), action["version"], group)
        except (FileNotFoundError, OSError) as exc:
            if group.world > 1:
                raise
            # the trainer pruned the checkpoint while it was being read: take the next one
            print(f"refresh: skipped {action['checkpoint']}: {exc}", file=sys.stderr, flush=True)
            continue
        published += 1
        last_new = time.monotonic()
        if cfg.max_versions and published >= cfg.max_versions:
            if group.rank == 0:
                print(f"refresh: stopping (max_versions {cfg.max_versions})", file=sys.stderr)
            return published


def _source(root: Path, version: int) -> str | None:
    try:
        return json.loads(handoff.manifest_file(root, version).read_text()).get("source")
    except (FileNotFoundError, ValueError):
        return None


def _next_action(
    cfg: RefreshConfig,
    layout: RunLayout,
    data_dir: Path,
    started: float,
    last_new: float,
    reported: set[str] | None = None,
) -> dict[str, Any]:
    root = layout.negatives
    finished = layout.finished
    done = finished.is_file() and finished.stat().st_mtime >= started - 1
    if cfg.idle_timeout_s and time.monotonic() - last_new > cfg.idle_timeout_s:
        return {"do": "stop", "why": f"no new checkpoint for {cfg.idle_timeout_s:.0f} s"}
    try:
        pointer, unknown = handoff.read_pointer(root), False
    except handoff.HandoffError as exc:
        # the current version is unknown; publishing the next one replaces the bad pointer
        pointer, unknown = None, True
        if reported is None or str(exc) not in reported:
            print(f"refresh: {exc}; will publish a new version", file=sys.stderr, flush=True)
            if reported is not None:
                reported.add(str(exc))
    if not (data_dir / ance_data.READY).is_file() or (pointer is None and not unknown):
        # the trainer prepares the data and publishes the BM25 version first
        return {"do": "stop", "why": "the trainer finished"} if done else {"do": "wait"}
    newest = ckpt.latest_complete(layout.checkpoints)
    # BM25 negatives come from no checkpoint: any checkpoint, even step 0, is newer (and so
    # it is when the current version is unknown)
    fresh = newest is not None and (
        unknown
        or _source(root, pointer["version"]) == "bm25"
        or ckpt.read_marker(newest)["step"] >= pointer["step"] + max(1, cfg.min_new_steps)
    )
    if fresh:
        # numbered past every published version (data + manifest), whatever the pointer says
        return {
            "do": "refresh",
            "checkpoint": str(newest),
            "step": ckpt.read_marker(newest)["step"],
            "version": handoff.next_version(root),
        }
    if done:
        return {"do": "stop", "why": "the trainer finished"}
    return {"do": "wait"}


def main(argv: list[str] | None = None) -> int:
    from retromae_ds.config import make_parser, parse_config

    parser = make_parser(
        RefreshConfig, prog="retromae-ds refresh", description=__doc__.splitlines()[0]
    )
    cfg, _ = parse_config(RefreshConfig, parser, argv)
    run_refresher(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
