"""Config plumbing: file + command-line overrides into nested dataclasses, the --help text
built from the fields' docstrings, and the DeepSpeed dict that the engine builds from the
training config (no process group needed)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from retromae_ds.base.config import field_docs, help_text
from retromae_ds.base.options import build_config, canonical_argv, command_parser, parse_command
from retromae_ds.components.engine import build_ds_config
from retromae_ds.components.optim import lr_lambda
from retromae_ds.pretrain import PretrainConfig
from retromae_ds.training.config import OptimConfig


def test_overrides_reach_nested_fields_with_types(tmp_path):
    (tmp_path / "c.yaml").write_text("data: {shards: s}\nmax_steps: 5\noptim: {lr: 0.001}\n")
    cfg = build_config(
        PretrainConfig,
        tmp_path / "c.yaml",
        [
            "--optim.lr",
            "2e-4",
            "--model.encoder.name=small",
            "--progress",
            "false",
            "--deepspeed.config",
            '["a.json", "b.json"]',
            "--checkpoint.every-steps",
            "7",
        ],
    )
    assert cfg.optim.lr == 2e-4 and cfg.max_steps == 5 and cfg.progress is False
    assert cfg.model.encoder.name == "small" and cfg.checkpoint.every_steps == 7
    assert cfg.deepspeed.config == ["a.json", "b.json"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--optim.lrr", "1"], "unknown config field"),
        (["--max_steps", "many"], "max_steps: expected an integer"),
        (["--progress", "maybe"], "progress: expected true/false"),
        (["--model.objective.name", "bert"], "objective.name must be one of"),
        (["--optim.schedule", "step"], "optim.schedule"),
        (["--max_steps"], "expected one argument"),
    ],
)
def test_bad_overrides_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        build_config(PretrainConfig, None, ["--data.shards", "s", "--max_steps", "1", *args])


def test_required_fields():
    with pytest.raises(ValueError, match="data.shards is required"):
        build_config(PretrainConfig, None, ["--max_steps", "1"])
    with pytest.raises(ValueError, match="set max_steps or epochs"):
        build_config(PretrainConfig, None, ["--data.shards", "s"])


def test_ds_config_takes_batch_settings_from_the_training_config(tmp_path):
    ds = build_ds_config(
        ["ds_configs/zero2.json", "ds_configs/bf16.json"],
        micro_batch=8,
        grad_accum=4,
        world_size=16,
        grad_clip=0.5,
        cuda=False,
    )
    assert ds["train_batch_size"] == 8 * 4 * 16 and ds["gradient_accumulation_steps"] == 4
    assert (
        ds["gradient_clipping"] == 0.5
        and ds["bf16"]["enabled"]
        and ds["zero_optimization"]["stage"] == 2
    )
    conflicting = tmp_path / "bad.json"
    conflicting.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        build_ds_config(
            [str(conflicting)], micro_batch=8, grad_accum=1, world_size=1, grad_clip=1.0, cuda=False
        )
    with pytest.raises(ValueError, match="fp16 does not run on CPU"):
        build_ds_config(
            ["ds_configs/fp16.json"],
            micro_batch=8,
            grad_accum=1,
            world_size=1,
            grad_clip=1.0,
            cuda=False,
        )
    with pytest.raises(FileNotFoundError, match="nope.json"):
        build_ds_config(
            ["nope.json"], micro_batch=8, grad_accum=1, world_size=1, grad_clip=1.0, cuda=False
        )


@dataclass(kw_only=True)
class _Inner:
    """The innermost section."""

    depth: int = 3
    """How deep the inner section goes."""


@dataclass(kw_only=True)
class _BaseSection:
    ratio: float = 0.5
    """A ratio inherited from the base class."""
    tags: list[str] = field(default_factory=lambda: ["a", "b"])
    """Tags, from a default_factory."""


@dataclass(kw_only=True)
class _Section(_BaseSection):
    limit: int | None = None
    """An optional limit."""
    weights: dict[str, int] = field(default_factory=dict)
    """Per-name weights."""
    inner: _Inner = field(default_factory=lambda: _Inner(depth=7))
    """The inner section, built with its own default."""


@dataclass(kw_only=True)
class _Top:
    name: str
    """A required name."""
    verbose: bool = False
    undocumented: int = 1
    section: _Section = field(default_factory=_Section)


def test_field_docs_follow_dataclass_bases_and_survive_missing_source():
    assert field_docs(_Section) == {
        "ratio": "A ratio inherited from the base class.",
        "tags": "Tags, from a default_factory.",
        "limit": "An optional limit.",
        "weights": "Per-name weights.",
        "inner": "The inner section, built with its own default.",
    }
    assert field_docs(_Top)["undocumented"] == ""
    no_source = dataclasses.make_dataclass("NoSource", [("x", int, dataclasses.field(default=1))])
    assert field_docs(no_source) == {"x": ""}
    assert "--x int  (default: 1)" in help_text(no_source)


def test_help_text_lists_every_field_dotted_with_type_default_and_docstring():
    text = help_text(_Top)
    lines = text.splitlines()
    expected = [
        "  --name str  (required)",
        "        A required name.",
        "  --verbose bool  (default: false)",
        "  --undocumented int  (default: 1)",
        "section  (_Section)",
        "  --section.ratio float  (default: 0.5)",
        "        A ratio inherited from the base class.",
        '  --section.tags list[str]  (default: ["a", "b"])',
        "  --section.limit int | None  (default: none)",
        "        An optional limit.",
        "  --section.weights dict[str, int]  (default: {})",
        "section.inner  (_Inner)",
        "  The inner section, built with its own default.",
        "  The innermost section.",
        "  --section.inner.depth int  (default: 7)",
        "        How deep the inner section goes.",
    ]
    positions = [lines.index(line) for line in expected]
    assert positions == sorted(positions), text
    # sections are headings, not fields with a default
    assert "--section " not in text and "--section.inner " not in text


def test_help_text_of_the_training_config_fits_the_terminal():
    from retromae_ds.finetune import FinetuneConfig

    text = help_text(PretrainConfig)
    for option, doc in [
        ("--optim.lr float  (default: 0.0001)", "Peak learning rate."),
        ('--model.objective.name str  (default: "retromae")', "(MLM + two-stream decoder)"),
        ("--deepspeed.config list[str]", "ds_config files merged in order"),
        ("--masking.encoder_ratio float", "Share of whole words masked"),
        ("--checkpoint.every_steps int", "Save every N optimizer steps"),
    ]:
        assert option in text and doc in text.split(option, 1)[1].split("\n  --")[0]
    assert max(len(line) for line in text.splitlines()) <= 100
    # a section's own default instance wins over the class defaults
    assert "--optim.lr float  (default: 3e-05)" in help_text(FinetuneConfig)


def test_parse_command_applies_the_file_then_the_command_line(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps({"data": {"shards": "s"}, "optim": {"lr": 0.5}}))
    cfg = parse_command(
        PretrainConfig,
        ["--optim.lr", "2e-4", "--config", str(tmp_path / "c.json"), "--max_steps=3"]
        + ["--checkpoint.resume", "none", "--masking.encoder_ratio", "0.15"],
    )
    assert (cfg.data.shards, cfg.optim.lr, cfg.max_steps) == ("s", 2e-4, 3)
    assert cfg.masking.encoder_ratio == 0.15 and cfg.checkpoint.resume == "none"
    with pytest.raises(ValueError, match="unknown config field.*optim.lrr"):
        parse_command(PretrainConfig, ["--data.shards", "s", "--max_steps=1", "--optim.lrr=1"])
    with pytest.raises(ValueError, match="max_steps: expected an integer"):
        parse_command(PretrainConfig, ["--data.shards", "s", "--max_steps", "x"])
    parser = command_parser(PretrainConfig, prog="retromae-ds pretrain", description="Pre-train.")
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--section.field VALUE" in out and "--optim.lr float" in out
    assert "--checkpoint.resume str" in out and "--config FILE" in out


def test_old_spellings_reach_their_field_with_one_note_each(capsys, monkeypatch):
    """Issue 47: one spelling, ``--section.field_name``; the spellings before it (kebab-case
    flags, ``--no-flag``, renamed fields, the flat names of a section's fields) still work,
    each noted once on stderr, and mean exactly what the new spelling means."""
    from retromae_ds.base import config as config_module
    from retromae_ds.data.preprocess import PreprocessConfig

    monkeypatch.setattr(config_module, "_NOTED", set())
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    old = canonical_argv(
        PretrainConfig,
        ["--local_rank=3", "--max-steps", "3", "--no-progress", "--resume", "auto"]
        + ["--checkpoint.every-steps=7", "--masking.decoder_ratio", "0.6", "--max-steps", "4"],
    )
    assert old == [
        "--max_steps", "3", "--progress=false", "--checkpoint.resume", "auto",
        "--checkpoint.every_steps=7", "--model.objective.decoder_ratio", "0.6",
        "--max_steps", "4",
    ]  # fmt: skip
    import os

    assert os.environ["LOCAL_RANK"] == "3"  # the deepspeed launcher's option, as torchrun sets it
    notes = capsys.readouterr().err.splitlines()
    assert notes == [
        "note: --max-steps is now --max_steps (the old name still works)",
        "note: --no-progress is now --progress false (the old name still works)",
        "note: --resume is now --checkpoint.resume (the old name still works)",
        "note: --checkpoint.every-steps is now --checkpoint.every_steps (the old name still works)",
        "note: --masking.decoder_ratio is now --model.objective.decoder_ratio (the old name still "
        "works)",
    ]
    base = ["--data.shards", "s", "--max_steps", "2"]
    assert build_config(PretrainConfig, None, [*base, "--no-progress", "--resume", "none"]) == (
        build_config(PretrainConfig, None, [*base, "--progress", "false"] + [
            "--checkpoint.resume", "none"])
    )  # fmt: skip
    # booleans: alone, with a word, or with =; a following positional is not taken as a value
    assert canonical_argv(PretrainConfig, ["--progress", "--seed", "1"])[0] == "--progress=true"
    assert canonical_argv(PretrainConfig, ["--progress", "off"]) == ["--progress=off"]
    flat = parse_command(
        PreprocessConfig, ["a.jsonl", "--out", "o", "--tokenizer", "t", "--text-field", "body"]
    )
    assert flat.source.text_field == "body" and flat.inputs == ["a.jsonl"]
    with pytest.raises(ValueError, match=r"unknown config field\(s\): optim.lrr, bogus"):
        canonical_argv(PretrainConfig, ["--optim.lrr", "1", "--bogus"])


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_lr_schedule_warms_up_then_decays(schedule):
    f = lr_lambda(OptimConfig(warmup_steps=10, schedule=schedule), max_steps=100)
    warm = [f(s) for s in range(10)]
    assert warm == sorted(warm) and warm[0] > 0 and f(10) == pytest.approx(1.0)
    tail = [f(s) for s in range(10, 101)]
    if schedule == "constant":
        assert set(tail) == {1.0}
    else:
        assert tail == sorted(tail, reverse=True) and f(100) == pytest.approx(0.0, abs=1e-12)


# --- which fields a resumed run may change (field metadata, config.resumable) ------------------

RESUMABLE_BEFORE = (
    "run_dir", "max_steps", "epochs", "stop_at_step", "log_every", "progress", "stop_signals",
    "stop_on_nonfinite", "checkpoint", "deepspeed.timeout_s", "data.num_workers", "data.workers",
    "refresher", "refresher_device", "refresh.device", "refresh.poll_s", "refresh.progress",
    "refresh.idle_timeout_s", "refresh.max_versions", "refresh.run_dir",
    "negatives.mine_first_timeout_s", "negatives.stale_after", "negatives.on_stale",
    "refresh.parent_pid", "eval",
    "negatives.wait_report_s",  # issue 46: how often the wait for mined negatives reports
    "refresh.threads",  # issue 46: the refresher's CPU threads, not what the steps compute
    "refresh.wait_report_s",  # issue 46: how often a waiting refresher reports
)  # fmt: skip
"""The list the shared training loop held before each field declared it (issue 29), and the
fields added since that a resumed run may change."""


def test_resumable_fields_are_the_list_the_loop_held():
    from retromae_ds.base.config import flat_defaults, resume_may_change
    from retromae_ds.finetune import FinetuneConfig
    from retromae_ds.pretrain import PretrainConfig

    for cls in (PretrainConfig, FinetuneConfig):
        keys = set(flat_defaults(cls)) | {"data.shards"}
        present = {
            name for name in RESUMABLE_BEFORE
            if name in keys or any(k.startswith(name + ".") for k in keys)
        }  # fmt: skip
        assert resume_may_change(cls) == present, cls.__name__


def test_resume_accepts_a_field_added_since_at_its_default(tmp_path):
    """A run saved before a field existed resumes while the field holds its default (the old
    run's meaning), and refuses once it is set to anything else."""
    from retromae_ds.base.config import to_dict
    from retromae_ds.pretrain import DataConfig, PretrainConfig
    from retromae_ds.training.loop import check_resume_config

    cfg = PretrainConfig(data=DataConfig(shards="s"), max_steps=4)
    saved = to_dict(cfg)
    del saved["optim"]["decoder_lr_scale"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved))
    check_resume_config(cfg, path)
    cfg.optim.decoder_lr_scale = 2.0
    with pytest.raises(ValueError, match=r"optim.decoder_lr_scale \(None -> 2.0\)"):
        check_resume_config(cfg, path)
    cfg.optim.decoder_lr_scale = 1.0
    cfg.max_steps = 8  # resumable
    cfg.optim.lr = 3e-4
    with pytest.raises(ValueError, match=r"optim.lr") as err:
        check_resume_config(cfg, path)
    assert "max_steps" not in str(err.value)


def test_a_renamed_field_is_read_under_its_old_name_with_one_note(tmp_path, capsys):
    """``masking.decoder_ratio`` is now ``model.objective.decoder_ratio`` (the model reads it,
    not the collator): the old name works in a file and on the command line, noted once per
    process; both names at once is an error naming both; a run saved with the old name
    resumes, and refuses a different value under the new one."""
    import retromae_ds.base.config as config
    from retromae_ds.base.config import to_dict
    from retromae_ds.base.options import build_config
    from retromae_ds.pretrain import PretrainConfig
    from retromae_ds.training.loop import check_resume_config

    config._NOTED.clear()
    old = {"data": {"shards": "s"}, "max_steps": 3, "masking": {"decoder_ratio": 0.7}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    cfg = build_config(PretrainConfig, path, [])
    assert cfg.model.objective.decoder_ratio == 0.7
    assert "masking.decoder_ratio is now model.objective.decoder_ratio" in capsys.readouterr().err
    cli = build_config(PretrainConfig, None, ["--data.shards", "s", "--max_steps", "3",
                                           "--masking.decoder_ratio", "0.9"])  # fmt: skip
    assert cli.model.objective.decoder_ratio == 0.9
    assert capsys.readouterr().err == ""  # noted once per process
    over = build_config(PretrainConfig, path, ["--model.objective.decoder_ratio", "0.6"])
    assert over.model.objective.decoder_ratio == 0.6  # the command line wins over the file
    with pytest.raises(
        ValueError, match=r"masking.decoder_ratio and model.objective.decoder_ratio"
    ):
        config.from_dict(
            PretrainConfig,
            {**old, "model": {"objective": {"decoder_ratio": 0.5}}},
        )

    saved = to_dict(cfg)
    del saved["model"]["objective"]["decoder_ratio"]
    saved["masking"]["decoder_ratio"] = 0.7
    del saved["optim"]["decoder_lr_scale"]
    run_config = tmp_path / "config.json"
    run_config.write_text(json.dumps(saved))
    check_resume_config(cfg, run_config)
    with pytest.raises(ValueError, match=r"model.objective.decoder_ratio \(0.7 -> 0.5\)"):
        cfg.model.objective.decoder_ratio = 0.5
        check_resume_config(cfg, run_config)


def test_mining_settings_have_their_own_section_and_the_old_names_still_work(tmp_path, capsys):
    """Issue 29: the mining settings are ``MiningConfig`` (``refresh.mining.*`` for the trainer,
    ``mining.*`` for the refresher) and ``refresh.device`` is the refresher's one device
    (``refresher_device`` overrode it). The old names work on the command line, in a file
    (an old trainer's refresh_config.json) and in a saved run's config (which holds both
    device fields: the old one is what ran); the trainer refuses a refresh.run_dir that is
    not its own."""
    import retromae_ds.base.config as config
    from retromae_ds.base.config import to_dict
    from retromae_ds.base.options import build_config
    from retromae_ds.finetune import FinetuneConfig
    from retromae_ds.refresher.config import RefreshConfig
    from retromae_ds.training.loop import check_resume_config

    config._NOTED.clear()
    refresh = build_config(RefreshConfig, None, ["--top_k", "20", "--mining.num_negatives", "5"])
    assert (refresh.mining.top_k, refresh.mining.num_negatives) == (20, 5)
    assert "--top_k is now --mining.top_k" in capsys.readouterr().err
    old_file = tmp_path / "refresh_config.json"  # as an old trainer wrote it: flat
    old_file.write_text(json.dumps({"run_dir": "r", "skip_top": 2, "seed": 7, "device": "cpu"}))
    refresh = build_config(RefreshConfig, old_file, [])
    assert (refresh.mining.skip_top, refresh.mining.seed, refresh.device) == (2, 7, "cpu")

    need = ["--data.beir", "b", "--model.init", "m", "--run_dir", str(tmp_path / "run")]
    ft = build_config(FinetuneConfig, None, [*need, "--refresher_device", "cpu",
                                             "--refresh.top_k", "30"])  # fmt: skip
    assert (ft.refresh.device, ft.refresh.mining.top_k) == ("cpu", 30)
    err = capsys.readouterr().err
    assert "--refresher_device is now --refresh.device" in err
    assert "--refresh.top_k is now --refresh.mining.top_k" in err
    with pytest.raises(ValueError, match="refresh.run_dir .* is not this run's folder"):
        build_config(FinetuneConfig, None, [*need, "--refresh.run_dir", str(tmp_path / "x")])
    same = build_config(FinetuneConfig, None, [*need, "--refresh.run_dir", str(tmp_path / "run")])
    assert same.refresh.run_dir == str(tmp_path / "run")  # the recipes used to write it
    with pytest.raises(ValueError, match="refresh.parent_pid is the trainer's"):
        build_config(FinetuneConfig, None, [*need, "--refresh.parent_pid", "12"])

    saved = to_dict(ft)  # an old run's config.json: both device fields, flat mining fields
    saved["refresher_device"] = "cpu"
    saved["refresh"]["device"] = "auto"
    saved["refresh"].update(saved["refresh"].pop("mining"))
    run_config = tmp_path / "config.json"
    run_config.write_text(json.dumps(saved))
    check_resume_config(ft, run_config)  # same settings under the new names: resumes
    with pytest.raises(ValueError, match=r"refresh.mining.top_k \(30 -> 40\)"):
        ft.refresh.mining.top_k = 40
        check_resume_config(ft, run_config)


def test_objective_decoder_ratio_is_a_share():
    from retromae_ds.modeling.objectives import ObjectiveConfig

    with pytest.raises(ValueError, match="objective.decoder_ratio"):
        ObjectiveConfig(decoder_ratio=-0.1)
    assert ObjectiveConfig(decoder_ratio=1.0).decoder_ratio == 1.0
