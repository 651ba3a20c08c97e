"""The one optimizer-step loop of pre-training and fine-tuning.

``Trainer`` owns what both have in common: the DeepSpeed engine (AdamW + schedule), resume,
the rank-0 log, the step (forward, backward, accumulation, optimizer step), the stop/requeue
protocol, periodic and final checkpoints through the ``CheckpointManager``. What differs is
handed in as data: the batches (an iterator) and a few :class:`Hooks` — which model outputs to
average into the log, what to count per batch, what each rank adds to a checkpoint, how the
consolidated weights become Hugging Face folders, and one call at each step boundary (where
fine-tuning swaps its hard negatives). The loop itself, :meth:`Trainer.fit`, reads top to
bottom.

Exact resume: everything random is either seeded from (seed, epoch, sample) or part of the
checkpoint (every rank's RNG states and sampler position, and whatever the task adds), so a run
stopped after step s and resumed computes the same losses at every later step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch

from retromae_ds.base import faults
from retromae_ds.base.config import (
    apply_renamed,
    flat_defaults,
    load_file,
    resume_may_change,
    to_dict,
)
from retromae_ds.base.errors import (
    JOB_ERRORS,
    DiskFull,
    RunFailed,
    disk_full_error,
)
from retromae_ds.base.fsutil import atomic_write_json
from retromae_ds.base.options import run_command
from retromae_ds.components import engine as eng
from retromae_ds.components import memory
from retromae_ds.components.checkpoint import (
    CheckpointManager,
    Restored,
    latest_complete,
    read_marker,
    recorded_config,
)
from retromae_ds.components.layout import RunLayout
from retromae_ds.components.metrics_log import MetricsLogger
from retromae_ds.components.optim import build_optimizer, build_scheduler, lr_lambda
from retromae_ds.components.run_lock import hold_run_folder
from retromae_ds.components.signals import (
    EXIT_REQUEUE,
    StopAfterCheckpoint,
    StopRequested,
    StopSignals,
)
from retromae_ds.data.sampler import ResumableDistributedSampler
from retromae_ds.training.config import RunConfig


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_saved_config(path: Path) -> dict[str, Any]:
    """A config a run saved (``RUN/config.json``, a checkpoint's ``run_config.json``); one
    that cannot be read or parsed (truncated, not UTF-8, not an object) is a ValueError
    naming the file."""
    try:
        return load_file(path)  # the one config reader: line and column, UTF-8, a mapping
    except ValueError as exc:
        raise ValueError(f"{path}: unreadable saved config ({exc})") from None


def check_resume_config(cfg: RunConfig, saved: Path) -> None:
    """Refuse to resume with settings that change the meaning of the run: compare ``cfg``
    with the config the checkpoint was written with (``saved``: its ``run_config.json``, or
    the run's ``config.json``; see :func:`resume_settings`), naming the first fields that
    differ. Fields marked ``config.resumable`` may differ, and so may a field the saved
    config predates while it holds its default (it then means what the old run did)."""
    old = _flatten(apply_renamed(type(cfg), read_saved_config(saved), quiet=True, saved=True))
    new = _flatten(to_dict(cfg))
    allowed = resume_may_change(type(cfg))
    defaults = flat_defaults(type(cfg))

    def may_change(key: str) -> bool:
        if any(key == a or key.startswith(a + ".") for a in allowed):
            return True
        return key not in old and key in defaults and new.get(key) == defaults[key]

    changed = [
        f"{key} ({old.get(key)!r} -> {new.get(key)!r})"
        for key in sorted(set(old) | set(new))
        if not may_change(key) and old.get(key) != new.get(key)
    ]
    if changed:
        raise ValueError(
            f"resume: {', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''} differ from "
            f"{saved}; these change what the resumed steps compute. Keep them, or start a new "
            "run_dir (or --checkpoint.resume none to start over)"
        )


def _config_problem(path: Path) -> str | None:
    """Why a run's ``config.json`` cannot be read (missing, unreadable), or None."""
    if not path.is_file():
        return f"{path} is missing"
    try:
        read_saved_config(path)
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


def resume_settings(checkpoint: Path, run_dir: Path) -> tuple[Path, str | None]:
    """(the file a resume from ``checkpoint`` is checked against, a note for rank 0 or None).

    The checkpoint's own record of the settings it was trained with (its ``run_config.json``,
    hashed in ``COMPLETE`` and verified with it) is the authority: a lost or damaged
    ``RUN/config.json`` cannot let a resume change the objective, and is said in the note
    (``start_log`` writes it again). A checkpoint written before checkpoints recorded their
    settings falls back on the ``config.json`` of the run that wrote it; when that is missing
    or unreadable nothing says what the checkpoint trained, and the resume is refused in one
    line saying what to do."""
    recorded = recorded_config(checkpoint)
    saved = RunLayout(checkpoint.parent.parent).config
    if recorded is not None:
        own = checkpoint.parent.resolve() == RunLayout(run_dir).checkpoints.resolve()
        problem = _config_problem(saved) if own else None
        note = (
            f"resume: {problem}; rebuilt from {recorded}, the checkpoint's own record of the "
            "settings it was trained with (this resume was checked against it)"
            if problem
            else None
        )
        return recorded, note
    problem = _config_problem(saved)
    if problem is None:
        return saved, None
    raise ValueError(
        f"resume: {checkpoint} predates checkpoints that record their settings and {problem}, "
        "so nothing says what it was trained with (objective, model, data) and this resume "
        f"cannot be checked; put that run's config.json back at {saved}, or start a new "
        "run_dir (or --checkpoint.resume none to start over)"
    )


def _saved_max_steps(saved: Path) -> int | None:
    """``max_steps`` of the config a run saved, when it set one (a checkpoint written before
    its rank state recorded the one its schedule followed)."""
    try:
        value = json.loads(saved.read_text()).get("max_steps")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def schedule_change(optim, old: int, new: int, step: int) -> str:
    """The one line a resume with another ``max_steps`` prints: the learning-rate schedule
    (warm-up and decay) follows the new one from the checkpoint's step on, so the learning
    rate moves: its value at the checkpoint and at the next step (the ``lr`` of that step's
    metrics row), under each."""
    before, after = lr_lambda(optim, old), lr_lambda(optim, new)
    peak = optim.lr
    return (
        f"resume: max_steps {old} -> {new} at step {step}: the learning-rate schedule "
        f"({optim.schedule}) now runs to step {new}: the learning rate, {peak * before(step):.3g} "
        f"at the checkpoint, is {peak * after(step + 1):.3g} at step {step + 1} (under "
        f"max_steps {old}: {peak * before(step + 1):.3g}); keep max_steps to keep the schedule "
        "(stop_at_step stops earlier without changing it)"
    )


def _recorded_bytes(checkpoint: Path) -> int | None:
    """The bytes a complete checkpoint's record lists: about what the next one needs."""
    try:
        files = read_marker(checkpoint).get("files", {})
    except (OSError, ValueError):
        return None
    return sum(int(f["bytes"]) for f in files.values()) or None


class NonFiniteLoss(RunFailed):
    """A loss was NaN or infinite; the run stopped before checkpointing that state."""


def _nothing() -> dict[str, Any]:
    return {}


class Stateful(Protocol):
    """A piece of per-rank task state a checkpoint holds (``Trainer.resume``'s ``state``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


TRAINER_STATE = ("sampler", "seen", "rng", "max_steps")
"""Per-rank state the trainer and the checkpoint manager save themselves (``max_steps``: the
one the learning-rate schedule followed, so a resume with another one can say what changes)."""


@dataclass
class Hooks:
    """What a task adds to the shared loop (every callable runs on every rank unless said)."""

    write_models: Callable[[dict[str, torch.Tensor], Path], None]
    """Rank 0, at each checkpoint: the consolidated state dict -> Hugging Face folders in the
    staging folder."""
    metrics: tuple[str, ...] = ("loss",)
    """Model outputs averaged (over steps and ranks) into each log row."""
    counts: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor | int]] = lambda batch: {}
    """Per micro-batch counts, logged as ``{name}_per_s`` and ``{name}_seen`` (e.g. tokens):
    host ints or device tensors, which are summed on the device and read at log rows only.
    ``tokens`` beside ``slots`` (the batch's padded positions) logs ``pad_fraction``."""
    consumed: Callable[[dict[str, torch.Tensor]], int] = lambda batch: 0
    """Samples of the sampler a micro-batch used (the sampler advances by it)."""
    marker: Callable[[], dict[str, Any]] = _nothing
    """Task fields of a checkpoint's completion record."""
    log_fields: Callable[[], dict[str, Any]] = _nothing
    """Task fields of each log row (after the averages)."""
    after_step: Callable[[int], None] | None = None
    """At each step boundary, after the step's log row, before its checkpoint. Raising a
    ``StopAfterCheckpoint`` stops the run after a checkpoint of that step."""
    evaluate: Callable[[], dict[str, Any]] | None = None
    """Rank 0: scores of the current weights (e.g. ``eval.periodic.PeriodicEval``), logged as
    their own row before the first step of a fresh run, every ``eval_every`` steps and after
    the last; must leave the model's mode and the random-number generators untouched."""
    eval_every: int = 0
    """Steps between evaluations (0: only before the first and after the last step)."""
    forward_backward: (
        Callable[[Any, dict[str, torch.Tensor], torch.autocast], dict[str, torch.Tensor]] | None
    ) = None
    """``(engine, batch, autocast) -> outputs``: one micro-batch's forward and backward passes,
    for a task that splits them (several ``engine(...)`` and ``engine.backward`` calls through
    ``components.engine.backward_parts``); the outputs hold the ``metrics``, detached. None:
    ``engine(batch)`` under ``autocast``, then ``engine.backward`` of its loss."""


class Trainer:
    """Engine, checkpoints and log of one run; ``fit`` trains until max_steps or a stop."""

    def __init__(
        self,
        cfg: RunConfig,
        dist: eng.DistInfo,
        model: torch.nn.Module,
        sampler: ResumableDistributedSampler,
        *,
        max_steps: int,
        stop: StopSignals,
    ) -> None:
        self.cfg, self.dist, self.sampler, self.stop = cfg, dist, sampler, stop
        self.max_steps = max_steps
        self.layout = RunLayout(cfg.run_dir)
        optimizer = build_optimizer(model, cfg.optim)
        self.scheduler = build_scheduler(optimizer, cfg.optim, max_steps)
        self.ds_config = eng.build_ds_config(
            cfg.deepspeed.config,
            micro_batch=cfg.micro_batch_size,
            grad_accum=cfg.grad_accum,
            world_size=dist.world_size,
            grad_clip=cfg.optim.grad_clip,
            cuda=dist.device.type == "cuda",
        )
        if cfg.compile:
            compile_parts = getattr(model, "compile_parts", None)
            if compile_parts is None:
                raise ValueError(f"compile: {type(model).__name__} names no parts to compile")
            if self.ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
                raise ValueError("compile: not with ZeRO-3 (its parameter hooks break graphs)")
            compile_parts(backend=cfg.compile_backend, device_type=dist.device.type)
        if cfg.autocast and any(
            self.ds_config.get(kind, {}).get("enabled") for kind in ("bf16", "fp16")
        ):
            raise ValueError(
                f"autocast {cfg.autocast} keeps fp32 weights: use it with ds_configs/fp32.json, "
                "not a DeepSpeed config that enables bf16 or fp16"
            )
        self.engine = eng.initialize(model, optimizer, self.scheduler, self.ds_config)
        self.checkpoints = CheckpointManager(
            self.layout,
            rank=dist.rank,
            world_size=dist.world_size,
            keep_last=cfg.checkpoint.keep_last,
            keep_best=cfg.checkpoint.keep_best,
        )
        self.step = 0
        self.seen: dict[str, float] = {}
        self._evaluated: tuple[int, dict[str, float]] = (-1, {})
        """Rank 0: the step of the last evaluation and its lead figure, recorded in the
        checkpoint of that step (``checkpoint.keep_best``)."""
        """This rank's running totals of the ``counts`` hook (tokens seen), checkpointed."""
        self.logger: MetricsLogger | None = None
        self.hooks: Hooks | None = None
        self.state: dict[str, Stateful] = {}
        """The task's per-rank state (``resume``), saved at every checkpoint."""
        self._pending: dict[str, torch.Tensor | int] = {}
        """Counts since the last fold, still on the device (``_fold_counts``)."""
        self._counts: dict[str, float] = {}
        """The log window's counts (host)."""
        self._window: list[torch.Tensor] = []
        """The log window's metrics, one stacked tensor per micro-batch (device)."""

    # -- set-up -------------------------------------------------------------------------
    def resume(self, state: Mapping[str, Stateful] | None = None) -> Restored | None:
        """Register the task's per-rank ``state`` (saved under its names at every checkpoint
        beside the sampler, the token totals and the RNG), then restore all of them, the
        engine included, from ``checkpoint.resume``; None when there is nothing to resume."""
        self.state = dict(state or {})
        clash = sorted(set(self.state) & set(TRAINER_STATE))
        if clash:
            raise ValueError(f"task state names {clash} are the trainer's own")
        checkpoint = self.checkpoints.choose(
            self.cfg.checkpoint.resume,
            prune_set_aside=self.cfg.checkpoint.prune_set_aside,
            # settings that differ are refused before a newer folder is set aside
            check=lambda ckpt: check_resume_config(
                self.cfg, resume_settings(ckpt, self.layout.root)[0]
            ),
        )
        if checkpoint is None:
            return None
        settings, note = resume_settings(checkpoint, self.layout.root)
        if note and self.dist.rank == 0:
            print(note, file=sys.stderr, flush=True)
        restored = self.checkpoints.load(self.engine, checkpoint)
        missing = sorted(set(self.state) - set(restored.rank_state))
        if missing:
            raise ValueError(f"{checkpoint}: rank {self.dist.rank}'s state lacks {missing}")
        self.sampler.load_state_dict(restored.rank_state["sampler"])
        self.seen = dict(restored.rank_state.get("seen", {}))  # absent before it was saved
        for name, part in self.state.items():
            part.load_state_dict(restored.rank_state[name])
        self.step = restored.step
        saved_max = restored.rank_state.get("max_steps")  # absent before it was saved
        if saved_max is None:
            saved_max = _saved_max_steps(settings)
        if self.dist.rank == 0 and saved_max not in (None, self.max_steps):
            print(
                schedule_change(self.cfg.optim, saved_max, self.max_steps, self.step),
                file=sys.stderr,
                flush=True,
            )
        return restored

    def start_log(self, note: str | None = None) -> None:
        """Open the rank-0 log and write the resolved configs into the run folder."""
        rank0 = self.dist.rank == 0
        self.logger = MetricsLogger(
            self.layout,
            enabled=rank0,
            progress=self.cfg.progress,
            total=self.max_steps,
            initial=self.step,
        )
        if rank0:
            atomic_write_json(self.layout.config, to_dict(self.cfg))
            atomic_write_json(self.layout.ds_config, self.ds_config)
            if note:
                self.logger.note(note)

    def note(self, text: str) -> None:
        if self.logger is not None:
            self.logger.note(text)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()

    # -- checkpoints --------------------------------------------------------------------
    def save(self, step: int, hooks: Hooks) -> None:
        """A complete checkpoint of ``step`` (collective: every rank calls it). A full disk is
        one error naming the folder and the space needed; the partial folder is removed and
        the newest complete checkpoint stays the one a rerun resumes from."""
        self._fold_counts()  # the token totals a checkpoint holds include this window's
        try:
            self.checkpoints.save(
                self.engine,
                step,
                rank_state={
                    "sampler": self.sampler.state_dict(),
                    "seen": dict(self.seen),
                    "max_steps": self.max_steps,
                    **{name: part.state_dict() for name, part in self.state.items()},
                },
                marker={**hooks.marker(), **self._eval_record(step)},
                write_models=hooks.write_models,
                run_config=to_dict(self.cfg),
            )
        except Exception as exc:
            kept_step = self.checkpoints.newest_step()
            newest = None if kept_step is None else self.layout.checkpoint(kept_step)
            needed = _recorded_bytes(newest) if newest is not None else None
            full = disk_full_error(
                exc, self.layout.checkpoints, f"the checkpoint of step {step}", needed
            )
            if full is None:
                raise
            if self.dist.rank == 0:  # give the space back; a partial folder is never read
                shutil.rmtree(self.layout.staging(step), ignore_errors=True)
            kept = f"step {kept_step}" if kept_step is not None else "none yet"
            raise DiskFull(
                f"{full}; the newest complete checkpoint ({kept}) is intact: free space and "
                "rerun with --checkpoint.resume auto",
                full.folder,
            ) from exc

    # -- the loop -----------------------------------------------------------------------
    def fit(self, batches: Iterator[dict[str, torch.Tensor]], hooks: Hooks) -> dict[str, Any]:
        """Train from ``self.step`` to ``max_steps`` (or ``stop_at_step``, or a stop signal);
        returns the last log row on every rank. Raises StopRequested after a stop signal (its
        checkpoint is complete).

        Nothing is read back from the device between sync steps (log rows, checkpoints, the
        last step): losses, counts and the first non-finite step stay on the device, so a GPU
        never waits for the host. A sync step reads them (one all-reduce + one read for the
        checks) and, before any checkpoint, refuses a non-finite loss. A stop signal is acted
        on at once in a one-process run (the flag lives on the host) and at the next sync step
        when several ranks must agree."""
        cfg, dist = self.cfg, self.dist
        if self.logger is None:
            self.start_log()
        step, micro, stopping = self.step, 0, False
        last: dict[str, Any] = {}
        self._window, self._pending, self._counts = [], {}, {}
        first_bad = torch.zeros((), dtype=torch.int64, device=dist.device)
        trim_each_step = dist.device.type == "cpu"
        checks = bool(self.stop.signals) or cfg.stop_on_nonfinite
        autocast = torch.autocast(
            dist.device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16"
        )
        try:
            if hooks.evaluate is not None and step == 0:
                self._eval_row(step, hooks)
            t_last = time.perf_counter()  # the rates measure training alone: no evaluation
            while step < self.max_steps:
                first_bad = self._micro_step(next(batches), hooks, step, first_bad, autocast)
                micro += 1
                if micro % cfg.grad_accum:
                    continue
                step += 1
                self.step = step
                every = cfg.checkpoint.every_steps
                saves = bool(every) and step % every == 0 and step < self.max_steps
                logs = step % cfg.log_every == 0 or step == self.max_steps
                sync = logs or saves or step == cfg.stop_at_step
                if trim_each_step or sync:  # flat host RSS (components/memory.py)
                    memory.release_freed_memory()
                faults.pause("sleep_after_step_s")
                one_rank_stop = dist.world_size == 1 and self.stop.received is not None
                if checks and (sync or one_rank_stop):
                    # every rank reaches the same sync steps, so all stop at the same step
                    stopping = self._agree_or_fail(first_bad, step)
                if logs:
                    last = self._log_row(step, time.perf_counter() - t_last, hooks)
                    t_last = time.perf_counter()
                if hooks.evaluate is not None and (
                    step == self.max_steps or (hooks.eval_every and step % hooks.eval_every == 0)
                ):
                    t_eval = time.perf_counter()
                    self._eval_row(step, hooks)
                    # an evaluation inside a log window moves its start: the rows' rates
                    # measure the window's training steps alone, over the time they took
                    t_last += time.perf_counter() - t_eval
                self._after_step(step, hooks)
                if saves:
                    self.save(step, hooks)
                self.logger.advance(step)
                if step == cfg.stop_at_step or stopping:
                    break
            # the step of the checkpoint this run resumed from or wrote, never the newest
            # folder's name: after a fallback past a corrupt one the retrained step is saved
            if self.checkpoints.newest_step() != step:
                self.save(step, hooks)
        finally:
            self.close()
        if stopping and step < self.max_steps:
            if dist.rank == 0:
                print(
                    f"stop signal: checkpoint of step {step} complete; exiting with "
                    f"{EXIT_REQUEUE} (resume with --checkpoint.resume auto)",
                    file=sys.stderr,
                    flush=True,
                )
            raise StopRequested(step)
        return last

    def _micro_step(
        self,
        batch: dict[str, torch.Tensor],
        hooks: Hooks,
        step: int,
        first_bad: torch.Tensor,
        autocast: torch.autocast,
    ) -> torch.Tensor:
        """One micro-batch forward, backward and engine step; its counts and metrics kept on
        the device; returns ``first_bad`` (the first step with a non-finite loss, 0: none)."""
        batch = {k: v.to(self.dist.device, non_blocking=True) for k, v in batch.items()}
        if hooks.forward_backward is None:
            with autocast:
                out = self.engine(batch)
            self.engine.backward(out["loss"])
        else:
            out = hooks.forward_backward(self.engine, batch, autocast)
        if self.cfg.stop_on_nonfinite:  # the first step with a non-finite loss, on device
            bad = ~torch.isfinite(out["loss"].detach()) & (first_bad == 0)
            first_bad = torch.where(bad, step + 1, first_bad)
        self.engine.step()
        self.sampler.advance(hooks.consumed(batch))
        for name, n in hooks.counts(batch).items():
            self._pending[name] = self._pending.get(name, 0) + n
        self._window.append(torch.stack([out[k].detach().float() for k in hooks.metrics]))
        return first_bad

    def _agree_or_fail(self, first_bad: torch.Tensor, step: int) -> bool:
        """Whether to stop (a rank got a stop signal); a non-finite loss on any rank is
        ``NonFiniteLoss`` before anything is saved."""
        stopping, bad_step = self._agree(first_bad)
        if bad_step:
            raise NonFiniteLoss(
                f"non-finite loss at step {bad_step} (a rank's loss was NaN or "
                f"infinite; found at step {step}); stopped without saving, the "
                f"newest checkpoint is step {self.checkpoints.newest_step()} "
                "(--stop_on_nonfinite false trains on)"
            )
        return stopping

    def _after_step(self, step: int, hooks: Hooks) -> None:
        """``hooks.after_step``; one that raises ``StopAfterCheckpoint`` gets this step's
        checkpoint first (nothing trained is lost), then the error goes on."""
        if hooks.after_step is None:
            return
        try:
            hooks.after_step(step)
        except StopAfterCheckpoint:
            if self.checkpoints.newest_step() != step:
                self.save(step, hooks)
            raise

    def _agree(self, first_bad: torch.Tensor) -> tuple[bool, int]:
        """(a stop signal reached some rank, the earliest non-finite step of any rank or 0):
        one all-reduce and one read, at a sync step (collective)."""
        none = torch.iinfo(torch.int64).max
        earliest = torch.where(first_bad == 0, none, first_bad)
        flags = torch.stack(
            [torch.tensor(int(self.stop.received is not None), device=earliest.device), -earliest]
        )
        stop, neg_earliest = eng.all_reduce_max(flags).tolist()
        return bool(stop), 0 if -neg_earliest == none else -neg_earliest

    def _fold_counts(self) -> None:
        """Move the counts accumulated on the device since the last fold into the window's
        and the run's totals (one read)."""
        pending, self._pending = self._pending, {}
        on_device = [name for name, v in pending.items() if isinstance(v, torch.Tensor)]
        values = {name: float(v) for name, v in pending.items() if name not in on_device}
        if on_device:
            read = torch.stack([pending[n].double() for n in on_device]).tolist()
            values.update(zip(on_device, read, strict=True))
        for name, value in values.items():
            self._counts[name] = self._counts.get(name, 0) + value
            self.seen[name] = self.seen.get(name, 0) + value

    def _log_row(self, step: int, seconds: float, hooks: Hooks) -> dict[str, Any]:
        """Means over the window's micro-batches and all ranks; rates summed over ranks. A
        ``tokens`` count beside a ``slots`` count (the padded batch's positions) also gives
        the window's ``pad_fraction``: the share of the computed positions that were padding."""
        world = self.dist.world_size
        self._fold_counts()
        window, counts = self._window, self._counts
        self._window, self._counts = [], {}
        means = eng.all_reduce_mean(torch.stack(window).mean(0)).tolist()
        row: dict[str, Any] = {"step": step}
        row.update(zip(hooks.metrics, means, strict=True))
        row["lr"] = float(self.scheduler.get_last_lr()[0])
        if counts:
            totals = eng.all_reduce_mean(torch.tensor(list(counts.values()), dtype=torch.float64))
            summed = {name: t * world for name, t in zip(counts, totals.tolist(), strict=True)}
            for name, total in summed.items():
                row[f"{name}_per_s"] = total / seconds
            if summed.get("slots"):
                row["pad_fraction"] = 1.0 - summed.get("tokens", 0.0) / summed["slots"]
        row["epoch"] = self.sampler.epoch
        row.update(self._seen_totals())
        row.update(hooks.log_fields())
        self.logger.log(row)
        return row

    def _seen_totals(self) -> dict[str, float]:
        """``{NAME_seen: total over ranks}`` of the counts so far (collective)."""
        self._fold_counts()
        if not self.seen:
            return {}
        names = sorted(self.seen)
        totals = torch.tensor([float(self.seen[n]) for n in names], dtype=torch.float64)
        means = eng.all_reduce_mean(totals).tolist()
        world = self.dist.world_size
        return {f"{n}_seen": round(m * world) for n, m in zip(names, means, strict=True)}

    def _eval_record(self, step: int) -> dict[str, Any]:
        """``{"eval": {key: value}}`` when rank 0 evaluated at ``step`` (the first measure at
        the first pooling: what ``checkpoint.keep_best`` compares), else nothing."""
        at, lead = self._evaluated
        return {"eval": lead} if at == step and lead else {}

    def _eval_row(self, step: int, hooks: Hooks) -> None:
        """Rank 0 scores the current weights (``hooks.evaluate``) and logs them with the step
        and the tokens seen; the other ranks go on to the next collective and wait there."""
        seen = self._seen_totals()
        if self.dist.rank != 0:
            return
        row = {"step": step, **seen, **hooks.evaluate()}
        self.logger.log(row, scope="eval")
        # the first of eval.measures, per pooling (keys: eval/NAME/POOLING/MEASURE)
        first = next((k for k in row if k.startswith("eval/")), "/")
        self._evaluated = (step, {first: row[first]} if first in row else {})
        lead = "/" + first.rsplit("/", 1)[-1]
        scores = [f"{k.split('/', 2)[-1]} {v:.4f}" for k, v in row.items() if k.endswith(lead)]
        self.note(f"eval at step {step}: {', '.join(scores)}")


def steps_for(cfg: RunConfig, steps_per_epoch: int) -> int:
    """``max_steps``, or the steps that ``epochs`` passes take."""
    return cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)


def run_guarded(
    cfg: RunConfig, body: Callable[[StopSignals, eng.DistInfo], dict[str, Any]]
) -> dict[str, Any]:
    """``body(stop, dist)`` of a job (pre-training, fine-tuning): stop signals caught from the
    start (a signal during set-up counts), the process group set up, and the run folder held
    by this one writer (``components.run_lock``) while it runs."""
    with StopSignals(cfg.stop_signals) as stop:
        dist = eng.setup_distributed(cfg.deepspeed.timeout_s)
        with hold_run_folder(RunLayout(cfg.run_dir), dist.rank):
            return body(stop, dist)


EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (SIGINT), as a shell reports a process that SIGINT ended."""


def interrupted(prog: str, run_dir: str) -> int:
    """Ctrl-C: one line (rank 0) naming the run's newest complete checkpoint, the one a rerun
    with ``--checkpoint.resume auto`` continues from; no traceback. The steps after it are lost (a stop
    signal, ``stop_signals``, checkpoints first)."""
    if eng.env_int("RANK", "SLURM_PROCID", default=0) == 0:
        try:
            newest = latest_complete(RunLayout(run_dir).checkpoints)
        except OSError:
            newest = None
        where = (
            f"the last complete checkpoint is {newest}: rerun with --checkpoint.resume auto to continue "
            "from it"
            if newest is not None
            else f"no checkpoint in {run_dir} yet: a rerun starts at step 0"
        )
        print(f"{prog}: interrupted (Ctrl-C); {where}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def job_main(
    config_cls: type,
    command: Callable[[Any], int],
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
) -> int:
    """``python -m retromae_ds.JOB`` (what the ``deepspeed`` launcher, ``torchrun`` and the Slurm
    scripts start): the job's ``retromae-ds`` command through the one entry path
    (``options.run_command``) with its one description (``base.commands``), reporting bad
    input and a failed run in one line."""
    return run_command(
        config_cls, command, argv, prog=prog, description=description, errors=JOB_ERRORS
    )


def run_job(run: Callable[[Any], Any], cfg: Any, prog: str) -> int:
    """A training job's run function as ``retromae-ds`` calls it: exit EXIT_REQUEUE after a
    stop signal (the checkpoint is written), one line naming the newest checkpoint on Ctrl-C
    (``interrupted``), 0 when it finishes. Bad input and a failed run (RunFailed) are
    reported in one line by the front door (``cli.main``). A process started for the command
    ends as soon as the run has closed what it wrote (``end_process``): a finished or
    requeued job is not held up by the interpreter's finalization either."""
    try:
        run(cfg)
        status = 0
    except StopRequested:
        status = EXIT_REQUEUE
    except KeyboardInterrupt:
        status = interrupted(prog, cfg.run_dir)
    if _started_for_this_command():
        end_process(status)
    return status


def _started_for_this_command() -> bool:
    """Whether this process was started to run one command (``retromae-ds ...``, ``python -m
    retromae_ds.JOB`` under any launcher), so that ending it ends nothing else: a notebook or
    a test that calls the command in-process gets the status back instead."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.startswith("retromae_ds."):
        return True
    return Path(getattr(main, "__file__", None) or "").name == "retromae-ds"


def end_process(status: int) -> NoReturn:
    """Exit with ``status`` now, after flushing stdout and stderr, without the interpreter's
    finalization. When the run returns (finished, requeued after a stop signal, or after
    Ctrl-C and its one line) everything it writes is closed (the metrics log, TensorBoard,
    the lock, the refresher); what finalization would still do is collect the whole heap of
    torch, DeepSpeed and transformers module by module and tear down the process groups:
    about 2 s for a tiny run on an idle machine, 5 s after a real one, 10-20 s under load,
    and once more than 120 s (issue 55 item 8), a terminal left hanging after the message."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed or detached
            stream.flush()
    os._exit(status)
