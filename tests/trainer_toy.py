"""A toy task on the shared Trainer, run as its own process by tests/test_training_core.py.

``python tests/trainer_toy.py RUN_DIR MAX_STEPS [--stop_at_step S] [--grad_accum A]``: a small
regression model on a real DeepSpeed engine (CPU, one rank), batches drawn through the
resumable sampler with noise from the global torch RNG (so resume must restore it), and hooks
that record, in order, every call the loop makes (``events.jsonl``) and carry task state
across a resume (a count of step boundaries, saved in each rank's checkpoint state).
``TOY_EVAL_EVERY=N TOY_EVAL_SLEEP_S=S`` add an evaluation hook every N steps that takes S
seconds (the logged rates must leave its time out).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from retromae_ds.base.options import build_config
from retromae_ds.components import engine as eng
from retromae_ds.components.signals import StopSignals
from retromae_ds.data.sampler import ResumableDistributedSampler
from retromae_ds.training.config import RunConfig
from retromae_ds.training.loop import Hooks, Trainer


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pred = self.linear(batch["x"]).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, batch["y"])
        return {"loss": loss, "close": (pred - batch["y"]).abs().lt(0.5).float().mean()}


@dataclass(kw_only=True)
class ToyConfig(RunConfig):
    pass


def main(argv: list[str]) -> None:
    cfg = build_config(
        ToyConfig,
        None,
        ["--deepspeed.config", '["ds_configs/zero2.json", "ds_configs/fp32.json"]', *argv],
    )
    dist = eng.setup_distributed()
    torch.manual_seed(cfg.seed)
    xs = torch.randn(64, 8)
    ys = xs @ torch.arange(8.0) / 8
    sampler = ResumableDistributedSampler(64, dist.world_size, dist.rank, seed=cfg.seed)
    events = Path(cfg.run_dir) / "events.jsonl"
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)

    def event(**row) -> None:
        with open(events, "a") as f:
            f.write(json.dumps(row) + "\n")

    state = {"boundaries": 0}

    class Boundaries:  # per-rank task state through the trainer's one save/restore pair
        def state_dict(self) -> int:
            return state["boundaries"]

        def load_state_dict(self, value: int) -> None:
            state["boundaries"] = value

    with StopSignals([]) as stop:
        trainer = Trainer(cfg, dist, Toy(), sampler, max_steps=cfg.max_steps, stop=stop)
        restored = trainer.resume({"boundaries": Boundaries()})
        if restored is not None:
            event(kind="resumed", step=restored.step, boundaries=state["boundaries"])
        trainer.start_log()

        def batches():
            while True:
                idx = sampler.indices(sampler.consumed, sampler.consumed + cfg.micro_batch_size)
                idx = torch.as_tensor(idx)
                noise = 0.01 * torch.randn(len(idx))  # the global RNG: resume restores it
                yield {"x": xs[idx], "y": ys[idx] + noise, "n": torch.tensor(len(idx))}

        def write_models(weights: dict[str, torch.Tensor], staging: Path) -> None:
            torch.save(weights, staging / "weights.pt")
            event(kind="write_models", step=trainer.step)

        def after_step(step: int) -> None:
            state["boundaries"] += 1
            event(kind="after_step", step=step, boundaries=state["boundaries"])

        def log_fields() -> dict:
            event(kind="log", step=trainer.step)
            return {"boundaries": state["boundaries"]}

        hooks = Hooks(
            write_models=write_models,
            metrics=("loss", "close"),
            counts=lambda batch: {"samples": int(batch["n"])},
            consumed=lambda batch: int(batch["n"]),
            marker=lambda: {"objective": "toy"},
            log_fields=log_fields,
            after_step=after_step,
        )
        if os.environ.get("TOY_EVAL_EVERY"):

            def evaluate() -> dict:
                time.sleep(float(os.environ.get("TOY_EVAL_SLEEP_S", "0")))
                return {"eval/toy": 1.0}

            hooks.evaluate, hooks.eval_every = evaluate, int(os.environ["TOY_EVAL_EVERY"])
        trainer.fit(batches(), hooks)


if __name__ == "__main__":
    main(sys.argv[1:])
