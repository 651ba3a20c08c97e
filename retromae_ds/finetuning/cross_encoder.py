"""The cross-encoder kind of fine-tuning (``finetune --model.kind cross_encoder``): a
reranker trained by the same job, Trainer, checkpoints and exact resume as the dual encoder.

Model: a Hugging Face ``AutoModelForSequenceClassification`` with one label, built from any
encoder folder ``eval`` takes (all-MiniLM-L6-v2, a RetroMAE checkpoint: the classifier head
is new, and so is the pooler when the init has none), or a cross-encoder to train further.
Input per pair: ``[CLS] query [SEP] passage [SEP]``, token types 0 then 1, made from the
already tokenized query and passage (``pair_batch``): what the init's tokenizer gives for
``tokenizer(query, passage)`` when nothing is cut (checked when the model is built; a
tokenizer with another pair template is refused), which is how sentence-transformers'
``CrossEncoder`` and ``retrieval.cross_encoder.score_pairs`` read a pair. In training the
query and the passage are cut separately (``data.q_max_len``, ``data.p_max_len``); at
inference the pair is cut as a whole to ``max_length`` = q_max_len + p_max_len - 1, the
longest pair trained on, so no pair within the training lengths is cut differently.

Loss: listwise cross-entropy over each query's group, its positive first and then its
``negatives.n_hard`` hard negatives (FlagEmbedding's reranker with ``train_group_size``,
sentence-transformers' ``CrossEncoder`` with several negatives): logits ``[B, 1 + n]``,
cross-entropy with target 0. The group is drawn by the shared ``BatchBuilder`` (a pure
function of seed, epoch, query and negatives version: BM25's v0 or a pairs file's
negatives). ``accuracy``: the share of queries whose positive scores above every negative.

Export: each checkpoint's ``encoder/`` is a folder sentence-transformers' ``CrossEncoder``
loads (``save_pretrained`` of the model, one label, the tokenizer with ``model_max_length``
= ``max_length``, the sigmoid activation named in ``config.json`` as sentence-transformers
writes it) plus ``cross_encoder.json`` (lengths, group, loss); ``retromae-ds export`` copies
it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.components.layout import ENCODER
from retromae_ds.finetuning.kind import Batch, ModelKind, ModelPieces
from retromae_ds.retrieval.cross_encoder import CROSS_ENCODER_FILE

ST_ACTIVATION = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
"""``config.json``'s ``sentence_transformers`` entry: the activation ``CrossEncoder.predict``
applies (its default for one label, written down as sentence-transformers 4+ writes it)."""


class CrossEncoder(nn.Module):
    """``forward(batch)`` -> ``{"loss", "accuracy"}`` for a batch of ``pair_batch``;
    ``scores(batch)`` -> one logit per pair ``[P]``."""

    def __init__(self, model: nn.Module, *, group: int, token_types: bool = True) -> None:
        super().__init__()
        if group < 2:
            raise ValueError(f"a group needs a positive and at least one negative, not {group}")
        self.model, self.group, self.token_types = model, group, token_types

    def scores(self, batch: Batch) -> torch.Tensor:
        inputs = {"input_ids": batch["ids"], "attention_mask": batch["mask"]}
        if self.token_types:
            inputs["token_type_ids"] = batch["types"]
        return self.model(**inputs).logits[:, 0]

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        logits_BG = self.scores(batch).float().view(-1, self.group)
        target_B = torch.zeros(len(logits_BG), dtype=torch.long, device=logits_BG.device)
        loss = nn.functional.cross_entropy(logits_BG, target_B)
        accuracy = (logits_BG[:, 0] > logits_BG[:, 1:].amax(1)).float().mean()
        return {"loss": loss, "accuracy": accuracy.detach()}


def pair_batch(batch: Batch, group: int, pad: int) -> Batch:
    """The dual encoder's batch (``q_ids`` ``[B, Lq]`` as ``[CLS] q [SEP]``, ``p_ids``
    ``[B * group, Lp]`` as ``[CLS] p [SEP]``, each right-padded) as pairs ``[CLS] q [SEP] p
    [SEP]``: ``ids``, ``mask``, ``types`` ``[B * group, L]``, pair i from query i // group."""
    q_ids, p_ids = batch["q_ids"], batch["p_ids"]
    q_len_B, p_len_P = batch["q_mask"].sum(1), batch["p_mask"].sum(1)
    if len(p_ids) != group * len(q_ids):
        raise ValueError(f"{len(p_ids)} passages for {len(q_ids)} queries in groups of {group}")
    query_P = torch.arange(len(p_ids)) // group
    q_len_P1 = q_len_B[query_P][:, None]
    total_P1 = q_len_P1 + p_len_P[:, None] - 1  # the passage's [CLS] is dropped
    j_1L = torch.arange(int(total_P1.max()))[None, :]
    in_q = j_1L < q_len_P1
    in_p = (j_1L >= q_len_P1) & (j_1L < total_P1)
    from_q = q_ids[query_P].gather(1, j_1L.clamp(max=q_ids.shape[1] - 1).expand(len(p_ids), -1))
    from_p = p_ids.gather(1, (j_1L - q_len_P1 + 1).clamp(0, p_ids.shape[1] - 1))
    ids = torch.where(in_q, from_q, torch.where(in_p, from_p, torch.full_like(from_p, pad)))
    return {"ids": ids, "mask": (in_q | in_p).long(), "types": in_p.long()}


class PairBatches:
    """The ``BatchBuilder``'s batches (same arguments, same draws) as ``pair_batch``'s."""

    def __init__(self, build: Any, group: int, pad: int) -> None:
        self.build, self.group, self.pad = build, group, pad

    def __call__(self, *args: Any) -> Batch:
        return pair_batch(self.build(*args), self.group, self.pad)


# ---------------------------------------------------------------------------- the kind
def check_config(cfg: Any) -> None:
    """Refuse, in one line, the ``FinetuneConfig`` settings a cross-encoder cannot have."""
    m = cfg.model
    dual_only = {
        "model.pooling": m.pooling != "auto",
        "model.normalize": m.normalize is not None,
        "model.temperature": m.temperature is not None,
        "model.bow_topk": m.bow_topk is not None,
        "model.shared false": not m.shared,
        "grad_cache": cfg.grad_cache.enabled,
        "compile": cfg.compile,
    }
    given = [name for name, set_ in dual_only.items() if set_]
    if given:
        raise ValueError(
            f"{', '.join(given)}: not for model.kind cross_encoder (it reads each query and "
            "passage together: no pooling, temperature, towers or GradCache); leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )
    if cfg.refresher != "none":
        raise ValueError(
            f"refresher {cfg.refresher}: a refresher mines negatives with the model being "
            "trained, which must be a dual encoder; model.kind cross_encoder trains on BM25's "
            "negatives (v0) or data.pairs' own: leave refresher none"
        )
    if cfg.negatives.n_hard < 1:
        raise ValueError(
            "negatives.n_hard 0: model.kind cross_encoder ranks each query's positive "
            "against its hard negatives; give negatives.n_hard >= 1"
        )


def build(cfg: Any, init_dir: Path, tokenizer_fingerprint: dict[str, Any]) -> ModelPieces:
    """The cross-encoder's pieces for the fine-tuning job (``finetuning.kind``)."""
    from retromae_ds.hf.util import load_tokenizer_checked

    tokenizer = load_tokenizer_checked(init_dir)
    special = SpecialIds.from_fingerprint(tokenizer_fingerprint)
    check_pair_template(tokenizer, special, init_dir)
    model = load_model(init_dir)
    max_length = cfg.data.q_max_len + cfg.data.p_max_len - 1
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and max_length > positions:
        raise ValueError(
            f"data.q_max_len + data.p_max_len - 1 = {max_length} tokens per pair, past the "
            f"{positions} positions of {init_dir}: shorten them"
        )
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    group = 1 + cfg.negatives.n_hard
    ce = CrossEncoder(
        model, group=group, token_types="token_type_ids" in tokenizer.model_input_names
    )
    record = {
        "kind": "cross_encoder",
        "loss": "listwise cross-entropy, positive first",
        "group": group,
        "q_max_len": cfg.data.q_max_len,
        "p_max_len": cfg.data.p_max_len,
        "max_length": max_length,
    }
    return ModelPieces(
        model=ce,
        batches=lambda builder: PairBatches(builder, group, special.pad),
        write_models=lambda state, staging: save_cross_encoder(
            ce, state, staging, tokenizer, record
        ),
        counts=lambda batch: {
            "tokens": batch["mask"].sum(),
            "slots": batch["mask"].numel(),
            "queries": len(batch["ids"]) // group,
        },
        marker={"objective": "contrastive", "model_kind": "cross_encoder"},
        note=(
            f"finetune: cross-encoder ({type(model).__name__}, one label), listwise "
            f"cross-entropy over 1 positive + {group - 1} negatives, pairs up to "
            f"{max_length} tokens"
        ),
    )


KIND = ModelKind(check=check_config, build=build)


def load_model(folder: str | Path) -> nn.Module:
    """The one-label sequence-classification model of ``folder`` (its classifier head new
    unless the folder is a cross-encoder already)."""
    from transformers import AutoModelForSequenceClassification

    from retromae_ds.modeling.load import load_pretrained

    return load_pretrained(
        AutoModelForSequenceClassification, folder, may_miss=("classifier.",), num_labels=1
    )


def check_pair_template(tokenizer: Any, special: SpecialIds, folder: Path) -> None:
    """The init's tokenizer must read a pair as ``pair_batch`` builds it (``[CLS] q [SEP] p
    [SEP]``, token types 0 then 1), else a ``ValueError`` naming the folder."""
    q, p = "what is a cross encoder", "a model that reads two texts together"
    q_ids = tokenizer(q, add_special_tokens=False)["input_ids"]
    p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
    ours = [special.cls, *q_ids, special.sep, *p_ids, special.sep]
    theirs = tokenizer(q, p)
    types = [0] * (len(q_ids) + 2) + [1] * (len(p_ids) + 1)
    if theirs["input_ids"] != ours or theirs.get("token_type_ids", types) != types:
        raise ValueError(
            f"{folder}: its tokenizer builds a pair as {theirs['input_ids']}, not [CLS] query "
            "[SEP] passage [SEP] with token types 0/1 (BERT's template), the one a "
            "cross-encoder is trained on here"
        )


def save_cross_encoder(
    model: CrossEncoder,
    state: dict[str, torch.Tensor],
    folder: Path,
    tokenizer: Any,
    record: dict[str, Any],
) -> None:
    """Write ``folder/encoder`` from a full state dict of ``model`` (DeepSpeed's
    consolidated one): a folder sentence-transformers' ``CrossEncoder`` loads (see the
    module doc)."""
    from retromae_ds.finetuning.model import record_dtype
    from retromae_ds.hf.util import quiet_transformers

    out = folder / ENCODER
    weights = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    model.model.config.sentence_transformers = dict(ST_ACTIVATION)
    with quiet_transformers():
        model.model.save_pretrained(str(out), state_dict=weights, safe_serialization=True)
        record_dtype(out / "config.json", weights)
        tokenizer.model_max_length = record["max_length"]
        tokenizer.save_pretrained(str(out))
    (out / CROSS_ENCODER_FILE).write_text(json.dumps(record, indent=2) + "\n")
