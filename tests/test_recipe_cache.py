"""A recipe's cache never answers for other settings: a finished run rerun with another
config, or an output folder rerun with other result-making options, fails naming the
fields, and writes nothing (the teacher study once reported a 128-token teacher's rows
under a 256-token teacher's heading)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from retromae_ds.base.config import to_dict
from retromae_ds.components.layout import RunLayout
from retromae_ds.finetune import DualModelConfig, FinetuneConfig, FinetuneDataConfig
from retromae_recipes.common import check_settings, run_finetune


def _finished(tmp_path) -> FinetuneConfig:
    cfg = FinetuneConfig(
        run_dir=str(tmp_path / "run"),
        max_steps=5,
        model=DualModelConfig(init="enc"),
        data=FinetuneDataConfig(beir="beir"),
    )
    layout = RunLayout(cfg.run_dir)
    layout.root.mkdir(parents=True)
    layout.finished.write_text("{}")
    (tmp_path / "run_config.json").write_text(json.dumps(to_dict(cfg)))
    return cfg


def test_a_finished_run_is_kept_for_its_own_config(tmp_path):
    cfg = _finished(tmp_path)
    assert run_finetune(cfg) == RunLayout(cfg.run_dir).root  # nothing launched: kept
    faster = replace(cfg, refresh=replace(cfg.refresh, threads=4), progress=not cfg.progress)
    assert run_finetune(faster) == RunLayout(cfg.run_dir).root  # speed only: still kept


def test_a_finished_run_is_refused_for_another_config(tmp_path):
    cfg = _finished(tmp_path)
    other = replace(cfg, max_steps=9, data=replace(cfg.data, p_max_len=128))
    with pytest.raises(ValueError) as e:
        run_finetune(other)
    msg = str(e.value)
    assert "run_config.json" in msg and "max_steps: 5 -> 9" in msg
    assert "data.p_max_len: 256 -> 128" in msg and str(tmp_path / "run") in msg
    assert json.loads((tmp_path / "run_config.json").read_text())["max_steps"] == 5


def test_an_output_folder_keeps_its_settings_but_for_the_free_ones(tmp_path):
    settings = {"seeds": [0], "steps": 100, "ce": {"len": 256}}
    check_settings(tmp_path, settings, free=("seeds",))
    saved = json.loads((tmp_path / "recipe_settings.json").read_text())
    assert saved == {"steps": 100, "ce": {"len": 256}}
    check_settings(tmp_path, {**settings, "seeds": [0, 1, 2]}, free=("seeds",))
    with pytest.raises(ValueError, match=r"ce\.len: 256 -> 128"):
        check_settings(tmp_path, {**settings, "ce": {"len": 128}}, free=("seeds",))
    with pytest.raises(ValueError, match=r"extra: None -> 1"):
        check_settings(tmp_path, {**settings, "extra": 1}, free=("seeds",))
    assert json.loads((tmp_path / "recipe_settings.json").read_text()) == saved
