"""Cross-encoder scoring: one logit per (query, passage) pair read together, the one place a
reranker's scores are computed (``retromae-ds eval --rerank.model``; ``mine`` is to store
them for every mined candidate).

A cross-encoder is a Hugging Face sequence-classification model with one label (what
``retromae-ds finetune --model.kind cross_encoder`` writes, or any such folder, e.g. a
sentence-transformers ``CrossEncoder``). A pair is tokenized as sentence-transformers'
``CrossEncoder.predict`` tokenizes it: ``tokenizer(query, passage)`` (``[CLS] query [SEP]
passage [SEP]``, token types 0 then 1), both truncated together (longest first) to
``max_length`` tokens. ``score_pairs`` returns the raw logits; sentence-transformers'
``predict`` applies a sigmoid to a one-label model's logit by default (the same order).

``CrossEncoderScorer.from_dir(path)`` takes a model folder, a checkpoint or a fine-tuning run
folder (its newest checkpoint's ``encoder/``); a folder that is not a one-label
sequence-classification model is refused in one line naming what it is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

CROSS_ENCODER_FILE = "cross_encoder.json"
"""What ``finetune --model.kind cross_encoder`` records beside the weights: the lengths it
was trained at and the loss (not needed to load the folder)."""
DEFAULT_MAX_LENGTH = 512
"""Tokens per pair for a folder whose tokenizer records no length of its own."""


def cross_encoder_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is not a cross-encoder (one line), or None: its ``config.json`` must
    name a ``...ForSequenceClassification`` architecture with one label."""
    config_file = Path(folder) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{config_file}: unreadable ({exc})"
    archs = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return (
            f"{folder}: not a cross-encoder (its config.json names "
            f"{', '.join(map(str, archs)) or 'no architecture'}, not a one-label "
            "...ForSequenceClassification model); train one with retromae-ds finetune "
            "--model.kind cross_encoder"
        )
    labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    if labels != 1:
        return f"{folder}: a classifier with {labels} labels; a reranker scores with one"
    return None


def is_cross_encoder(folder: str | Path) -> bool:
    return cross_encoder_problem(folder) is None


def pair_inputs(
    tokenizer: Any, query_texts: Sequence[str], passage_texts: Sequence[str], max_length: int
) -> dict[str, torch.Tensor]:
    """The padded model inputs of the pairs, as sentence-transformers' ``CrossEncoder``
    builds them (``input_ids``, ``attention_mask``, and ``token_type_ids`` where the
    tokenizer makes them)."""
    return tokenizer(
        list(query_texts),
        list(passage_texts),
        padding=True,
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )


@torch.inference_mode()
def score_pairs(
    model: torch.nn.Module,
    tokenizer: Any,
    query_texts: Sequence[str],
    passage_texts: Sequence[str],
    *,
    batch_size: int = 32,
    max_length: int = DEFAULT_MAX_LENGTH,
    bf16: bool = False,
) -> np.ndarray:
    """float32 ``[N]``: the logit of each (query, passage) pair, pair i from
    ``query_texts[i]`` and ``passage_texts[i]``. Pairs are batched longest first (less
    padding; the order of the result is the input's). ``bf16``: the forward passes run under
    bf16 autocast (about 2× the pairs per second on a CPU with AMX or AVX512-BF16; the
    logits move in the second or third digit)."""
    if len(query_texts) != len(passage_texts):
        raise ValueError(f"{len(query_texts)} queries for {len(passage_texts)} passages")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    order = np.argsort(
        [-(len(q) + len(p)) for q, p in zip(query_texts, passage_texts, strict=True)], kind="stable"
    )
    out = np.zeros(len(order), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        inputs = pair_inputs(
            tokenizer, [query_texts[i] for i in rows], [passage_texts[i] for i in rows], max_length
        )
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits
        out[rows] = logits.view(len(rows), -1)[:, 0].float().cpu().numpy()
    model.train(was_training)
    return out


@dataclass
class CrossEncoderScorer:
    """A loaded cross-encoder and how it scores: ``scorer(queries, passages) -> [N]``
    logits; ``pairs`` and ``seconds`` count what it scored (pairs per second)."""

    model: torch.nn.Module
    tokenizer: Any
    folder: Path
    max_length: int
    batch_size: int = 32
    bf16: bool = False
    pairs: int = 0
    seconds: float = 0.0
    capped_by: str | None = field(default=None)

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        *,
        device: str = "auto",
        max_length: int | None = None,
        batch_size: int = 32,
        bf16: bool = False,
    ) -> CrossEncoderScorer:
        """Load the cross-encoder ``path`` names (a folder, a checkpoint, a run folder);
        ``max_length`` none: the tokenizer's ``model_max_length`` (what sentence-transformers
        reads), else 512; never past the position embeddings."""
        from transformers import AutoModelForSequenceClassification

        from retromae_ds.components.checkpoint import resolve_encoder
        from retromae_ds.hf.util import load_tokenizer_checked
        from retromae_ds.modeling.load import load_pretrained
        from retromae_ds.retrieval.encode import resolve_device

        if batch_size < 1:
            raise ValueError(f"rerank batch_size must be >= 1, not {batch_size}")
        folder = resolve_encoder(path)
        problem = cross_encoder_problem(folder)
        if problem is not None:
            raise ValueError(problem)
        tokenizer = load_tokenizer_checked(folder)
        model = load_pretrained(AutoModelForSequenceClassification, folder)
        model = model.to(resolve_device(device)).eval()
        own = getattr(tokenizer, "model_max_length", None)
        length = max_length or (own if isinstance(own, int) and own < 10**6 else DEFAULT_MAX_LENGTH)
        positions = getattr(model.config, "max_position_embeddings", None)
        capped_by = None
        if isinstance(positions, int) and positions < length:
            length, capped_by = positions, "the model's position embeddings"
        return cls(model, tokenizer, folder, length, batch_size, bf16, capped_by=capped_by)

    def __call__(self, query_texts: Sequence[str], passage_texts: Sequence[str]) -> np.ndarray:
        t = time.perf_counter()
        scores = score_pairs(
            self.model, self.tokenizer, query_texts, passage_texts,
            batch_size=self.batch_size, max_length=self.max_length, bf16=self.bf16,
        )  # fmt: skip
        self.seconds += time.perf_counter() - t
        self.pairs += len(scores)
        return scores

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def record(self) -> dict[str, Any]:
        """What a result says about the scoring: the folder, settings and pairs per second."""
        return {
            "model": str(self.folder),
            "max_length": self.max_length,
            "batch_size": self.batch_size,
            "bf16": self.bf16,
            "device": str(self.device),
            "pairs": self.pairs,
            "seconds": round(self.seconds, 3),
            "pairs_per_s": round(self.pairs / self.seconds, 1) if self.seconds else None,
        }
