"""The ANCE refresher guarded (issue 27): it dies with its trainer, one refresher per
negatives folder, a dead or silent refresher is reported by the trainer, it stops on a
finished run and refuses another run's data, ``--progress false`` shows no bars, and a full
disk under ``negatives/`` is one clear error that loses nothing once space is freed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_disk import fill, small_disk

from retromae_ds.base import faults
from retromae_ds.components.layout import RunLayout
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff

from helpers_ance import ENV, REPO, write_synthetic_beir, write_tiny_encoder
from helpers_proc import parent_pid, processes

FINETUNE_COMMON = [
    "--progress", "false",
    "--data.q_max_len", "16", "--data.p_max_len", "32",
    "--micro_batch_size", "4", "--negatives.n_hard", "1", "--refresh.mining.num_negatives", "3",
    "--refresh.mining.top_k", "20", "--refresh.batch_size", "16", "--refresh.poll_s", "0.2",
    "--log_every", "1", "--optim.lr", "1e-3", "--optim.warmup_steps", "1",
    "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]',
]  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("guard_assets")
    return SimpleNamespace(
        beir=write_synthetic_beir(base / "beir", num_docs=90, num_queries=28),
        encoder=write_tiny_encoder(base / "encoder", tokenizer_dir),
    )


def _finetune_cmd(run: Path, assets: SimpleNamespace, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "retromae_ds.finetune", "--run_dir", str(run),
        "--data.beir", str(assets.beir), "--model.init", str(assets.encoder),
        *FINETUNE_COMMON, *extra,
    ]  # fmt: skip


def _refresh_cmd(run: Path, *extra: str) -> list[str]:
    """``retromae-ds refresh`` as a user types it (through the command-line entry point)."""
    return [
        sys.executable, "-c", "import sys; from retromae_ds.cli import main; sys.exit(main())",
        "refresh", "--run_dir", str(run), "--mining.num_negatives", "3", "--top_k", "20",
        "--batch_size", "16", "--poll_s", "0.2", "--progress", "false", "--device", "cpu",
        *extra,
    ]  # fmt: skip


# --------------------------------------------------------------------------- processes
def _state(pid: int) -> str | None:
    """The process state letter (``Z`` zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _refresher_child(trainer: subprocess.Popen, timeout: float) -> int:
    """The pid of the local refresher the trainer started (its child running the module)."""
    trainer_pid = trainer.pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if trainer.poll() is not None:
            raise AssertionError(f"the trainer exited ({trainer.returncode}) first")
        for pid, read in processes("stat", "cmdline"):
            if parent_pid(read["stat"]) == trainer_pid and (
                b"retromae_ds.refresh" in read["cmdline"]
            ):
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no local refresher started by pid {trainer_pid} within {timeout} s")


def _kill(pid: int | None) -> None:
    """SIGKILL a process this test started (directly or through its trainer), if alive."""
    if pid is not None and _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _one_line_error(stderr: str, prog: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in lines if line.startswith(f"{prog}: error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- defect 5
@pytest.mark.slow
def test_the_local_refresher_exits_when_its_trainer_is_killed(tmp_path, assets):
    run = tmp_path / "run"
    trainer = subprocess.Popen(
        _finetune_cmd(
            run, assets, "--max_steps", "60", "--refresher", "local", "--refresh.device", "cpu"
        ),  # fmt: skip
        cwd=REPO,
        env={**ENV, **faults.env(sleep_after_step_s=0.5)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    refresher = None
    try:
        refresher = _refresher_child(trainer, timeout=120)
        time.sleep(2.0)  # the refresher is up (imports done, polling)
        assert _alive(refresher)
        trainer.kill()
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(refresher) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(refresher), (
            f"refresher pid {refresher} still alive 10 s after its trainer was killed"
        )
    finally:
        _kill(refresher)
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


@pytest.fixture(scope="module")
def bm25_run(tmp_path_factory, tokenizer_dir, assets) -> Path:
    """A run folder with prepared data and the BM25 version 0 (copied per test)."""
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    from helpers_ance import prepared_set

    run = tmp_path_factory.mktemp("guard_bm25") / "run"
    ts = ance_data.load(prepared_set(run / "data", assets.beir, tokenizer_dir))
    publish_bm25(
        RefreshConfig(mining=MiningConfig(num_negatives=3), progress=False),
        ts,
        RunLayout(run).negatives,
    )
    return run


def _copy(bm25_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(bm25_run, run)
    return run


@pytest.mark.slow
def test_a_second_refresher_on_one_negatives_folder_is_refused(tmp_path, bm25_run):
    """The first refresher holds ``negatives/`` (a lock file naming it); a second one fails at
    once, in one line naming the holder."""
    run = _copy(bm25_run, tmp_path)
    first = subprocess.Popen(
        _refresh_cmd(run, "--idle_timeout_s", "120"),
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lock = RunLayout(run).negatives / ".refresher.lock"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and first.poll() is None:
            if lock.is_file() and str(first.pid) in lock.read_text():
                break
            time.sleep(0.2)
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert lock.is_file() and str(first.pid) in lock.read_text(), "no lock naming the holder"

        second = subprocess.run(
            _refresh_cmd(run, "--idle_timeout_s", "5"),
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode != 0, second.stderr[-3000:]
        line = _one_line_error(second.stderr, "retromae-ds refresh")
        assert f"pid {first.pid}" in line and str(RunLayout(run).negatives) in line, line
        assert first.poll() is None  # the holder is untouched
    finally:
        _kill(first.pid)
        first.wait()


@pytest.mark.slow
def test_a_refresher_exits_when_the_process_it_serves_is_gone(tmp_path, bm25_run):
    """The portable fallback of the parent-death signal: ``--parent_pid`` names the trainer;
    once it is gone the refresher stops, saying so."""
    run = _copy(bm25_run, tmp_path)
    parent = subprocess.Popen(["sleep", "300"])
    refresher = subprocess.Popen(
        _refresh_cmd(run, "--parent_pid", str(parent.pid), "--idle_timeout_s", "120"),
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(8.0)  # up and polling
        assert refresher.poll() is None, refresher.stderr.read()[-3000:]
        parent.kill()
        parent.wait()
        refresher.wait(timeout=15)
        stderr = refresher.stderr.read()
        assert refresher.returncode == 0, stderr[-3000:]
        assert f"pid {parent.pid}" in stderr.strip().splitlines()[-1], stderr[-3000:]
    finally:
        _kill(refresher.pid)
        _kill(parent.pid)
        refresher.wait()


# --------------------------------------------------------------------------- defect 7
@pytest.mark.slow
def test_refresh_on_a_finished_run_mines_what_is_new_then_exits(tmp_path, bm25_run, assets):
    from helpers_ance import fake_checkpoint

    run = _copy(bm25_run, tmp_path)
    layout = RunLayout(run)
    fake_checkpoint(run, 5, assets.encoder)
    layout.finished.write_text(json.dumps({"step": 5}))
    old = time.time() - 3600  # finished an hour before the refresher starts
    os.utime(layout.finished, (old, old))

    # a checkpoint newer than the negatives: mined once, then the refresher stops by itself
    first = subprocess.run(
        _refresh_cmd(run), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert handoff.read_pointer(layout.negatives)["version"] == 1
    assert "finished" in first.stderr.splitlines()[-1], first.stderr[-2000:]

    # nothing newer: exits at once saying so, publishing nothing
    t0 = time.monotonic()
    again = subprocess.run(
        _refresh_cmd(run), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr[-3000:]
    last = again.stderr.strip().splitlines()[-1]
    assert "finished" in last and "v1" in last and str(layout.finished) in last, last
    assert "encoding" not in again.stderr
    assert handoff.published_versions(layout.negatives) == [0, 1]
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_refresh_refuses_a_data_folder_that_is_not_the_runs(
    tmp_path, bm25_run, assets, tokenizer_dir
):
    from helpers_ance import fake_checkpoint, prepared_set

    run = _copy(bm25_run, tmp_path)
    fake_checkpoint(run, 5, assets.encoder)
    other_beir = write_synthetic_beir(tmp_path / "other_beir", num_docs=60, num_queries=18)
    other = prepared_set(tmp_path / "other_data", other_beir, tokenizer_dir)

    done = subprocess.run(
        _refresh_cmd(run, "--data_dir", str(other), "--max_versions", "1",
                     "--idle_timeout_s", "20"),  # fmt: skip
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    line = _one_line_error(done.stderr, "retromae-ds refresh")
    assert str(other) in line and "negatives" in line, line
    assert handoff.published_versions(RunLayout(run).negatives) == [0]


# --------------------------------------------------------------------------- defect 6
@pytest.fixture(scope="module")
def refresher_killed(tmp_path_factory, assets) -> SimpleNamespace:
    """A quiet run (``--progress false``) whose local refresher is killed once it is up; the
    trainer trains on to the end."""
    run = tmp_path_factory.mktemp("guard_killed") / "run"
    trainer = subprocess.Popen(
        _finetune_cmd(
            run,
            assets,
            "--max_steps",
            "10",
            "--refresher",
            "local",
            "--refresh.device",
            "cpu",
            "--negatives.refresh_every",
            "2",
        ),  # fmt: skip
        cwd=REPO,
        env={**ENV, **faults.env(sleep_after_step_s=0.5)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    refresher = None
    try:
        refresher = _refresher_child(trainer, timeout=120)
        time.sleep(1.0)
        os.kill(refresher, signal.SIGKILL)
        stdout, stderr = trainer.communicate(timeout=300)
    finally:
        _kill(refresher)
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
    return SimpleNamespace(run=run, rc=trainer.returncode, stderr=stderr, refresher=refresher)


@pytest.mark.slow
def test_the_trainer_warns_once_when_its_refresher_dies(refresher_killed):
    r = refresher_killed
    assert r.rc == 0, r.stderr[-3000:]
    warnings = [line for line in r.stderr.splitlines() if "refresher" in line and "exited" in line]
    assert len(warnings) == 1, r.stderr[-3000:]
    assert "refresher.log" in warnings[0] and "v0" in warnings[0], warnings
    rows = _metrics(r.run)
    assert [row["step"] for row in rows] == list(range(1, 11))
    assert rows[-1]["refresher_alive"] is False, rows[-1]


@pytest.mark.slow
def test_progress_false_shows_no_progress_bars(refresher_killed):
    r = refresher_killed
    assert r.rc == 0, r.stderr[-3000:]
    assert "\r" not in r.stderr and "it/s]" not in r.stderr, r.stderr[:2000]


class _Notes:
    """Collects what ``NegativesInUse`` reports (the trainer passes its ``note``)."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def test_stale_negatives_are_reported_once_until_a_new_version_comes(bm25_run, tmp_path):
    """``negatives.stale_after`` = 2 checks of ``refresh_every`` 5: warned once at step 10,
    again only after a new version went stale in its turn; ``stop`` hands the warning back
    for the trainer to stop on."""
    import numpy as np

    from retromae_ds.finetuning.negatives import NegativesInUse, load_negatives

    run = _copy(bm25_run, tmp_path)
    root = RunLayout(run).negatives
    ts = ance_data.load(run / "data")
    dist = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    in_use = NegativesInUse(root, ts, load_negatives(root, 0, ts), dist, stale_after_steps=10)
    trainer = _Notes()
    alarms = [in_use.maybe_swap(step, trainer.note) for step in (5, 10, 15, 20)]
    stale = [n for n in trainer.notes if "stale" in n]
    assert len(stale) == 1 and "10 steps" in stale[0] and "v0" in stale[0], trainer.notes
    assert alarms[0] is None and alarms[2:] == [None, None]
    assert alarms[1].removeprefix("finetune: ") in stale[0]

    rng = np.random.default_rng(0)
    content = [rng.integers(0, 50, size=3).astype(np.int32) for _ in range(ts.num_queries)]
    handoff.publish(root, 1, content, step=20, meta={"data": ts.fingerprint()})
    assert in_use.maybe_swap(25, trainer.note) is None and in_use.current.version == 1
    assert in_use.maybe_swap(30, trainer.note) is None
    assert in_use.maybe_swap(35, trainer.note) is not None  # 10 steps after the swap at 25
    assert len([n for n in trainer.notes if "stale" in n]) == 2


# --------------------------------------------------------------------------- full disk
@pytest.mark.slow
def test_a_full_disk_under_negatives_fails_the_refresher_clearly_and_loses_nothing(
    tmp_path, assets
):
    """``negatives/`` on a small tmpfs, filled once the trainer published v0: the local
    refresher's first write fails naming the path and the space left, no partial version is
    visible, and the trainer (``on_stale stop``) saves a checkpoint and fails in one line.
    With the space back, the resumed run's refresher publishes and training ends, each step
    logged once."""
    with small_disk("8m") as disk:
        run = tmp_path / "run"
        run.mkdir()
        (run / "negatives").symlink_to(disk)
        root = RunLayout(run).negatives
        cmd = _finetune_cmd(
            run, assets, "--max_steps", "24", "--refresher", "local", "--refresh.device", "cpu",
            "--negatives.refresh_every", "2", "--checkpoint.every_steps", "2",
            "--negatives.on_stale", "stop",
        )  # fmt: skip
        trainer = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**ENV, **faults.env(sleep_after_step_s=0.7)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        ballast = None
        try:
            deadline = time.monotonic() + 120
            while not (root / handoff.POINTER).is_file() and time.monotonic() < deadline:
                if trainer.poll() is not None:
                    break
                time.sleep(0.05)
            assert (root / handoff.POINTER).is_file(), "the trainer published no BM25 version"
            ballast = fill(disk, leave=0)
            _, stderr = trainer.communicate(timeout=300)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.communicate()
        log = (run / "refresher.log").read_text()
        # the refresher: one clear error naming the path and the space, no endless re-encoding
        errors = [line for line in log.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
        assert str(disk) in errors[0] or str(root) in errors[0], errors
        assert "No space left" in errors[0] and "free" in errors[0], errors
        assert log.count("encoding") <= 1, log[-3000:]
        # nothing partial is visible
        assert handoff.read_pointer(root)["version"] == 0
        assert handoff.published_versions(root) == [0]
        assert not [p.name for p in disk.iterdir() if p.name.startswith("v1")]
        # the trainer: one line, after a checkpoint
        assert trainer.returncode == 2, stderr[-3000:]
        line = _one_line_error(stderr, "retromae-ds finetune")
        assert "refresher" in line and "No space left" in line, line
        from retromae_ds.components import checkpoint as ckpt

        saved = ckpt.read_marker(ckpt.latest_complete(run / "checkpoints"))["step"]
        assert 0 < saved < 24 and not (run / "FINISHED").exists()

        ballast.unlink()
        # slow steps, and twice the steps the first version of this test ran: a loaded CI
        # machine once let the new refresher publish after the trainer's last look
        again = subprocess.run(
            cmd,
            cwd=REPO,
            env={**ENV, **faults.env(sleep_after_step_s=1.2)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert again.returncode == 0, again.stderr[-3000:]
        rows = _metrics(run)
        steps = [row["step"] for row in rows if "loss" in row]
        assert sorted(set(steps)) == list(range(1, 25)), steps
        assert len(steps) == len(set(steps)), f"metrics.jsonl repeats step rows: {steps}"
        # with the space back a refresher publishes: the run's own one when a loaded machine
        # gave it time before the last step, else the refresher on the finished run (no race)
        if handoff.read_pointer(root)["version"] == 0:
            late = subprocess.run(
                _refresh_cmd(run), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
            )
            assert late.returncode == 0, late.stderr[-3000:]
        assert handoff.read_pointer(root)["version"] >= 1


# --------------------------------------------------------------------------- issue 46, item 7
def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_refresh_on_a_folder_that_is_not_a_finetuning_run_is_refused_creating_nothing(tmp_path):
    """A typo, a file, an empty folder or a pre-training run as ``--run_dir``: one line naming
    the folder and why, exit 2, within seconds, and nothing created (no ``negatives/``, no
    lock, no mistyped tree)."""
    from retromae_ds.base.config import to_dict
    from retromae_ds.base.fsutil import atomic_write_json
    from retromae_ds.pretrain import DataConfig, PretrainConfig

    pre = tmp_path / "pretrain_run"
    (pre / "checkpoints").mkdir(parents=True)
    atomic_write_json(
        RunLayout(pre).config,
        to_dict(
            PretrainConfig(run_dir=str(pre), max_steps=10, data=DataConfig(shards=str(tmp_path)))
        ),
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = {
        tmp_path / "typo" / "run": "no such run folder",
        a_file: "is a file",
        empty: "holds no fine-tuning run",
        pre: "a pre-training run",
    }
    before = _tree(tmp_path)
    for run, why in cases.items():
        t0 = time.monotonic()
        done = subprocess.run(
            _refresh_cmd(run), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, done.stderr[-3000:]
        line = _one_line_error(done.stderr, "retromae-ds refresh")
        assert str(run) in line and why in line and "retromae-ds finetune" in line, line
        assert time.monotonic() - t0 < 60
        assert _tree(tmp_path) == before, f"{run}: created {set(_tree(tmp_path)) - set(before)}"


@pytest.mark.slow
def test_a_waiting_refresher_says_what_it_waits_for(tmp_path, bm25_run):
    """On a fine-tuning run with no checkpoint yet the refresher waits, saying every
    ``wait_report_s`` what for, and ends on SIGTERM."""
    run = _copy(bm25_run, tmp_path)
    log = tmp_path / "refresher.log"

    def waits() -> list[str]:
        return [line for line in log.read_text().splitlines() if "waiting for" in line]

    with open(log, "w") as err:
        proc = subprocess.Popen(
            _refresh_cmd(run, "--wait_report_s", "1"),
            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=err, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180  # a loaded machine starts Python slowly
        while time.monotonic() < deadline and proc.poll() is None and len(waits()) < 2:
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        lines = waits()
        assert len(lines) >= 2, log.read_text()[-3000:]
        assert str(RunLayout(run).checkpoints) in lines[-1] and "v0" in lines[-1], lines[-1]
    finally:
        _kill(proc.pid)
        proc.wait()
