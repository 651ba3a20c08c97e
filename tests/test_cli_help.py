"""One front door (issue 29): every subcommand of ``retromae-ds`` answers ``--help`` with every
option it takes and that option's default (or "required"), as a user reads it."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

import pytest

from retromae_ds.cli import build_parser, main

CONFIG_COMMANDS = {
    "pretrain": ("retromae_ds.pretrain", "TrainConfig"),
    "finetune": ("retromae_ds.finetune", "FinetuneConfig"),
    "refresh": ("retromae_ds.ance.refresh_config", "RefreshConfig"),
}
"""Subcommands whose options are the fields of a config dataclass (``--section.field``)."""

ARGPARSE_COMMANDS = (
    "preprocess",
    "train-tokenizer",
    "make-tokenizer",
    "inspect",
    "export",
    "long-task",
    "demo",
    "eval",
)


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field of config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += _fields(tp, f"{prefix}{f.name}.")
        elif f.init:
            out.append(prefix + f.name)
    return out


def test_the_top_level_help_lists_every_subcommand(capsys):
    out = _help(capsys)
    listed = set(build_parser()._subparsers._group_actions[0].choices)
    assert listed == set(CONFIG_COMMANDS) | set(ARGPARSE_COMMANDS)
    for command in listed:
        assert re.search(rf"^\s+{re.escape(command)}\s", out, re.M), command


@pytest.mark.parametrize("command", sorted(CONFIG_COMMANDS))
def test_config_commands_list_every_field_with_its_default(capsys, command):
    import importlib

    module, name = CONFIG_COMMANDS[command]
    cls = getattr(importlib.import_module(module), name)
    out = _help(capsys, command)
    fields = _fields(cls)
    assert len(fields) > 5
    for dotted in fields:
        found = re.search(
            rf"^  --{re.escape(dotted)} [^\n]*?(\n\s+)?\((default: |required\))", out, re.M
        )
        assert found, f"{command} --help: --{dotted} with its default"
    assert "--config FILE" in out


@pytest.mark.parametrize("command", ARGPARSE_COMMANDS)
def test_argparse_commands_list_every_option_with_its_default(capsys, command):
    if command == "eval":
        from retromae_ds.eval.run import add_eval_args

        parser = argparse.ArgumentParser()
        add_eval_args(parser)
    else:
        parser = build_parser()._subparsers._group_actions[0].choices[command]
    out = _help(capsys, command)
    # an option's entry: from its first option string to the next entry (two-space indent)
    entries = re.split(r"\n(?=  \S)", out)
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options
    for action in options:
        entry = next(
            (e for e in entries if e.lstrip().startswith(tuple(action.option_strings))), None
        )
        assert entry is not None, f"{command} --help lacks {action.option_strings}"
        text = " ".join(entry.split())
        assert "default" in text or "(required)" in text, f"{command}: {text}"


def test_the_old_pretraining_module_name_still_runs():
    """``retromae_ds.pretrain`` was ``retromae_ds.train``: a command line written before the
    rename (a Slurm job requeued with its original script) still runs pre-training."""
    import subprocess
    import sys

    from retromae_ds import pretrain, train

    assert train.TrainConfig is pretrain.TrainConfig and train.main is pretrain.main
    done = subprocess.run(
        [sys.executable, "-m", "retromae_ds.train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "retromae-ds pretrain" in done.stdout and "--model.objective.name" in done.stdout
