"""Pre-training objectives over one encoder: RetroMAE, DupMAE, SEED-Encoder and plain MLM (the
control).

RetroMAE (Xiao et al. 2022): loss = w_mlm · encoder MLM + w_dec · decoder reconstruction,
where the one-layer decoder reconstructs every real token from the sentence embedding alone,
with "enhanced decoding":

- query stream  H1[i] = embeddings(inputs_embeds = sentence embedding)[i] (adds position i);
- key/value stream H2 = [sentence embedding; embeddings(unmasked original tokens)[1:]];
- position-specific visibility (``retromae_ds.attention.rules``), computed by the attention backend.

DupMAE (Xiao et al., RetroMAE v2): RetroMAE's loss plus w_bow · the bag-of-words loss of the
ordinary tokens: the MLM head over every ordinary position's final hidden state, max-pooled
per document into one vocabulary-sized vector whose softmax predicts the document's distinct
tokens (``modeling.bow``, which states the loss exactly; packed rows pool per document).

SEED-Encoder (Lu et al. 2021): loss = w_mlm · MLM + w_dec · autoregressive reconstruction by a
weak decoder of ``decoder_layers`` layers (default 3). Decoder position 0 holds the sentence
embedding; position t ≥ 1 holds the embedding of token t-1 (teacher forcing, with position t)
and predicts token t, seeing only position 0 and the previous ``window`` tokens (default 2), so
it has to rely on the sentence embedding; ``strong_decoder`` (full causal attention) is the
paper's ablation.

Decoders share the encoder's embedding module and MLM head, and are submodules of this
model, so it is saved and restored with every checkpoint. ``forward`` returns the loss and
the logged components (as detached tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from retromae_ds.attention import TwoStreamSpec, WindowSpec, resolve_backend
from retromae_ds.attention.packing import Packing, packing_of
from retromae_ds.base.special_tokens import IGNORE
from retromae_ds.modeling.bow import bow_loss, pooled_vocabulary
from retromae_ds.modeling.decoder import CrossStreamLayer
from retromae_ds.modeling.encoder import compile_whole, encode, mlm_head
from retromae_ds.modeling.positions import position_offset
from retromae_ds.modeling.vocab_loss import HeadParts, head_parts, linear_cross_entropy

OBJECTIVES = ("retromae", "dupmae", "seed", "mlm")
TWO_STREAM = ("retromae", "dupmae")
"""Objectives with RetroMAE's one-layer two-stream [CLS] decoder."""


@dataclass(kw_only=True)
class ObjectiveConfig:
    """What the encoder is trained to do."""

    name: str = "retromae"
    """``retromae`` (MLM + two-stream decoder), ``dupmae`` (RetroMAE + the ordinary tokens'
    bag-of-words task), ``seed`` (MLM + weak autoregressive decoder) or ``mlm`` (encoder MLM
    only, the control)."""
    mlm_weight: float = 1.0
    """Weight of the encoder MLM loss."""
    decoder_weight: float = 1.0
    """Weight of the decoder reconstruction loss."""
    bow_weight: float = 0.1
    """DupMAE: weight of the bag-of-words loss (the reference code's ``bow_loss_weight``
    default; the paper writes the plain sum)."""
    decoder_ratio: float = 0.5
    """RetroMAE: share of words each decoder query position may not see (the report's
    aggressive ratio; drawn per position by the decoder's attention rule)."""
    attention: str = "auto"
    """Decoder attention backend: ``auto`` (per device and rule: ``flex`` on CUDA; ``window``
    or ``chunked`` elsewhere), ``flex``, ``chunked``, ``window`` or ``reference`` (dense mask +
    SDPA, the oracle). See ``retromae_ds.attention``."""
    decoder_layers: int = 3
    """SEED-Encoder: layers of the weak decoder (RetroMAE always has one)."""
    window: int = 2
    """SEED-Encoder: previous tokens each decoder position may attend to."""
    strong_decoder: bool = False
    """SEED-Encoder ablation: full causal attention instead of the window."""
    head: str = "chunked"
    """Vocabulary loss of the MLM and decoder predictions (and DupMAE's max-pooled logits):
    ``chunked`` never holds the N×V logits (``modeling.vocab_loss``, ``modeling.bow``; same
    loss and gradients), ``plain`` calls the MLM head on every prediction at once."""
    head_chunk: int = 0
    """Predictions per chunk of the chunked head (0: as many as fit 64 MiB of fp32 logits)."""

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective.name must be one of {OBJECTIVES}, not {self.name!r}")
        from retromae_ds.attention import BACKENDS

        if self.attention != "auto" and self.attention not in BACKENDS:
            raise ValueError(
                f"objective.attention must be 'auto' or one of {sorted(BACKENDS)}, "
                f"not {self.attention!r}"
            )
        if self.bow_weight < 0:
            raise ValueError(f"objective.bow_weight must be >= 0, got {self.bow_weight}")
        if not 0.0 <= self.decoder_ratio <= 1.0:
            raise ValueError(f"objective.decoder_ratio must be in [0, 1], got {self.decoder_ratio}")
        if self.decoder_layers < 1 or self.window < 1:
            raise ValueError("objective.decoder_layers and objective.window must be >= 1")
        if self.head not in ("chunked", "plain") or self.head_chunk < 0:
            raise ValueError(
                f"objective.head must be chunked or plain (head_chunk >= 0), not {self.head!r}"
            )


class PretrainModel(nn.Module):
    def __init__(self, encoder: nn.Module, objective: ObjectiveConfig) -> None:
        super().__init__()
        self.encoder = encoder
        self.objective = objective
        self.decoder_ratio = objective.decoder_ratio
        c = encoder.config

        def layer() -> CrossStreamLayer:
            return CrossStreamLayer(
                c.hidden_size,
                c.num_attention_heads,
                c.intermediate_size,
                dropout=c.hidden_dropout_prob,
                layer_norm_eps=c.layer_norm_eps,
                backend=objective.attention,
            )

        if objective.name in TWO_STREAM:
            self.decoder = layer()
        elif objective.name == "seed":
            self.decoder = nn.ModuleList(layer() for _ in range(objective.decoder_layers))
        self._head_parts = (
            _checked_parts(mlm_head(encoder)) if objective.head == "chunked" else None
        )

    def external_parameters(self) -> list[nn.Parameter]:
        """Parameters this module's own forward uses outside their owners' forward (the
        chunked loss reads the head's projection directly): ZeRO-3 must be told to gather
        them for this module's forward (``deepspeed.zero.register_external_parameter``)."""
        parts = self._head_parts
        if parts is None:
            return []
        return [p for p in (parts.weight, parts.bias) if p is not None]

    def compile_parts(self, backend: str = "inductor", device_type: str = "cpu") -> list[nn.Module]:
        """``torch.compile`` the encoder body and the decoder layers in place (``--compile``):
        whole graphs (``fullgraph``: a graph break is an error), dynamic in batch and length
        from the first call (one graph serves every padded length, no recompilation), the
        parameters and state-dict keys unchanged; returns the compiled modules. The
        vocabulary loss stays eager (its number of predictions changes every batch), and so
        does a decoder whose attention resolves to the ``chunked`` backend on ``device_type``
        (a Python loop over query chunks with its own backward, which dynamo cannot trace
        with a symbolic length; CUDA's ``flex`` and the ``window`` and ``reference`` backends
        compile)."""
        parts: list[nn.Module] = [self.encoder.base_model]
        if self.objective.name in TWO_STREAM:
            parts += [self.decoder] if self._decoder_compiles(device_type, None) else []
        elif self.objective.name == "seed":
            window = None if self.objective.strong_decoder else self.objective.window
            spec = WindowSpec(torch.zeros(1), window)
            parts += [layer for layer in self.decoder if self._decoder_compiles(device_type, spec)]
        return compile_whole(parts, backend)

    def _decoder_compiles(self, device_type: str, spec: WindowSpec | None) -> bool:
        backend = self.objective.attention
        return resolve_backend(backend, device_type, spec) != "chunked"

    def vocab_loss(
        self, features_NH: torch.Tensor, targets_N: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy of the MLM head's predictions from ``features``, detached accuracy)."""
        parts = self._head_parts
        if parts is None:
            logits = mlm_head(self.encoder)(features_NH)
            accuracy = (logits.argmax(-1) == targets_N).float().mean().detach()
            return F.cross_entropy(logits.float(), targets_N), accuracy
        loss, correct = linear_cross_entropy(
            parts.transform(features_NH),
            parts.weight,
            parts.bias,
            targets_N,
            self.objective.head_chunk,
        )
        return loss, (correct.float() / max(1, len(targets_N))).detach()

    def sentence_embedding(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        return encode(self.encoder, input_ids, attention_mask)[:, 0]

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        packing = packing_of(batch)
        hidden_BLH = encode(self.encoder, batch["input_ids"], batch["attention_mask"], packing)
        features_NH, targets_N = _predicted(hidden_BLH, batch, "labels", "label_positions")
        mlm_loss, mlm_accuracy = self.vocab_loss(features_NH, targets_N)
        out = {
            "mlm_loss": mlm_loss.detach(),
            "mlm_accuracy": mlm_accuracy,
            "mlm_tokens": torch.full((), len(targets_N), device=targets_N.device),
        }
        loss = self.objective.mlm_weight * mlm_loss
        if self.objective.name != "mlm":
            two_stream = self.objective.name in TWO_STREAM
            decode = self._decoder_loss if two_stream else self._seed_loss
            dec_loss, dec_accuracy = decode(hidden_BLH, batch, packing)
            out["decoder_loss"] = dec_loss.detach()
            out["decoder_accuracy"] = dec_accuracy
            loss = loss + self.objective.decoder_weight * dec_loss
        if self.objective.name == "dupmae":
            b_loss, b_recall = self._bow_loss(hidden_BLH, batch, packing)
            out["bow_loss"] = b_loss.detach()
            out["bow_recall"] = b_recall
            loss = loss + self.objective.bow_weight * b_loss
        out["loss"] = loss
        return out

    def _bow_loss(
        self, hidden_BLH: torch.Tensor, batch: dict[str, torch.Tensor], packing: Packing | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DupMAE's bag-of-words loss (``modeling.bow``): the ordinary positions are the
        decoder's targets (every real token but the specials), pooled per document: per row,
        or per ``doc_ids`` entry when the batch is packed."""
        labels_BL = batch["decoder_labels"]
        if "decoder_label_positions" in batch:
            flat_N = batch["decoder_label_positions"]
        else:  # a batch built elsewhere: the boolean mask (a GPU waits for its count)
            flat_N = torch.nonzero(labels_BL.flatten() != IGNORE).squeeze(1)
        B, L, H = hidden_BLH.shape
        if packing is None:
            doc_N, docs = torch.div(flat_N, L, rounding_mode="floor"), B
        else:  # each position's document, in the batch's order
            doc_N = packing.doc_ids_BL.flatten().index_select(0, flat_N)
            docs = len(batch["lengths"])
        features_NH = hidden_BLH.flatten(0, 1).index_select(0, flat_N)
        pooled_DV = pooled_vocabulary(
            self.encoder,
            features_NH,
            doc_N,
            docs,
            chunked=self._head_parts is not None,
            chunk=self.objective.head_chunk,
        )
        return bow_loss(pooled_DV, labels_BL.flatten().index_select(0, flat_N), doc_N)

    def _decoder_loss(
        self, hidden_BLH: torch.Tensor, batch: dict[str, torch.Tensor], packing: Packing | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings = self.encoder.base_model.embeddings
        B, L, H = hidden_BLH.shape
        seeds = batch["decoder_seed"]
        if packing is not None:
            seeds = packing.per_position(seeds)
        spec = TwoStreamSpec(
            batch["word_ids"], batch["lengths"], seeds, self.decoder_ratio, packing
        )
        if packing is None:
            cls_B1H = hidden_BLH[:, :1]
            query_BLH = embeddings(inputs_embeds=cls_B1H.expand(B, L, -1))
            tokens_BLH = embeddings(input_ids=batch["original_ids"])
            kv_BLH = torch.cat([cls_B1H, tokens_BLH[:, 1:]], dim=1)
        else:
            # each position's own document: its sentence embedding, its own positions
            positions_BL = packing.position_ids_BL + position_offset(self.encoder)
            cls_BLH = hidden_BLH.gather(1, packing.starts()[..., None].expand(B, L, H))
            query_BLH = embeddings(inputs_embeds=cls_BLH, position_ids=positions_BL)
            tokens_BLH = embeddings(input_ids=batch["original_ids"], position_ids=positions_BL)
            kv_BLH = torch.where(packing.is_first()[..., None], hidden_BLH, tokens_BLH)
        dec_BLH = self.decoder(query_BLH, kv_BLH, spec)
        return self._reconstruction(dec_BLH, batch)

    def _seed_loss(
        self, hidden_BLH: torch.Tensor, batch: dict[str, torch.Tensor], packing: Packing | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings = self.encoder.base_model.embeddings
        original = batch["original_ids"]
        # teacher forcing: position t holds token t-1 (with position t), position 0 the CLS vector
        shifted = torch.cat([original[:, :1], original[:, :-1]], dim=1)
        window = None if self.objective.strong_decoder else self.objective.window
        spec = WindowSpec(batch["lengths"], window, packing)
        if packing is None:
            x_BLH = torch.cat([hidden_BLH[:, :1], embeddings(input_ids=shifted)[:, 1:]], dim=1)
        else:
            # a document's first position holds its CLS vector; the shift never crosses into
            # the previous document, since that position is not a shifted token
            positions_BL = packing.position_ids_BL + position_offset(self.encoder)
            tokens_BLH = embeddings(input_ids=shifted, position_ids=positions_BL)
            x_BLH = torch.where(packing.is_first()[..., None], hidden_BLH, tokens_BLH)
        for layer in self.decoder:
            x_BLH = layer(x_BLH, x_BLH, spec)
        return self._reconstruction(x_BLH, batch)

    def _reconstruction(
        self, dec_BLH: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, detached token accuracy) of the decoder's predictions at the
        labelled positions."""
        features_NH, targets_N = _predicted(
            dec_BLH, batch, "decoder_labels", "decoder_label_positions"
        )
        return self.vocab_loss(features_NH, targets_N)


def _predicted(
    hidden_BLH: torch.Tensor, batch: dict[str, torch.Tensor], labels: str, positions: str
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


def _checked_parts(head: nn.Module) -> HeadParts:
    """The head's transform and projection, checked once to reproduce the head itself."""
    parts = head_parts(head)
    if parts is not None:
        weight = parts.weight
        x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
        x = x.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            whole = head(x)
            split = parts.transform(x) @ weight.t()
            if parts.bias is not None:
                split = split + parts.bias
        if whole.shape == split.shape and torch.allclose(whole, split, rtol=1e-3, atol=1e-3):
            return parts
    raise ValueError(
        f"{type(head).__name__}: not a head the chunked vocabulary loss knows "
        "(transform + linear projection); use --model.objective.head plain"
    )
