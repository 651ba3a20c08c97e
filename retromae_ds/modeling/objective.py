"""What a pre-training objective is: the extension point every objective implements.

An objective is a subclass of ``Objective`` registered in ``OBJECTIVES`` under its name
(``modeling/objectives.py`` registers the library's; another package registers its own
through the ``retromae_ds.objectives`` entry-point group, name -> the class). The trainer,
the collator and the checkpoints read only what the class declares:

- ``decoder_inputs``: whether the collator adds the unmasked input and the decoders' targets
  (``original_ids``, ``decoder_labels`` and ``decoder_label_positions``: every real token but
  the specials, ``word_ids``, ``decoder_seed``); without them a batch holds the masked input
  and the MLM labels only;
- ``build``: the modules it adds to the model (a decoder, a head). They become attributes of
  ``PretrainModel``, so they are saved, restored, sharded by ZeRO and given the decoder's
  learning rate like every parameter outside the encoder; their state-dict keys and the
  objective's name (``identity``, written in every checkpoint) are its resume identity;
- ``terms``: its weighted loss terms beside the encoder MLM loss every objective shares,
  with the figures it logs (``metrics`` names them for the progress line);
- ``poolings``: the poolings its encoder is meant to be read with (every encoder also serves
  ``cls`` and ``mean``);
- ``compile_parts``: which of its modules ``--compile`` may compile whole.

``MaskedLM`` is the base case: the encoder MLM loss alone (the control).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from retromae_ds.attention.packing import Packing
from retromae_ds.base.registry import Registry
from retromae_ds.base.special_tokens import IGNORE

PretrainModel = nn.Module
"""``objectives.PretrainModel`` (named here without importing it: it imports this module)."""

Batch = dict[str, torch.Tensor]
Terms = tuple[list[torch.Tensor], dict[str, torch.Tensor]]
"""(weighted loss terms, added to the MLM loss in this order; the figures logged)."""


class Objective:
    """One pre-training objective over an encoder (see the module doc). Subclasses set the
    class attributes and override what they add; instances hold the resolved config."""

    decoder_inputs: ClassVar[bool] = False
    """Whether the collator adds the unmasked input and the decoders' targets."""
    metrics: ClassVar[tuple[str, ...]] = ()
    """The figures ``terms`` logs, beside ``loss``, ``mlm_loss`` and ``mlm_accuracy``."""
    poolings: ClassVar[tuple[str, ...]] = ("cls",)
    """The poolings its encoder is meant to be read with, best first."""

    def __init__(self, name: str, config: Any) -> None:
        """``config``: the run's ``objectives.ObjectiveConfig``."""
        self.name, self.config = name, config

    def identity(self) -> dict[str, Any]:
        """What every checkpoint of this objective records (its marker's ``objective``)."""
        return {"objective": self.name}

    def build(self, model: PretrainModel) -> None:
        """Add this objective's modules to ``model`` (``model.decoder = ...``)."""

    def compile_parts(self, model: PretrainModel, device_type: str) -> list[nn.Module]:
        """Its modules ``--compile`` compiles whole on ``device_type`` (none by default)."""
        return []

    def terms(
        self, model: PretrainModel, hidden_BLH: torch.Tensor, batch: Batch, packing: Packing | None
    ) -> Terms:
        """Its weighted loss terms and logged figures, from the encoder's final hidden states
        of the masked input (the forward pass the MLM loss uses)."""
        return [], {}


class MaskedLM(Objective):
    """Plain MLM, the control: the shared encoder MLM loss and nothing else."""

    poolings = ("cls", "mean")


class DecoderObjective(Objective):
    """MLM + a decoder that reconstructs the input from the sentence embedding: one term,
    ``decoder_weight`` · its cross-entropy, logged with its accuracy. Subclasses build the
    decoder and give ``decoder_loss``."""

    decoder_inputs = True
    metrics = ("decoder_loss", "decoder_accuracy")

    def terms(
        self, model: PretrainModel, hidden_BLH: torch.Tensor, batch: Batch, packing: Packing | None
    ) -> Terms:
        loss, accuracy = self.decoder_loss(model, hidden_BLH, batch, packing)
        logged = {"decoder_loss": loss.detach(), "decoder_accuracy": accuracy}
        return [self.config.decoder_weight * loss], logged

    def decoder_loss(
        self, model: PretrainModel, hidden_BLH: torch.Tensor, batch: Batch, packing: Packing | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, detached token accuracy) of the decoder's predictions."""
        raise NotImplementedError


OBJECTIVES: Registry[type[Objective]] = Registry("objective", "retromae_ds.objectives")
"""Objective name -> its class (``modeling/objectives.py`` registers the library's)."""


def predicted(
    hidden_BLH: torch.Tensor, batch: Batch, labels: str, positions: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, H], targets [N]) at the labelled positions, row-major. With the
    collator's flat ``positions`` this is a gather whose size the host knows; a batch
    without them (built elsewhere) falls back to the boolean mask, whose nonzero makes a GPU
    wait for the host."""
    labels_BL = batch[labels]
    if positions not in batch:
        selected = labels_BL != IGNORE
        return hidden_BLH[selected], labels_BL[selected]
    flat_N = batch[positions]
    return hidden_BLH.flatten(0, 1).index_select(0, flat_N), labels_BL.flatten().index_select(
        0, flat_N
    )


def ordinary_tokens(batch: Batch, B: int, L: int, packing: Packing | None):
    """(flat positions [N] of the ordinary tokens: every real token but the specials, the
    decoders' targets; each one's document [N]; the number of documents): per row, or per
    ``doc_ids`` entry when the batch is packed."""
    labels_BL = batch["decoder_labels"]
    if "decoder_label_positions" in batch:
        flat_N = batch["decoder_label_positions"]
    else:  # a batch built elsewhere: the boolean mask (a GPU waits for its count)
        flat_N = torch.nonzero(labels_BL.flatten() != IGNORE).squeeze(1)
    if packing is None:
        return flat_N, torch.div(flat_N, L, rounding_mode="floor"), B
    # each position's document, in the batch's order
    return flat_N, packing.doc_ids_BL.flatten().index_select(0, flat_N), len(batch["lengths"])


def decoder_layer(model: PretrainModel) -> nn.Module:
    """One decoder layer shaped like ``model``'s encoder (its hidden size, heads, FFN width,
    dropout and LayerNorm epsilon), attending through ``objective.attention``."""
    from retromae_ds.modeling.decoder import CrossStreamLayer

    c = model.encoder.config
    return CrossStreamLayer(
        c.hidden_size,
        c.num_attention_heads,
        c.intermediate_size,
        dropout=c.hidden_dropout_prob,
        layer_norm_eps=c.layer_norm_eps,
        backend=model.objective.attention,
    )


def decoder_compiles(backend: str, device_type: str, spec: Any) -> bool:
    """Whether a decoder layer attending through ``backend`` for ``spec`` compiles on
    ``device_type``: every backend but ``chunked`` does (a Python loop over query chunks with
    its own backward, which dynamo cannot trace with a symbolic length)."""
    from retromae_ds.attention import resolve_backend

    return resolve_backend(backend, device_type, spec) != "chunked"
