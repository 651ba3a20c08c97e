"""Packaging: the ds_configs shipped inside the package match the top-level ones, and a wheel
built from the repository works from a folder with no ds_configs (a non-editable install)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from retromae_ds.components.engine import build_ds_config, resolve_ds_config, shipped_ds_configs

REPO = Path(__file__).resolve().parents[1]


def test_shipped_ds_configs_are_byte_identical_to_the_top_level_ones():
    top = sorted(p.name for p in (REPO / "ds_configs").iterdir() if p.is_file())
    inside = sorted(p.name for p in (REPO / "retromae_ds" / "ds_configs").iterdir() if p.is_file())
    assert top == inside and "zero2.json" in top
    for name in top:
        assert (REPO / "ds_configs" / name).read_bytes() == (
            REPO / "retromae_ds" / "ds_configs" / name
        ).read_bytes(), f"ds_configs/{name} and retromae_ds/ds_configs/{name} differ"
    assert shipped_ds_configs() == [n for n in top if n.endswith(".json")]


def test_ds_config_names_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = REPO / "retromae_ds" / "ds_configs" / "zero3.json"
    for name in ("ds_configs/zero3.json", "zero3.json"):
        assert Path(str(resolve_ds_config(name))).resolve() == shipped.resolve()
    own = tmp_path / "ds_configs" / "zero3.json"  # a user's own file wins over the shipped one
    own.parent.mkdir()
    own.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    ds = build_ds_config(
        ["ds_configs/zero3.json"],
        micro_batch=2,
        grad_accum=1,
        world_size=1,
        grad_clip=1,
        cuda=False,
    )
    assert ds["zero_optimization"] == {"stage": 1}
    for name in ("nope.json", "elsewhere/zero2.json"):
        with pytest.raises(FileNotFoundError, match=rf"{name}.*zero2\.json"):
            resolve_ds_config(name)


@pytest.mark.slow
def test_wheel_ships_the_ds_configs_and_works_outside_the_repository(tmp_path):
    for module in ("setuptools", "wheel"):
        pytest.importorskip(module, reason=f"building the wheel offline needs {module}")
    # build from a copy without what .gitignore lists, so that setuptools' build/ folder
    # (stale files included) and egg-info never come from or land in the checkout
    src = tmp_path / "src"
    ignored = (".git", "build", "dist", "runs", "*.egg-info", "__pycache__", ".*_cache", "*.tmp")
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*ignored, ".hypothesis"))
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--quiet", ".", "-w", str(wheels)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("retromae_ds-*.whl")
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        assert "retromae_ds/ds_configs/zero2.json" in zf.namelist()
        # the recipes' commands reach retromae-ds through an entry point, not an import
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(entry_points).decode()
        assert "[retromae_ds.commands]\ndemo = retromae_recipes.commands:DEMO_ENTRY" in text, text
        assert "retromae_recipes/commands.py" in zf.namelist()
        # no top-level package with a generic name (torchtune, for one, installs "recipes")
        assert not any(n.startswith("recipes/") for n in zf.namelist())
        zf.extractall(unpacked)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (
        "import json, retromae_ds\n"
        "from retromae_ds.components.engine import build_ds_config\n"
        "ds = build_ds_config(['ds_configs/zero2.json', 'ds_configs/fp32.json'], micro_batch=2,"
        " grad_accum=1, world_size=1, grad_clip=1.0, cuda=False)\n"
        "print(json.dumps({'file': retromae_ds.__file__, 'ds': ds}))\n"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(unpacked), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve().is_relative_to(unpacked.resolve())
    assert result["ds"]["zero_optimization"]["stage"] == 2
    assert result["ds"]["bf16"] == {"enabled": False} and result["ds"]["train_batch_size"] == 2
