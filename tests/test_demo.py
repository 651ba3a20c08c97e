"""The README's main job (`retromae-ds demo`) and the small CLI commands, run for real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from retromae_ds.cli import parse_size
from retromae_ds.data.builtin_corpus import iter_documents

REPO = Path(__file__).resolve().parents[1]


def test_builtin_corpus_is_deterministic_and_has_unique_ids():
    first = list(iter_documents(max_docs=500))
    assert first == list(iter_documents(max_docs=500))
    assert len({d["_id"] for d in first}) == len(first) == 500
    assert all(d["text"].strip() for d in first)


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "retromae_ds.cli",
            "demo",
            "--out",
            str(tmp_path),
            "--max-docs",
            "1500",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "preprocess: 1,500 documents" in result.stdout
    assert "sha256 verified" in result.stdout
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["counts"]["documents"] == 1500 and len(manifest["shards"]) >= 2
    inspect = subprocess.run(
        [sys.executable, "-m", "retromae_ds.cli", "inspect", str(tmp_path / "shards"), "--verify"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["samples"] == manifest["counts"]["rows"]


def test_parse_size():
    assert parse_size("64MB") == 64 * 2**20
    assert parse_size("512KiB") == 512 * 2**10
    assert parse_size("1g") == 2**30
    assert parse_size("1000") == 1000
