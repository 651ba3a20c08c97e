"""An unreadable negatives pointer (``negatives/CURRENT``): the reader names it, the trainer
keeps its version and says so once, the refresher recovers by publishing the next version."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from retromae_ds.components.layout import RunLayout
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff

from helpers_ance import ENV, load_current, write_synthetic_beir, write_tiny_encoder

BAD_POINTERS = {
    "garbage": "{not json",
    "list": "[1, 2, 3]",
    "missing_fields": json.dumps({"version": 1}),
    "bad_version": json.dumps({"version": "one", "step": 0, "path": "v1.arrow", "sha256": "x"}),
}


def _content(num_queries: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50, size=3).astype(np.int32) for _ in range(num_queries)]


@pytest.fixture(scope="module")
def bm25_run(tmp_path_factory, tokenizer_dir) -> tuple[Path, ance_data.TrainingSet]:
    """A run folder with prepared data and the BM25 version 0 (copied per test)."""
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    from helpers_ance import prepared_set  # the same prepared folder as the refresher tests

    base = tmp_path_factory.mktemp("bm25_run")
    run = base / "run"
    beir = write_synthetic_beir(base / "beir")
    ts = ance_data.load(prepared_set(run / "data", beir, tokenizer_dir))
    publish_bm25(
        RefreshConfig(mining=MiningConfig(num_negatives=3), progress=False),
        ts,
        RunLayout(run).negatives,
    )
    return run, ts


def _copy_run(bm25_run, tmp_path: Path) -> tuple[Path, ance_data.TrainingSet]:
    import shutil

    src, _ = bm25_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    return run, ance_data.load(run / "data")


# --------------------------------------------------------------------------- the reader
@pytest.mark.parametrize("kind", sorted(BAD_POINTERS))
def test_read_pointer_names_an_unreadable_pointer(tmp_path, kind):
    root = tmp_path / "negatives"
    handoff.publish(root, 0, _content(4, 0), step=0)
    (root / handoff.POINTER).write_text(BAD_POINTERS[kind])
    with pytest.raises(handoff.HandoffError, match="CURRENT") as info:
        handoff.read_pointer(root)
    assert isinstance(info.value, ValueError)
    assert str(root / handoff.POINTER) in str(info.value)
    # numbering goes on past the published versions
    assert handoff.next_version(root) == 1


def test_missing_pointer_is_still_none(tmp_path):
    assert handoff.read_pointer(tmp_path / "negatives") is None


# --------------------------------------------------------------------------- the trainer
class _Notes:
    """Collects what ``NegativesInUse`` reports (the trainer passes its ``note``)."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def test_trainer_keeps_its_version_when_the_pointer_is_corrupted(bm25_run, tmp_path):
    from retromae_ds.finetuning.negatives import NegativesInUse, load_negatives

    run, ts = _copy_run(bm25_run, tmp_path)
    root = RunLayout(run).negatives
    dist = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    in_use = NegativesInUse(root, ts, load_negatives(root, 0, ts), dist)
    trainer = _Notes()

    (root / handoff.POINTER).write_text("{garbage")
    in_use.maybe_swap(10, trainer.note)
    in_use.maybe_swap(20, trainer.note)
    assert in_use.current.version == 0
    assert len(trainer.notes) == 1, trainer.notes
    assert "CURRENT" in trainer.notes[0] and "JSON" in trainer.notes[0]

    # a different problem is noted once more
    (root / handoff.POINTER).write_text("[]")
    in_use.maybe_swap(30, trainer.note)
    in_use.maybe_swap(40, trainer.note)
    assert in_use.current.version == 0 and len(trainer.notes) == 2

    # a pointer naming a version that does not exist: kept, noted once
    (root / handoff.POINTER).write_text(
        json.dumps({"version": 7, "step": 5, "path": "v7.arrow", "sha256": "0" * 64})
    )
    in_use.maybe_swap(50, trainer.note)
    in_use.maybe_swap(60, trainer.note)
    assert in_use.current.version == 0 and len(trainer.notes) == 3
    assert "v7" in trainer.notes[-1]

    # the refresher, seeing a garbage pointer, publishes the version after the published ones
    # (replacing the pointer): picked up
    (root / handoff.POINTER).write_text("{garbage")
    assert handoff.next_version(root) == 1
    handoff.publish(root, 1, _content(ts.num_queries, 1), step=50, meta={"data": ts.fingerprint()})
    in_use.maybe_swap(70, trainer.note)
    assert (in_use.current.version, in_use.current.step) == (1, 50)
    assert "negatives v1" in trainer.notes[-1]


def test_start_up_falls_back_past_a_bad_pointer_or_fails_naming_it(bm25_run, tmp_path):
    from retromae_ds.finetuning.negatives import start_version

    run, ts = _copy_run(bm25_run, tmp_path)
    root = RunLayout(run).negatives
    neg, problem = start_version(root, ts)
    assert (neg.version, problem) == (0, None)

    (root / handoff.POINTER).write_text("not json")
    neg, problem = start_version(root, ts)
    assert neg.version == 0 and "CURRENT" in problem and "v0" in problem

    # no usable version at all: no version, a problem naming the pointer
    handoff.data_file(root, 0).write_bytes(b"corrupt")
    neg, problem = start_version(root, ts)
    assert neg is None and str(root / handoff.POINTER) in problem


def test_waiting_for_mined_negatives_reports_a_bad_pointer_once(tmp_path):
    from retromae_ds.finetuning.negatives import wait_for_mined

    root = tmp_path / "negatives"
    handoff.publish(root, 0, _content(4, 0), step=0)
    (root / handoff.POINTER).write_text("{garbage")
    reports: list[str] = []
    with pytest.raises(TimeoutError, match="CURRENT"):
        wait_for_mined(root, 0, None, 1.5, tmp_path / "refresh.log", reports.append)
    problems = [r for r in reports if "CURRENT" in r]
    assert len(problems) == 1, reports
    assert [r for r in reports if "waiting for negatives mined" in r], reports  # what it awaits


# --------------------------------------------------------------------------- the refresher
@pytest.mark.slow
def test_refresher_recovers_from_a_corrupted_pointer(bm25_run, tmp_path, tokenizer_dir):
    from helpers_ance import fake_checkpoint, refresh_cmd

    run, ts = _copy_run(bm25_run, tmp_path)
    root = RunLayout(run).negatives
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    fake_checkpoint(run, 5, encoder)
    (root / handoff.POINTER).write_text("{garbage")

    done = subprocess.run(
        refresh_cmd(run, "--max_versions", "1", "--idle_timeout_s", "60"),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(root / handoff.POINTER) in done.stderr
    pointer = handoff.read_pointer(root)
    assert pointer["version"] == 1
    neg = load_current(root)
    assert (neg.version, neg.step, neg.manifest["source"]) == (1, 5, "model")
    assert neg.manifest["data"] == ts.fingerprint()
    assert handoff.published_versions(root) == [0, 1]


def test_a_meta_key_that_would_overwrite_the_manifests_own_is_refused(tmp_path):
    negatives = [np.array([1, 2], dtype=np.int32)]
    with pytest.raises(ValueError, match=r"negatives v0: meta may not set file, sha256"):
        handoff.publish(tmp_path, 0, negatives, step=0, meta={"file": "x", "sha256": "y"})
    assert not any(tmp_path.iterdir())  # nothing written
