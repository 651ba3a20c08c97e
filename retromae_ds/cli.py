"""The ``retromae-ds`` command line: one entry point, one subcommand per job; ``--help`` of
each lists every option with its default.

retromae-ds demo [--full]      the main job on the built-in corpus (README; retromae_recipes/demo.py,
                               added through the ``retromae_ds.commands`` entry point)
retromae-ds preprocess ...     raw text -> Arrow shards (also tools/preprocess_shards.py)
retromae-ds train-tokenizer    train a WordPiece tokenizer on inputs
retromae-ds make-tokenizer     a BERT tokenizer folder from a vocab.txt (e.g. Chinese BERT)
retromae-ds inspect DIR        summary of a shards folder
retromae-ds pretrain ...       RetroMAE / SEED-Encoder / MLM pre-training (--config FILE, --a.b VALUE)
retromae-ds finetune ...       ANCE dense-retrieval fine-tuning (--config FILE, --a.b VALUE)
retromae-ds refresh ...        the asynchronous hard-negative refresher of a fine-tuning run
retromae-ds eval ...           retrieval metrics of an encoder on a BEIR folder
retromae-ds export CKPT OUT    an encoder as a Hugging Face (sentence-transformers) folder
retromae-ds long-task ...      the long-document retrieval task from raw articles"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from retromae_ds.base.config import HelpWithDefaults, flag_parser, parse_flags
from retromae_ds.base.errors import USER_ERRORS, run_reporting

COMMANDS = "retromae_ds.commands"
"""Entry-point group of the commands other packages add: each entry is a callable that adds
its subparser (with ``func``) to the ``retromae-ds`` subparsers."""


@dataclass(frozen=True)
class Entry:
    """One flag-style subcommand: its config dataclass and run function, as ``module:name``
    (imported only when the command runs, so ``retromae-ds --help`` stays light). The
    parser comes from the dataclass (``config.flag_parser``); the run function takes the
    config and returns the exit status."""

    name: str
    help: str
    config: str
    run: str

    def load(self) -> tuple[type, Callable[[Any], int | None]]:
        return _load(self.config), _load(self.run)

    def parse(self, argv: list[str]) -> Any:
        cls, _ = self.load()
        cfg, _ = parse_flags(cls, argv, prog=f"retromae-ds {self.name}", description=self.help)
        return cfg

    def parser(self) -> argparse.ArgumentParser:
        cls, _ = self.load()
        return flag_parser(cls, prog=f"retromae-ds {self.name}", description=self.help)


def _load(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


ENTRIES = {
    e.name: e
    for e in (
        Entry(
            "preprocess",
            "raw text -> memory-mapped Arrow shards",
            "retromae_ds.data.preprocess:PreprocessConfig",
            "retromae_ds.data.preprocess:preprocess_command",
        ),
        Entry(
            "make-tokenizer",
            "a BERT fast-tokenizer folder from a WordPiece vocab.txt",
            "retromae_ds.data.tokenizer:MakeTokenizerConfig",
            "retromae_ds.data.tokenizer:make_tokenizer_command",
        ),
        Entry(
            "train-tokenizer",
            "train a WordPiece tokenizer on inputs",
            "retromae_ds.data.tokenizer:TrainTokenizerConfig",
            "retromae_ds.data.tokenizer:train_tokenizer_command",
        ),
        Entry(
            "inspect",
            "summary of a shards folder",
            "retromae_ds.data.dataset:InspectConfig",
            "retromae_ds.data.dataset:inspect_command",
        ),
        Entry(
            "export",
            "encoder of a checkpoint -> Hugging Face folder",
            "retromae_ds.export:ExportConfig",
            "retromae_ds.export:export_command",
        ),
        Entry(
            "long-task",
            "a long-document BEIR task from WikiText articles (title / deep sentence)",
            "retromae_ds.data.long_task:LongTaskConfig",
            "retromae_ds.data.long_task:long_task_command",
        ),
        Entry(
            "eval",
            "retrieval metrics of an encoder on a BEIR folder",
            "retromae_ds.eval.run:EvalConfig",
            "retromae_ds.eval.run:eval_command",
        ),
    )
}
"""The flag-style subcommands (``--name VALUE`` options generated from a config dataclass)."""

CONFIG_JOBS = {
    "pretrain": (
        "retromae_ds.pretrain:main",
        "pre-train on DeepSpeed (--config FILE, --section.field VALUE)",
    ),
    "finetune": (
        "retromae_ds.finetune:main",
        "ANCE fine-tuning on DeepSpeed (--config FILE, --a.b VALUE)",
    ),
    "refresh": (
        "retromae_ds.ance.refresher:main",
        "hard-negative refresher of a fine-tuning run (--run_dir RUN)",
    ),
}
"""The jobs whose options are their config's dotted fields (``config.make_parser``); each
parses its own command line and reports its own errors (``training.loop.run_main``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retromae-ds", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpWithDefaults),
    )

    for entry in ENTRIES.values():  # listed for --help; parsed when chosen (main)
        sub.add_parser(entry.name, help=entry.help, add_help=False)
    for name, (_, text) in CONFIG_JOBS.items():
        sub.add_parser(name, help=text, add_help=False)

    # commands other packages add (entry-point group ``retromae_ds.commands``; this
    # repository's recipes add ``demo``): the library never imports them by name
    for ep in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        ep.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command in CONFIG_JOBS:  # free-form --section.field overrides: parsed by the job
        return _load(CONFIG_JOBS[command][0])(argv[1:])
    if command in ENTRIES:
        entry = ENTRIES[command]
        _, run = entry.load()
        prog = f"retromae-ds {command}"
        return run_reporting(prog, lambda: run(entry.parse(argv[1:])), errors=_ERRORS)
    args = build_parser().parse_args(argv)
    return run_reporting(f"retromae-ds {args.command}", args.func, args, errors=_ERRORS)


_ERRORS = (*USER_ERRORS, RuntimeError)
"""What the commands report as one line: bad input, and RuntimeError, which they raise for a
model folder they cannot use."""


if __name__ == "__main__":
    sys.exit(main())
