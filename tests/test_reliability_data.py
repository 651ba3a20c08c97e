"""Issue 13, items 7, 11, 12 and 13 (data side): a resumed preprocessing run never reuses a
tokenizer or shards made with other tokenizer-training settings or from inputs changed since;
empty inputs are reported at preprocessing and refused by ``inspect`` and training; bad
``--out`` folders, a full disk and a killed run's temporaries give clear errors and no litter;
every file we make respects the umask."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from retromae_ds.base.fsutil import atomic_write_text
from retromae_ds.cli import main
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.data.preprocess import run_preprocess

from helpers_shards import preprocess_config as config
from helpers_shards import write_jsonl
from synthetic import synthetic_texts

DEAD_PID = 9_999_999  # above Linux's largest pid_max (2**22): never a live process


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


# --- item 7: the resume key ----------------------------------------------------------------------
def test_rerun_with_other_tokenizer_training_settings_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(60, seed=3))
    out = tmp_path / "out"
    first = run_preprocess(config([src], out, train_tokenizer=80))
    tokenizer_json = (out / "tokenizer" / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="different settings") as info:
        run_preprocess(config([src], out, train_tokenizer=120, lowercase=False))
    message = str(info.value)
    assert "tokenizer training" in message and str(out) in message
    assert "--train_tokenizer 80 lowercase -> --train_tokenizer 120 --lowercase false" in message
    with pytest.raises(ValueError, match="tokenizer training"):  # the vocabulary size alone
        run_preprocess(config([src], out, train_tokenizer=120))
    # nothing was replaced, and the same settings still resume
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer_json
    assert run_preprocess(config([src], out, train_tokenizer=80)) == first


def test_switching_from_a_given_tokenizer_to_training_one_is_refused(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(40, seed=4))
    out = tmp_path / "out"
    run_preprocess(config([src], out, tokenizer_dir))
    with pytest.raises(ValueError, match=r"tokenizer training \(--tokenizer DIR -> "):
        run_preprocess(config([src], out, train_tokenizer=80))


def test_an_input_edited_in_place_with_the_same_size_is_refused(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "docs.jsonl", ["alpha beta gamma"] * 20)
    out = tmp_path / "out"
    run_preprocess(config([src], out, tokenizer_dir))
    before = src.stat()
    src.write_text(src.read_text().replace("alpha", "delta"))  # same size, other text
    assert src.stat().st_size == before.st_size
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))  # even with the old mtime
    with pytest.raises(ValueError, match=r"docs\.jsonl: content changed"):
        run_preprocess(config([src], out, tokenizer_dir))
    src.write_text(src.read_text().replace("delta", "alpha"))  # the old text, a new mtime
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=r"docs\.jsonl: modification time changed"):
        run_preprocess(config([src], out, tokenizer_dir))


# --- item 11: empty inputs -----------------------------------------------------------------------
def test_empty_inputs_warn_at_preprocessing_and_are_refused_by_inspect_and_training(
    tmp_path, tokenizer_dir, capsys
):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\t\n")
    out = tmp_path / "out"
    manifest = run_preprocess(config([empty, blank], out, tokenizer_dir))
    assert manifest["counts"]["rows"] == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert str(empty) in warnings[0] and str(blank) in warnings[0]
    assert "no rows" in warnings[0]

    with pytest.raises(ValueError, match="no samples") as info:
        ShardDataset(out)  # what training opens
    assert str(out) in str(info.value) and "empty" in str(info.value)
    assert len(ShardDataset(out, require_rows=False)) == 0  # the explicit opt-out

    assert main(["inspect", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "no samples" in err


def test_an_empty_input_next_to_real_ones_is_named_but_the_dataset_opens(
    tmp_path, tokenizer_dir, capsys
):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(30, seed=5))
    out = tmp_path / "out"
    run_preprocess(config([empty, src], out, tokenizer_dir))
    err = capsys.readouterr().err
    assert str(empty) in err and str(src) not in err
    assert len(ShardDataset(out)) > 0


# --- item 12: output folder, full disk, a killed run's temporaries -------------------------------
def test_out_naming_an_existing_file_is_a_clear_error(tmp_path, tokenizer_dir, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl", ["some text"])
    out = tmp_path / "out.txt"
    out.write_text("not a folder")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        run_preprocess(config([src], out, tokenizer_dir))
    code = main(["preprocess", str(src), "--out", str(out), "--tokenizer", str(tokenizer_dir)])
    err = capsys.readouterr().err
    assert code == 2 and str(out) in err and "Errno" not in err
    assert out.read_text() == "not a folder"


def test_disk_full_while_saving_the_trained_tokenizer(tmp_path, monkeypatch, capsys):
    from transformers import PreTrainedTokenizerFast

    def full_disk(self, *args, **kwargs):
        Path(args[0], "tokenizer.json").write_text("{")  # a partial write, then no space
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full_disk)
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(40, seed=6))
    out = tmp_path / "out"
    with pytest.raises(OSError) as info:
        run_preprocess(config([src], out, train_tokenizer=80))
    message = str(info.value)
    assert str(out / "tokenizer") in message and "No space left on device" in message
    assert "Errno" not in message
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert not (out / "tokenizer").exists()

    code = main(["preprocess", str(src), "--out", str(out), "--train_tokenizer", "80"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and str(out / "tokenizer") in err[0]
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


def test_a_killed_runs_temporaries_are_removed_by_the_next_run(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(30, seed=7))
    out = tmp_path / "out"
    first = run_preprocess(config([src], out, tokenizer_dir))
    (out / f"backend.tmp-{DEAD_PID}.json").write_text("{}")
    (out / f"tokenizer.tmp-{DEAD_PID}").mkdir()
    (out / f"tokenizer.tmp-{DEAD_PID}" / "vocab.txt").write_text("x")
    live = out / f"backend.tmp-{os.getppid()}.json"  # a live process's file is left alone
    live.write_text("{}")
    assert run_preprocess(config([src], out, tokenizer_dir)) == first
    assert sorted(p.name for p in out.iterdir() if ".tmp" in p.name) == [live.name]


# --- item 13: permissions follow the umask -------------------------------------------------------
def test_preprocessing_output_is_readable_by_others(tmp_path, tokenizer_dir, umask_022):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(40, seed=8))
    out = tmp_path / "out"
    run_preprocess(config([src], out, tokenizer_dir))
    files = [out / "manifest.json", out / "plan.json", *sorted((out / "shards").iterdir())]
    assert any(p.suffix == ".arrow" for p in files)
    assert {p.name: mode(p) for p in files} == {p.name: 0o644 for p in files}


def test_atomic_write_text_follows_the_umask(tmp_path, umask_022):
    target = tmp_path / "record.json"
    atomic_write_text(target, "{}\n")
    assert mode(target) == 0o644
    os.umask(0o027)
    atomic_write_text(target, "{}\n")
    assert mode(target) == 0o640


def test_negatives_files_follow_the_umask(tmp_path, umask_022):
    import numpy as np

    from retromae_ds.finetuning import handoff

    handoff.publish(tmp_path, 0, [np.array([1, 2], dtype=np.int64)], step=1)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and {mode(p) for p in written} == {0o644}


def test_an_export_is_readable_by_others(tmp_path, tokenizer_dir, umask_022):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from retromae_ds.export import export_encoder

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config_ = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    BertForMaskedLM(config_).save_pretrained(checkpoint / "encoder")
    tokenizer.save_pretrained(checkpoint / "encoder")
    (checkpoint / "COMPLETE").write_text(json.dumps({"step": 2, "world_size": 1}))
    out = export_encoder(checkpoint, tmp_path / "exported")
    folders = [out, *(p for p in out.rglob("*") if p.is_dir())]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {mode(p) for p in folders} == {0o755}
    assert files and {p.name: mode(p) for p in files} == {p.name: 0o644 for p in files}
