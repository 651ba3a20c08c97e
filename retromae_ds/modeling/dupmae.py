"""DupMAE (Xiao et al., RetroMAE v2): RetroMAE's loss plus bow_weight · the bag-of-words loss
of the ordinary tokens: the MLM head over every ordinary position's final hidden state,
max-pooled per document into one vocabulary-sized vector whose softmax predicts the
document's distinct tokens (``modeling.bow``, which states the loss exactly; packed rows pool
per document). Its encoder is read with the ``dupmae`` poolings (docs/dupmae.md)."""

from __future__ import annotations

import torch

from retromae_ds.attention.packing import Packing
from retromae_ds.modeling.bow import bow_loss, pooled_vocabulary
from retromae_ds.modeling.objective import Batch, Terms, ordinary_tokens
from retromae_ds.modeling.retromae import RetroMAE


class DupMAE(RetroMAE):
    """RetroMAE + the ordinary tokens' bag-of-words task (no parameters of its own)."""

    metrics = RetroMAE.metrics + ("bow_loss", "bow_recall")
    poolings = ("dupmae", "dupmae_bow", "cls", "mean")

    def terms(
        self, model, hidden_BLH: torch.Tensor, batch: Batch, packing: Packing | None
    ) -> Terms:
        weighted, logged = super().terms(model, hidden_BLH, batch, packing)
        loss, recall = self.bow_loss(model, hidden_BLH, batch, packing)
        logged.update(bow_loss=loss.detach(), bow_recall=recall)
        return [*weighted, self.config.bow_weight * loss], logged

    def bow_loss(
        self, model, hidden_BLH: torch.Tensor, batch: Batch, packing: Packing | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(bag-of-words loss, detached recall) of the ordinary tokens' max-pooled logits."""
        B, L, _ = hidden_BLH.shape
        flat_N, doc_N, docs = ordinary_tokens(batch, B, L, packing)
        features_NH = hidden_BLH.flatten(0, 1).index_select(0, flat_N)
        pooled_DV = pooled_vocabulary(
            model.encoder,
            features_NH,
            doc_N,
            docs,
            chunked=model.chunked_head,
            chunk=self.config.head_chunk,
        )
        tokens_N = batch["decoder_labels"].flatten().index_select(0, flat_N)
        return bow_loss(pooled_DV, tokens_N, doc_N)
