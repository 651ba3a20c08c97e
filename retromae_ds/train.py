"""Pre-training: ``retromae-ds pretrain --config FILE [--section.field VALUE ...]``.

Also ``python -m retromae_ds.train``. Reads shards, builds the collator and the model, wraps
them in a DeepSpeed engine and trains, with checkpoints that resume exactly: a run stopped
after step s and resumed (same world size, CPU) computes the same losses at every later step
as an uninterrupted run. Launch it as one process, with ``torchrun``, the ``deepspeed``
launcher or ``srun``; rank and world size come from the environment.

Stopping on a signal (Slurm's time-limit warning, preemption, ``scancel --signal``): the
handlers for ``stop_signals`` (SIGUSR1 and SIGTERM by default) only note the signal; at the
next optimizer-step boundary the ranks agree (an all-reduce, so a signal that reached one
rank stops all of them at the same step), write a complete checkpoint and exit with
``EXIT_REQUEUE`` (85). ``slurm/pretrain.sh`` requeues the job on that status and the requeued
job resumes from the checkpoint (``--resume auto``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from retromae_ds import checkpoint as ckpt
from retromae_ds import engine as eng
from retromae_ds import faults
from retromae_ds.config import build_config, to_dict
from retromae_ds.data.collate import IndexedSamples, MaskingConfig, PretrainCollator
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.data.sampler import ResumableDistributedSampler
from retromae_ds.metrics_log import MetricsLogger
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.pretrain import ObjectiveConfig, PretrainModel
from retromae_ds.tokens import SpecialIds

EXIT_REQUEUE = 85
"""Exit status of a run stopped by a stop signal after its checkpoint was completed: resume
it (``slurm/pretrain.sh`` runs ``scontrol requeue`` on it). Distinct from the statuses others
use: 1-2 (errors), 17 (the crash-in-save test hook), 124 (timeout(1)), 128+N (killed by N)."""


@dataclass(kw_only=True)
class DataConfig:
    shards: str = ""
    """Folder written by ``retromae-ds preprocess``."""
    max_length: int = 0
    """Model sequence length; 0 = the shards' max length."""
    num_workers: int = 0
    """DataLoader worker processes (results do not depend on it)."""


@dataclass(kw_only=True)
class ModelConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and LayerNorm weights)."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    """Linear warm-up steps (0: use warmup_ratio)."""
    warmup_ratio: float = 0.1
    """Warm-up as a share of max_steps when warmup_steps is 0."""
    schedule: str = "linear"
    """Decay after warm-up: linear, cosine or constant."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    encoder_frozen_steps: int = 0
    """Heads-only warm-up: the encoder body's learning rate is 0 for the first N steps while
    the heads (MLM transform, decoder) learn, e.g. when continuing from a checkpoint that
    ships without them; afterwards the body follows the schedule over the remaining steps."""

    def __post_init__(self) -> None:
        if self.schedule not in ("linear", "cosine", "constant"):
            raise ValueError(
                f"optim.schedule must be linear, cosine or constant, not {self.schedule!r}"
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    every_steps: int = 0
    """Save every N optimizer steps (0: only at the end)."""
    keep_last: int = 3
    """Complete checkpoints to keep (0: all)."""
    resume: str = "auto"
    """``auto`` (newest complete checkpoint of the run, if any), ``none``, or a path."""


@dataclass(kw_only=True)
class TrainConfig:
    run_dir: str = "runs/pretrain"
    """Where checkpoints, metrics and resolved configs go."""
    seed: int = 0
    micro_batch_size: int = 8
    """Samples per rank per forward pass."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    max_steps: int = 0
    """Optimizer steps to train (0: derive from epochs)."""
    epochs: float = 0.0
    """Passes over the data when max_steps is 0."""
    stop_at_step: int = 0
    """Stop after this step with a checkpoint although max_steps is larger (time-boxed jobs;
    the schedule still follows max_steps, so a resumed run continues exactly)."""
    log_every: int = 10
    progress: bool = True
    stop_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    """Signals that stop the run cleanly: every rank finishes the current optimizer step, a
    complete checkpoint is written, and the process exits with EXIT_REQUEUE (85). [] disables."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    deepspeed: eng.DeepSpeedSettings = field(default_factory=eng.DeepSpeedSettings)

    def __post_init__(self) -> None:
        if not self.data.shards:
            raise ValueError("data.shards is required (a folder written by retromae-ds preprocess)")
        if self.max_steps <= 0 and self.epochs <= 0:
            raise ValueError("set max_steps or epochs")
        if self.micro_batch_size < 1 or self.grad_accum < 1:
            raise ValueError("micro_batch_size and grad_accum must be >= 1")
        self.stop_signals = [name for name in self.stop_signals if name]
        for name in self.stop_signals:
            signal_number(name)  # fails naming the signal


def signal_number(name: str) -> signal.Signals:
    """``"SIGUSR1"`` or ``"USR1"`` -> the signal; SIGKILL and SIGSTOP cannot be handled."""
    full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    sig = getattr(signal.Signals, full, None)
    if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"stop_signals: {name!r} is not a signal that can be handled")
    return sig


class StopRequested(Exception):
    """train() stopped on a signal after the checkpoint of ``step`` was completed."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped by a signal after step {step} (checkpoint complete)")
        self.step = step


class StopSignals:
    """Handlers that only note that a stop signal arrived (nothing else is safe inside a
    handler); the training loop reads ``received`` at step boundaries. Restores the previous
    handlers on exit, except after a stop: then the process is on its way out with a complete
    checkpoint and ignores further stop signals, because the launcher ends the other ranks
    with SIGTERM as soon as the first one exits (srun --kill-on-bad-exit, the deepspeed
    launcher), which must not turn their status 85 into 143. Outside the main thread Python
    cannot install handlers: then inert."""

    def __init__(self, names: list[str]) -> None:
        self.signals = [signal_number(name) for name in names]
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _note(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        stopped = exc_type is not None and issubclass(exc_type, StopRequested)
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if stopped else handler)


def lr_lambda(cfg: OptimConfig, max_steps: int):
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * max_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        if cfg.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    return factor


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norms. With ``encoder_frozen_steps`` the encoder
    body's parameters get groups of their own (marked ``body``) for ``build_scheduler``."""
    body = set()
    if cfg.encoder_frozen_steps:
        encoder = getattr(model, "encoder", None)
        if encoder is None or not hasattr(encoder, "base_model"):
            raise ValueError("optim.encoder_frozen_steps needs a model with an encoder body")
        body = {id(p) for p in encoder.base_model.parameters()}
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decays = not (p.ndim < 2 or "norm" in name.lower())
        groups.setdefault((id(p) in body, decays), []).append(p)
    param_groups = [
        {"params": groups[key], "weight_decay": cfg.weight_decay if key[1] else 0.0}
        | ({"body": True} if key[0] else {})
        for key in ((False, True), (False, False), (True, True), (True, False))
        if key in groups
    ]
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The warm-up + decay schedule; the encoder body's groups wait ``encoder_frozen_steps``
    at learning rate 0, then run the same schedule over the remaining steps."""
    heads = lr_lambda(cfg, max_steps)
    frozen = cfg.encoder_frozen_steps
    if not frozen:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, heads)
    if frozen >= max_steps:
        raise ValueError(f"optim.encoder_frozen_steps ({frozen}) must be < max_steps ({max_steps})")
    later = lr_lambda(cfg, max_steps - frozen)

    def body(step: int) -> float:
        return 0.0 if step < frozen else later(step - frozen)

    lambdas = [body if g.get("body") else heads for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) pre-training; returns the final metrics row on every rank. Raises
    StopRequested when a stop signal ended the run early (its checkpoint is complete)."""
    with StopSignals(cfg.stop_signals) as stop:  # from the start: a signal during set-up counts
        return _train(cfg, stop)


def _train(cfg: TrainConfig, stop: StopSignals) -> dict[str, Any]:
    dist = eng.setup_distributed(cfg.deepspeed.timeout_s)
    run_dir = Path(cfg.run_dir)
    ckpt_root = run_dir / "checkpoints"
    torch.manual_seed(cfg.seed)

    data = ShardDataset(cfg.data.shards)
    manifest = data.manifest
    max_length = cfg.data.max_length or manifest["max_length"]
    if max_length < manifest["max_tokens_per_row"] + 2:
        raise ValueError(
            f"data.max_length {max_length} is shorter than the shards' rows ({manifest['max_length']})"
        )
    special = SpecialIds.from_fingerprint(manifest["tokenizer"])
    has_decoder = cfg.model.objective.name != "mlm"
    collator = PretrainCollator(
        special, cfg.masking, max_length, seed=cfg.seed, decoder=has_decoder
    )
    sampler = ResumableDistributedSampler(len(data), dist.world_size, dist.rank, seed=cfg.seed)
    loader = torch.utils.data.DataLoader(
        IndexedSamples(data),
        batch_size=cfg.micro_batch_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=cfg.data.num_workers,
        # a private generator: creating an iterator must not consume the global torch RNG,
        # or dropout would differ between an uninterrupted and a resumed run
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    steps_per_epoch = max(1, len(sampler) // (cfg.micro_batch_size * cfg.grad_accum))
    max_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)

    encoder = build_encoder(cfg.model.encoder, special.vocab_size, special.pad)
    if encoder.config.max_position_embeddings < max_length:
        raise ValueError(
            f"encoder has {encoder.config.max_position_embeddings} positions < max_length {max_length}"
        )
    model = PretrainModel(encoder, cfg.model.objective, cfg.masking.decoder_ratio)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps)
    ds_config = eng.build_ds_config(
        cfg.deepspeed.config,
        micro_batch=cfg.micro_batch_size,
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
                f"{resume_from}: saved with world size {marker['world_size']}, this run has {dist.world_size}"
            )
        eng.load_engine(engine, resume_from.parent, resume_from.name)
        rank_state = ckpt.read_rank_state(resume_from, dist.rank)
        sampler.load_state_dict(rank_state["sampler"])
        ckpt.set_rng_state(rank_state["rng"])
        step = marker["step"]

    logger = MetricsLogger(
        run_dir, enabled=dist.rank == 0, progress=cfg.progress, total=max_steps, initial=step
    )
    if dist.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
        if resume_from is not None:
            logger.note(f"resumed from {resume_from} at step {step}")

    def save(at_step: int) -> None:
        tag = ckpt.tag_for(at_step)
        final, staging = ckpt_root / tag, ckpt_root / f"{tag}.partial"
        if dist.rank == 0 and staging.exists():
            import shutil

            shutil.rmtree(staging)
        eng.barrier()
        eng.save_engine(engine, ckpt_root, staging.name, {"step": at_step})
        ckpt.write_rank_state(
            staging, dist.rank, {"sampler": sampler.state_dict(), "rng": ckpt.rng_state()}
        )
        _save_encoder(engine, staging / "encoder", cfg.data.shards)
        faults.crash("crash_in_save_at_step", at_step)  # dies with the checkpoint half-published
        eng.barrier()
        if dist.rank == 0:
            marker = {
                "step": at_step,
                "world_size": dist.world_size,
                "objective": cfg.model.objective.name,
            }
            ckpt.publish(staging, final, marker, cfg.checkpoint.keep_last)
        eng.barrier()

    last: dict[str, Any] = {}
    window: list[torch.Tensor] = []
    tokens = 0
    t_last = time.perf_counter()
    micro = 0
    stopping = False
    while step < max_steps:
        collator.epoch = sampler.epoch
        for batch in loader:
            batch = {k: v.to(dist.device, non_blocking=True) for k, v in batch.items()}
            out = engine(batch)
            engine.backward(out["loss"])
            engine.step()
            sampler.advance(len(batch["sample_index"]))
            tokens += int(batch["attention_mask"].sum())
            window.append(
                torch.stack(
                    [
                        out["loss"].detach(),
                        out["mlm_loss"],
                        out.get("decoder_loss", out["mlm_loss"] * 0),
                        out["mlm_accuracy"],
                    ]
                )
            )
            micro += 1
            if micro % cfg.grad_accum:
                continue
            step += 1
            faults.pause("sleep_after_step_s")
            # every rank calls the all-reduce at every step, so all stop at the same step
            stopping = bool(stop.signals) and eng.any_rank(stop.received is not None, dist.device)
            if step % cfg.log_every == 0 or step == max_steps:
                stats = eng.all_reduce_mean(torch.stack(window).mean(0).float())
                tok = eng.all_reduce_mean(torch.tensor([float(tokens)])) * dist.world_size
                now = time.perf_counter()
                last = {
                    "step": step,
                    "loss": float(stats[0]),
                    "mlm_loss": float(stats[1]),
                    "mlm_accuracy": float(stats[3]),
                    "lr": float(scheduler.get_last_lr()[0]),
                    "tokens_per_s": float(tok[0]) / (now - t_last),
                    "epoch": sampler.epoch,
                }
                if has_decoder:
                    last["decoder_loss"] = float(stats[2])
                logger.log(last)
                window, tokens, t_last = [], 0, now
            if (
                cfg.checkpoint.every_steps
                and step % cfg.checkpoint.every_steps == 0
                and step < max_steps
            ):
                save(step)
            logger.advance(step)
            if step >= max_steps or step == cfg.stop_at_step or stopping:
                break
        if step == cfg.stop_at_step or stopping:
            break
    newest = ckpt.latest_complete(ckpt_root)
    if newest is None or ckpt.read_marker(newest)["step"] != step:
        save(step)
    logger.close()
    if stopping and step < max_steps:
        if dist.rank == 0:
            print(
                f"stop signal: checkpoint of step {step} complete; exiting with {EXIT_REQUEUE} "
                "(resume with --resume auto)",
                file=sys.stderr,
                flush=True,
            )
        raise StopRequested(step)
    return last


def _save_encoder(engine, folder: Path, shards: str) -> None:
    """Rank 0 writes the consolidated encoder as a Hugging Face folder (with the tokenizer)."""
    state = eng.consolidated_state_dict(engine)
    if state is None:
        return
    module = engine.module
    with torch.random.fork_rng(devices=[]):  # building a model draws random weights: saving
        _write_encoder(module, state, folder)  # must not move the training RNG streams
    from retromae_ds.data.tokenizer import load_tokenizer

    load_tokenizer(Path(shards) / "tokenizer").save_pretrained(str(folder))


def _write_encoder(module, state: dict[str, torch.Tensor], folder: Path) -> None:
    encoder_state = {
        k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")
    }
    fresh = type(module.encoder)(module.encoder.config)
    missing, unexpected = fresh.load_state_dict(encoder_state, strict=False)
    fresh.tie_weights()
    tied = {k for k in missing if k.endswith(("decoder.weight", "decoder.bias"))}
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"encoder export: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
        )
    fresh.save_pretrained(str(folder), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="retromae-ds pretrain", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", default=None, help="YAML or JSON training config")
    parser.add_argument(
        "--resume", default=None, help="auto | none | CHECKPOINT (= --checkpoint.resume)"
    )
    # the deepspeed launcher passes --local_rank; LOCAL_RANK in the environment says the same
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    args, overrides = parser.parse_known_args(argv)
    if args.resume is not None:
        overrides += ["--checkpoint.resume", args.resume]
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    cfg = build_config(TrainConfig, args.config, overrides)
    try:
        train(cfg)
    except StopRequested:
        return EXIT_REQUEUE
    return 0


if __name__ == "__main__":
    sys.exit(main())
