"""The recipes' command lines (``scripts/study.py``, ``scripts/knobs.py``,
``scripts/finetune_scifact.py``) are typed config dataclasses parsed by the library's one
options parser (``base.options``): every recipe command the docs quote parses in the one
spelling, ``--help`` lists the fields with their docstrings, a bad value is one line naming the
option, and the same intent gives the same study config, knob runs and fine-tuning recipe as
the argparse parsers they replace. Pure parsing: nothing trains."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest

from retromae_ds.base import config as config_module
from retromae_ds.base.config import to_dict
from retromae_ds.base.options import build_config, leaves, parse_command
from retromae_ds.pretrain import PretrainConfig
from retromae_recipes import batch_effect, finetune, knobs, study, teacher
from retromae_recipes.batch_effect import EffectOptions
from retromae_recipes.finetune import RecipeConfig, RecipeOptions, recipe_config
from retromae_recipes.knobs import KnobsOptions
from retromae_recipes.study_config import (
    StudyConfig,
    StudyOptions,
    bert_config,
    config_of,
    gpu_config,
    quick_config,
)
from retromae_recipes.teacher import TeacherOptions

REPO = Path(__file__).resolve().parents[1]
RECIPES = {
    "scripts/study.py": StudyOptions,
    "scripts/knobs.py": KnobsOptions,
    "scripts/finetune_scifact.py": RecipeOptions,
    "scripts/batch_effect.py": EffectOptions,
    "scripts/teacher_study.py": TeacherOptions,
}
MAINS = {
    StudyOptions: study.main,
    KnobsOptions: knobs.main,
    RecipeOptions: finetune.main,
    EffectOptions: batch_effect.main,
    TeacherOptions: teacher.main,
}
SCRIPT = re.compile(
    r"^(?:python\s+)?(scripts/(?:study|knobs|finetune_scifact|batch_effect|teacher_study)\.py)\b(.*)$",
    re.S,
)


def _documented() -> list[tuple[str, str, list[str]]]:
    """(where, script, arguments) of every recipe command README.md and docs/ quote: the lines
    of fenced blocks (``\\`` continuations joined, ``#`` comments dropped) and inline code
    spans (which may wrap lines)."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(REPO))
        fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
        for block in fenced:
            for line in block.replace("\\\n", " ").splitlines():
                found += _command(where, line.strip())
        prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`([^`]+)`", prose):
            found += _command(where, " ".join(span.split()))
    return found


def _command(where: str, text: str) -> list[tuple[str, str, list[str]]]:
    match = SCRIPT.match(text)
    if match is None:
        return []
    return [(where, match.group(1), shlex.split(match.group(2), comments=True))]


def _built(cls: type, opts: object) -> object:
    """What the recipe builds from its options, without running or writing anything."""
    if cls is StudyOptions:
        return None if opts.chinese else config_of(opts)  # --chinese writes its texts first
    if cls is KnobsOptions:
        base = build_config(PretrainConfig, None, ["--data.shards", "s", "--max_steps", "9"])
        return knobs.with_settings(base, opts.set)
    if cls in (EffectOptions, TeacherOptions):
        return opts  # the options are the experiment's config; building it writes the task
    return recipe_config(dataclasses.replace(opts, builtin_task=False))


def test_every_documented_recipe_command_parses_in_the_one_spelling():
    """Every recipe command in README.md and docs/ parses with its recipe's parser, each
    option spelt as the field it sets (no old spelling the parser would have to translate), and
    builds its recipe's config: the docs stay true."""
    commands = _documented()
    assert len(commands) >= 25, commands  # the extractor finds the docs' commands
    assert {script for _, script, _ in commands} == set(RECIPES)
    for where, script, args in commands:
        cls = RECIPES[script]
        names = set(leaves(cls))
        given = [a[2:].partition("=")[0] for a in args if a.startswith("--")]
        assert all(name in names for name in given), (where, script, args)
        if cls is StudyOptions and not ({"data", "pretrain_inputs"} & set(given)):
            args = [*args, "--data", "data"]  # a prose command that leaves the data implicit
        if cls in (RecipeOptions, KnobsOptions) and "data" not in given and "study" not in given:
            args = [
                *(["--data", "data"] if cls is RecipeOptions else ["--study", "s", "--out", "o"]),
                *args,
            ]
        _built(cls, parse_command(cls, args))


@pytest.mark.parametrize("cls", list(MAINS), ids=lambda c: c.__name__)
def test_help_lists_every_field_with_its_docstring(cls, capsys):
    with pytest.raises(SystemExit) as stop:
        MAINS[cls](["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    docs = config_module.field_docs(cls)
    for name in leaves(cls):
        assert f"  --{name} " in out, name
        assert docs[name], f"{cls.__name__}.{name} has no docstring"
        assert " ".join(docs[name].split())[:40] in " ".join(out.split()), name


@pytest.mark.parametrize(
    ("cls", "argv", "named"),
    [
        (StudyOptions, ["--data", "d", "--pretrain_steps", "many"], "pretrain_steps"),
        (StudyOptions, ["--data", "d", "--bert", "--chinese"], "--bert and --chinese"),
        (StudyOptions, ["--data", "d", "--seedz", "1"], "seedz"),
        (KnobsOptions, ["--study", "s", "--out", "o", "--knobs", "lr=7"], "--knobs"),
        (KnobsOptions, ["--study", "s", "--out", "o", "--steps", "1.5"], "steps"),
        (RecipeOptions, ["--data", "d", "--refresh_mode", "poool"], "--refresh_mode"),
        (RecipeOptions, ["--data", "d", "--extra_task", "nameless"], "--extra_task"),
        (RecipeOptions, ["--out", "o"], "--data"),
        (EffectOptions, ["--lr_rule", "cube"], "--lr_rule"),
        (EffectOptions, ["--batches", "32", "0"], "--batches"),
        (EffectOptions, ["--epochs", "0"], "--epochs"),
    ],
)
def test_a_bad_option_is_one_line_naming_it(cls, argv, named, capsys):
    assert MAINS[cls](argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ": error: " in err[0] and named in err[0], err


def test_old_spellings_are_read_with_a_note_naming_the_new_one(monkeypatch, capsys):
    monkeypatch.setattr(config_module, "_NOTED", set())
    old = ["--data", "d", "--pretrain-steps", "7", "--no-dupmae-curve", "--report-only"]
    new = ["--data", "d", "--pretrain_steps", "7", "--dupmae_curve", "false", "--report_only"]
    assert parse_command(StudyOptions, old) == parse_command(StudyOptions, new)
    err = capsys.readouterr().err
    for note in ("--pretrain_steps", "--dupmae_curve false", "--report_only"):
        assert f"is now {note} " in err, err


def test_the_same_intent_gives_the_same_study_config(monkeypatch):
    """The study's command line against the presets it chooses, built directly: the options
    given replace the preset's, the rest is the preset's (``--objectives none`` is the arm
    ``none``, not an empty setting)."""
    monkeypatch.delenv("RETROMAE_DS_DATA", raising=False)

    def of(*argv: str) -> StudyConfig:
        return config_of(parse_command(StudyOptions, ["--data", "D", "--out", "O", *argv]))

    assert of() == StudyConfig(out="O", data="D")
    assert of("--quick") == quick_config("O", "D")
    arms = ["none", "mlm", "retromae", "dupmae"]
    assert of("--bert", "--objectives", *arms) == bert_config("O", "D", objectives=arms)
    assert of("--bert", "--starts", "scratch", "--objectives", "none") == bert_config(
        "O", "D", starts=["scratch"], objectives=["none"]
    )
    gpu = gpu_config("O", "D", seeds=[1], extra_beir=["B"], dupmae_curve=False)
    gpu.pretrain_steps = dict.fromkeys(gpu.pretrain_steps, 9)
    assert of("--gpu", "--seeds", "1", "--beir", "B", "--pretrain_steps", "9",
              "--dupmae_curve", "false") == gpu  # fmt: skip
    monkeypatch.setenv("RETROMAE_DS_DATA", "ENV")
    assert config_of(parse_command(StudyOptions, ["--quick"])) == quick_config("runs/study", "ENV")


def test_the_same_intent_gives_the_same_finetune_recipe():
    argv = ["--data", "D", "--out", "O", "--seeds", "0", "--arms", "ance", "--builtin_task",
            "false", "--refresh_mode", "pool", "--pool_k", "200", "--top_k", "50",
            "--extra_task", "a=x", "b=y=z"]  # fmt: skip
    got = recipe_config(parse_command(RecipeOptions, argv))
    want = RecipeConfig(data="D", out="O", seeds=[0], arms=["ance"], refresh_mode="pool",
                        pool_k=200, top_k=50, extra_tasks={"a": "x", "b": "y=z"})  # fmt: skip
    assert got == want
    plain = parse_command(RecipeOptions, ["--data", "D", "--builtin_task", "false"])
    assert recipe_config(plain) == RecipeConfig(data="D")


OLD_KNOBS = {
    "reference": {},
    "decoder_ratio=0.7": {"model.objective.decoder_ratio": 0.7},
    "decoder_ratio=0.9": {"model.objective.decoder_ratio": 0.9},
    "decoder_ratio=1.0": {"model.objective.decoder_ratio": 1.0},
    "encoder_ratio=0.15": {"masking.encoder_ratio": 0.15},
    "encoder_ratio=0.4": {"masking.encoder_ratio": 0.4},
    "encoder_ratio=0.5": {"masking.encoder_ratio": 0.5},
    "lr=2e-3": {"optim.lr": 2e-3},
    "lr=3e-3": {"optim.lr": 3e-3},
    "lr=5e-3": {"optim.lr": 5e-3},
    "lr=1e-2": {"optim.lr": 1e-2},
    "lr=5e-4": {"optim.lr": 5e-4},
    "warmup=0": {"optim.warmup_ratio": 0.0},
    "schedule=constant": {"optim.schedule": "constant"},
    "decoder_weight=3": {"model.objective.decoder_weight": 3.0},
    "mlm_weight=0.3": {"model.objective.mlm_weight": 0.3},
    "batch=16": {"micro_batch_size": 16, "steps_scale": 2},
    "batch=64": {"micro_batch_size": 64, "steps_scale": 0.5},
    "dropout=0": {"model.encoder.dropout": 0.0},
    "decoder_lr=5x": {"optim.decoder_lr_scale": 5.0},
    "decoder_lr=10x": {"optim.decoder_lr_scale": 10.0},
    "decoder_lr=20x": {"optim.decoder_lr_scale": 20.0},
}
"""The knob table as it was (name -> dotted overrides): the oracle of the typed knobs."""


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("name", [*OLD_KNOBS, "lr=5e-3+batch=16", "batch=16+lr=3e-3+warmup=0"])
def test_typed_knobs_change_what_the_old_table_changed(name, tmp_path):
    """Each typed knob (and a combination) gives the run the string-keyed table gave: the
    reference's config with the steps scaled and the knob's fields set, nothing else."""
    assert set(knobs.KNOBS) == {*OLD_KNOBS, "shard_length=64"}  # shard_length: test_demo
    base = build_config(
        PretrainConfig, None, ["--data.shards", "s", "--eval.beir", "b", "--max_steps", "9"]
    )
    base = knobs.with_settings(base, ["optim.lr=0.001", "model.objective.name=mlm"])
    assert (base.optim.lr, base.model.objective.name) == (0.001, "mlm")
    got = knobs.knob_config(base, name, knobs.combined(name), 40, 10, tmp_path, tmp_path)
    overrides: dict = {}
    for part in name.split("+"):
        overrides.update(OLD_KNOBS[part])
    scale = overrides.pop("steps_scale", 1)
    n = int(round(40 * scale))
    want = _flat(to_dict(base)) | {
        "run_dir": str(tmp_path / "runs" / name.replace("=", "_")),
        "max_steps": n,
        "log_every": max(1, int(round(10 * scale)) // 2),
        "checkpoint.every_steps": n,
        "checkpoint.keep_last": 1,
        "eval.every": max(1, int(round(10 * scale))),
        **overrides,
    }
    assert _flat(to_dict(got)) == want
    assert json.loads(json.dumps(to_dict(got))) == to_dict(got)


def test_no_module_imports_a_private_name_of_another():
    """A helper another module needs is public API of its module (``options.py`` once
    imported three private helpers of ``config.py``)."""
    private = []
    for path in sorted(
        [*(REPO / "retromae_ds").rglob("*.py"), *(REPO / "retromae_recipes").rglob("*.py")]
    ):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("retromae"):
                private += [f"{path.relative_to(REPO)}: {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]  # fmt: skip
    assert not private, private
