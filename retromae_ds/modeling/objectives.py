"""The pre-training objectives, registered by name, and the model that trains one.

Each objective is one module (``retromae``, ``dupmae``, ``seed``; the control ``mlm`` is
``objective.MaskedLM``) holding a subclass of ``objective.Objective``, and one line below
registers it. ``PretrainModel`` is the encoder, the encoder MLM loss every objective shares,
the vocabulary loss their predictions go through, and the objective's own modules and terms:

    loss = mlm_weight · MLM + Σ the objective's weighted terms

Decoders share the encoder's embedding module and MLM head, and are submodules of this
model, so it is saved and restored with every checkpoint. ``forward`` returns the loss and
the logged components (as detached tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from retromae_ds.attention.packing import packing_of
from retromae_ds.modeling import bowdpr, dupmae, retromae, seed
from retromae_ds.modeling.encoder import compile_whole, encode, mlm_head
from retromae_ds.modeling.objective import OBJECTIVES, MaskedLM, Objective, predicted
from retromae_ds.modeling.vocab_loss import HeadParts, head_parts, linear_cross_entropy

OBJECTIVES.register("retromae", retromae.RetroMAE)
OBJECTIVES.register("dupmae", dupmae.DupMAE)
OBJECTIVES.register("seed", seed.SEEDEncoder)
OBJECTIVES.register("mlm", MaskedLM)
OBJECTIVES.register("bowdpr", bowdpr.BowDPR)


@dataclass(kw_only=True)
class ObjectiveConfig:
    """What the encoder is trained to do."""

    name: str = "retromae"
    """``retromae`` (MLM + two-stream decoder), ``dupmae`` (RetroMAE + the ordinary tokens'
    bag-of-words task), ``seed`` (MLM + weak autoregressive decoder), ``mlm`` (encoder MLM
    only, the control), or an objective another package registers."""
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
            raise ValueError(
                f"objective.name must be one of {', '.join(OBJECTIVES.names())} (or a name a "
                f"package adds through the {OBJECTIVES.group!r} entry point), not {self.name!r}"
            )
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
    """The encoder trained by one registered objective (``objective.name``)."""

    def __init__(self, encoder: nn.Module, objective: ObjectiveConfig) -> None:
        super().__init__()
        self.encoder = encoder
        self.objective = objective
        self.task: Objective = OBJECTIVES.get(objective.name, "objective.name")(
            objective.name, objective
        )
        self.task.build(self)
        self._head_parts = (
            _checked_parts(mlm_head(encoder)) if objective.head == "chunked" else None
        )

    @property
    def chunked_head(self) -> bool:
        """Whether vocabulary losses go chunk by chunk (``objective.head chunked``)."""
        return self._head_parts is not None

    def external_parameters(self) -> list[nn.Parameter]:
        """Parameters this module's own forward uses outside their owners' forward (the
        chunked loss reads the head's projection directly): ZeRO-3 must be told to gather
        them for this module's forward (``deepspeed.zero.register_external_parameter``)."""
        parts = self._head_parts
        if parts is None:
            return []
        return [p for p in (parts.weight, parts.bias) if p is not None]

    def compile_parts(self, backend: str = "inductor", device_type: str = "cpu") -> list[nn.Module]:
        """``torch.compile`` the encoder body and the objective's modules in place
        (``--compile``): whole graphs (``fullgraph``: a graph break is an error), dynamic in
        batch and length from the first call (one graph serves every padded length, no
        recompilation), the parameters and state-dict keys unchanged; returns the compiled
        modules. The vocabulary loss stays eager (its number of predictions changes every
        batch), and so does a decoder whose attention resolves to the ``chunked`` backend on
        ``device_type`` (CUDA's ``flex`` and the ``window`` and ``reference`` backends
        compile)."""
        parts = [self.encoder.base_model, *self.task.compile_parts(self, device_type)]
        return compile_whole(parts, backend)

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
        features_NH, targets_N = predicted(hidden_BLH, batch, "labels", "label_positions")
        mlm_loss, mlm_accuracy = self.vocab_loss(features_NH, targets_N)
        out = {
            "mlm_loss": mlm_loss.detach(),
            "mlm_accuracy": mlm_accuracy,
            "mlm_tokens": torch.full((), len(targets_N), device=targets_N.device),
        }
        loss = self.objective.mlm_weight * mlm_loss
        terms, logged = self.task.terms(self, hidden_BLH, batch, packing)
        for term in terms:  # in order: the sum is the same float sum on every rank
            loss = loss + term
        out.update(logged)
        out["loss"] = loss
        return out


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
