"""Objectives are one registry of ``Objective`` classes: the trainer, the collator and the
checkpoints read what the class declares, nothing in the library branches on an objective's
name, and a package outside this one adds an objective through the
``retromae_ds.objectives`` entry point and trains it (two ranks, ZeRO-2, exact resume)
without touching the library."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from helpers_plugins import install_package
from helpers_train import metrics, pretrain
from helpers_train import synthetic_shards as make_shards
from safetensors.torch import load_file

from retromae_ds.components.checkpoint import read_marker
from retromae_ds.modeling.objective import OBJECTIVES, Objective
from retromae_ds.modeling.objectives import ObjectiveConfig

REPO = Path(__file__).resolve().parents[1]

PROBE = """
    import torch
    from torch import nn

    from retromae_ds.modeling.objective import Objective


    class CLSProbe(Objective):
        '''MLM plus a linear probe that must read each row's length from its [CLS] vector.'''

        metrics = ("probe_loss",)

        def build(self, model):
            model.probe = nn.Linear(model.encoder.config.hidden_size, 1)

        def terms(self, model, hidden_BLH, batch, packing):
            target = batch["attention_mask"].sum(1).float()[:, None] / 64.0
            loss = torch.nn.functional.mse_loss(model.probe(hidden_BLH[:, 0]), target)
            return [0.5 * loss], {"probe_loss": loss.detach()}
"""


@pytest.fixture(scope="module")
def synthetic_shards(tmp_path_factory, tokenizer_dir) -> Path:
    return make_shards(tmp_path_factory.mktemp("objective_shards"), tokenizer_dir, 200, seed=5)


def test_the_library_objectives_are_registered_classes():
    assert OBJECTIVES.names()[:4] == ("retromae", "dupmae", "seed", "mlm")
    for name in OBJECTIVES.names():
        kind = OBJECTIVES[name]
        assert issubclass(kind, Objective) and set(kind.metrics).isdisjoint({"loss", "mlm_loss"})
    assert not OBJECTIVES["mlm"].decoder_inputs and OBJECTIVES["retromae"].decoder_inputs
    with pytest.raises(ValueError, match=r"objective.name must be one of retromae, dupmae"):
        ObjectiveConfig(name="bert")


def test_nothing_in_the_library_branches_on_an_objectives_name():
    """What an objective is lives in its class: no comparison of ``objective.name`` (or of
    an objective's name literal) anywhere in the library. (The recipes' reports compare
    objectives by name: that is what they are for.)"""
    pattern = re.compile(
        r"objective\.name\s*(==|!=|\bin\b|\bnot in\b)|"
        r"(==|!=)\s*\"(retromae|dupmae|seed|mlm|bowdpr)\"|\bTWO_STREAM\b"
    )
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in sorted((REPO / "retromae_ds").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def test_a_packaged_objective_trains_on_two_ranks_and_resumes_exactly(tmp_path, synthetic_shards):
    """``--model.objective.name cls_probe`` names an objective only an installed package
    (a dist-info entry point on PYTHONPATH) defines: it trains under ZeRO-2 on two gloo
    ranks, logs its own figure, checkpoints its probe beside the encoder, records its name,
    and a run stopped at step 2 and resumed ends with the losses of an uninterrupted one."""
    site = install_package(
        tmp_path / "site",
        "extra_objective",
        PROBE,
        {"retromae_ds.objectives": {"cls_probe": "extra_objective:CLSProbe"}},
    )
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    common = ("--model.objective.name", "cls_probe", "--log_every", "1", "--deepspeed.config",
              '["ds_configs/zero2.json", "ds_configs/fp32.json"]')  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    pretrain(straight, synthetic_shards, *common, "--max_steps", "4", ranks=2, env=env)
    pretrain(resumed, synthetic_shards, *common, "--max_steps", "4", "--stop_at_step", "2",
             ranks=2, env=env)  # fmt: skip
    pretrain(resumed, synthetic_shards, *common, "--max_steps", "4", ranks=2, env=env)

    rows = [m for m in metrics(straight) if "loss" in m]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert all("probe_loss" in m and "decoder_loss" not in m for m in rows)
    resumed_rows = {m["step"]: m for m in metrics(resumed) if "loss" in m}
    assert [resumed_rows[m["step"]]["loss"] for m in rows] == [m["loss"] for m in rows]

    last = straight / "checkpoints" / "step_00000004"
    assert read_marker(last)["objective"] == "cls_probe"
    state = torch.load(last / "mp_rank_00_model_states.pt", weights_only=False)
    module = state["module"]
    assert {"probe.weight", "probe.bias"} <= set(module)
    assert load_file(str(last / "encoder" / "model.safetensors"))  # the encoder is exported

    # without the package the name is unknown: one line naming the option and the names
    done = pretrain(tmp_path / "bare", synthetic_shards, *common, "--max_steps", "1", check=False)
    assert done.returncode == 2
    assert "objective.name must be one of retromae, dupmae, seed, mlm" in done.stderr


def test_every_objectives_poolings_are_registered_poolings():
    from retromae_ds.hf.pooling import pooling_names

    for name in OBJECTIVES.names():
        assert set(OBJECTIVES[name].poolings) <= set(pooling_names()), name
