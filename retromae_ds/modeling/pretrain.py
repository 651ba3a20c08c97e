"""Pre-training objectives over one encoder: RetroMAE and plain MLM (the control).

RetroMAE (Xiao et al. 2022): loss = w_mlm · encoder MLM + w_dec · decoder reconstruction,
where the one-layer decoder reconstructs every real token from the sentence embedding alone,
with "enhanced decoding":

- query stream  H1[i] = embeddings(inputs_embeds = sentence embedding)[i] (adds position i);
- key/value stream H2 = [sentence embedding; embeddings(unmasked original tokens)[1:]];
- position-specific visibility (``retromae_ds.masks``), computed by the attention backend.

The decoder shares the encoder's embedding module and MLM head, and is a submodule of this
model, so it is saved and restored with every checkpoint. ``forward`` returns the loss and
the logged components (as detached tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from retromae_ds.attention import TwoStreamSpec
from retromae_ds.data.collate import IGNORE
from retromae_ds.modeling.decoder import CrossStreamLayer
from retromae_ds.modeling.encoder import encode, mlm_head

OBJECTIVES = ("retromae", "mlm")


@dataclass(kw_only=True)
class ObjectiveConfig:
    """What the encoder is trained to do."""

    name: str = "retromae"
    """``retromae`` (MLM + two-stream decoder) or ``mlm`` (encoder MLM only, the control)."""
    mlm_weight: float = 1.0
    """Weight of the encoder MLM loss."""
    decoder_weight: float = 1.0
    """Weight of the decoder reconstruction loss."""
    attention: str = "reference"
    """Decoder attention backend: ``reference`` (dense mask + SDPA) or ``auto``."""

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective.name must be one of {OBJECTIVES}, not {self.name!r}")


class PretrainModel(nn.Module):
    def __init__(
        self, encoder: nn.Module, objective: ObjectiveConfig, decoder_ratio: float
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.objective = objective
        self.decoder_ratio = decoder_ratio
        if objective.name == "retromae":
            c = encoder.config
            self.decoder = CrossStreamLayer(
                c.hidden_size,
                c.num_attention_heads,
                c.intermediate_size,
                dropout=c.hidden_dropout_prob,
                layer_norm_eps=c.layer_norm_eps,
                backend=objective.attention,
            )

    def sentence_embedding(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        return encode(self.encoder, input_ids, attention_mask)[:, 0]

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        head = mlm_head(self.encoder)
        hidden_BLH = encode(self.encoder, batch["input_ids"], batch["attention_mask"])
        labels = batch["labels"]
        masked = labels != IGNORE
        mlm_logits = head(hidden_BLH[masked])
        mlm_targets = labels[masked]
        mlm_loss = F.cross_entropy(mlm_logits.float(), mlm_targets)
        out = {
            "mlm_loss": mlm_loss.detach(),
            "mlm_accuracy": (mlm_logits.argmax(-1) == mlm_targets).float().mean().detach(),
            "mlm_tokens": masked.sum().detach(),
        }
        loss = self.objective.mlm_weight * mlm_loss
        if self.objective.name == "retromae":
            dec_loss = self._decoder_loss(hidden_BLH, batch, head)
            out["decoder_loss"] = dec_loss.detach()
            loss = loss + self.objective.decoder_weight * dec_loss
        out["loss"] = loss
        return out

    def _decoder_loss(
        self, hidden_BLH: torch.Tensor, batch: dict[str, torch.Tensor], head: nn.Module
    ) -> torch.Tensor:
        embeddings = self.encoder.base_model.embeddings
        B, L, _ = hidden_BLH.shape
        cls_B1H = hidden_BLH[:, :1]
        query_BLH = embeddings(inputs_embeds=cls_B1H.expand(B, L, -1))
        tokens_BLH = embeddings(input_ids=batch["original_ids"])
        kv_BLH = torch.cat([cls_B1H, tokens_BLH[:, 1:]], dim=1)
        spec = TwoStreamSpec(
            batch["word_ids"], batch["lengths"], batch["decoder_seed"], self.decoder_ratio
        )
        dec_BLH = self.decoder(query_BLH, kv_BLH, spec)
        targets = batch["decoder_labels"]
        sel = targets != IGNORE
        return F.cross_entropy(head(dec_BLH[sel]).float(), targets[sel])
