"""Fine-tuning's data and up-front checks (issue 55, fourth hostile pass; each test failed on
the code before its fix):

- item 1: a fine-tuning run's tokenized shards are checked against their manifest before the
  trainer or a refresher reads them: a flipped byte is refused in one line naming the shard,
  and the folder is made again from the BEIR files; a refresher on corrupt data encodes
  nothing, so a shared embedding cache is never filled from corrupt bytes;
- item 3: a fine-tune resumes after its init run (``--model.init RUN``) wrote a newer
  checkpoint: the data is compared by tokenizer fingerprint, not by the resolved path;
- item 5: a fine-tune that failed its up-front checks does not block its rerun: an unfinished
  data folder is tokenized again once the input is fixed, a pooling the init cannot serve is
  refused before anything is prepared, and a settings mismatch is one readable line;
- item 6: ``finetune --run_dir`` on a pre-training run is refused, writing nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from helpers_train import pretrain
from helpers_train import synthetic_shards as make_shards

from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import RunLayout, step_tag
from retromae_ds.data import schema
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff

from helpers_ance import (
    ENV,
    REPO,
    fake_checkpoint,
    load_current,
    prepared_set,
    refresh_cmd,
    write_synthetic_beir,
    write_tiny_encoder,
)

CORPUS_SHARD = Path("corpus") / "shards" / "part-000000.arrow"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tokenizer_dir) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("ft4_inputs")
    beir = write_synthetic_beir(root / "beir", num_docs=60, num_queries=16)
    return SimpleNamespace(
        root=root, beir=beir, init=write_tiny_encoder(root / "init", tokenizer_dir)
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tokenizer_dir) -> Path:
    """A real pre-training run (tiny encoder with its MLM head): checkpoints at steps 2, 4."""
    root = tmp_path_factory.mktemp("ft4_pretrain")
    shards = make_shards(root, tokenizer_dir, 200, seed=55)
    run = root / "run"
    pretrain(
        run, shards, "--max_steps", "4", "--checkpoint.every_steps", "2",
        "--checkpoint.keep_last", "0",
    )  # fmt: skip
    steps = [p.name for p in ckpt.complete_checkpoints(run / "checkpoints")]
    assert steps == [step_tag(2), step_tag(4)]
    return run


def finetune(run: Path, beir: Path, init: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable, "-m", "retromae_ds.finetune",
            "--run_dir", str(run), "--progress", "false", "--data.beir", str(beir),
            "--model.init", str(init), "--data.q_max_len", "16", "--data.p_max_len", "32",
            "--micro_batch_size", "4", "--negatives.n_hard", "1",
            "--refresh.mining.num_negatives", "3", "--max_steps", "3", "--log_every", "1",
            "--optim.lr", "1e-3",
            "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]', *extra,
        ],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def one_error(result: subprocess.CompletedProcess) -> str:
    """The one error line of a command refused with exit 2 (no traceback)."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def steps(run: Path) -> list[int]:
    return [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]


def listing(folder: Path) -> dict[str, int]:
    """Every path under ``folder`` (hidden ones too) with its mtime in ns."""
    return {str(p.relative_to(folder)): p.lstat().st_mtime_ns for p in folder.rglob("*")}


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def scramble_token_ids(path: Path) -> None:
    """Reverse the order of a shard's token ids in place: every id stays inside the
    vocabulary (so only the sha256 can tell), and almost every passage reads other tokens."""
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
        ids = table.column(schema.INPUT_IDS).combine_chunks().values.to_numpy().astype(np.int32)
    del table
    data = bytearray(path.read_bytes())
    start = bytes(data).find(ids.tobytes())
    assert start >= 0 and len(np.unique(ids)) > 10
    data[start : start + ids.nbytes] = ids[::-1].tobytes()
    path.write_bytes(bytes(data))


# --- item 1: the tokenized shards are verified before anything reads them ----------------------


def test_a_flipped_byte_in_a_corpus_shard_is_refused_before_training_and_made_again(
    inputs, tmp_path
):
    run = tmp_path / "run"
    first = finetune(run, inputs.beir, inputs.init, "--stop_at_step", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    rows = (run / "metrics.jsonl").read_text()
    shard = run / "data" / CORPUS_SHARD
    flip_byte(shard)

    refused = finetune(run, inputs.beir, inputs.init, "--checkpoint.resume", "auto")
    line = one_error(refused)
    assert f"{shard}: sha256 differs" in line, line
    assert f"remove {run / 'data'}" in line, line  # and how to make it again
    assert (run / "metrics.jsonl").read_text() == rows  # nothing trained

    shutil.rmtree(run / "data")  # made again from the BEIR files: the same tokens
    again = finetune(run, inputs.beir, inputs.init, "--checkpoint.resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step 1" in again.stderr, again.stderr[-3000:]
    assert steps(run) == [1, 2, 3]


def test_load_checks_the_queries_shards_too(inputs, tmp_path, tokenizer_dir):
    data = prepared_set(tmp_path / "data", inputs.beir, tokenizer_dir)
    ance_data.load(data)
    shard = data / "queries" / "shards" / "part-000000.arrow"
    flip_byte(shard)
    with pytest.raises(ValueError, match=rf"^{shard}: sha256 differs .*remove {data} "):
        ance_data.load(data)


def _refresh_run(run: Path, ts: ance_data.TrainingSet, encoder: Path, data: Path, **kw):
    """A fine-tuning run folder as a refresher sees one (BM25's v0, a step-4 checkpoint) and
    the refresher's settings for it."""
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    cfg = RefreshConfig(
        run_dir=str(run), data_dir=str(data), batch_size=8, device="cpu", progress=False,
        mining=MiningConfig(top_k=10, num_negatives=3, strategy="top"), **kw,
    )  # fmt: skip
    publish_bm25(cfg, ts, RunLayout(run).negatives)
    return cfg, fake_checkpoint(run, 4, encoder)


def _negatives(run: Path) -> list[list[int]]:
    neg = load_current(run / "negatives")
    assert neg.version == 1
    return [neg.of(q).tolist() for q in range(neg.num_queries)]


def test_a_refresher_on_corrupt_data_encodes_nothing_and_the_shared_cache_stays_clean(
    inputs, tmp_path, tokenizer_dir
):
    """The embedding cache is keyed by the manifest's sha256: a refresher that encoded a
    corrupt shard (ids scrambled, all still valid) would fill a shared cache that clean runs
    then hit. It is refused before encoding, publishing nothing; a clean run's negatives with
    the shared cache equal those without one."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    clean = prepared_set(tmp_path / "clean", inputs.beir, tokenizer_dir)
    ts = ance_data.load(clean)
    corrupt = Path(shutil.copytree(clean, tmp_path / "corrupt"))
    scramble_token_ids(corrupt / CORPUS_SHARD)
    cache = tmp_path / "cache"
    cache.mkdir()

    bad_run = tmp_path / "bad_run"
    _refresh_run(bad_run, ts, inputs.init, corrupt)
    cmd = refresh_cmd(
        bad_run, "--data_dir", str(corrupt), "--cache_dir", str(cache), "--max_versions", "1",
        "--mining.strategy", "top", "--mining.top_k", "10",
    )  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    line = one_error(result)
    assert f"{corrupt / CORPUS_SHARD}: sha256 differs" in line, line
    assert handoff.published_versions(bad_run / "negatives") == [0]
    assert handoff.read_pointer(bad_run / "negatives")["version"] == 0
    assert not list(cache.iterdir())  # nothing encoded, nothing cached

    cfg, checkpoint = _refresh_run(tmp_path / "plain", ts, inputs.init, clean)
    refresher.refresh_once(cfg, ts, checkpoint, 1, stages.Group(60))
    cfg, checkpoint = _refresh_run(
        tmp_path / "cached", ts, inputs.init, clean, cache_dir=str(cache)
    )
    refresher.refresh_once(cfg, ts, checkpoint, 1, stages.Group(60))
    assert _negatives(tmp_path / "cached") == _negatives(tmp_path / "plain")


# --- item 3: a resume after the init run wrote a newer checkpoint -------------------------------


def test_a_finetune_resumes_after_its_init_run_wrote_a_newer_checkpoint(
    inputs, pretrained, tmp_path
):
    init_run = Path(shutil.copytree(pretrained, tmp_path / "pretrain"))
    newer = init_run / "checkpoints" / step_tag(4)
    shutil.move(newer, tmp_path / "aside")  # the init run is at step 2 when fine-tuning starts
    run = tmp_path / "run"
    first = finetune(run, inputs.beir, init_run, "--stop_at_step", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.move(tmp_path / "aside", newer)  # and wrote step 4 since (a Slurm requeue)

    resumed = finetune(run, inputs.beir, init_run, "--checkpoint.resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 1" in resumed.stderr, resumed.stderr[-3000:]
    assert steps(run) == [1, 2, 3]


def test_an_older_ready_is_accepted_for_the_same_tokenizer_and_a_mismatch_is_one_line(
    inputs, tmp_path, tokenizer_dir
):
    """``READY`` written before the fingerprint recorded the tokenizer's path: accepted when
    the shards' tokenizer is this run's (and brought up to date); another tokenizer, or
    another length, is one line naming what differs, never a settings dict."""
    from retromae_ds.data.tokenizer import train_wordpiece

    from synthetic import synthetic_texts

    data = prepared_set(tmp_path / "data", inputs.beir, tokenizer_dir)
    record = json.loads((data / ance_data.READY).read_text())
    record["tokenizer"] = str(tmp_path / "gone" / "step_00000006" / "encoder")  # older form
    (data / ance_data.READY).write_text(json.dumps(record))
    prepared_set(data, inputs.beir, tokenizer_dir)
    upgraded = json.loads((data / ance_data.READY).read_text())
    assert isinstance(upgraded["tokenizer"], dict)
    assert upgraded[ance_data.FINGERPRINT] == record[ance_data.FINGERPRINT]

    other = tmp_path / "other_tokenizer"
    train_wordpiece(synthetic_texts(300, seed=9), 150, other)
    with pytest.raises(ValueError) as refused:
        prepared_set(data, inputs.beir, other)
    message = str(refused.value)
    assert "\n" not in message and "{" not in message, message
    assert "the tokenizer" in message and "vocab_sha256" in message, message
    assert "another --run_dir" in message, message

    with pytest.raises(ValueError) as refused:
        ance_data.prepare(
            inputs.beir, "train", tokenizer_dir, data, q_max_len=16, p_max_len=64, progress=False
        )
    message = str(refused.value)
    assert "\n" not in message and "{" not in message, message
    assert "p_max_len 32, this run 64" in message and "q_max_len" not in message, message


# --- item 5: failed up-front checks do not block the rerun --------------------------------------


def test_an_unfinished_data_folder_is_tokenized_again_once_the_input_is_fixed(
    inputs, tmp_path, tokenizer_dir, capsys
):
    beir = Path(shutil.copytree(inputs.beir, tmp_path / "beir"))
    corpus = beir / "corpus.jsonl"
    good = corpus.read_bytes()
    lines = good.split(b"\n")
    lines[40] = b'{"_id": "d40", "title": "", "text": "bad \xff\xfe bytes"}'
    corpus.write_bytes(b"\n".join(lines))
    data = tmp_path / "data"
    for _ in range(2):  # the same input again: the same one-line refusal
        with pytest.raises(ValueError, match=r"corpus\.jsonl:41: invalid UTF-8"):
            prepared_set(data, beir, tokenizer_dir)
    assert not (data / ance_data.READY).exists()

    corpus.write_bytes(good)
    capsys.readouterr()
    prepared_set(data, beir, tokenizer_dir)
    assert "tokenizing again" in capsys.readouterr().err
    ts = ance_data.load(data)
    assert ts.num_queries == 16 and not (data / ance_data.PREPARING).exists()


def test_a_foreign_folder_in_an_unfinished_data_folder_is_named_not_removed(
    inputs, tmp_path, tokenizer_dir
):
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    (data / "corpus" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=rf"^{data / 'corpus'}: not a folder this tool"):
        prepared_set(data, inputs.beir, tokenizer_dir)
    assert (data / "corpus" / "notes.txt").read_text() == "mine"


def test_a_pooling_the_init_cannot_serve_is_refused_before_anything_is_prepared(inputs, tmp_path):
    run = tmp_path / "run"
    refused = finetune(run, inputs.beir, inputs.init, "--model.pooling", "dupmae")
    line = one_error(refused)
    assert "no MLM head" in line, line
    assert not (run / "data").exists() and not (run / "negatives").exists()


# --- item 6: finetune into a pre-training run --------------------------------------------------


def test_finetune_into_a_pretraining_run_is_refused_writing_nothing(inputs, pretrained, tmp_path):
    run = Path(shutil.copytree(pretrained, tmp_path / "pretrain"))
    before = listing(run)
    refused = finetune(run, inputs.beir, inputs.init)
    line = one_error(refused)
    assert f"{run}: a pre-training run" in line and "--run_dir" in line, line
    assert "checkpoint.resume" not in line, line
    assert listing(run) == before
