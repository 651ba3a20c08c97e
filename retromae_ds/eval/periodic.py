"""Zero-shot retrieval evaluation during training: "is pre-training done yet?".

``PeriodicEvalConfig`` is the ``eval`` section of a pre-training run (``--eval.beir DIR --eval.every
N``). ``PeriodicEval`` loads the BEIR split once, draws a fixed sample of it (``max_queries``
judged queries, their judged documents plus other documents up to ``max_docs``; the sample
depends only on ``sample_seed``, so every run — every objective, every seed — is measured on
the same queries and documents), and, called with the current encoder, encodes the sample once
and scores CLS and mean pooling (or DupMAE's, ``retromae_ds.modeling.bow``) side by side: the
measures of ``--eval.measures`` (default nDCG@10, MRR@10 and Recall@100; any measure of
``retromae_ds.retrieval.metrics.MEASURES``) by exact inner-product search, the same code as
``retromae-ds eval`` (``evaluate_embeddings``).

It never disturbs the training it observes: the model is put in eval mode and back, no
gradient is kept, and the random-number generators are forked and restored, so a run with
evaluation computes bit-identical losses to one without (tested). Only rank 0 encodes; the
other ranks wait at the next collective, so the sample caps keep it short (they also bound the
time another rank waits, within ``deepspeed.timeout_s``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from retromae_ds.hf import sbert
from retromae_ds.hf.pooling import CLS, MEAN, check_pooling
from retromae_ds.retrieval.beir import BeirData, check_beir, load_beir
from retromae_ds.retrieval.metrics import TRAINING_MEASURES, check_measures


@dataclass(kw_only=True)
class PeriodicEvalConfig:
    """Zero-shot retrieval evaluation of the encoder while it trains."""

    beir: str = ""
    """BEIR dataset folder to evaluate on ('' disables)."""
    split: str = "test"
    """Its qrels split (tune on a train/dev split; keep test for the report)."""
    every: int = 0
    """Evaluate every N optimizer steps (and before the first step and after the last);
    0 = only before the first and after the last step."""
    max_queries: int = 200
    """Judged queries sampled (0 = all)."""
    max_docs: int = 5000
    """Documents searched: the sampled queries' judged documents plus a sample of the rest up
    to this many (0 = the whole corpus). Figures on a sample are higher than on the full
    corpus: compare runs with each other, not with published numbers."""
    sample_seed: int = 0
    """Seed of the sample (independent of the run's seed: every run sees the same sample)."""
    poolings: list[str] = field(default_factory=lambda: [CLS.name, MEAN.name])
    """Sentence embeddings scored, from one encoding pass: any registered pooling
    (``retromae_ds.hf.pooling``: cls, mean, dupmae_bow, dupmae, an installed package's; the
    DupMAE poolings go through the MLM head, any objective's; their vectors have |V| entries:
    mind ``max_docs``)."""
    measures: list[str] = field(default_factory=lambda: list(TRAINING_MEASURES))
    """Ranking measures logged per pooling, each name@k (as retromae-ds eval --measures); the
    first is the one the trainer's progress line shows."""
    bow_topk: int = sbert.DEFAULT_BOW_TOPK
    """DupMAE poolings: entries of the bag-of-words vector kept (0: all)."""
    max_length: int = 128
    """Tokens per text (special tokens included)."""
    batch_size: int = 64
    """Texts per forward pass."""
    bf16: bool = False
    """Encode under bf16 autocast (faster on GPUs and AVX-512 CPUs)."""

    def __post_init__(self) -> None:
        if isinstance(self.poolings, str) or not self.poolings:
            raise ValueError(f"eval.poolings: expected a list of poolings, got {self.poolings!r}")
        self.poolings = [check_pooling(p, "eval.poolings", auto=False) for p in self.poolings]
        self.measures = check_measures(self.measures, "eval.measures")
        if self.bow_topk < 0:
            raise ValueError(f"eval.bow_topk must be >= 0, got {self.bow_topk}")
        if self.every < 0 or self.max_queries < 0 or self.max_docs < 0:
            raise ValueError("eval.every, eval.max_queries and eval.max_docs must be >= 0")
        if self.max_length < 2 or self.batch_size < 1:
            raise ValueError("eval.max_length must be >= 2 and eval.batch_size >= 1")

    @property
    def enabled(self) -> bool:
        return bool(self.beir)


def sample_beir(data: BeirData, max_queries: int, max_docs: int, seed: int) -> BeirData:
    """A fixed sample of ``data``: ``max_queries`` judged queries (0 = all) and a corpus of
    their judged documents plus others drawn up to ``max_docs`` (0 = all), in corpus order."""
    rng = random.Random(seed)
    qids = list(data.query_ids)
    if max_queries and len(qids) > max_queries:
        qids = sorted(rng.sample(qids, max_queries), key=data.query_ids.index)
    texts = dict(zip(data.query_ids, data.query_texts, strict=True))
    qrels = {q: data.qrels[q] for q in qids}
    keep = set(range(len(data.corpus_ids)))
    if max_docs and len(data.corpus_ids) > max_docs:
        judged = {d for docs in qrels.values() for d in docs}
        must = {i for i, d in enumerate(data.corpus_ids) if d in judged}
        rest = sorted(set(range(len(data.corpus_ids))) - must)
        fill = max(0, max_docs - len(must))
        keep = must | set(rng.sample(rest, min(fill, len(rest))))
    rows = sorted(keep)
    return BeirData(
        corpus_ids=[data.corpus_ids[i] for i in rows],
        corpus_texts=[data.corpus_texts[i] for i in rows],
        query_ids=qids,
        query_texts=[texts[q] for q in qids],
        qrels=qrels,
        corpus_source=data.corpus_source,
        qrels_source=data.qrels_source,
    )


class PeriodicEval:
    """The sample of ``cfg``'s BEIR split, and ``__call__(model, tokenizer)`` that scores an
    encoder (a Hugging Face model whose output has ``last_hidden_state``) on it."""

    def __init__(self, cfg: PeriodicEvalConfig) -> None:
        if not cfg.enabled:
            raise ValueError("eval.beir is not set")
        self.cfg = cfg
        full = load_beir(cfg.beir, cfg.split)
        check_beir(full)
        self.data = sample_beir(full, cfg.max_queries, cfg.max_docs, cfg.sample_seed)
        self.name = Path(cfg.beir).name or "beir"

    def describe(self) -> str:
        return (
            f"eval: {self.name} [{self.cfg.split}] sample of {len(self.data.query_ids)} queries, "
            f"{len(self.data.corpus_ids)} documents; pooling {'+'.join(self.cfg.poolings)}"
        )

    def __call__(self, model: torch.nn.Module, tokenizer: Any) -> dict[str, float]:
        """``{"eval/NAME/POOLING/MEASURE": value, ..., "eval_seconds": s}``; leaves the model's
        mode and every random-number generator as it found them. The DupMAE poolings need
        ``model`` to be the masked-LM model (its MLM head)."""
        from retromae_ds.eval.run import evaluate_embeddings
        from retromae_ds.retrieval.encode import HFEncoder

        cfg, t = self.cfg, time.perf_counter()
        device = next(model.parameters()).device
        encoder = HFEncoder(
            model,
            tokenizer,
            max_length=cfg.max_length,
            batch_size=cfg.batch_size,
            device="auto",
            amp_dtype=torch.bfloat16 if cfg.bf16 else None,
            progress=False,
            bow_topk=cfg.bow_topk,
        )
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            corpus = encoder.encode_pools(self.data.corpus_texts, cfg.poolings)
            queries = encoder.encode_pools(self.data.query_texts, cfg.poolings)
        row: dict[str, float] = {}
        for pooling in cfg.poolings:
            means, _ = evaluate_embeddings(
                self.data, queries[pooling], corpus[pooling], cfg.measures
            )
            for measure, value in means.items():
                row[f"eval/{self.name}/{pooling}/{measure}"] = float(value)
        row["eval_seconds"] = time.perf_counter() - t
        return row
