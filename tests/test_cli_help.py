"""One front door (issues 29 and 47): every subcommand of ``retromae-ds`` parses through one
parser (``base.options``) and answers ``--help`` with every setting it takes, spelt one way
(``--section.field``), with its default (or "required"), as a user reads it."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from retromae_ds.cli import ENTRIES, build_parser, entries, main

COMMANDS = (
    "pretrain",
    "finetune",
    "refresh",
    "mine",
    "preprocess",
    "train-tokenizer",
    "make-tokenizer",
    "inspect",
    "export",
    "long-task",
    "eval",
)
"""The library's subcommands: options generated from a config dataclass (``cli.ENTRIES``)."""

ADDED_COMMANDS = ("demo",)
"""Added from outside the library (the ``retromae_ds.commands`` entry point), parsed the same
way."""


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted name, field) of every leaf field of config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += _fields(tp, f"{prefix}{f.name}.")
        elif f.init:
            out.append((prefix + f.name, f))
    return out


def _parse(command: str, argv: list[str]):
    from retromae_ds.base.options import parse_command

    cls, _ = entries()[command].load()
    return parse_command(cls, argv)


def test_the_top_level_help_lists_every_subcommand(capsys):
    out = _help(capsys)
    listed = set(build_parser()._subparsers._group_actions[0].choices)
    assert listed == set(COMMANDS) | set(ADDED_COMMANDS)
    assert set(ENTRIES) == set(COMMANDS)
    for command in listed:
        assert re.search(rf"^\s+{re.escape(command)}\s", out, re.M), command


@pytest.mark.parametrize("command", COMMANDS + ADDED_COMMANDS)
def test_every_command_lists_every_field_in_one_spelling_with_its_default(capsys, command):
    """Each leaf field is one line of --help: ``--dotted.name TYPE (default: ...)`` (or
    "required"), a positional as ``DOTTED TYPE (positional...)``; and the parser takes each
    option under exactly that name."""
    cls, _ = entries()[command].load()
    out = _help(capsys, command)
    parser = entries()[command].parser()
    by_dest = {a.dest: a for a in parser._actions}
    fields = _fields(cls)
    assert fields
    for dotted, f in fields:
        positional = f.metadata.get("flag", {}).get("positional")
        shown = dotted.upper() if positional else f"--{dotted}"
        found = re.search(
            rf"^  {re.escape(shown)} [^\n]*?(\n\s+)?\((default: |required\)|positional)",
            out,
            re.M,
        )
        assert found, f"{command} --help: {shown} with its default"
        action = by_dest.get(dotted)
        assert action is not None, f"{command}: no option for field {dotted}"
        assert list(action.option_strings) == ([] if positional else [f"--{dotted}"])
    assert "--config FILE" in out


def test_old_spellings_parse_to_the_settings_of_the_new_and_a_config_file_reads(
    tmp_path, monkeypatch
):
    """The options written before the one spelling still parse to the same settings
    (hyphens, --no-... switches, sizes, the source section's flat names, the Slurm array
    index) as the new spelling, and --config supplies any field, the command line winning."""
    from retromae_ds.data.preprocess import PreprocessConfig
    from retromae_ds.data.sources import SourceOptions

    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "6")
    cfg = _parse(
        "preprocess",
        ["a.jsonl", "b/*.txt", "--out", "o", "--tokenizer", "tok", "--no-lowercase"]
        + ["--shard-size", "2MB", "--text-field", "body", "--txt-mode", "paragraph"]
        + ["--num-tasks", "3", "--no-progress", "--segmenter", "none"],
    )
    new = _parse(
        "preprocess",
        ["a.jsonl", "b/*.txt", "--out", "o", "--tokenizer", "tok", "--lowercase", "false"]
        + ["--shard_size", "2MB", "--source.text_field", "body", "--source.txt_mode"]
        + ["paragraph", "--num_tasks", "3", "--progress", "false", "--segmenter", "none"],
    )
    assert (
        cfg
        == new
        == PreprocessConfig(
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
    )
    file = tmp_path / "pre.yaml"
    file.write_text("out: from-file\ntokenizer: tok\nworkers: 2\nsource:\n  title_field: title\n")
    cfg = _parse("preprocess", ["x.jsonl", "--config", str(file), "--out", "cli"])
    assert (cfg.out, cfg.tokenizer, cfg.workers, cfg.source.title_field) == (
        "cli",
        "tok",
        2,
        "title",
    )
    export = _parse("export", ["ckpt", "hf", "--no-normalize", "--pooling", "mean"])
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
def test_commands_name_what_is_missing_or_wrong_in_one_line(capsys, argv, says):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "Traceback" not in err, err


def test_a_bad_config_file_of_a_command_names_the_field(tmp_path, capsys):
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


def test_every_command_runs_from_the_jobs_layer_with_one_description():
    """Each command's run function sits in a module at the package root (the jobs layer),
    and a job's own ``python -m`` spelling (what launchers, Slurm and the trainer's local
    refresher start) prints the same help as ``retromae-ds NAME --help``."""
    import subprocess
    import sys

    for entry in ENTRIES.values():
        module = entry.run.split(":")[0]
        assert module.count(".") == 1, entry.run  # retromae_ds.JOB
    spellings = {
        "pretrain": ["retromae_ds.pretrain", "retromae_ds.train"],
        "finetune": ["retromae_ds.finetune"],
        "refresh": ["retromae_ds.refresh", "retromae_ds.ance.refresher"],
    }
    for name, modules in spellings.items():
        front = subprocess.run(
            [sys.executable, "-m", "retromae_ds.cli", name, "--help"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        for module in modules:
            job = subprocess.run(
                [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True
            ).stdout
            assert job == front, module
