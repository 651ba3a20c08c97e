"""Config plumbing: file + command-line overrides into nested dataclasses, and the DeepSpeed
dict that the engine builds from the training config (no process group needed)."""

from __future__ import annotations

import json

import pytest

from retromae_ds.config import build_config, parse_overrides
from retromae_ds.engine import build_ds_config
from retromae_ds.train import TrainConfig, lr_lambda


def test_overrides_reach_nested_fields_with_types(tmp_path):
    (tmp_path / "c.yaml").write_text("data: {shards: s}\nmax_steps: 5\noptim: {lr: 0.001}\n")
    cfg = build_config(
        TrainConfig,
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
        (["--max_steps"], "needs a value"),
    ],
)
def test_bad_overrides_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        build_config(TrainConfig, None, ["--data.shards", "s", "--max_steps", "1", *args])


def test_required_fields():
    with pytest.raises(ValueError, match="data.shards is required"):
        build_config(TrainConfig, None, ["--max_steps", "1"])
    with pytest.raises(ValueError, match="set max_steps or epochs"):
        build_config(TrainConfig, None, ["--data.shards", "s"])
    assert parse_overrides(["--a-b.c", "1"]) == {"a_b.c": "1"}


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


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_lr_schedule_warms_up_then_decays(schedule):
    from retromae_ds.train import OptimConfig

    f = lr_lambda(OptimConfig(warmup_steps=10, schedule=schedule), max_steps=100)
    warm = [f(s) for s in range(10)]
    assert warm == sorted(warm) and warm[0] > 0 and f(10) == pytest.approx(1.0)
    tail = [f(s) for s in range(10, 101)]
    if schedule == "constant":
        assert set(tail) == {1.0}
    else:
        assert tail == sorted(tail, reverse=True) and f(100) == pytest.approx(0.0, abs=1e-12)
