"""Long inputs end to end: a 512-position checkpoint extended to 2,048 positions, pre-trained
with RetroMAE on whole WikiText articles (length-grouped batches), exported, and loaded back
with transformers at 2,048."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_train import metrics, pretrain

from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

from helpers_model import small_config

LONG = 2048


@pytest.fixture(scope="module")
def long_shards(tmp_path_factory) -> Path:
    from retromae_ds.data.long_task import build

    from helpers_data import SHARED_DATA

    wiki = SHARED_DATA / "wikitext2" / "wiki.test.raw"
    if not wiki.is_file():
        pytest.skip(f"{wiki} is absent (real WikiText-2 data)")
    root = tmp_path_factory.mktemp("long")
    task = build(wiki, root / "task")
    run_preprocess(
        PreprocessConfig(
            inputs=[str(task / "corpus.jsonl")],
            out=str(root / "shards"),
            train_tokenizer=2000,
            max_length=LONG,
            workers=2,
            progress=False,
        )
    )
    return root / "shards"


def _checkpoint_at_512(folder: Path, shards: Path) -> Path:
    """A small BERT MLM checkpoint with 512 positions and the shards' tokenizer."""
    from transformers import BertConfig, BertForMaskedLM

    from retromae_ds.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(shards / "tokenizer")
    torch.manual_seed(0)
    config = BertConfig(
        **small_config(
            len(tokenizer), 64, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id
        )
    )
    BertForMaskedLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.mark.slow
def test_extended_checkpoint_trains_at_2048_and_exports_at_2048(tmp_path, long_shards):
    manifest = json.loads((long_shards / "manifest.json").read_text())
    assert manifest["max_length"] == LONG
    init = _checkpoint_at_512(tmp_path / "init", long_shards)
    run = tmp_path / "run"
    pretrain(
        run,
        long_shards,
        "--model.encoder.name",
        str(init),
        "--model.encoder.max_positions",
        str(LONG),
        "--model.encoder.attention_dropout",
        "0",
        "--data.length_grouping",
        "2",
        "--micro_batch_size",
        "2",
        "--max_steps",
        "12",
        "--log_every",
        "3",
        "--deepspeed.config",
        '["ds_configs/zero2.json", "ds_configs/fp32.json"]',
    )
    rows = metrics(run)
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    # long rows were read: over 1,024 tokens per sample on average
    assert rows[-1]["tokens_seen"] > 1024 * 2 * rows[-1]["step"], rows[-1]

    from transformers import AutoModel, AutoTokenizer

    from retromae_ds.export import export_encoder
    from retromae_ds.modeling.positions import usable_positions

    out = export_encoder(run, tmp_path / "exported")
    model = AutoModel.from_pretrained(str(out), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert usable_positions(model) == LONG and tokenizer.model_max_length == LONG
    text = (long_shards.parent / "task" / "corpus.jsonl").read_text().splitlines()[1]
    enc = tokenizer(json.loads(text)["text"], truncation=True, max_length=LONG, return_tensors="pt")
    assert enc["input_ids"].shape[1] == LONG
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    assert hidden.shape == (1, LONG, 64) and torch.isfinite(hidden).all()


@pytest.fixture(scope="module")
def long_shards_4k(long_shards, tmp_path_factory) -> Path:
    """The same articles at 4,096 tokens a row, with the same tokenizer."""
    out = tmp_path_factory.mktemp("long4k") / "shards"
    run_preprocess(
        PreprocessConfig(
            inputs=[str(long_shards.parent / "task" / "corpus.jsonl")],
            out=str(out),
            tokenizer=str(long_shards / "tokenizer"),
            max_length=2 * LONG,
            workers=2,
            progress=False,
        )
    )
    return out


@pytest.mark.slow
def test_two_ranks_at_4096_loss_falls_and_resumes_exactly(tmp_path, long_shards_4k):
    init = _checkpoint_at_512(tmp_path / "init", long_shards_4k)
    common = [
        "--model.encoder.name",
        str(init),
        "--model.encoder.max_positions",
        str(2 * LONG),
        "--model.encoder.attention_dropout",
        "0",
        "--data.length_grouping",
        "2",
        "--micro_batch_size",
        "1",
        "--max_steps",
        "8",
        "--log_every",
        "1",
        "--checkpoint.every_steps",
        "4",
        "--deepspeed.config",
        '["ds_configs/zero2.json", "ds_configs/fp32.json"]',
    ]
    pretrain(tmp_path / "straight", long_shards_4k, *common, ranks=2)
    pretrain(tmp_path / "resumed", long_shards_4k, *common, "--stop_at_step", "4", ranks=2)
    pretrain(tmp_path / "resumed", long_shards_4k, *common, ranks=2)
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    keys = ("loss", "mlm_loss", "decoder_loss", "lr", "tokens_seen")
    for a, b in zip(straight, resumed, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (a, b)
    first, last = straight[:2], straight[-2:]
    assert sum(r["loss"] for r in last) < sum(r["loss"] for r in first), straight
    # one sample a rank and step, rows of up to 4,096 tokens: well over 1,024 on average
    assert straight[-1]["tokens_seen"] > 1024 * 8, straight[-1]
