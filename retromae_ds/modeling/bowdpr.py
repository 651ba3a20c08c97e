"""bowdpr: bag-of-words prediction from the [CLS] vector, with no decoder.

Ma et al., "Drop your Decoder: Pre-training with Bag-of-Word Prediction for Dense Passage
Retrieval" (SIGIR 2024; ma787639046/bowdpr). Masked auto-encoders pass the input through a
decoder so that [CLS] must carry it; bowdpr asks [CLS] for the input's words directly. The
MLM head (transform + vocabulary projection, shared with the MLM task) maps the final hidden
state h_d of document d's [CLS] position to vocabulary logits z_d, and their softmax must
predict d's distinct ordinary tokens T_d (every real token but the specials), a multi-label
task over the vocabulary:

    L_bow(d) = -(1 / |T_d|) · Σ_{t ∈ T_d} log softmax(z_d)[t]
    loss     = mlm_weight · MLM + decoder_weight · mean_d L_bow(d)

- **Weight**: ``--model.objective.decoder_weight`` (default 1: the paper's plain sum); the
  [CLS] prediction takes the decoder's place, so it takes the decoder's weight.
- **Masking**: the encoder's usual masking (``--masking.encoder_ratio``, default 0.3, the
  paper's 30 %); h_d comes from the same forward pass of the masked input as the MLM loss.
- **Cost**: one head application per document (D×V logits, not N×V), no decoder and no
  parameters beyond the encoder's: its step costs about an MLM step.
- **Packed rows** (``--data.packing``): each document's own first position and its own bag.
- **Logged**: ``bow_loss`` and ``bow_recall`` (the share of T_d among z_d's |T_d| largest
  entries, as for DupMAE).

Its encoder is read with CLS pooling, like RetroMAE's.
"""

from __future__ import annotations

import torch

from retromae_ds.attention.packing import Packing
from retromae_ds.modeling.bow import bag_of_words, bag_recall
from retromae_ds.modeling.encoder import mlm_head
from retromae_ds.modeling.objective import Batch, Objective, Terms, ordinary_tokens


class BowDPR(Objective):
    """MLM + the [CLS] vector's bag-of-words prediction (no parameters of its own)."""

    decoder_inputs = True  # the unmasked input's ordinary tokens are the targets
    metrics = ("bow_loss", "bow_recall")
    poolings = ("cls", "mean")

    def terms(
        self, model, hidden_BLH: torch.Tensor, batch: Batch, packing: Packing | None
    ) -> Terms:
        B, L, H = hidden_BLH.shape
        flat_N, doc_N, docs = ordinary_tokens(batch, B, L, packing)
        logits_DV = mlm_head(model.encoder)(_cls_vectors(hidden_BLH, packing, docs)).float()
        tokens_N = batch["decoder_labels"].flatten().index_select(0, flat_N)
        bag_DV = bag_of_words(tokens_N, doc_N, docs, logits_DV.shape[1], logits_DV.device)
        distinct_D = bag_DV.sum(-1)
        per_doc = -(bag_DV * torch.log_softmax(logits_DV, dim=-1)).sum(-1)
        has_D = (distinct_D > 0).float()
        loss = (per_doc / distinct_D.clamp_min(1.0) * has_D).sum() / has_D.sum().clamp_min(1.0)
        logged = {"bow_loss": loss.detach(), "bow_recall": bag_recall(logits_DV, bag_DV, has_D)}
        return [self.config.decoder_weight * loss], logged


def _cls_vectors(hidden_BLH: torch.Tensor, packing: Packing | None, docs: int) -> torch.Tensor:
    """``[docs, H]``: each document's final hidden state at its first position. Packed, the
    first positions are summed into their documents' rows (every other position with weight
    0), so no size is read from the device."""
    if packing is None:
        return hidden_BLH[:, 0]
    first_N = packing.is_first().flatten().to(hidden_BLH.dtype)
    doc_N = packing.doc_ids_BL.flatten().long().clamp_min(0)
    flat_NH = hidden_BLH.flatten(0, 1) * first_N[:, None]
    return flat_NH.new_zeros(docs, flat_NH.shape[1]).index_add(0, doc_N, flat_NH)
