"""Issue 46, training side: self-healing that heals. A rerun past a corrupt newest checkpoint
(a flipped byte, an unparseable ``COMPLETE`` record) sets it aside, retrains and saves the
step; a run folder whose checkpoints are all corrupt is not silently started over; a changed
``max_steps`` says what it does to the learning rate; config mistakes and Ctrl-C are one line.
Each test failed on the code before its fix."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_train import ENV, REPO, metrics, pretrain
from helpers_train import synthetic_shards as make_shards

from retromae_ds.base import faults
from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import RunLayout, step_tag

EVERY_2 = ("--log_every", "1", "--checkpoint.every_steps", "2")


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_dir) -> Path:
    return make_shards(tmp_path_factory.mktemp("resume_shards"), tokenizer_dir, 300, seed=5)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def _optimizer_file(checkpoint: Path) -> Path:
    (found,) = checkpoint.glob("*optim_states.pt")
    return found


@pytest.mark.slow
def test_a_fallback_sets_the_corrupt_checkpoint_aside_and_saves_the_retrained_step(
    tmp_path, shards
):
    """Item 2: one flipped byte in the newest checkpoint's optimizer file. The rerun falls
    back, retrains, and saves the final step (it used to trust the corrupt folder's name and
    save nothing, so every rerun repeated the same steps); the corrupt folder is kept, renamed
    ``*.corrupt``, with one line saying so."""
    run = tmp_path / "run"
    pretrain(run, shards, "--max_steps", "4", *EVERY_2)
    step4 = run / "checkpoints" / step_tag(4)
    victim = _optimizer_file(step4)
    _flip(victim)
    damaged = _tree(step4)

    again = pretrain(run, shards, "--max_steps", "4", *EVERY_2)
    aside = run / "checkpoints" / f"{step_tag(4)}.corrupt"
    notes = [line for line in again.stderr.splitlines() if str(aside.name) in line]
    assert len(notes) == 1 and victim.name in notes[0], again.stderr[-3000:]
    assert _tree(aside) == damaged  # set aside as it was, not deleted
    ckpt.verify(step4)  # the retrained step 4 was saved
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]

    third = pretrain(run, shards, "--max_steps", "4", *EVERY_2)
    assert f"resumed from {step4} at step 4" in third.stderr  # nothing to repeat
    assert "falling back" not in third.stderr


@pytest.mark.slow
def test_an_unparseable_complete_record_is_a_corrupt_checkpoint(tmp_path, shards):
    """Item 3: a ``COMPLETE`` record that is not JSON. The rerun falls back naming the file,
    retrains, saves the step and exits 0 (it used to fail at the end with "Expecting property
    name", no file named)."""
    run = tmp_path / "run"
    pretrain(run, shards, "--max_steps", "4", *EVERY_2)
    step4 = run / "checkpoints" / step_tag(4)
    record = step4 / ckpt.COMPLETE
    record.write_text(record.read_text()[:40])

    again = pretrain(run, shards, "--max_steps", "4", *EVERY_2, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    named = [line for line in again.stderr.splitlines() if str(record) in line]
    assert len(named) == 1 and "set aside" in named[0], again.stderr[-3000:]
    assert (run / "checkpoints" / f"{step_tag(4)}.corrupt" / ckpt.COMPLETE).is_file()
    ckpt.verify(step4)
    assert ckpt.read_marker(step4)["step"] == 4
    with pytest.raises(ckpt.CheckpointCorrupt, match="COMPLETE"):
        ckpt.read_marker(run / "checkpoints" / f"{step_tag(4)}.corrupt")


@pytest.mark.slow
def test_a_run_whose_only_checkpoint_is_corrupt_is_not_started_over_silently(tmp_path, shards):
    """Item 4: ``keep_last 1`` and its only checkpoint corrupt. The rerun refuses in one line
    naming it (it used to restart from step 0 and delete it); ``--checkpoint.resume none`` starts over
    and keeps it, set aside."""
    run = tmp_path / "run"
    common = ("--max_steps", "2", "--log_every", "1", "--checkpoint.keep_last", "1")
    pretrain(run, shards, *common)
    step2 = run / "checkpoints" / step_tag(2)
    _flip(_optimizer_file(step2))
    before = _tree(run / "checkpoints")
    rows = metrics(run)

    refused = pretrain(run, shards, *common, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    (line,) = _error_lines(refused.stderr)
    assert step2.name in line and "--checkpoint.resume none" in line, line
    assert _tree(run / "checkpoints") == before  # nothing deleted, nothing renamed
    assert metrics(run) == rows

    fresh = pretrain(run, shards, *common, "--checkpoint.resume", "none")
    aside = run / "checkpoints" / f"{step2.name}.superseded"
    assert any(aside.name in x for x in fresh.stderr.splitlines()), fresh.stderr[-3000:]
    assert _tree(aside) == {k.removeprefix(f"{step2.name}/"): v for k, v in before.items()
                            if k.startswith(f"{step2.name}/")}  # fmt: skip
    ckpt.verify(step2)  # the new run's own


def test_resume_sets_aside_every_newer_folder_and_refuses_when_none_verifies(tmp_path):
    """The resume rules on checkpoint folders alone (no training): ``auto`` takes the newest
    that verifies and sets every newer one aside (corrupt or without a record), saying so;
    with none intact it refuses naming them and moves nothing; an explicit older checkpoint
    sets the newer, intact ones aside as ``*.superseded``."""
    layout = RunLayout(tmp_path / "run")
    for step in (2, 4, 6, 8):
        staging = layout.staging(step)
        staging.mkdir(parents=True)
        (staging / "weights.bin").write_bytes(bytes(range(200)) * step)
        ckpt.publish(staging, layout.checkpoint(step), {"step": step, "world_size": 1}, 0)
    _flip(layout.checkpoint(8) / "weights.bin")
    (layout.checkpoint(6) / ckpt.COMPLETE).unlink()
    lines: list[str] = []
    chosen = ckpt.resolve_resume("auto", layout.root, log=lines.append)
    assert chosen == layout.checkpoint(4)
    assert sorted(p.name for p in layout.checkpoints.iterdir()) == [
        "step_00000002", "step_00000004", "step_00000006.corrupt", "step_00000008.corrupt"]  # fmt: skip
    assert any("step_00000008.corrupt" in x and "weights.bin" in x for x in lines), lines
    assert any("step_00000006.corrupt" in x and ckpt.COMPLETE in x for x in lines), lines

    lines.clear()
    assert ckpt.resolve_resume(str(layout.checkpoint(2)), layout.root, log=lines.append)
    assert (layout.checkpoints / "step_00000004.superseded").is_dir()
    assert len(lines) == 1 and "step_00000004.superseded" in lines[0], lines

    _flip(layout.checkpoint(2) / "weights.bin")
    names = sorted(p.name for p in layout.checkpoints.iterdir())
    with pytest.raises(ckpt.CheckpointCorrupt, match="step_00000002.*--checkpoint.resume none"):
        ckpt.resolve_resume("auto", layout.root, log=lines.append)
    assert sorted(p.name for p in layout.checkpoints.iterdir()) == names
    # a second fallback past the same step keeps the first one set aside too
    assert ckpt.set_aside(layout.checkpoint(2), "corrupt").name == "step_00000002.corrupt"
    (layout.checkpoint(2)).mkdir()
    assert ckpt.set_aside(layout.checkpoint(2), "corrupt").name == "step_00000002.2.corrupt"


def test_an_unparseable_record_names_its_file(tmp_path):
    folder = tmp_path / step_tag(3)
    folder.mkdir()
    (folder / ckpt.COMPLETE).write_text('{"step": 3, ')
    with pytest.raises(ckpt.CheckpointCorrupt, match=f"{folder / ckpt.COMPLETE}: unreadable"):
        ckpt.read_marker(folder)


@pytest.mark.slow
def test_raising_max_steps_on_resume_says_how_the_learning_rate_changes(tmp_path, shards):
    """Item 14: max_steps 4 -> 8 on resume recomputes the linear decay; one line says so with
    the learning rate before and after (it used to jump from 0 to half the peak unsaid)."""
    run = tmp_path / "run"
    pretrain(run, shards, "--max_steps", "4", "--log_every", "1")
    longer = pretrain(run, shards, "--max_steps", "8", "--log_every", "1")
    lines = [x for x in longer.stderr.splitlines() if "max_steps 4 -> 8" in x]
    assert len(lines) == 1, longer.stderr[-3000:]
    rows = {r["step"]: r for r in metrics(run)}
    assert rows[4]["lr"] == 0.0 and rows[6]["lr"] > 0
    assert "learning rate" in lines[0] and f"{rows[5]['lr']:.3g} at step 5" in lines[0], lines
    same = pretrain(run, shards, "--max_steps", "8", "--log_every", "1")
    assert "resume: max_steps" not in same.stderr  # unchanged: nothing to say


def _cli(run: Path, shards: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "retromae_ds.pretrain", "--data.shards", str(shards),
           "--run_dir", str(run), "--progress", "false", "--model.encoder.name", "tiny",
           "--model.encoder.max_position_embeddings", "64", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--max_steps", "-5"], "max_steps must be >= 0"),
        (["--max_steps", "2", "--checkpoint.every_steps", "-1"], "checkpoint.every_steps"),
        (["--max_steps", "2", "--checkpoint.keep_last", "-2"], "checkpoint.keep_last"),
        (["--max_steps", "2", "--masking.encoder_ratio", "0"], "masking.encoder_ratio 0"),
        (["--max_steps", "2", "--masking.encoder_ratio", "0.001"], "masking.encoder_ratio 0.001"),
    ],
)
def test_settings_that_cannot_train_are_refused_up_front(tmp_path, shards, args, words):
    """Item 13: each is one line naming the field, before the engine starts (a ratio that masks
    no word used to end in a non-finite loss at step 1; every_steps -1 trained on)."""
    run = tmp_path / "run"
    result = _cli(run, shards, *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = _error_lines(result.stderr)
    assert words in line, line
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_a_run_dir_that_is_a_file_says_so(tmp_path, shards):
    file = tmp_path / "notes.txt"
    file.write_text("not a run\n")
    for run_dir in (file, file / "run"):
        result = _cli(run_dir, shards, "--max_steps", "2")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        (line,) = _error_lines(result.stderr)
        assert f"{file}: is a file, not a folder" in line, line
    assert file.read_text() == "not a run\n"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_is_one_line_naming_the_last_checkpoint(tmp_path, shards):
    """Item 13: SIGINT mid-run (as Ctrl-C sends it) prints one line naming the newest complete
    checkpoint and how to continue, no traceback, and exits 130."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "retromae_ds.pretrain", "--data.shards", str(shards),
           "--run_dir", str(run), "--progress", "false", "--model.encoder.name", "tiny",
           "--model.encoder.max_position_embeddings", "64", "--max_steps", "200",
           "--log_every", "1", "--checkpoint.every_steps", "2"]  # fmt: skip
    env = {**ENV, **faults.env(sleep_after_step_s=0.2)}
    # A terminal's foreground job takes SIGINT with its default action. A suite started in the
    # background by a shell (`pytest ... &`) passes SIGINT on ignored, and Python then installs
    # no Ctrl-C handler: the child would train to the end and exit 0 (seen once), so the
    # child starts with the terminal's disposition.
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint
    )
    try:
        deadline = time.monotonic() + 180
        while ckpt.latest_complete(run / "checkpoints") is None:
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint"
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    newest = ckpt.latest_complete(run / "checkpoints")
    (line,) = [x for x in stderr.splitlines() if "interrupted" in x]
    assert str(newest) in line and "--checkpoint.resume auto" in line, line
    assert json.loads((run / "config.json").read_text())["max_steps"] == 200


def test_refresh_threads_may_change_on_resume(tmp_path):
    """Item 14: the refresher's CPU threads change how fast it mines, not what the resumed
    steps compute; a resume with another ``refresh.threads`` is allowed."""
    from retromae_ds.base.config import to_dict
    from retromae_ds.base.options import build_config
    from retromae_ds.finetune import FinetuneConfig
    from retromae_ds.training.loop import check_resume_config

    base = ["--max_steps", "4", "--data.beir", str(tmp_path), "--model.init", str(tmp_path)]
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(to_dict(build_config(FinetuneConfig, None, base))))
    check_resume_config(
        build_config(FinetuneConfig, None, [*base, "--refresh.threads", "4"]), saved
    )
