"""Commands this repository's recipes add to ``retromae-ds`` (pyproject.toml's entry points,
group ``retromae_ds.commands``, each a ``cli.Entry``): ``demo``, the README's main job. The
library finds them by the group and never imports ``recipes`` by name; this module imports no
torch, so ``retromae-ds --help`` stays fast.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from retromae_ds.cli import Entry


@dataclass(kw_only=True)
class DemoConfig:
    """``retromae-ds demo``: the study's MLM-base protocol on the built-in corpus
    (``retromae_recipes.study_config.DEMO``; ``--full``: ``DEMO_FULL``)."""

    full: bool = False
    """The longer budget: 1,000 continuation steps instead of 300 (measured in
    docs/results.md); the output then defaults to runs/demo_full."""
    out: str | None = None
    """Output folder (none: runs/demo, or runs/demo_full with --full)."""
    workers: int = 2
    """Tokenization processes."""
    max_docs: int | None = None
    """Use the first N built-in documents, 0 for all (none: the budget's, 4,000)."""
    base_steps: int | None = None
    """Steps of the MLM base (none: the budget's)."""
    steps: int | None = None
    """Continued pre-training steps per objective (none: the budget's)."""
    finetune_steps: int | None = None
    """Fine-tuning steps (none: the budget's)."""
    seeds: list[int] | None = None
    """Seeds of the continuations (none: 0 1 2)."""
    objectives: list[str] = field(default_factory=lambda: ["none", "mlm", "retromae"])
    """none (the MLM base itself) and the continuations: mlm, retromae, dupmae, seed,
    seed_strong."""
    beir: list[str] | None = None
    """Also evaluate every encoder on these BEIR folders (their test qrels)."""


def demo_command(cfg: DemoConfig) -> int:
    from retromae_recipes.demo import run_demo  # torch and DeepSpeed: only when it runs
    from retromae_recipes.study_config import DEMO, DEMO_FULL

    run_demo(
        cfg.out or ("runs/demo_full" if cfg.full else "runs/demo"),
        budget=DEMO_FULL if cfg.full else DEMO,
        workers=cfg.workers,
        max_docs=cfg.max_docs,
        base_steps=cfg.base_steps,
        steps=cfg.steps,
        finetune_steps=cfg.finetune_steps,
        seeds=cfg.seeds,
        objectives=tuple(cfg.objectives),
        beir=cfg.beir,
        command=" ".join(["retromae-ds", *sys.argv[1:]]),
    )
    return 0


DEMO_ENTRY = Entry(
    "demo",
    "the main job: the study's MLM-base protocol, built-in corpus",
    "retromae_recipes.commands:DemoConfig",
    "retromae_recipes.commands:demo_command",
)
"""``retromae-ds demo``, parsed like every library command (``base.options``)."""
