"""Commands this repository's recipes add to ``retromae-ds`` (pyproject.toml's entry points,
group ``retromae_ds.commands``): ``demo``, the README's main job. The library finds them by
the group and never imports ``recipes`` by name; this module imports no torch, so
``retromae-ds --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from retromae_recipes.study_config import DEMO, DEMO_FULL


def add_demo(sub: argparse._SubParsersAction) -> None:
    """``retromae-ds demo [--full] ...``: the subparser, run by ``cmd_demo``."""
    p = sub.add_parser("demo", help="the main job: the study's MLM-base protocol, built-in corpus")
    p.add_argument(
        "--full",
        action="store_true",
        help=f"the longer budget: {DEMO_FULL['steps']} continuation steps instead of "
        f"{DEMO['steps']} (measured: docs/results.md); default --out runs/demo_full",
    )
    p.add_argument("--out", default=None, help="default runs/demo (--full: runs/demo_full)")
    p.add_argument("--workers", type=int, default=2, help="tokenization processes")
    for flag, key, what in (
        ("--max-docs", "max_docs", "use the first N built-in documents (0: all)"),
        ("--base-steps", "base_steps", "steps of the MLM base"),
        ("--steps", "steps", "continued pre-training steps per objective"),
        ("--finetune-steps", "finetune_steps", "fine-tuning steps"),
    ):
        p.add_argument(
            flag,
            type=int,
            default=None,
            help=f"{what} (default {DEMO[key]}; --full: {DEMO_FULL[key]})",
        )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2")
    p.add_argument(
        "--objectives",
        nargs="+",
        default=["none", "mlm", "retromae"],
        help="none (the MLM base itself) and the continuations: mlm, retromae, dupmae, seed, "
        "seed_strong (default: none mlm retromae)",
    )
    p.add_argument(
        "--beir",
        action="append",
        default=None,
        metavar="DIR",
        help="also evaluate every encoder on this BEIR folder (its test qrels; repeatable)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from retromae_recipes.demo import run_demo  # torch and DeepSpeed: only when it runs

    run_demo(
        args.out or ("runs/demo_full" if args.full else "runs/demo"),
        budget=DEMO_FULL if args.full else DEMO,
        workers=args.workers,
        max_docs=args.max_docs,
        base_steps=args.base_steps,
        steps=args.steps,
        finetune_steps=args.finetune_steps,
        seeds=args.seeds,
        objectives=tuple(args.objectives),
        beir=args.beir,
        command=" ".join(["retromae-ds", *sys.argv[1:]]),
    )
    return 0
