"""The encoder: a Hugging Face masked-LM model of the BERT / RoBERTa / XLM-R families.

Either loaded from a local checkpoint folder, or built from scratch from a named size preset
(``tiny``, ``small``, ``base``) with the vocabulary of the shards' tokenizer. The sentence
embedding is the last-layer hidden state at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from retromae_ds.attention.packing import Packing
from retromae_ds.modeling.load import load_pretrained
from retromae_ds.modeling.long_attention import use_broadcast_mask
from retromae_ds.modeling.mask_form import takes_4d_mask
from retromae_ds.modeling.positions import extend_positions, position_offset

PRESETS = {
    # name: (layers, hidden, heads, intermediate)
    "tiny": (2, 128, 2, 512),
    "small": (4, 256, 4, 1024),
    "base": (12, 768, 12, 3072),
}


@dataclass(kw_only=True)
class EncoderConfig:
    """Which encoder to train."""

    name: str = "tiny"
    """A preset (tiny, small, base) trained from scratch, a local Hugging Face MLM folder, or a
    pre-training run or checkpoint (its newest complete checkpoint's encoder, MLM head
    included: continued pre-training)."""
    max_position_embeddings: int = 512
    """Positions of a from-scratch encoder (>= the shards' max length)."""
    max_positions: int = 0
    """Extend a loaded checkpoint to this many positions (tokens per input, specials included):
    the new absolute position embeddings start as copies of the trained ones
    (``modeling.positions``; Longformer, BGE-M3). 0: the checkpoint's own. A preset gets
    max(max_position_embeddings, max_positions)."""
    dropout: float = 0.1
    """Hidden and attention dropout of a from-scratch encoder."""
    attention_dropout: float | None = None
    """Dropout of the attention probabilities (None: the checkpoint's own, or ``dropout``).
    Fused attention kernels on CPU need 0 (``modeling.long_attention``): set it for long
    inputs."""
    gradient_checkpointing: bool = False
    """Recompute encoder activations in the backward pass to save memory."""

    def __post_init__(self) -> None:
        if self.attention_dropout is not None and not 0 <= self.attention_dropout < 1:
            raise ValueError(
                f"model.encoder.attention_dropout must be in [0, 1), not {self.attention_dropout}"
            )
        if self.max_positions < 0:
            raise ValueError(f"model.encoder.max_positions must be >= 0, not {self.max_positions}")
        if self.name not in PRESETS and not Path(self.name).is_dir():
            raise ValueError(
                f"model.encoder.name: {self.name!r} is neither a preset {sorted(PRESETS)} nor a local folder"
            )


def build_encoder(
    cfg: EncoderConfig, vocab_size: int, pad_id: int, *, folder: str | Path | None = None
) -> nn.Module:
    """A masked-LM model: from the preset (random init, fixed by torch's seed) or a folder,
    ``folder`` when given (the caller's resolved ``cfg.name``, e.g. a run's verified newest
    encoder: ``checkpoint.resolve_encoder``), else ``cfg.name`` itself."""
    from transformers import AutoModelForMaskedLM, BertConfig, BertForMaskedLM

    if cfg.name in PRESETS:
        layers, hidden, heads, inter = PRESETS[cfg.name]
        config = BertConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=inter,
            max_position_embeddings=max(cfg.max_position_embeddings, cfg.max_positions),
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.dropout,
            pad_token_id=pad_id,
        )
        model = BertForMaskedLM(config)
        use_broadcast_mask(model)
        takes_4d_mask(model)  # the mask form, chosen now rather than at the first step
    else:
        # a missing MLM head is named (an exported encoder has none: start from its run);
        # loading installs the broadcast padding mask
        model = load_pretrained(AutoModelForMaskedLM, folder or cfg.name)
        if model.config.vocab_size < vocab_size:
            raise ValueError(
                f"{cfg.name}: model vocabulary {model.config.vocab_size} < tokenizer vocabulary {vocab_size}; "
                "preprocess the shards with this model's tokenizer"
            )
        if cfg.max_positions:
            extend_positions(model, cfg.max_positions)
    if cfg.attention_dropout is not None:
        set_attention_dropout(model, cfg.attention_dropout)
    if cfg.gradient_checkpointing:
        # transformers >= 5 renamed it; the old name still works there but warns
        enable = (
            getattr(model, "activation_checkpointing_enable", None)
            or model.gradient_checkpointing_enable
        )
        enable()
    return model


def set_attention_dropout(model: nn.Module, p: float) -> None:
    """Set the attention-probability dropout of every self-attention layer (and the config)."""
    layers = [
        m.dropout
        for m in model.modules()
        if type(m).__name__.endswith("SelfAttention")
        and isinstance(getattr(m, "dropout", None), nn.Dropout)
    ]
    if not layers:
        raise TypeError(f"{type(model).__name__}: no self-attention dropout found to set")
    for dropout in layers:
        dropout.p = p
    model.config.attention_probs_dropout_prob = p


def mlm_head(model: nn.Module) -> nn.Module:
    """The MLM prediction head (transform + vocabulary projection) of a HF masked-LM model."""
    for name in ("cls", "lm_head"):
        head = getattr(model, name, None)
        if head is not None:
            return head
    raise TypeError(f"{type(model).__name__}: no MLM head found (expected .cls or .lm_head)")


def padding_mask_4d(attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """The [B, 1, 1, L] boolean key-padding mask (True: attend) of a [B, L] 0/1 mask.

    transformers' SDPA path checks a 2-D mask for padding (``mask.all()``) to skip the mask
    when there is none: a read from the device at every forward, so a GPU waits for the host
    every step. A 4-D mask is used as it is, with no such check, and broadcasts inside SDPA's
    kernels; outputs are bit-identical to the 2-D path's (tests/test_host_reads.py)."""
    return attention_mask_BL[:, None, None, :].bool()


def compile_whole(parts: list[nn.Module], backend: str) -> list[nn.Module]:
    """``torch.compile`` each module in place as one whole graph (``fullgraph``: a graph
    break is an error) with dynamic batch and length from the first call (no recompilation
    per padded length); parameters and state-dict keys stay as they are. Returns ``parts``."""
    for part in parts:
        part.compile(fullgraph=True, dynamic=True, backend=backend)
    return parts


# attention implementations that take a boolean 4-D mask as SDPA does (eager adds the mask)
_BOOL_MASK_ATTENTION = ("sdpa", "sdpa_broadcast_mask")


def encode(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packing: Packing | None = None,
) -> torch.Tensor:
    """Last-layer hidden states [B, L, H] of the encoder body. With SDPA attention the padding
    mask goes in as ``padding_mask_4d`` (as [B, 1, L] where this transformers takes no 4-D
    mask: ``takes_4d_mask``): no read from the device. Packed rows (``packing``)
    attend within their document, with positions counted from each document's [CLS]: each
    document's states are those it gets alone (tests/test_packing.py)."""
    body = model.base_model
    implementation = getattr(body.config, "_attn_implementation", None)
    four_d = takes_4d_mask(model)
    if packing is not None:
        mask = packing.encoder_mask()
        if not four_d:  # [B, L, L]: transformers makes it additive, for every implementation
            mask = mask[:, 0]
        elif implementation not in _BOOL_MASK_ATTENTION:  # eager adds the mask to the scores
            mask = additive_mask(mask, body.dtype)
        positions = packing.position_ids_BL + position_offset(model)
        out = body(input_ids=input_ids, attention_mask=mask, position_ids=positions)
        return out.last_hidden_state
    mask = attention_mask
    if attention_mask.dim() == 2 and implementation in _BOOL_MASK_ATTENTION:
        # before 4-D masks, a 3-D [B, 1, L] one skips the same check (its own broadcast form)
        mask = padding_mask_4d(attention_mask) if four_d else attention_mask[:, None, :]
    return body(input_ids=input_ids, attention_mask=mask).last_hidden_state


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive mask eager attention adds to its scores."""
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill_(~visible, torch.finfo(dtype).min)
