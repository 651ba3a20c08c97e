"""Dense-retrieval fine-tuning (ANCE): ``retromae-ds finetune --config FILE [--a.b VALUE ...]``.

Also ``python -m retromae_ds.finetune``; one process, ``torchrun``, the ``deepspeed`` launcher
or ``srun`` (``slurm/finetune.sh`` runs it beside the refresher). A dual encoder (shared
weights by default), initialised from a pre-training checkpoint or any local Hugging Face
encoder, is trained contrastively on a BEIR split: per query its positive, ``n_hard`` hard
negatives and every other passage of the global batch (gathered from all ranks, gradients
flowing through the gather), with a temperature.

Negatives: before the first step rank 0 publishes version 0 from BM25 (``bm25s``, all
positives removed) unless a version exists. Every ``negatives.refresh_every`` steps rank 0
reads the ``CURRENT`` pointer and, when the refresher published a newer version, all ranks
swap to it at that step boundary; the version in use and its staleness (steps since the
checkpoint it was mined from) are logged. If the refresher dies, training goes on with the
last version. ``--refresher local`` starts ``retromae-ds refresh`` as a subprocess.

Checkpoints are those of pre-training (``step_N.partial`` -> ``COMPLETE`` -> rename) plus
``encoder/`` (and ``query_encoder/``) as Hugging Face folders; the per-rank state holds the
sampler position, RNG states and the negatives version in use, so a resumed run builds the
same batches as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retromae_ds import checkpoint as ckpt
from retromae_ds import engine as eng
from retromae_ds.ance import data as ance_data
from retromae_ds.ance import handoff
from retromae_ds.ance.model import DualEncoder, load_body, resolve_init, save_encoders
from retromae_ds.ance.refresher import FINISHED, RefreshConfig, publish_bm25
from retromae_ds.config import build_config, to_dict
from retromae_ds.data.sampler import ResumableDistributedSampler
from retromae_ds.fsutil import atomic_write_text
from retromae_ds.metrics_log import MetricsLogger
from retromae_ds.train import (
    EXIT_REQUEUE,
    CheckpointConfig,
    OptimConfig,
    StopRequested,
    StopSignals,
    build_optimizer,
    build_scheduler,
    signal_number,
)


@dataclass(kw_only=True)
class FinetuneDataConfig:
    beir: str = ""
    """BEIR folder (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv)."""
    split: str = "train"
    """Qrels split to train on."""
    q_max_len: int = 64
    """Query tokens including special tokens."""
    p_max_len: int = 256
    """Passage tokens including special tokens (longer documents are truncated)."""
    prepared: str = ""
    """Tokenized data folder (default RUN/data; tokenized once, reused on resume)."""
    workers: int = 1
    """Tokenization worker processes."""


@dataclass(kw_only=True)
class DualModelConfig:
    init: str = ""
    """A local Hugging Face encoder folder, a complete checkpoint, or a run folder."""
    pooling: str = "cls"
    """cls (RetroMAE's sentence embedding) or mean."""
    normalize: bool = False
    """L2-normalise embeddings (cosine similarity)."""
    temperature: float = 1.0
    """Scores are divided by it (use ~0.05 with normalize)."""
    shared: bool = True
    """One encoder for queries and passages; false trains a separate query tower."""
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"model.pooling must be cls or mean, not {self.pooling!r}")
        if self.temperature <= 0:
            raise ValueError("model.temperature must be > 0")


@dataclass(kw_only=True)
class NegativesConfig:
    n_hard: int = 7
    """Hard negatives per query in each batch (at most refresh.num_negatives are distinct)."""
    refresh_every: int = 50
    """Look for a newer negatives version every M steps."""
    mine_first: bool = False
    """ANCE's start: save a step-0 checkpoint and train only once the refresher has published
    negatives mined with the initial encoder (BM25 negatives are then never trained on)."""
    mine_first_timeout_s: float = 3600.0
    """How long to wait for those first mined negatives before failing."""


@dataclass(kw_only=True)
class FinetuneConfig:
    run_dir: str = "runs/finetune"
    seed: int = 0
    micro_batch_size: int = 16
    """Queries per rank per forward pass (each with 1 + n_hard passages)."""
    grad_accum: int = 1
    max_steps: int = 0
    """Optimizer steps (0: derive from epochs)."""
    epochs: float = 0.0
    stop_at_step: int = 0
    """Stop after this step with a checkpoint although max_steps is larger."""
    log_every: int = 10
    progress: bool = True
    stop_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    """As in pre-training: finish the step on every rank, write a complete checkpoint, exit
    with EXIT_REQUEUE (85); [] disables."""
    refresher: str = "none"
    """none (a refresher runs elsewhere, or not at all) or local (start it as a subprocess)."""
    refresher_device: str = "auto"
    """Device of a local refresher (cpu keeps a single GPU for the trainer)."""
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    model: DualModelConfig = field(default_factory=DualModelConfig)
    negatives: NegativesConfig = field(default_factory=NegativesConfig)
    refresh: RefreshConfig = field(default_factory=RefreshConfig)
    """Mining settings (also used for the BM25 version) and a local refresher's settings."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    deepspeed: eng.DeepSpeedSettings = field(default_factory=eng.DeepSpeedSettings)

    def __post_init__(self) -> None:
        if not self.data.beir or not self.model.init:
            raise ValueError("data.beir and model.init are required")
        if self.max_steps <= 0 and self.epochs <= 0:
            raise ValueError("set max_steps or epochs")
        if self.micro_batch_size < 1 or self.grad_accum < 1 or self.negatives.n_hard < 0:
            raise ValueError("micro_batch_size, grad_accum >= 1 and negatives.n_hard >= 0")
        if self.negatives.refresh_every < 1:
            raise ValueError("negatives.refresh_every must be >= 1")
        if self.refresher not in ("none", "local"):
            raise ValueError(f"refresher must be none or local, not {self.refresher!r}")
        self.refresh.run_dir = self.run_dir
        self.stop_signals = [name for name in self.stop_signals if name]
        for name in self.stop_signals:
            signal_number(name)


# --------------------------------------------------------------------------- batches
class BatchBuilder:
    """Batches as a pure function of (seed, epoch, query index, negatives version)."""

    def __init__(self, ts: ance_data.TrainingSet, n_hard: int, seed: int) -> None:
        self.ts, self.n_hard, self.seed = ts, n_hard, seed
        width = max(len(p) for p in ts.positives)
        self.positives = np.full((ts.num_queries, width), -1, dtype=np.int64)
        for q, pos in enumerate(ts.positives):
            self.positives[q, : len(pos)] = pos

    def __call__(
        self, queries: np.ndarray, epoch: int, negatives: handoff.Negatives
    ) -> dict[str, torch.Tensor]:
        ts = self.ts
        passages = []
        for q in queries.tolist():
            rng = np.random.default_rng([self.seed, epoch, q, negatives.version])
            pos = ts.positives[q]
            pool = negatives.of(q)
            if len(pool) == 0 and self.n_hard:
                raise ValueError(f"negatives v{negatives.version} has none for query {q}")
            hard = rng.choice(pool, size=self.n_hard, replace=len(pool) < self.n_hard)
            passages += [int(pos[rng.integers(len(pos))]), *hard.tolist()]
        p_index = np.asarray(passages, dtype=np.int64)
        q_ids, q_mask = ance_data.token_batch(ts.queries, ts.query_rows[queries], ts.special)
        p_ids, p_mask = ance_data.token_batch(ts.corpus, ts.passage_rows[p_index], ts.special)
        return {
            "q_ids": q_ids,
            "q_mask": q_mask,
            "p_ids": p_ids,
            "p_mask": p_mask,
            "p_index": torch.from_numpy(p_index),
            "positives": torch.from_numpy(self.positives[queries]),
        }


# --------------------------------------------------------------------------- helpers
def _broadcast(obj: Any) -> Any:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _load_negatives(root: Path, version: int, ts: ance_data.TrainingSet) -> handoff.Negatives:
    neg = handoff.load_version(root, version)
    if neg.manifest.get("data") != ts.fingerprint() or neg.num_queries != ts.num_queries:
        raise ValueError(f"{root}: version {version} was mined for other training data")
    return neg


REFRESH_CONFIG = "refresh_config.json"


def _wait_for_mined(
    root: Path, after: int, refresher: subprocess.Popen | None, timeout_s: float, log: Path
) -> int:
    """Every rank polls the shared negatives folder until a version newer than ``after`` is
    published; fails if the local refresher exits first or nothing comes within the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        pointer = handoff.read_pointer(root)
        if pointer is not None and pointer["version"] > after:
            return _broadcast(pointer["version"])
        if refresher is not None and refresher.poll() is not None:
            raise RuntimeError(
                f"the local refresher exited ({refresher.returncode}) before mining the first "
                f"negatives; see {log}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{root}: no mined negatives within {timeout_s:.0f} s of the step-0 checkpoint "
                "(negatives.mine_first needs a running refresher)"
            )
        time.sleep(1.0)


def _write_refresh_config(cfg: FinetuneConfig, run_dir: Path) -> Path:
    """The refresher's settings (the ``refresh`` section) for any refresher of this run: the
    local subprocess, or a Slurm job step that waits for this file (slurm/finetune.sh)."""
    refresh = {**to_dict(cfg.refresh), "run_dir": str(run_dir), "device": cfg.refresher_device}
    cfg_file = run_dir / REFRESH_CONFIG
    atomic_write_text(cfg_file, json.dumps(refresh, indent=2))
    return cfg_file


def _start_local_refresher(cfg_file: Path, run_dir: Path) -> subprocess.Popen:
    """``retromae-ds refresh`` as one plain process beside rank 0, with its own log."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
        and k not in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
        and not k.startswith(("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    }
    log = open(run_dir / "refresher.log", "ab")  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen(
        [sys.executable, "-m", "retromae_ds.ance.refresher", "--config", str(cfg_file)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _stop_local_refresher(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()  # a refresher killed anywhere leaves no visible partial version
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- the loop
def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Run (or resume) fine-tuning; returns the last metrics row on every rank. Raises
    StopRequested when a stop signal ended the run early (its checkpoint is complete)."""
    with StopSignals(cfg.stop_signals) as stop:
        return _finetune(cfg, stop)


def _finetune(cfg: FinetuneConfig, stop: StopSignals) -> dict[str, Any]:
    dist = eng.setup_distributed(cfg.deepspeed.timeout_s)
    run_dir = Path(cfg.run_dir)
    ckpt_root = run_dir / "checkpoints"
    neg_root = run_dir / "negatives"
    prepared = Path(cfg.data.prepared or run_dir / "data")
    torch.manual_seed(cfg.seed)
    init_dir = resolve_init(cfg.model.init)

    if dist.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / FINISHED).unlink(missing_ok=True)
        ance_data.prepare(
            cfg.data.beir,
            cfg.data.split,
            init_dir,
            prepared,
            q_max_len=cfg.data.q_max_len,
            p_max_len=cfg.data.p_max_len,
            workers=cfg.data.workers,
            progress=cfg.progress,
        )
    eng.barrier()
    ts = ance_data.load(prepared)
    if dist.rank == 0 and handoff.read_pointer(neg_root) is None:
        manifest = publish_bm25(cfg.refresh, ts)
        print(f"finetune: BM25 negatives published as v{manifest['version']}", file=sys.stderr)
    eng.barrier()

    encoder = load_body(init_dir)
    query_encoder = None if cfg.model.shared else load_body(init_dir)
    for tower in (encoder, query_encoder):
        if tower is not None and cfg.model.gradient_checkpointing:
            tower.gradient_checkpointing_enable()
    model = DualEncoder(
        encoder,
        query_encoder,
        pooling=cfg.model.pooling,
        normalize=cfg.model.normalize,
        temperature=cfg.model.temperature,
    )
    sampler = ResumableDistributedSampler(ts.num_queries, dist.world_size, dist.rank, seed=cfg.seed)
    batch_size = cfg.micro_batch_size
    if len(sampler) < batch_size:
        raise ValueError(
            f"{ts.num_queries} training queries over {dist.world_size} ranks cannot fill "
            f"micro batches of {batch_size}"
        )
    micro_per_epoch = len(sampler) // batch_size  # the partial last batch of an epoch is skipped
    steps_per_epoch = max(1, micro_per_epoch // cfg.grad_accum)
    max_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps)
    ds_config = eng.build_ds_config(
        cfg.deepspeed.config,
        micro_batch=batch_size,
        grad_accum=cfg.grad_accum,
        world_size=dist.world_size,
        grad_clip=cfg.optim.grad_clip,
        cuda=dist.device.type == "cuda",
    )
    engine = eng.initialize(model, optimizer, scheduler, ds_config)

    step = 0
    resume_from = ckpt.resolve_resume(cfg.checkpoint.resume, run_dir)
    if resume_from is not None:
        marker = ckpt.read_marker(resume_from)
        if marker["world_size"] != dist.world_size:
            raise ValueError(
                f"{resume_from}: saved with world size {marker['world_size']}, "
                f"this run has {dist.world_size}"
            )
        eng.load_engine(engine, resume_from.parent, resume_from.name)
        rank_state = ckpt.read_rank_state(resume_from, dist.rank)
        sampler.load_state_dict(rank_state["sampler"])
        ckpt.set_rng_state(rank_state["rng"])
        version = int(rank_state["negatives_version"])
        step = marker["step"]
    else:
        version = _broadcast(handoff.read_pointer(neg_root)["version"] if dist.rank == 0 else None)
    negatives = _load_negatives(neg_root, version, ts)
    build = BatchBuilder(ts, cfg.negatives.n_hard, cfg.seed)

    logger = MetricsLogger(
        run_dir, enabled=dist.rank == 0, progress=cfg.progress, total=max_steps, initial=step
    )
    if dist.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
        logger.note(
            f"finetune: {ts.num_queries} queries, {ts.num_passages} passages, "
            f"negatives v{version}" + (f", resumed at step {step}" if resume_from else "")
        )
    refresher = None
    if dist.rank == 0:
        refresh_file = _write_refresh_config(cfg, run_dir)
        if cfg.refresher == "local":
            refresher = _start_local_refresher(refresh_file, run_dir)

    def save(at_step: int) -> None:
        tag = ckpt.tag_for(at_step)
        final, staging = ckpt_root / tag, ckpt_root / f"{tag}.partial"
        if dist.rank == 0 and staging.exists():
            shutil.rmtree(staging)
        eng.barrier()
        eng.save_engine(engine, ckpt_root, staging.name, {"step": at_step})
        ckpt.write_rank_state(
            staging,
            dist.rank,
            {
                "sampler": sampler.state_dict(),
                "rng": ckpt.rng_state(),
                "negatives_version": negatives.version,
            },
        )
        state = eng.consolidated_state_dict(engine)
        if state is not None:
            with torch.random.fork_rng(devices=[]):
                save_encoders(model, state, staging, init_dir)
        eng.barrier()
        if dist.rank == 0:
            marker = {
                "step": at_step,
                "world_size": dist.world_size,
                "objective": "contrastive",
                "negatives_version": negatives.version,
            }
            ckpt.publish(staging, final, marker, cfg.checkpoint.keep_last)
        eng.barrier()

    last: dict[str, Any] = {}
    window: list[torch.Tensor] = []
    tokens, queries_seen = 0, 0
    refresh_note: dict[str, Any] = {}
    t_last = time.perf_counter()
    micro = 0
    stopping = False
    try:
        if cfg.negatives.mine_first and step == 0:
            if resume_from is None:
                save(0)
            version = _wait_for_mined(
                neg_root,
                negatives.version,
                refresher,
                cfg.negatives.mine_first_timeout_s,
                run_dir / "refresher.log",
            )
            negatives = _load_negatives(neg_root, version, ts)
            logger.note(f"finetune: step 0: negatives v{version} mined from the initial encoder")
        while step < max_steps:
            if sampler.consumed + batch_size > len(sampler):  # skip an epoch's partial tail
                sampler.advance(len(sampler) - sampler.consumed)
            queries = sampler.indices(sampler.consumed, sampler.consumed + batch_size)
            batch = build(queries, sampler.epoch, negatives)
            batch = {k: v.to(dist.device, non_blocking=True) for k, v in batch.items()}
            out = engine(batch)
            engine.backward(out["loss"])
            engine.step()
            sampler.advance(batch_size)
            tokens += int(batch["q_mask"].sum() + batch["p_mask"].sum())
            queries_seen += batch_size
            window.append(torch.stack([out["loss"].detach().float(), out["accuracy"].float()]))
            micro += 1
            if micro % cfg.grad_accum:
                continue
            step += 1
            # every rank joins the all-reduce at every step, so all stop at the same step
            stopping = bool(stop.signals) and eng.any_rank(stop.received is not None, dist.device)
            if step % cfg.log_every == 0 or step == max_steps:
                stats = eng.all_reduce_mean(torch.stack(window).mean(0))
                now = time.perf_counter()
                rate = eng.all_reduce_mean(torch.tensor([float(tokens), float(queries_seen)]))
                last = {
                    "step": step,
                    "loss": float(stats[0]),
                    "accuracy": float(stats[1]),
                    "lr": float(scheduler.get_last_lr()[0]),
                    "tokens_per_s": float(rate[0]) * dist.world_size / (now - t_last),
                    "queries_per_s": float(rate[1]) * dist.world_size / (now - t_last),
                    "epoch": sampler.epoch,
                    "negatives_version": negatives.version,
                    "negatives_staleness": step - negatives.step,
                    **refresh_note,
                }
                logger.log(last)
                window, tokens, queries_seen, t_last, refresh_note = [], 0, 0, now, {}
            # after the step's log row (it names the version that step used), before a
            # checkpoint (which records the version the next step will use)
            if step % cfg.negatives.refresh_every == 0:
                newest = None
                if dist.rank == 0:
                    pointer = handoff.read_pointer(neg_root)
                    newest = pointer["version"] if pointer else None
                newest = _broadcast(newest)
                if newest is not None and newest > negatives.version:
                    try:
                        loaded, problem = _load_negatives(neg_root, newest, ts), None
                    except (FileNotFoundError, ValueError) as exc:  # pruned or foreign
                        loaded, problem = None, exc
                    # every rank swaps, or none does
                    if eng.any_rank(loaded is None, dist.device):
                        logger.note(f"finetune: negatives v{newest} not used: {problem}")
                    else:
                        negatives = loaded
                        refresh_note = {
                            f"refresh_{k}": v
                            for k, v in negatives.manifest.get("timings", {}).items()
                        }
                        logger.note(
                            f"finetune: step {step}: negatives v{newest} "
                            f"(from step {negatives.step})"
                        )
            if (
                cfg.checkpoint.every_steps
                and step % cfg.checkpoint.every_steps == 0
                and step < max_steps
            ):
                save(step)
            logger.advance(step)
            if step == cfg.stop_at_step or stopping:
                break
        newest = ckpt.latest_complete(ckpt_root)
        if newest is None or ckpt.read_marker(newest)["step"] != step:
            save(step)
        if dist.rank == 0 and step >= max_steps:
            atomic_write_text(run_dir / FINISHED, json.dumps({"step": step}))
    finally:
        _stop_local_refresher(refresher)
        logger.close()
    if stopping and step < max_steps:
        raise StopRequested(step)
    return last


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="retromae-ds finetune", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", default=None, help="YAML or JSON fine-tuning config")
    parser.add_argument(
        "--resume", default=None, help="auto | none | CHECKPOINT (= --checkpoint.resume)"
    )
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    args, overrides = parser.parse_known_args(argv)
    if args.resume is not None:
        overrides += ["--checkpoint.resume", args.resume]
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    cfg = build_config(FinetuneConfig, args.config, overrides)
    try:
        finetune(cfg)
    except StopRequested:
        return EXIT_REQUEUE
    return 0


if __name__ == "__main__":
    sys.exit(main())
