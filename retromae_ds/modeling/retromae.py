"""RetroMAE (Xiao et al. 2022): encoder MLM plus a one-layer decoder that reconstructs every
real token from the sentence embedding alone, with "enhanced decoding":

- query stream  H1[i] = embeddings(inputs_embeds = sentence embedding)[i] (adds position i);
- key/value stream H2 = [sentence embedding; embeddings(unmasked original tokens)[1:]];
- position-specific visibility (``retromae_ds.attention.rules``), computed by the attention
  backend.

loss = mlm_weight · MLM + decoder_weight · reconstruction. The decoder shares the encoder's
embedding module and MLM head.
"""

from __future__ import annotations

import torch
from torch import nn

from retromae_ds.attention import TwoStreamSpec
from retromae_ds.attention.packing import Packing
from retromae_ds.modeling.objective import (
    Batch,
    DecoderObjective,
    decoder_compiles,
    decoder_layer,
    predicted,
)
from retromae_ds.modeling.positions import position_offset


class RetroMAE(DecoderObjective):
    """MLM + the two-stream [CLS] decoder (``model.decoder``, one layer)."""

    poolings = ("cls", "mean")

    def build(self, model) -> None:
        model.decoder = decoder_layer(model)

    def compile_parts(self, model, device_type: str) -> list[nn.Module]:
        compiles = decoder_compiles(self.config.attention, device_type, None)
        return [model.decoder] if compiles else []

    def decoder_loss(
        self, model, hidden_BLH: torch.Tensor, batch: Batch, packing: Packing | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, detached accuracy) of the decoder's reconstruction."""
        embeddings = model.encoder.base_model.embeddings
        B, L, H = hidden_BLH.shape
        seeds = batch["decoder_seed"]
        if packing is not None:
            seeds = packing.per_position(seeds)
        spec = TwoStreamSpec(
            batch["word_ids"], batch["lengths"], seeds, self.config.decoder_ratio, packing
        )
        if packing is None:
            cls_B1H = hidden_BLH[:, :1]
            query_BLH = embeddings(inputs_embeds=cls_B1H.expand(B, L, -1))
            tokens_BLH = embeddings(input_ids=batch["original_ids"])
            kv_BLH = torch.cat([cls_B1H, tokens_BLH[:, 1:]], dim=1)
        else:
            # each position's own document: its sentence embedding, its own positions
            positions_BL = packing.position_ids_BL + position_offset(model.encoder)
            cls_BLH = hidden_BLH.gather(1, packing.starts()[..., None].expand(B, L, H))
            query_BLH = embeddings(inputs_embeds=cls_BLH, position_ids=positions_BL)
            tokens_BLH = embeddings(input_ids=batch["original_ids"], position_ids=positions_BL)
            kv_BLH = torch.where(packing.is_first()[..., None], hidden_BLH, tokens_BLH)
        dec_BLH = model.decoder(query_BLH, kv_BLH, spec)
        return reconstruction(model, dec_BLH, batch)


def reconstruction(model, dec_BLH: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, detached token accuracy) of a decoder's predictions at the labelled
    positions."""
    features_NH, targets_N = predicted(dec_BLH, batch, "decoder_labels", "decoder_label_positions")
    return model.vocab_loss(features_NH, targets_N)
