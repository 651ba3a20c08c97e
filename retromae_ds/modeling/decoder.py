"""Decoder blocks for the pre-training objectives.

``CrossStreamLayer`` is one post-LN transformer layer (BERT's layout) whose queries come from
one stream and keys/values from another; with ``query is kv`` it is ordinary self-attention.
Which keys a query may see is a ``MaskSpec``, computed by the configured attention backend.
The module imports neither DeepSpeed nor torch.distributed.
"""

from __future__ import annotations

import torch
from torch import nn

from retromae_ds.attention import MaskSpec, attend


class CrossStreamLayer(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        intermediate: int,
        *,
        dropout: float = 0.1,
        layer_norm_eps: float = 1e-12,
        backend: str = "reference",
    ) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads, self.head_dim, self.backend = heads, hidden // heads, backend
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=layer_norm_eps)
        self.ffn_in = nn.Linear(hidden, intermediate)
        self.ffn_out = nn.Linear(intermediate, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.apply(_init_bert)

    def _split(self, x_BLH: torch.Tensor) -> torch.Tensor:
        B, L, _ = x_BLH.shape
        return x_BLH.view(B, L, self.heads, self.head_dim).transpose(1, 2)

    def forward(
        self, query_BLH: torch.Tensor, kv_BLH: torch.Tensor, spec: MaskSpec
    ) -> torch.Tensor:
        q = self._split(self.q_proj(query_BLH))
        k = self._split(self.k_proj(kv_BLH))
        v = self._split(self.v_proj(kv_BLH))
        out_BHLD = attend(q, k, v, spec, self.backend)
        B, _, L, _ = out_BHLD.shape
        attn_BLH = out_BHLD.transpose(1, 2).reshape(B, L, -1)
        x = self.attn_norm(query_BLH + self.dropout(self.o_proj(attn_BLH)))
        h = self.ffn_out(nn.functional.gelu(self.ffn_in(x)))
        return self.ffn_norm(x + self.dropout(h))


def _init_bert(module: nn.Module, std: float = 0.02) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=std)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
