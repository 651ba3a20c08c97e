"""The dual encoder: query and passage towers (one shared Hugging Face encoder by default),
pooled sentence embeddings, and the contrastive loss with gathered in-batch negatives.

``save_encoders`` writes the towers as Hugging Face folders (with the tokenizer, the
sentence-transformers files and ``dual_encoder.json`` naming the pooling, normalisation,
temperature and the query/passage lengths it was trained at), which is what the refresher,
``retromae-ds eval`` and ``export`` read (``retromae_ds.hf.sbert``).

The pooling is any registered one (``retromae_ds.hf.pooling``), applied by its own function.
A pooling that needs the MLM head (DupMAE's ``dupmae``, ``dupmae_bow``) trains through each
tower's head (``retromae_ds.modeling.bow``): the towers are then masked-LM models
(``load_tower``) and are saved with their heads.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from retromae_ds.components.layout import ENCODER, QUERY_ENCODER
from retromae_ds.finetuning.distill import (
    DistillSettings,
    check_teacher_targets,
    distill_loss,
    group_scores,
)
from retromae_ds.finetuning.loss import contrastive_loss, contrastive_loss_grads
from retromae_ds.hf import sbert
from retromae_ds.hf.pooling import DEFAULT_POOLING, check_pooling, get_pooling
from retromae_ds.modeling.bow import bow_vectors, head_weights
from retromae_ds.modeling.encoder import compile_whole, encode


def load_body(folder: str | Path) -> nn.Module:
    """The encoder body (no MLM head, no pooler) of a local Hugging Face folder."""
    from transformers import AutoModel

    from retromae_ds.modeling.load import load_pretrained

    model = load_pretrained(AutoModel, folder)
    if getattr(model, "pooler", None) is not None:
        model.pooler = None  # unused by CLS/mean pooling; would hold parameters without grads
    return model


def load_tower(folder: str | Path, *, head: bool) -> nn.Module:
    """``load_body``, or with ``head`` the masked-LM model (DupMAE's poolings need its MLM
    head; a folder without one is a ``ValueError``)."""
    if not head:
        return load_body(folder)
    from retromae_ds.modeling.load import load_with_head

    return load_with_head(folder)


class DualEncoder(nn.Module):
    """``forward(batch)`` -> ``{"loss", "accuracy"}`` for a batch made by the fine-tuning
    collator; ``embed(ids, mask, query=...)`` -> pooled embeddings ``[B, D]``."""

    def __init__(
        self,
        encoder: nn.Module,
        query_encoder: nn.Module | None = None,
        *,
        pooling: str = DEFAULT_POOLING,
        normalize: bool = False,
        temperature: float = 1.0,
        bow_topk: int = sbert.DEFAULT_BOW_TOPK,
        special_ids: tuple[int, ...] = (),
        distill: DistillSettings | None = None,
    ) -> None:
        super().__init__()
        self.distill = distill  # a teacher's scores distilled beside (or instead of) the loss
        self._checked_teacher = False
        pooling = check_pooling(pooling, "pooling", auto=False)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.pool = get_pooling(pooling)
        self.head = self.pool.needs_head
        if self.head and not special_ids:
            raise ValueError(f"pooling {pooling}: the tokenizer's special ids are needed")
        self.encoder = encoder
        self.query_encoder = query_encoder
        self.pooling, self.normalize, self.temperature = pooling, normalize, temperature
        self.bow_topk = bow_topk
        self.register_buffer(
            "special_ids", torch.tensor(sorted(special_ids), dtype=torch.long), persistent=False
        )

    def external_parameters(self) -> list[nn.Parameter]:
        """The towers' MLM-head projections, which the DupMAE pooling reads outside the head's
        forward (ZeRO-3 gathers them: ``components.engine.initialize``)."""
        towers = [t for t in (self.encoder, self.query_encoder) if t is not None]
        return [p for t in towers for p in head_weights(t)] if self.head else []

    def compile_parts(self, backend: str = "inductor", device_type: str = "cpu") -> list[nn.Module]:
        """``torch.compile`` each tower in place (``--compile``: whole graphs, dynamic shapes,
        state-dict keys unchanged); pooling and the loss stay eager."""
        towers = [t for t in (self.encoder, self.query_encoder) if t is not None]
        # a masked-LM tower runs its body alone (``encode``): that is what to compile
        return compile_whole([t.base_model if self.head else t for t in towers], backend)

    def embed(self, ids_BL: torch.Tensor, mask_BL: torch.Tensor, *, query: bool) -> torch.Tensor:
        tower = self.query_encoder if query and self.query_encoder is not None else self.encoder
        hidden_BLD = encode(tower, ids_BL, mask_BL)
        bow_BV = None
        if self.head:
            bow_BV = bow_vectors(
                tower, hidden_BLD, ids_BL, mask_BL, self.special_ids, self.bow_topk
            )
        emb_BD = self.pool(hidden_BLD, mask_BL, bow_BV)
        return nn.functional.normalize(emb_BD, dim=-1) if self.normalize else emb_BD

    def forward(
        self, batch: dict[str, torch.Tensor], *, embed: str | None = None
    ) -> dict[str, torch.Tensor] | torch.Tensor:
        """The loss and accuracy of a collated batch; with ``embed`` ("query" or "passage")
        the embeddings of ``batch["ids"]``, ``batch["mask"]`` instead: what GradCache
        (``finetuning.grad_cache``) runs through the engine chunk by chunk, so that ZeRO-3
        gathers the weights for it and counts each pass."""
        if embed is not None:
            return self.embed(batch["ids"], batch["mask"], query=embed == "query")
        q_BD = self.embed(batch["q_ids"], batch["q_mask"], query=True)
        p_PD = self.embed(batch["p_ids"], batch["p_mask"], query=False)
        loss, accuracy = self.loss(q_BD, p_PD, batch)
        return {"loss": loss, "accuracy": accuracy}

    def loss(
        self, q_BD: torch.Tensor, p_PD: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, accuracy) of this rank's query and passage embeddings: the contrastive loss,
        or with ``distill`` its weighted sum with the distillation term."""
        s = self.distill
        with torch.set_grad_enabled(torch.is_grad_enabled() and (s is None or s.ce_weight > 0)):
            loss, accuracy = contrastive_loss(
                q_BD, p_PD, batch["p_index"], batch["positives"], temperature=self.temperature
            )
        if s is None:
            return loss, accuracy
        kd = distill_loss(group_scores(q_BD, p_PD), self._teacher(batch, q_BD.device), s)
        total = s.weight * kd + (s.ce_weight * loss if s.ce_weight > 0 else 0.0)
        return total, accuracy

    def loss_grads(
        self, q_BD: torch.Tensor, p_PD: torch.Tensor, batch: dict[str, torch.Tensor], chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, accuracy, d loss / d ``q_BD``, d loss / d ``p_PD``) of detached embeddings,
        ``chunk`` queries at a time (GradCache's second pass); the distillation term, local
        to each query's own group, in one piece."""
        loss, accuracy, grad_q, grad_p = contrastive_loss_grads(
            q_BD, p_PD, batch["p_index"], batch["positives"], temperature=self.temperature,
            chunk=chunk,
        )  # fmt: skip
        s = self.distill
        if s is None:
            return loss, accuracy, grad_q, grad_p
        q = q_BD.detach().requires_grad_()
        p = p_PD.detach().requires_grad_()
        with torch.enable_grad():
            kd = s.weight * distill_loss(group_scores(q, p), self._teacher(batch, q.device), s)
            kd_q, kd_p = torch.autograd.grad(kd, [q, p])
        return (
            kd.detach() + s.ce_weight * loss,
            accuracy,
            (s.ce_weight * grad_q + kd_q).to(q_BD.dtype),
            (s.ce_weight * grad_p + kd_p).to(p_PD.dtype),
        )

    def _teacher(self, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """The batch's teacher scores, checked once (sentence-transformers'
        ``check_teacher_targets``: NaN is an error, underflowing probabilities a warning)."""
        if "teacher" not in batch:
            raise ValueError("distillation: the batch holds no teacher scores")
        teacher = batch["teacher"].to(device)
        if not self._checked_teacher and self.distill.loss != "margin_mse":
            self._checked_teacher = True
            problem = check_teacher_targets(teacher, self.distill.teacher_temperature)
            if problem is not None:
                warnings.warn(problem, stacklevel=2)
        return teacher

    def settings(self) -> dict[str, Any]:
        return {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "temperature": self.temperature,
            "shared": self.query_encoder is None,
            **({"distill": self.distill.as_dict()} if self.distill is not None else {}),
            **({"bow_topk": self.bow_topk} if self.head else {}),
        }


def save_encoders(
    model: DualEncoder,
    state: dict[str, torch.Tensor],
    folder: Path,
    tokenizer_dir: str | Path,
    lengths: dict[str, int],
) -> None:
    """Write ``folder/encoder`` (and ``folder/query_encoder`` when the towers differ) from a
    full state dict of ``model`` (e.g. DeepSpeed's consolidated one). ``lengths``:
    ``q_max_len``, ``p_max_len`` (recorded in ``dual_encoder.json``) and ``max_seq_length``
    (what sentence-transformers reads texts up to)."""
    from transformers import AutoTokenizer

    from retromae_ds.hf.util import quiet_transformers

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    towers = [("encoder", ENCODER, model.encoder)]  # (attribute = state prefix, folder, module)
    if model.query_encoder is not None:
        towers.append(("query_encoder", QUERY_ENCODER, model.query_encoder))
    for prefix, sub_folder, tower in towers:
        sub = {
            k.removeprefix(f"{prefix}."): v for k, v in state.items() if k.startswith(f"{prefix}.")
        }
        out = folder / sub_folder
        tower.save_pretrained(str(out), state_dict=sub, safe_serialization=True)
        record_dtype(out / "config.json", sub)
        tokenizer.save_pretrained(str(out))
        sbert.write_files(
            out,
            tower.config.hidden_size,
            model.pooling,
            lengths["max_seq_length"],
            normalize=model.normalize,
            bow_topk=model.bow_topk,
        )
        settings = {
            **model.settings(),
            "q_max_len": lengths["q_max_len"],
            "p_max_len": lengths["p_max_len"],
        }
        (out / sbert.DUAL_ENCODER_FILE).write_text(json.dumps(settings, indent=2))


def record_dtype(config_file: Path, state: dict[str, torch.Tensor]) -> None:
    """Make ``config.json`` name the dtype of the weights written (a bf16 run's tower is
    bf16 while its saved weights are the fp32 master copies), so loaders do not cast them
    down."""
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()}
    if len(dtypes) != 1:
        return
    config = json.loads(config_file.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = next(iter(dtypes))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
