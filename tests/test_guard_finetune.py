"""Fine-tuning's waits and inputs (issue 46, third hostile pass; each test failed on the code
before its fix):

- item 6: ``--negatives.mine_first true`` with no refresher is refused up front; the wait for
  the first mined version says what it waits for every ``negatives.wait_report_s`` and ends
  on SIGTERM or SIGUSR1 as training does (the step-0 checkpoint is complete: exit 85);
- item 8: the BEIR folder's files are fingerprinted when the run tokenizes them; a resume
  against an edited folder is refused naming the files that changed.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import step_tag
from retromae_ds.components.signals import EXIT_REQUEUE

from helpers_ance import ENV, REPO, write_synthetic_beir, write_tiny_encoder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ft_inputs")
    beir = write_synthetic_beir(root / "beir", num_docs=60, num_queries=16)
    return beir, write_tiny_encoder(root / "init", tokenizer_dir)


def _args(run: Path, beir: Path, init: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "retromae_ds.finetune",
        "--run_dir", str(run), "--progress", "false", "--data.beir", str(beir),
        "--model.init", str(init), "--data.q_max_len", "16", "--data.p_max_len", "32",
        "--micro_batch_size", "4", "--negatives.n_hard", "1", "--refresh.mining.num_negatives", "3",
        "--max_steps", "3", "--log_every", "1", "--optim.lr", "1e-3",
        "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]', *extra,
    ]  # fmt: skip


def finetune(run: Path, beir: Path, init: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _args(run, beir, init, *extra),
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


# --- item 6: waits that say what they wait for and end on a stop signal ----------------------


def test_mine_first_without_any_refresher_is_refused_up_front(inputs, tmp_path):
    beir, init = inputs
    run = tmp_path / "run"
    t0 = time.monotonic()
    result = finetune(
        run, beir, init, "--negatives.mine_first", "true",
        "--negatives.mine_first_timeout_s", "30",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert time.monotonic() - t0 < 25  # refused, not waited out
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "negatives.mine_first" in lines[0] and "refresher" in lines[0], lines
    assert "external" in lines[0] and "local" in lines[0], lines
    assert not run.exists()


def _stream(pipe, lines: list[str]) -> None:
    for line in pipe:
        lines.append(line)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGUSR1])
def test_the_wait_for_mined_negatives_reports_and_ends_on_a_stop_signal(inputs, tmp_path, stop):
    """No refresher publishes (it is said to run elsewhere): the trainer saves step 0, says
    every second what it waits for, and a stop signal ends the wait at once, cleanly."""
    beir, init = inputs
    run = tmp_path / "run"
    trainer = subprocess.Popen(
        _args(run, beir, init, "--negatives.mine_first", "true", "--refresher", "external",
              "--negatives.wait_report_s", "1"),
        cwd=REPO, env=ENV, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=_stream, args=(trainer.stderr, lines), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while sum("waiting for" in line for line in lines) < 3:
            assert trainer.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        trainer.send_signal(stop)
        code = trainer.wait(timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    reader.join(timeout=10)
    log = "".join(lines)
    assert code == EXIT_REQUEUE, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    waits = [line for line in log.splitlines() if "waiting for" in line]
    assert all("v0" in w and str(run / "negatives") in w and "external" in w for w in waits), waits
    stopped = [line for line in log.splitlines() if stop.name in line]
    assert len(stopped) == 1 and step_tag(0) in stopped[0], log[-3000:]
    assert [p.name for p in ckpt.complete_checkpoints(run / "checkpoints")] == [step_tag(0)]
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()


# --- item 8: a resume against an edited BEIR folder ------------------------------------------


def test_a_resume_against_an_edited_beir_folder_is_refused_naming_the_files(inputs, tmp_path):
    beir = Path(shutil.copytree(inputs[0], tmp_path / "beir"))
    init = inputs[1]
    run = tmp_path / "run"
    first = finetune(run, beir, init, "--stop_at_step", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    rows = (run / "metrics.jsonl").read_text()

    qrels = beir / "qrels" / "train.tsv"
    corpus = beir / "corpus.jsonl"
    saved = {path: path.read_bytes() for path in (qrels, corpus)}
    qrels.write_text("\n".join(qrels.read_text().splitlines()[:-3]) + "\n")  # a query less
    lines = corpus.read_text().splitlines()
    lines[5] = json.dumps({"_id": "d5", "title": "", "text": "an edited passage"})
    corpus.write_text("\n".join(lines) + "\n")

    resumed = finetune(run, beir, init, "--checkpoint.resume", "auto")
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    lines = error_lines(resumed.stderr)
    assert len(lines) == 1 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert "corpus.jsonl" in lines[0] and "qrels/train.tsv" in lines[0], lines
    assert "queries.jsonl" not in lines[0], lines
    assert (run / "metrics.jsonl").read_text() == rows  # nothing trained

    for path, data in saved.items():
        path.write_bytes(data)
    again = finetune(run, beir, init, "--checkpoint.resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_the_fingerprint_is_checked_by_load_and_recorded_for_an_older_folder(
    inputs, tmp_path, tokenizer_dir, capsys
):
    """``load`` (the refresher's way in) checks the qrels it reads; a folder prepared before
    fingerprints existed gets one on its next start, saying so, and is guarded from then on."""
    from retromae_ds.finetuning import data as ance_data

    beir = Path(shutil.copytree(inputs[0], tmp_path / "beir"))
    out = tmp_path / "prepared"

    def prepare() -> None:
        ance_data.prepare(
            beir, "train", tokenizer_dir, out, q_max_len=16, p_max_len=32, progress=False
        )

    prepare()
    record = json.loads((out / "READY").read_text())
    assert set(record[ance_data.FINGERPRINT]) == {
        "corpus.jsonl",
        "queries.jsonl",
        "qrels/train.tsv",
    }
    ance_data.load(out)
    qrels = beir / "qrels" / "train.tsv"
    saved = qrels.read_bytes()
    qrels.write_bytes(saved + b"q0\td7\t1\n")
    with pytest.raises(ValueError, match=r"changed since .*: qrels/train\.tsv; "):
        ance_data.load(out)
    qrels.write_bytes(saved)

    del record[ance_data.FINGERPRINT]  # as an older version wrote it
    (out / "READY").write_text(json.dumps(record))
    capsys.readouterr()
    prepare()
    assert "records no fingerprint" in capsys.readouterr().err
    assert ance_data.FINGERPRINT in json.loads((out / "READY").read_text())
    (beir / "queries.jsonl").write_text((beir / "queries.jsonl").read_text() + "\n")
    with pytest.raises(ValueError, match=r"changed since .*: queries\.jsonl; "):
        prepare()
