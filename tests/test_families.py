"""Other encoder families: a local RoBERTa-style checkpoint with a byte-level BPE tokenizer
(special tokens <s>=0, <pad>=1, </s>=2, recognised by id) pre-trains through the same path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.data.collate import IndexedSamples, MaskingConfig, PretrainCollator
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

from synthetic import synthetic_texts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def roberta(tmp_path_factory) -> tuple[Path, Path]:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, RobertaConfig, RobertaForMaskedLM

    root = tmp_path_factory.mktemp("roberta")
    texts = synthetic_texts(300, seed=31)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    )
    from tokenizers.processors import RobertaProcessing

    tok.backend_tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    model_dir = root / "model"
    tok.save_pretrained(str(model_dir))
    config = RobertaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64 + 2,
        pad_token_id=1,
    )
    RobertaForMaskedLM(config).save_pretrained(str(model_dir))
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run_preprocess(
        PreprocessConfig(
            inputs=[str(src)],
            out=str(root / "shards"),
            tokenizer=str(model_dir),
            max_length=64,
            progress=False,
        )
    )
    return model_dir, root / "shards"


def test_roberta_special_ids_and_word_starts(roberta):
    _, shards = roberta
    ds = ShardDataset(shards)
    special = SpecialIds.from_fingerprint(ds.manifest["tokenizer"])
    assert (special.cls, special.pad, special.sep) == (0, 1, 2)
    batch = PretrainCollator(special, MaskingConfig(), 64)(
        [IndexedSamples(ds)[i] for i in range(8)]
    )
    assert (batch["input_ids"][:, 0] == 0).all() and (batch["labels"][:, 0] == -100).all()
    assert (batch["word_ids"][:, 0] == 0).all()
    # byte-level BPE: sub-word pieces exist, so not every token starts a word
    starts = ds[0].word_starts
    assert 0 < starts.sum() < len(starts) or len(starts) < 3


def test_roberta_checkpoint_pretrains(roberta, tmp_path):
    model_dir, shards = roberta
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "retromae_ds.pretrain",
            "--data.shards",
            str(shards),
            "--run_dir",
            str(tmp_path / "run"),
            "--model.encoder.name",
            str(model_dir),
            "--max_steps",
            "3",
            "--log_every",
            "1",
            "--progress",
            "false",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 3 and all(r["decoder_loss"] > 0 for r in rows)
    exported = tmp_path / "run" / "checkpoints" / "step_00000003" / "encoder" / "config.json"
    assert json.loads(exported.read_text())["model_type"] == "roberta"
