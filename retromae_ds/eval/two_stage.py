"""Two-stage retrieval in ``retromae-ds eval``: a first stage (any dense model ``eval`` takes,
or BM25: ``--model bm25``) and a cross-encoder reranking its top K per query
(``--rerank.model CE --rerank.depth K``).

The reranked ranking of a query is its first stage's top K ordered by the cross-encoder's
logits (``retrieval.cross_encoder.score_pairs``; ties broken as trec_eval breaks them: doc id
descending), then the rest of the first stage's ranking in its own order, so a measure deeper
than K (recall@1000 over a top 100) still reads the first stage below K. The result's
``metrics`` and ``per_query`` are the reranked run's; ``first_stage`` holds the first stage's
means and ``cross_encoder`` the scoring (folder, depth, pairs scored, seconds, pairs per
second, device). ``rerank.lists`` (C-MTEB's candidate lists ranked by the embeddings,
``eval.rerank``) is another measure of the dense model, independent of this.

``evaluate_bm25_beir`` is the BM25 first stage (``retrieval.lexical``: bm25s, the
language-aware analyzer) with the same result keys as ``eval.run.evaluate_beir``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retromae_ds.eval.rerank import DEFAULT_NEGATIVES
from retromae_ds.retrieval.beir import BeirData, check_beir, load_beir
from retromae_ds.retrieval.cross_encoder import CrossEncoderScorer
from retromae_ds.retrieval.metrics import (
    Run,
    evaluate_run,
    max_cutoff,
    mean_metrics,
    per_query_metrics,
    rank_run,
)

BM25 = "bm25"
"""``--model bm25``: the lexical first stage instead of a model folder (a folder named so is
``./bm25``)."""
DEFAULT_DEPTH = 100


@dataclass(kw_only=True)
class RerankConfig:
    """``eval --rerank.*``: a cross-encoder over the first stage's top K, and C-MTEB's
    candidate lists ranked by the dense model."""

    model: str = ""
    """A cross-encoder (finetune --model.kind cross_encoder's run, checkpoint or export, or
    any one-label sequence-classification folder) reranking the first stage's top
    rerank.depth per query; the reported measures are then the reranked run's."""
    depth: int = DEFAULT_DEPTH
    """Documents per query the cross-encoder scores (the first stage's top K)."""
    batch_size: int = 32
    """Pairs per forward pass of the cross-encoder."""
    max_length: int | None = None
    """Tokens per pair (none: the cross-encoder's own, its tokenizer's model_max_length)."""
    bf16: bool = False
    """Score under bf16 autocast: about 2× the pairs per second on a CPU with AMX or
    AVX512-BF16 (and on CUDA); the logits move in the second or third digit."""
    lists: bool = False
    """Also rank each query's candidate list (positives + rerank.negatives BM25 negatives,
    or rerank.candidates) by the dense model's embeddings: MAP, MRR@10 (C-MTEB's reranking
    tasks; was --rerank)."""
    negatives: int = DEFAULT_NEGATIVES
    """BM25 negatives per candidate list (was --rerank_negatives)."""
    candidates: str | None = None
    """JSONL candidate lists (query_id, negative[, positive]) instead of BM25's (was
    --candidates)."""

    def __post_init__(self) -> None:
        if self.depth < 1 or self.batch_size < 1:
            raise ValueError(
                f"rerank.depth and rerank.batch_size must be >= 1, not {self.depth} and "
                f"{self.batch_size}"
            )
        if self.max_length is not None and self.max_length < 3:
            raise ValueError(f"rerank.max_length must be >= 3, not {self.max_length}")


@dataclass
class CrossEncoderStage:
    """The reranking step of one evaluation: what ``eval.run.score`` and
    ``evaluate_bm25_beir`` run after their first stage."""

    model: str
    depth: int = DEFAULT_DEPTH
    batch_size: int = 32
    max_length: int | None = None
    device: str = "auto"
    bf16: bool = False
    scorer: CrossEncoderScorer | None = field(default=None, repr=False)

    def load(self) -> CrossEncoderScorer:
        """The cross-encoder, loaded once (a folder that is not one is refused here: before
        the first stage runs); a length capped by the model is said in one line."""
        if self.scorer is None:
            self.scorer = CrossEncoderScorer.from_dir(
                self.model, device=self.device, max_length=self.max_length,
                batch_size=self.batch_size, bf16=self.bf16,
            )  # fmt: skip
            if self.max_length and self.scorer.capped_by:
                print(
                    f"eval: --rerank.max_length {self.max_length} capped at "
                    f"{self.scorer.max_length}, {self.scorer.capped_by}",
                    file=sys.stderr,
                    flush=True,
                )
        return self.scorer

    def retrieve_depth(self, measures: Sequence[str]) -> int:
        """How deep the first stage must retrieve: the measures' depth, at least K."""
        return max(max_cutoff(measures), self.depth)

    def run(self, data: BeirData, first: Run, measures: Sequence[str]) -> dict[str, Any]:
        """The reranked run's measures and the scoring's record (see the module doc)."""
        scorer = self.load()
        ranking, _ = rerank_top(data, first, scorer, self.depth)
        per_query = per_query_metrics(data.qrels, ranking, measures)
        return {
            **scorer.record(),
            "depth": self.depth,
            "metrics": mean_metrics(per_query, measures),
            "per_query": per_query,
        }


def rerank_top(
    data: BeirData, first: Run, scorer: CrossEncoderScorer, depth: int
) -> tuple[dict[str, list[str]], dict[str, dict[str, float]]]:
    """(each query's reranked ranking, the cross-encoder's logit of each pair it scored):
    the first stage's top ``depth`` by logit, then the rest of its ranking as it was."""
    text_of_query = dict(zip(data.query_ids, data.query_texts, strict=True))
    text_of_doc = dict(zip(data.corpus_ids, data.corpus_texts, strict=True))
    ranked = rank_run(first)
    pairs = [(q, d) for q, docs in ranked.items() if q in text_of_query for d in docs[:depth]]
    logits = scorer([text_of_query[q] for q, _ in pairs], [text_of_doc[d] for _, d in pairs])
    scores: dict[str, dict[str, float]] = {q: {} for q in ranked}
    for (q, d), logit in zip(pairs, logits.tolist(), strict=True):
        scores[q][d] = logit
    reranked = rank_run(scores)
    return {q: reranked[q] + ranked[q][depth:] for q in ranked}, scores


def evaluate_bm25_beir(
    beir_dir: str | Path | BeirData,
    split: str = "test",
    *,
    measures: Sequence[str],
    ignore_identical_ids: bool = True,
    cross_encoder: CrossEncoderStage | None = None,
) -> dict[str, Any]:
    """BM25 on one split, reranked by ``cross_encoder`` when given: ``evaluate_beir``'s
    result keys (``model`` is ``bm25``, ``settings`` holds the analyzer)."""
    from retromae_ds.retrieval.lexical import bm25_run, choose_analyzer

    t = time.perf_counter()
    data = beir_dir if isinstance(beir_dir, BeirData) else load_beir(beir_dir, split)
    missing = check_beir(data)
    if cross_encoder is not None:
        cross_encoder.load()  # a folder that is not a cross-encoder: refused before BM25 runs
    seconds = {"load": time.perf_counter() - t}
    t = time.perf_counter()
    analyzer = choose_analyzer(data.corpus_texts)
    depth = cross_encoder.retrieve_depth(measures) if cross_encoder else max_cutoff(measures)
    first = bm25_run(data, depth, ignore_identical_ids=ignore_identical_ids, analyzer=analyzer)
    mean, per_query = evaluate_run(data.qrels, first, measures)
    seconds["search_and_metrics"] = time.perf_counter() - t
    result: dict[str, Any] = {
        "dataset": str(beir_dir) if not isinstance(beir_dir, BeirData) else "<BeirData>",
        "split": split,
        "model": BM25,
        "num_corpus": len(data.corpus_ids),
        "num_queries": len(per_query),
        "num_queries_skipped": len(data.qrels) - len(per_query),
        "qrels_docs_missing": len(missing),
        "metrics": mean,
        "settings": {"analyzer": analyzer, "ignore_identical_ids": ignore_identical_ids},
        "seconds": seconds,
        "per_query": per_query,
    }
    if cross_encoder is not None:
        t = time.perf_counter()
        with_reranking(result, cross_encoder.run(data, first, measures))
        seconds["rerank"] = time.perf_counter() - t
    result["seconds"] = {name: round(value, 3) for name, value in seconds.items()}
    return result


def with_reranking(result: dict[str, Any], reranked: dict[str, Any]) -> dict[str, Any]:
    """``result`` (a first stage's) made the two stages': its measures become the reranked
    run's, the first stage's means move to ``first_stage``, the scoring to
    ``cross_encoder``."""
    result["first_stage"] = {"model": result.get("model"), "metrics": result["metrics"]}
    result["metrics"], result["per_query"] = reranked.pop("metrics"), reranked.pop("per_query")
    result["cross_encoder"] = reranked
    return result


def reranking_lines(result: dict[str, Any]) -> list[str]:
    """The summary table's lines for a two-stage result (first stage, then reranked)."""
    ce = result["cross_encoder"]
    lines = [f"  first stage ({result['first_stage']['model']}):"]
    lines += [
        f"  {name:<12} {value:.4f}" for name, value in result["first_stage"]["metrics"].items()
    ]
    lines.append(
        f"  reranked: top {ce['depth']} by {ce['model']} ({ce['pairs']} pairs, "
        f"{ce['pairs_per_s']} pairs/s on {ce['device']}):"
    )
    return lines
