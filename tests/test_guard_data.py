"""Issue 27, data side: a rerun of preprocessing never keeps a shard that changed since it was
written (defect 4); an unreadable shard is refused by ``inspect`` and before training starts,
in one line naming it (defect 10); ``inspect --verify`` checks the manifest's counts and
lengths against the shards, and training names both lengths when they disagree (defect 11);
invalid UTF-8 in a corpus is reported as ``file:line: invalid UTF-8 (byte 0xNN at column N)``
by every reader and every path that reads texts (defect 12a)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_train import ENV, REPO, TINY

from retromae_ds.base.fsutil import sha256_file
from retromae_ds.cli import main
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

from helpers_shards import preprocess_config as config
from helpers_shards import write_jsonl
from synthetic import synthetic_texts


def flip_byte(path: Path) -> None:
    """Flip one bit in the middle of ``path``, keeping its size (a silent disk error)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_dir) -> Path:
    """A finished preprocessing output of several shards; tests copy it before changing it."""
    tmp = tmp_path_factory.mktemp("corpus")
    src = write_jsonl(tmp / "docs.jsonl", synthetic_texts(80, seed=11))
    out = tmp / "out"
    run_preprocess(config([src], out, tokenizer_dir, shard_size=3000))
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) >= 3
    return out


def copy_of(corpus: Path, tmp_path: Path) -> Path:
    out = tmp_path / "shards"
    shutil.copytree(corpus, out)
    return out


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line]


# --- defect 4: a rerun never keeps a changed shard -----------------------------------------------
def test_rerun_redoes_a_shard_changed_since_it_was_written(tmp_path, tokenizer_dir, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(80, seed=12))
    out = tmp_path / "out"
    cfg = config([src], out, tokenizer_dir, shard_size=3000)
    first = run_preprocess(cfg)
    shards = len(first["shards"])
    assert shards >= 3
    good = (out / "shards" / "part-000001.arrow").read_bytes()
    flip_byte(out / "shards" / "part-000001.arrow")
    capsys.readouterr()

    again = run_preprocess(cfg)
    captured = capsys.readouterr()
    redone = [line for line in captured.err.splitlines() if "part-000001.arrow" in line]
    assert len(redone) == 1, captured.err
    assert "sha256" in redone[0] and "redoing it" in redone[0]
    assert f"({shards - 1} kept from an earlier run)" in captured.out
    # the shard was rewritten, not kept: the manifest matches every shard byte for byte
    assert (out / "shards" / "part-000001.arrow").read_bytes() == good
    assert again == first
    for entry in again["shards"]:
        assert sha256_file(out / entry["file"]) == entry["sha256"]
    ShardDataset(out, verify=True)


def test_merge_refuses_a_shard_changed_since_its_task_wrote_it(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(80, seed=13))
    out = tmp_path / "out"
    for task in (0, 1):
        run_preprocess(
            config([src], out, tokenizer_dir, shard_size=3000, num_tasks=2, task_index=task)
        )
    flip_byte(out / "shards" / "part-000002.arrow")  # task 0's
    with pytest.raises(RuntimeError) as info:
        run_preprocess(PreprocessConfig(out=str(out), merge=True, progress=False))
    message = str(info.value)
    assert "part-000002" in message and "sha256" in message and "task 0" in message
    assert not (out / "manifest.json").exists()
    # rerunning the task that owns it redoes that shard; the merge then succeeds
    run_preprocess(config([src], out, tokenizer_dir, shard_size=3000, num_tasks=2, task_index=0))
    run_preprocess(PreprocessConfig(out=str(out), merge=True, progress=False))
    ShardDataset(out, verify=True)


# --- defect 10: an unreadable shard ---------------------------------------------------------------
def without_read_access() -> list[str]:
    """A command prefix under which files of mode 000 cannot be read: as root, drop the
    capabilities that bypass file permissions (a root process ignores modes otherwise)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run a command without root's read access")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]


def test_an_unreadable_shard_is_refused_by_inspect_and_before_training(corpus, tmp_path):
    out = copy_of(corpus, tmp_path)
    shard = out / "shards" / "part-000001.arrow"
    shard.chmod(0)
    prefix = without_read_access()
    probe = subprocess.run([*prefix, "cat", str(shard)], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("this user can read a file of mode 000 even without its capabilities")

    for verify in ([], ["--verify"]):
        cmd = [*prefix, sys.executable, "-m", "retromae_ds.cli", "inspect", str(out), *verify]
        result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO)
        assert result.returncode != 0, result.stdout
        assert "Traceback" not in result.stderr, result.stderr
        (line,) = error_lines(result.stderr)
        assert str(shard) in line and "cannot read" in line, line

    run_dir = tmp_path / "run"
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "retromae_ds.pretrain",
        "--data.shards",
        str(out),
        "--run_dir",
        str(run_dir),
        *TINY,
        "--max_steps",
        "4",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = error_lines(result.stderr)
    assert str(shard) in line and "cannot read" in line, line
    # refused while opening the data: no engine was built, no step taken, nothing saved
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "metrics.jsonl").exists()


# --- defect 11: the manifest against the shards ---------------------------------------------------
def edit_manifest(out: Path, edit) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def test_verify_passes_on_an_unedited_folder(corpus, capsys):
    assert main(["inspect", str(corpus), "--verify"]) == 0, capsys.readouterr().err


EDITS = {
    # name: (edit, field the error names, manifest value, shards' value) from the original
    "shard_rows": (
        lambda m: m["shards"][1].update(rows=m["shards"][1]["rows"] + 10),
        "shards[1].rows",
        lambda m: m["shards"][1]["rows"] + 10,
        lambda m: m["shards"][1]["rows"],
    ),
    "total_rows": (
        lambda m: m["counts"].update(rows=m["counts"]["rows"] + 10),
        "counts.rows",
        lambda m: m["counts"]["rows"] + 10,
        lambda m: m["counts"]["rows"],
    ),
    "shard_tokens": (
        lambda m: m["shards"][0].update(tokens=m["shards"][0]["tokens"] + 3),
        "shards[0].tokens",
        lambda m: m["shards"][0]["tokens"] + 3,
        lambda m: m["shards"][0]["tokens"],
    ),
    "total_tokens": (
        lambda m: m["counts"].update(tokens=m["counts"]["tokens"] - 1),
        "counts.tokens",
        lambda m: m["counts"]["tokens"] - 1,
        lambda m: m["counts"]["tokens"],
    ),
    "shard_bytes": (
        lambda m: m["shards"][2].update(bytes=m["shards"][2]["bytes"] + 8),
        "shards[2].bytes",
        lambda m: m["shards"][2]["bytes"] + 8,
        lambda m: m["shards"][2]["bytes"],
    ),
    "max_length": (
        lambda m: m.update(max_length=16),
        "max_length",
        lambda m: 16,
        lambda m: m["max_length"],  # the longest row (30 tokens) + 2 special tokens
    ),
    "max_tokens_per_row": (
        lambda m: m.update(max_tokens_per_row=10),
        "max_tokens_per_row",
        lambda m: 10,
        lambda m: m["max_tokens_per_row"],
    ),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_verify_checks_the_manifest_against_the_shards(corpus, tmp_path, capsys, case):
    edit, field, claimed, actual = EDITS[case]
    out = copy_of(corpus, tmp_path)
    original = json.loads((out / "manifest.json").read_text())
    edit_manifest(out, edit)
    assert main(["inspect", str(out), "--verify"]) != 0
    (line,) = error_lines(capsys.readouterr().err)
    assert f"{field} is {claimed(original)} in the manifest" in line, line
    assert f"the shards hold {actual(original)}" in line, line


def test_training_names_both_lengths_when_the_manifest_is_shorter(corpus, tmp_path):
    out = copy_of(corpus, tmp_path)
    edit_manifest(out, lambda m: m.update(max_length=16))  # rows hold up to 30 tokens
    cmd = [
        sys.executable,
        "-m",
        "retromae_ds.pretrain",
        "--data.shards",
        str(out),
        "--run_dir",
        str(tmp_path / "run"),
        "--model.encoder.name",
        "tiny",
        "--max_steps",
        "2",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert result.returncode == 2
    (line,) = error_lines(result.stderr)
    assert "max_length 16" in line and "manifest" in line, line
    assert "30 tokens + 2 special tokens = 32" in line, line
    assert "(16)" not in line  # the old message printed max_length as the rows' length


def test_training_names_both_lengths_when_data_max_length_is_shorter(corpus):
    from retromae_ds.pretrain import check_max_length

    manifest = json.loads((corpus / "manifest.json").read_text())
    assert check_max_length(0, manifest, str(corpus)) == 32
    assert check_max_length(40, manifest, str(corpus)) == 40
    with pytest.raises(ValueError) as info:
        check_max_length(20, manifest, str(corpus))
    message = str(info.value)
    assert "data.max_length 20" in message and "30 tokens + 2 special tokens = 32" in message


# --- defect 12a: invalid UTF-8 names file, line and column ----------------------------------------
LINES = [f"document number {i} about retrieval encoder shard manifest sampler" for i in range(300)]
BAD_LINE = 100  # 1-based; several KB into the file


def with_bad_byte(path: Path, lines: list[str]) -> tuple[Path, int]:
    """Write ``lines`` with a 0xff byte in line BAD_LINE; returns the path and the byte's
    1-based column (in characters)."""
    text = "".join(line + "\n" for line in lines)
    start = sum(len(line) + 1 for line in lines[: BAD_LINE - 1])
    column = lines[BAD_LINE - 1].index("retrieval") + 1
    data = bytearray(text.encode())
    data[start + column - 1] = 0xFF
    assert start > 4096
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(bytes(data)))
    else:
        path.write_bytes(bytes(data))
    return path, column


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    tmp = tmp_path_factory.mktemp("bad")
    jsonl = [json.dumps({"_id": f"d{i}", "text": t}) for i, t in enumerate(LINES)]
    (tmp / "beir").mkdir()
    return {
        "txt": with_bad_byte(tmp / "a.txt", LINES),
        "jsonl": with_bad_byte(tmp / "a.jsonl", jsonl),
        "jsonl.gz": with_bad_byte(tmp / "a.jsonl.gz", jsonl),
        "beir": with_bad_byte(tmp / "beir" / "corpus.jsonl", jsonl),
    }


def expected(path: Path, column: int) -> str:
    return f"{path}:{BAD_LINE}: invalid UTF-8 (byte 0xff at column {column})"


@pytest.mark.parametrize(
    "kind, options",
    [
        ("txt", []),
        ("txt", ["--txt_mode", "paragraph"]),
        ("txt", ["--workers", "2", "--shard_size", "2000"]),
        ("txt", ["--train_tokenizer", "200"]),
        ("jsonl", []),
        ("jsonl", ["--workers", "2", "--shard_size", "2000"]),
        ("jsonl", ["--train_tokenizer", "200"]),
        ("jsonl.gz", []),
        ("beir", []),
    ],
)
def test_invalid_utf8_names_file_line_and_column(
    bad_inputs, tokenizer_dir, tmp_path, capsys, kind, options
):
    path, column = bad_inputs[kind]
    given = str(path.parent) if kind == "beir" else str(path)
    tok = [] if "--train_tokenizer" in options else ["--tokenizer", str(tokenizer_dir)]
    argv = [
        "preprocess",
        given,
        "--out",
        str(tmp_path / "out"),
        "--progress",
        "false",
        *tok,
        *options,
    ]
    assert main(argv) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line == f"retromae-ds preprocess: error: {expected(path, column)}"
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_invalid_utf8_in_train_tokenizer_names_file_line_and_column(
    bad_inputs, tmp_path, capsys, kind
):
    path, column = bad_inputs[kind]
    argv = ["train-tokenizer", str(path), "--out", str(tmp_path / "tok"), "--vocab_size", "200"]
    assert main(argv) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line == f"retromae-ds train-tokenizer: error: {expected(path, column)}"


def test_invalid_utf8_skipped_is_logged_with_its_column(bad_inputs, tokenizer_dir, tmp_path):
    path, column = bad_inputs["jsonl"]
    out = tmp_path / "out"
    run_preprocess(config([path], out, tokenizer_dir, on_error="skip"))
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject == {
        "file": str(path),
        "line": BAD_LINE,
        "reason": f"invalid UTF-8 (byte 0xff at column {column})",
    }


@pytest.mark.parametrize("kind", ["txt", "jsonl.gz"])
def test_text_lines_names_file_line_and_column(bad_inputs, kind):
    """The shared line reader other readers of corpus files (the BEIR loader) build on."""
    from retromae_ds.data.sources import InputError, text_lines

    path, column = bad_inputs[kind]
    lines = []
    with pytest.raises(InputError) as info:
        lines.extend(text_lines(path))
    assert str(info.value) == expected(path, column)
    assert [n for n, _ in lines] == list(range(1, BAD_LINE))
    assert lines[0][1] == (
        LINES[0] if kind == "txt" else json.dumps({"_id": "d0", "text": LINES[0]})
    )


def test_invalid_utf8_in_the_beir_loader_names_file_line_and_column(bad_inputs):
    from retromae_ds.retrieval.beir import load_corpus

    path, column = bad_inputs["beir"]
    with pytest.raises(ValueError) as info:
        load_corpus(path)
    assert str(info.value) == expected(path, column)
