"""SEED-Encoder (Lu et al. 2021): loss = mlm_weight · MLM + decoder_weight · autoregressive
reconstruction by a weak decoder of ``decoder_layers`` layers (default 3). Decoder position
0 holds the sentence embedding; position t ≥ 1 holds the embedding of token t-1 (teacher
forcing, with position t) and predicts token t, seeing only position 0 and the previous
``window`` tokens (default 2), so it has to rely on the sentence embedding;
``strong_decoder`` (full causal attention) is the paper's ablation. The decoder shares the
encoder's embedding module and MLM head."""

from __future__ import annotations

import torch
from torch import nn

from retromae_ds.attention import WindowSpec
from retromae_ds.attention.packing import Packing
from retromae_ds.modeling.objective import (
    Batch,
    DecoderObjective,
    decoder_compiles,
    decoder_layer,
)
from retromae_ds.modeling.positions import position_offset
from retromae_ds.modeling.retromae import reconstruction


class SEEDEncoder(DecoderObjective):
    """MLM + the weak autoregressive decoder (``model.decoder``, a list of layers)."""

    poolings = ("cls", "mean")

    def build(self, model) -> None:
        model.decoder = nn.ModuleList(
            decoder_layer(model) for _ in range(self.config.decoder_layers)
        )

    def window(self) -> int | None:
        return None if self.config.strong_decoder else self.config.window

    def compile_parts(self, model, device_type: str) -> list[nn.Module]:
        spec = WindowSpec(torch.zeros(1), self.window())
        backend = self.config.attention
        return [layer for layer in model.decoder if decoder_compiles(backend, device_type, spec)]

    def decoder_loss(
        self, model, hidden_BLH: torch.Tensor, batch: Batch, packing: Packing | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, detached accuracy) of the weak decoder's next-token predictions."""
        embeddings = model.encoder.base_model.embeddings
        original = batch["original_ids"]
        # teacher forcing: position t holds token t-1 (with position t), position 0 the CLS vector
        shifted = torch.cat([original[:, :1], original[:, :-1]], dim=1)
        spec = WindowSpec(batch["lengths"], self.window(), packing)
        if packing is None:
            x_BLH = torch.cat([hidden_BLH[:, :1], embeddings(input_ids=shifted)[:, 1:]], dim=1)
        else:
            # a document's first position holds its CLS vector; the shift never crosses into
            # the previous document, since that position is not a shifted token
            positions_BL = packing.position_ids_BL + position_offset(model.encoder)
            tokens_BLH = embeddings(input_ids=shifted, position_ids=positions_BL)
            x_BLH = torch.where(packing.is_first()[..., None], hidden_BLH, tokens_BLH)
        for layer in model.decoder:
            x_BLH = layer(x_BLH, x_BLH, spec)
        return reconstruction(model, x_BLH, batch)
