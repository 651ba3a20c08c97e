"""The dual encoder: query and passage towers (one shared Hugging Face encoder by default),
pooled sentence embeddings, and the contrastive loss with gathered in-batch negatives.

``save_encoders`` writes the towers as Hugging Face folders (with the tokenizer, the
sentence-transformers files and ``dual_encoder.json`` naming the pooling, normalisation,
temperature and the query/passage lengths it was trained at), which is what the refresher,
``retromae-ds eval`` and ``export`` read (``retromae_ds.sbert``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from retromae_ds import sbert
from retromae_ds.ance.loss import contrastive_loss
from retromae_ds.components.layout import ENCODER, QUERY_ENCODER
from retromae_ds.eval.encode import pool
from retromae_ds.modeling.encoder import compile_whole, encode


def load_body(folder: str | Path) -> nn.Module:
    """The encoder body (no MLM head, no pooler) of a local Hugging Face folder."""
    from transformers import AutoModel

    from retromae_ds.modeling.load import load_pretrained

    model = load_pretrained(AutoModel, folder)
    if getattr(model, "pooler", None) is not None:
        model.pooler = None  # unused by CLS/mean pooling; would hold parameters without grads
    return model


class DualEncoder(nn.Module):
    """``forward(batch)`` -> ``{"loss", "accuracy"}`` for a batch made by the fine-tuning
    collator; ``embed(ids, mask, query=...)`` -> pooled embeddings ``[B, D]``."""

    def __init__(
        self,
        encoder: nn.Module,
        query_encoder: nn.Module | None = None,
        *,
        pooling: str = "cls",
        normalize: bool = False,
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        if pooling not in ("cls", "mean") or temperature <= 0:
            raise ValueError(f"pooling cls|mean and temperature > 0, got {pooling}, {temperature}")
        self.encoder = encoder
        self.query_encoder = query_encoder
        self.pooling, self.normalize, self.temperature = pooling, normalize, temperature

    def compile_parts(self, backend: str = "inductor", device_type: str = "cpu") -> list[nn.Module]:
        """``torch.compile`` each tower in place (``--compile``: whole graphs, dynamic shapes,
        state-dict keys unchanged); pooling and the loss stay eager."""
        return compile_whole(
            [t for t in (self.encoder, self.query_encoder) if t is not None], backend
        )

    def embed(self, ids_BL: torch.Tensor, mask_BL: torch.Tensor, *, query: bool) -> torch.Tensor:
        tower = self.query_encoder if query and self.query_encoder is not None else self.encoder
        hidden_BLD = encode(tower, ids_BL, mask_BL)
        emb_BD = pool(hidden_BLD, mask_BL, self.pooling)
        return nn.functional.normalize(emb_BD, dim=-1) if self.normalize else emb_BD

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        q_BD = self.embed(batch["q_ids"], batch["q_mask"], query=True)
        p_PD = self.embed(batch["p_ids"], batch["p_mask"], query=False)
        loss, accuracy = contrastive_loss(
            q_BD, p_PD, batch["p_index"], batch["positives"], temperature=self.temperature
        )
        return {"loss": loss, "accuracy": accuracy}

    def settings(self) -> dict[str, Any]:
        return {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "temperature": self.temperature,
            "shared": self.query_encoder is None,
        }


def save_encoders(
    model: DualEncoder,
    state: dict[str, torch.Tensor],
    folder: Path,
    tokenizer_dir: str | Path,
    lengths: dict[str, int],
) -> None:
    """Write ``folder/encoder`` (and ``folder/query_encoder`` when the towers differ) from a
    full state dict of ``model`` (e.g. DeepSpeed's consolidated one). ``lengths``:
    ``q_max_len``, ``p_max_len`` (recorded in ``dual_encoder.json``) and ``max_seq_length``
    (what sentence-transformers reads texts up to)."""
    from transformers import AutoTokenizer

    from retromae_ds.hfutil import quiet_transformers

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    towers = [("encoder", ENCODER, model.encoder)]  # (attribute = state prefix, folder, module)
    if model.query_encoder is not None:
        towers.append(("query_encoder", QUERY_ENCODER, model.query_encoder))
    for prefix, sub_folder, tower in towers:
        sub = {
            k.removeprefix(f"{prefix}."): v for k, v in state.items() if k.startswith(f"{prefix}.")
        }
        out = folder / sub_folder
        tower.save_pretrained(str(out), state_dict=sub, safe_serialization=True)
        _record_dtype(out / "config.json", sub)
        tokenizer.save_pretrained(str(out))
        sbert.write_files(
            out,
            tower.config.hidden_size,
            model.pooling,
            lengths["max_seq_length"],
            normalize=model.normalize,
        )
        settings = {
            **model.settings(),
            "q_max_len": lengths["q_max_len"],
            "p_max_len": lengths["p_max_len"],
        }
        (out / sbert.DUAL_ENCODER_FILE).write_text(json.dumps(settings, indent=2))


def _record_dtype(config_file: Path, state: dict[str, torch.Tensor]) -> None:
    """Make ``config.json`` name the dtype of the weights written (a bf16 run's tower is
    bf16 while its saved weights are the fp32 master copies), so loaders do not cast them
    down."""
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()}
    if len(dtypes) != 1:
        return
    config = json.loads(config_file.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = next(iter(dtypes))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
