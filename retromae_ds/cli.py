"""The ``retromae-ds`` command line: one entry point, one subcommand per job.

Each subcommand's ``--help`` lists every option with its default.

retromae-ds demo [--full]      the main job on the built-in corpus (README; retromae_recipes/demo.py,
                               added through the ``retromae_ds.commands`` entry point)
retromae-ds preprocess ...     raw text -> Arrow shards (also tools/preprocess_shards.py)
retromae-ds train-tokenizer    train a WordPiece tokenizer on inputs
retromae-ds make-tokenizer     a BERT tokenizer folder from a vocab.txt (e.g. Chinese BERT)
retromae-ds inspect DIR        summary of a shards folder
retromae-ds pretrain ...       RetroMAE / DupMAE / SEED-Encoder / bowdpr / MLM pre-training
retromae-ds finetune ...       ANCE dense-retrieval fine-tuning
retromae-ds refresh ...        the asynchronous hard-negative refresher of a fine-tuning run
retromae-ds mine ...           offline hard negatives as a file (ST / FE / Tevatron exports)
retromae-ds eval ...           retrieval metrics of an encoder on a BEIR folder
retromae-ds export CKPT OUT    an encoder as a Hugging Face (sentence-transformers) folder
retromae-ds long-task ...      the long-document retrieval task from raw articles

Every subcommand reads its options one way: the fields of its config, spelt as in a
``--config`` file, ``--section.field VALUE`` (``base.options``; ``--help`` lists them)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from retromae_ds.base.commands import DESCRIPTIONS
from retromae_ds.base.errors import JOB_ERRORS, USER_ERRORS
from retromae_ds.base.options import command_parser, run_command

COMMANDS = "retromae_ds.commands"
"""Entry-point group of the commands other packages add: each entry is an :class:`Entry`."""


@dataclass(frozen=True)
class Entry:
    """One subcommand: its config dataclass and run function, as ``module:name`` (imported
    only when the command runs, so ``retromae-ds --help`` stays light). Every subcommand
    parses and runs through ``options.run_command``: its options are its config's fields,
    ``--section.field VALUE``; the run function takes the config and returns the exit status.
    ``errors``: what it reports in one line rather than with a traceback."""

    name: str
    help: str
    config: str
    run: str
    errors: tuple[type[BaseException], ...] = (*USER_ERRORS, RuntimeError)

    def load(self) -> tuple[type, Callable[[Any], int | None]]:
        return _load(self.config), _load(self.run)

    def main(self, argv: list[str]) -> int:
        cls, run = self.load()
        prog = f"retromae-ds {self.name}"
        return run_command(cls, run, argv, prog=prog, description=self.help, errors=self.errors)

    def parser(self) -> argparse.ArgumentParser:
        cls, _ = self.load()
        return command_parser(cls, prog=f"retromae-ds {self.name}", description=self.help)


def _load(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


ENTRIES = {
    e.name: e
    for e in (
        Entry(
            "pretrain",
            DESCRIPTIONS["pretrain"],
            "retromae_ds.pretrain:PretrainConfig",
            "retromae_ds.pretrain:pretrain_command",
            errors=JOB_ERRORS,
        ),
        Entry(
            "finetune",
            DESCRIPTIONS["finetune"],
            "retromae_ds.finetune:FinetuneConfig",
            "retromae_ds.finetune:finetune_command",
            errors=JOB_ERRORS,
        ),
        Entry(
            "refresh",
            DESCRIPTIONS["refresh"],
            "retromae_ds.refresher.config:RefresherConfig",
            "retromae_ds.refresh:refresh_command",
            errors=USER_ERRORS,
        ),
        Entry(
            "mine",
            DESCRIPTIONS["mine"],
            "retromae_ds.mine:MineConfig",
            "retromae_ds.mine:mine_command",
        ),
        Entry(
            "preprocess",
            DESCRIPTIONS["preprocess"],
            "retromae_ds.data.preprocess:PreprocessConfig",
            "retromae_ds.prepare:preprocess_command",
        ),
        Entry(
            "make-tokenizer",
            DESCRIPTIONS["make-tokenizer"],
            "retromae_ds.data.tokenizer:MakeTokenizerConfig",
            "retromae_ds.prepare:make_tokenizer_command",
        ),
        Entry(
            "train-tokenizer",
            DESCRIPTIONS["train-tokenizer"],
            "retromae_ds.data.tokenizer:TrainTokenizerConfig",
            "retromae_ds.prepare:train_tokenizer_command",
        ),
        Entry(
            "inspect",
            DESCRIPTIONS["inspect"],
            "retromae_ds.data.dataset:InspectConfig",
            "retromae_ds.prepare:inspect_command",
        ),
        Entry(
            "export",
            DESCRIPTIONS["export"],
            "retromae_ds.export:ExportConfig",
            "retromae_ds.export:export_command",
        ),
        Entry(
            "long-task",
            DESCRIPTIONS["long-task"],
            "retromae_ds.data.long_task:LongTaskConfig",
            "retromae_ds.prepare:long_task_command",
        ),
        Entry(
            "eval",
            DESCRIPTIONS["eval"],
            "retromae_ds.eval.run:EvalConfig",
            "retromae_ds.evaluate:eval_command",
        ),
    )
}
"""Every subcommand of the library (commands other packages add come from ``COMMANDS``)."""


def entries() -> dict[str, Entry]:
    """The library's subcommands and those other packages add (entry-point group
    ``COMMANDS``, each a :class:`Entry`; this repository's recipes add ``demo``): the library
    never imports them by name."""
    added = {ep.name: ep.load() for ep in entry_points(group=COMMANDS)}
    return {**ENTRIES, **{name: added[name] for name in sorted(added) if name not in ENTRIES}}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: lists the subcommands for ``--help``; each parses its own
    options when chosen (``main``)."""
    parser = argparse.ArgumentParser(prog="retromae-ds", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for entry in entries().values():
        sub.add_parser(entry.name, help=entry.help, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``retromae-ds COMMAND ...``: every command through ``options.run_command``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    known = entries()
    if argv and argv[0] in known:
        return known[argv[0]].main(argv[1:])
    build_parser().parse_args(argv)  # --help, or a usage error naming the choices
    return 2


if __name__ == "__main__":
    sys.exit(main())
