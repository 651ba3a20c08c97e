"""The fourth hostile pass (issue 55), options: numbers, config files and run folders that
used to fail with a traceback, a message without the option's name, or silently. Each case
is one line naming the option, file or cause, exit 2, and nothing is created."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers_train import ENV, REPO

from retromae_ds.base.options import parse_command
from retromae_ds.pretrain import PretrainConfig

SHARDS = ["--data.shards", "/nowhere/shards"]  # configs are built before any shard is read


def _parse(*argv: str) -> PretrainConfig:
    return parse_command(PretrainConfig, [*SHARDS, *argv])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--max_steps", "1e400"], "max_steps: expected a whole number, got '1e400'"),
        (["--max_steps", "1.5e0"], "max_steps: expected a whole number, got '1.5e0'"),
        (["--max_steps", "2", "--seed", "1e30"], "seed: '1e30' is out of range"),
        (["--max_steps", "2", "--seed", "-1"], "seed must be >= 0, not -1"),
        (["--max_steps", "2", "--optim.lr", "1e400"], "optim.lr: expected a finite number"),
        (["--max_steps", "2", "--optim.lr", "nan"], "optim.lr: expected a finite number"),
    ],
)
def test_numbers_out_of_range_or_not_whole_name_the_option(argv, says):
    with pytest.raises(ValueError) as err:
        _parse(*argv)
    assert says in str(err.value)


def test_whole_numbers_in_any_spelling_still_read():
    cfg = _parse("--max_steps", "1e3", "--seed", "2.0", "--log_every", "1_0")
    assert (cfg.max_steps, cfg.seed, cfg.log_every) == (1000, 2, 10)


def test_a_list_that_is_not_json_names_its_option():
    with pytest.raises(ValueError) as err:
        _parse("--max_steps", "2", "--stop_signals", "[SIGTERM")
    assert str(err.value).startswith("stop_signals: '[SIGTERM' starts like a JSON list")
    cfg = _parse("--max_steps", "2", "--stop_signals", '["SIGTERM"]')
    assert cfg.stop_signals == ["SIGTERM"]


def test_a_yaml_date_stays_the_text_it_is(tmp_path):
    job = tmp_path / "job.YAML"  # any case of the suffix is YAML
    job.write_text("run_dir: 2024-01-01\nmax_steps: 2\n")
    cfg = _parse("--config", str(job))
    assert cfg.run_dir == "2024-01-01" and cfg.max_steps == 2


def test_config_file_errors_name_the_file_line_and_column(tmp_path):
    bad = tmp_path / "job.json"
    bad.write_bytes(b'{"max_steps": 2,\n "run_dir": "r\xff"}\n')
    with pytest.raises(ValueError) as err:
        _parse("--config", str(bad))
    assert str(err.value) == f"{bad}:2:15: not UTF-8 text (byte 0xff)"
    with pytest.raises(ValueError) as err:
        _parse("--max_steps", "2", "--config", "")
    assert str(err.value).startswith("--config: an empty path")


def test_one_setting_under_two_names_on_one_command_line_is_refused():
    with pytest.raises(ValueError) as err:
        _parse("--max_steps", "2", "--resume", "none", "--checkpoint.resume", "auto")
    assert "--resume and --checkpoint.resume both set checkpoint.resume" in str(err.value)
    # as a --config file refuses the pair; the same name twice is still the last one given
    cfg = _parse("--max_steps", "2", "--seed", "1", "--seed", "3")
    assert cfg.seed == 3


@pytest.mark.parametrize("name", [b"", b"run\xff"])
def test_a_run_folder_name_that_would_misplace_the_run_creates_nothing(tmp_path, name):
    """An empty ``run_dir`` used to train into the current directory; non-UTF-8 bytes left a
    half-made folder. Both are refused before anything is written."""
    work = tmp_path / "work"
    work.mkdir()
    shards = tmp_path / "shards"
    shards.mkdir()
    argv = [sys.executable.encode(), b"-m", b"retromae_ds.pretrain", b"--data.shards",
            str(shards).encode(), b"--max_steps", b"2", b"--run_dir", name]  # fmt: skip
    env = {**ENV, "PYTHONPATH": str(REPO)}
    result = subprocess.run(argv, cwd=work, env=env, capture_output=True, timeout=300)
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, stderr[-2000:]
    (line,) = stderr.strip().splitlines()
    assert line.startswith("retromae-ds pretrain: error: run_dir ")
    assert ("is empty" if not name else "is not UTF-8") in line
    assert os.listdir(work) == []
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"shards", b"work"]
    assert not any(shards.iterdir())
