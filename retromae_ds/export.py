"""Export a pre-trained encoder as a Hugging Face model folder.

``retromae-ds export CKPT OUT``: CKPT is a complete checkpoint folder or a run folder (its
newest complete checkpoint is used). OUT gets the encoder body (safetensors), its config and
tokenizer, loadable with ``AutoModel.from_pretrained``, plus the sentence-transformers files
for CLS pooling, so ``SentenceTransformer(OUT)`` gives the training-time sentence embedding
(the last-layer hidden state at position 0). The MLM head is left out; the complete masked-LM
model (for continued pre-training) stays in the checkpoint's ``encoder/`` folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from retromae_ds import checkpoint as ckpt
from retromae_ds.hfutil import load_pretrained, quiet_transformers
from retromae_ds.layout import ENCODER


def export_encoder(checkpoint: str | Path, out: str | Path, pooling: str = "cls") -> Path:
    """Write the encoder of ``checkpoint`` to ``out`` (atomically: staged, then renamed)."""
    from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

    if pooling not in ("cls", "mean"):
        raise ValueError(f"pooling must be 'cls' or 'mean', not {pooling!r}")
    source = ckpt.resolve_checkpoint(checkpoint) / ENCODER
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}: the checkpoint holds no encoder folder")
    out = Path(out)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    mlm = load_pretrained(AutoModelForMaskedLM, source)
    torch.manual_seed(0)  # the (unused, untrained) pooler gets a fixed initialisation
    with quiet_transformers():
        body = AutoModel.from_config(mlm.config)
        missing, unexpected = body.load_state_dict(mlm.base_model.state_dict(), strict=False)
        if unexpected or any(not k.startswith("pooler.") for k in missing):
            raise RuntimeError(f"encoder body mismatch: missing {missing}, unexpected {unexpected}")
        body.save_pretrained(str(staging), safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        tokenizer.save_pretrained(str(staging))
    write_sentence_transformers_files(
        staging, mlm.config.hidden_size, pooling, mlm.config.max_position_embeddings
    )
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    return out


def write_sentence_transformers_files(folder: Path, dim: int, pooling: str, max_len: int) -> None:
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_len, "do_lower_case": False}, indent=2)
    )
    pool = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
