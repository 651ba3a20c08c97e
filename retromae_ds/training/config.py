"""The settings every training run has, whatever it trains: where it writes, how long it runs,
batch and accumulation, logging, stop signals, optimizer, checkpoints and DeepSpeed.

``retromae_ds.pretrain.PretrainConfig`` (pre-training) and ``retromae_ds.finetune.FinetuneConfig``
(fine-tuning) extend :class:`RunConfig` with their data and model sections; the ``Trainer``
reads only what is declared here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retromae_ds.base.config import resumable
from retromae_ds.components.checkpoint import CheckpointConfig
from retromae_ds.components.engine import DeepSpeedSettings
from retromae_ds.components.optim import OptimConfig
from retromae_ds.components.signals import signal_number


@dataclass(kw_only=True)
class RunConfig:
    run_dir: str = resumable("runs/run")
    """Where checkpoints, metrics and resolved configs go."""
    seed: int = 0
    """Seeds the initialisation, the data order, masking and dropout."""
    micro_batch_size: int = 8
    """Samples per rank per forward pass."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    max_steps: int = resumable(0)
    """Optimizer steps to train (0: derive from epochs)."""
    epochs: float = resumable(0.0)
    """Passes over the data when max_steps is 0."""
    stop_at_step: int = resumable(0)
    """Stop after this step with a checkpoint although max_steps is larger (time-boxed jobs;
    the schedule still follows max_steps, so a resumed run continues exactly)."""
    log_every: int = resumable(10)
    """Write a metrics row (means since the last row) every N steps."""
    progress: bool = resumable(True)
    """Show a progress bar on rank 0."""
    stop_signals: list[str] = resumable(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    """Signals that stop the run cleanly: every rank finishes the current optimizer step, a
    complete checkpoint is written, and the process exits with EXIT_REQUEUE (85). One process
    stops after the step in which the signal came; several ranks agree at the next log row or
    checkpoint step (no per-step collective), so keep the requeue lead (slurm/*.sh: 300 s)
    longer than ``log_every`` steps. [] disables."""
    stop_on_nonfinite: bool = resumable(True)
    """Stop the run with an error, saving nothing, when a loss is NaN or infinite on any rank
    (the last checkpoint stays the newest); false trains on. Checked on the device at every
    step and read at log rows and checkpoint steps only, so the error comes at the next of
    those and names the step the loss went bad."""
    autocast: str = ""
    """``bf16``: forward passes under ``torch.autocast(bfloat16)`` while DeepSpeed keeps the
    weights, gradients and optimizer state in fp32 (use with ``ds_configs/fp32.json``):
    bf16 compute, fp32 master weights, the plain torch AMP loop's semantics. Unlike
    ``ds_configs/bf16.json`` (DeepSpeed's bf16 optimizer, which reads every parameter's
    gradient back from the device to check it for overflow at each step) the ZeRO-0 engine
    then reads nothing from the device between log rows. ``""``: as the DeepSpeed config
    says."""
    compile: bool = False
    """``torch.compile`` the model's heavy parts (the encoder body and the pre-training
    decoder, or the fine-tuning towers) as whole graphs with dynamic lengths; the vocabulary
    loss and the optimizer stay eager. The first steps take the compile time."""
    compile_backend: str = "inductor"
    """torch.compile backend of ``compile``: ``inductor`` generates kernels; ``aot_eager``
    traces forward and backward without generating code (what the CPU tests use)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = resumable(default_factory=CheckpointConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)

    def __post_init__(self) -> None:
        check_folder_name("run_dir", self.run_dir)
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, not {self.seed}")
        for name in ("max_steps", "epochs", "stop_at_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.max_steps == 0 and self.epochs == 0:
            raise ValueError("set max_steps or epochs (both are 0)")
        if self.micro_batch_size < 1 or self.grad_accum < 1:
            raise ValueError("micro_batch_size and grad_accum must be >= 1")
        if self.log_every < 1:
            raise ValueError("log_every must be >= 1")
        if self.autocast not in ("", "bf16"):
            raise ValueError(f"autocast must be '' or bf16, not {self.autocast!r}")
        self.stop_signals = [name for name in self.stop_signals if name]
        for name in self.stop_signals:
            signal_number(name)  # fails naming the signal


def check_folder_name(option: str, value: str) -> None:
    """Refuse, before anything is created, a folder name that would misplace a run: empty
    (the run would write into the current directory) or not UTF-8 (bytes a run's records,
    written as UTF-8, cannot name, so the folder would be left half made)."""
    if not value.strip():
        raise ValueError(
            f"{option} is empty: name the run's folder (an empty name would write into the "
            "current directory)"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise ValueError(
            f"{option} {shown!r} is not UTF-8 (byte at position {exc.start}): a run's records "
            "name its folder in UTF-8; choose a UTF-8 name"
        ) from None
