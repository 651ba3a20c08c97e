"""Longer inputs than a checkpoint was trained at: extend its absolute position embeddings.

BERT, RoBERTa and XLM-R learn one position embedding per position (512). To read N > 512
tokens, ``extend_positions(model, N)`` gives the model N usable positions, the new rows
initialised by repeating the trained ones (position ``p`` gets the trained row ``p mod 512``),
as Longformer did for RoBERTa and BGE-M3 for XLM-R (8,192): attention still sees a smooth,
locally correct position signal, and continued pre-training at length adapts it.

RoBERTa-style embeddings (XLM-R, CamemBERT, ...) number positions from ``padding_idx + 1``:
their table has ``offset`` more rows than usable positions (514 for 512). The offset rows are
kept as they are and only the usable rows are repeated; the config records the new table size
(``max_position_embeddings`` = N + offset), so a saved model loads back at N with
transformers' own classes. Positions below the old length keep their exact embeddings, so
inputs that fit the old length give the same outputs as before.
"""

from __future__ import annotations

import torch
from torch import nn


def embeddings(model: nn.Module) -> nn.Module:
    """The embeddings module of a BERT-family model (masked-LM or bare)."""
    emb = getattr(getattr(model, "base_model", model), "embeddings", None)
    if emb is None or not isinstance(getattr(emb, "position_embeddings", None), nn.Embedding):
        raise TypeError(
            f"{type(model).__name__}: no absolute position embeddings (embeddings.position_embeddings)"
        )
    return emb


def position_offset(model: nn.Module) -> int:
    """Rows of the position table before position 0 (RoBERTa family: padding_idx + 1)."""
    emb = embeddings(model)
    # transformers 4 (4.45 - 4.57) has only the second method on the module (the first is a
    # module-level function there)
    methods = ("create_position_ids_from_input_ids", "create_position_ids_from_inputs_embeds")
    if any(hasattr(emb, name) for name in methods):
        return int(emb.padding_idx) + 1
    return 0


def usable_positions(model: nn.Module) -> int:
    """The longest input (tokens, specials included) the model's position table covers."""
    return embeddings(model).position_embeddings.num_embeddings - position_offset(model)


def extend_positions(model: nn.Module, positions: int) -> bool:
    """Give ``model`` ``positions`` usable positions (in place); False if it already has them.

    Raises for a model whose positions are not absolute learned embeddings (rotary or relative
    ones need no extension of this kind, and copying would be wrong)."""
    config = model.config
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(
            f"{type(model).__name__}: position_embedding_type {kind!r}; only absolute position "
            "embeddings can be extended by copying"
        )
    old_len = usable_positions(model)
    if positions <= old_len:
        return False
    emb = embeddings(model)
    offset = position_offset(model)
    old = emb.position_embeddings
    weight = old.weight.detach()
    trained = weight[offset:]
    repeat = -(-positions // old_len)
    new_weight = torch.cat([weight[:offset], trained.repeat(repeat, 1)[:positions]])
    table = nn.Embedding(
        offset + positions,
        weight.shape[1],
        padding_idx=old.padding_idx,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        table.weight.copy_(new_weight)
    table.weight.requires_grad_(old.weight.requires_grad)
    emb.position_embeddings = table
    ids = torch.arange(offset + positions, device=weight.device).expand((1, -1))
    for name, value in (("position_ids", ids), ("token_type_ids", torch.zeros_like(ids))):
        if name in emb._buffers:
            persistent = name not in emb._non_persistent_buffers_set
            emb.register_buffer(name, value.to(emb._buffers[name].dtype), persistent=persistent)
    config.max_position_embeddings = offset + positions
    return True
