"""One front door (issue 29): every subcommand of ``retromae-ds`` answers ``--help`` with every
option it takes and that option's default (or "required"), as a user reads it."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from retromae_ds.cli import ENTRIES, build_parser, main

CONFIG_COMMANDS = {
    "pretrain": ("retromae_ds.pretrain", "PretrainConfig"),
    "finetune": ("retromae_ds.finetune", "FinetuneConfig"),
    "refresh": ("retromae_ds.ance.refresh_config", "RefreshConfig"),
}
"""Subcommands whose options are the fields of a config dataclass (``--section.field``)."""

FLAG_COMMANDS = (
    "preprocess",
    "train-tokenizer",
    "make-tokenizer",
    "inspect",
    "export",
    "long-task",
    "eval",
)
"""Subcommands whose ``--name VALUE`` options are generated from a config dataclass
(``cli.ENTRIES``, ``config.flag_parser``)."""

ARGPARSE_COMMANDS = ("demo",)
"""Added from outside the library (the ``retromae_ds.commands`` entry point)."""


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
    assert listed == set(CONFIG_COMMANDS) | set(FLAG_COMMANDS) | set(ARGPARSE_COMMANDS)
    assert set(ENTRIES) == set(FLAG_COMMANDS)
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


@pytest.mark.parametrize("command", FLAG_COMMANDS)
def test_flag_commands_list_every_field_with_its_default(capsys, command):
    """Each leaf field of the command's config is one option (or positional) in --help, with
    its default or "required"."""
    cls, _ = ENTRIES[command].load()
    out = _help(capsys, command)
    entries = re.split(r"\n(?=  \S)", out)
    parser = ENTRIES[command].parser()
    by_dest = {a.dest: a for a in parser._actions}
    fields = _fields(cls)
    assert fields
    for dotted in fields:
        action = by_dest.get(dotted)
        assert action is not None, f"{command}: no option for field {dotted}"
        names = tuple(action.option_strings) or (action.metavar,)
        entry = next((e for e in entries if e.lstrip().startswith(names)), None)
        assert entry is not None, f"{command} --help lacks {names}"
        text = " ".join(entry.split())
        assert "default" in text or "(required)" in text, f"{command}: {text}"
    assert "--config FILE" in out


def test_argparse_commands_list_every_option_with_its_default(capsys):
    for command in ARGPARSE_COMMANDS:
        parser = build_parser()._subparsers._group_actions[0].choices[command]
        out = _help(capsys, command)
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


def test_flag_commands_keep_their_spellings_and_read_a_config_file(tmp_path, monkeypatch):
    """The options written before the commands became config entries still parse to the same
    settings (hyphens, --no-... switches, sizes, the source section's flat names, the Slurm
    array index), and --config supplies any field, the command line winning."""
    from retromae_ds.data.preprocess import PreprocessConfig
    from retromae_ds.data.sources import SourceOptions

    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "6")
    cfg = ENTRIES["preprocess"].parse(
        ["a.jsonl", "b/*.txt", "--out", "o", "--tokenizer", "tok", "--no-lowercase"]
        + ["--shard-size", "2MB", "--text-field", "body", "--txt-mode", "paragraph"]
        + ["--num-tasks", "3", "--no-progress", "--segmenter", "none"]
    )
    assert cfg == PreprocessConfig(
        inputs=["a.jsonl", "b/*.txt"],
        out="o",
        tokenizer="tok",
        lowercase=False,
        shard_size=2 * 2**20,
        num_tasks=3,
        task_index=1,
        progress=False,
        source=SourceOptions(text_field="body", txt_mode="paragraph"),
    )
    file = tmp_path / "pre.yaml"
    file.write_text("out: from-file\ntokenizer: tok\nworkers: 2\nsource:\n  title_field: title\n")
    cfg = ENTRIES["preprocess"].parse(["x.jsonl", "--config", str(file), "--out", "cli"])
    assert (cfg.out, cfg.tokenizer, cfg.workers, cfg.source.title_field) == (
        "cli",
        "tok",
        2,
        "title",
    )
    export = ENTRIES["export"].parse(["ckpt", "hf", "--no-normalize", "--pooling", "mean"])
    assert (export.checkpoint, export.out, export.normalize, export.pooling) == (
        "ckpt",
        "hf",
        False,
        "mean",
    )


@pytest.mark.parametrize(
    "argv, says",
    [
        (["preprocess", "x.jsonl", "--tokenizer", "t"], "required: --out"),
        (["export", "ckpt"], "required"),
        (["preprocess", "x.jsonl", "--out", "o", "--tokenizer", "t", "--workers", "0"], "workers"),
        (["eval", "--model", "m"], "required: --beir"),
    ],
)
def test_flag_commands_name_what_is_missing_or_wrong_in_one_line(capsys, argv, says):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "Traceback" not in err, err


def test_a_bad_config_file_of_a_flag_command_names_the_field(tmp_path, capsys):
    file = tmp_path / "pre.yaml"
    file.write_text("out: o\ntokenizer: t\nworkerz: 2\n")
    assert main(["preprocess", "x.jsonl", "--config", str(file)]) == 2
    assert "workerz" in capsys.readouterr().err


def test_the_old_pretraining_module_name_still_runs():
    """``retromae_ds.pretrain`` was ``retromae_ds.train``: a command line written before the
    rename (a Slurm job requeued with its original script) still runs pre-training."""
    import subprocess
    import sys

    from retromae_ds import pretrain, train

    assert train.TrainConfig is pretrain.PretrainConfig and train.main is pretrain.main
    assert train.train is pretrain.pretrain
    done = subprocess.run(
        [sys.executable, "-m", "retromae_ds.train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "retromae-ds pretrain" in done.stdout and "--model.objective.name" in done.stdout
