"""Dense-retrieval evaluation on a BEIR dataset: encode, exact search, metrics, report.

``evaluate_beir(model_dir_or_encoder, beir_dir, split="test")`` encodes the corpus and the
split's queries, searches the top ``max(k)`` documents per query by exact inner product
(``retromae_ds.search.exact``), computes nDCG@10, MRR@10, Recall@100/1000 (``retromae_ds.eval.metrics``),
prints a small table and optionally writes everything (means, per-query values, settings,
timings) to a JSON file. ``retrieve`` and ``evaluate_embeddings`` are the same steps for callers
that already hold embeddings. Command line (wired as ``retromae-ds eval``)::

    retromae-ds eval --model DIR --beir DIR [--split test] [--pooling auto|cls|mean|dupmae|dupmae_bow] [--normalize]
                     [--rerank [--rerank_negatives N | --candidates FILE]] [--ignore_identical_ids false]

A model with separate towers (a fine-tuning run with ``--model.shared false``, one of its
checkpoints, or its export) encodes the queries with its query tower and the passages with its
passage tower (``retromae_ds.eval.towers``). ``--model RUN`` reads the run's newest checkpoint
and, if the live run prunes it while it is being read, its newest again. ``--out`` is never
written inside the model's or the BEIR folder, nor over a file that is not an earlier result
(``retromae_ds.eval.result_file``).

BEIR drops a retrieved document whose id equals its query's (``ignore_identical_ids``, on by
default as in BEIR: ArguAna and Quora hold their queries in the corpus); whenever that drops
anything, or a judged relevant pair has one id (a pair that can then never count), one line
says how many, and the result records the setting and the counts.

``--rerank`` also ranks each query's candidate list with the same embeddings and reports MAP
and MRR@10 (C-MTEB's reranking measures; ``retromae_ds.eval.rerank``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retromae_ds.base.config import flag
from retromae_ds.eval.beir import BeirData, check_beir, load_beir
from retromae_ds.eval.encode import Encoder, HFEncoder, encode_texts
from retromae_ds.eval.metrics import DEFAULT_MEASURES, Run, evaluate_run, max_cutoff
from retromae_ds.eval.rerank import (
    DEFAULT_NEGATIVES,
    bm25_candidates,
    evaluate_rerank,
    load_candidates,
)
from retromae_ds.eval.result_file import check_out, write_result
from retromae_ds.eval.towers import Towers, load_newest
from retromae_ds.hf import sbert
from retromae_ds.search.arrays import Backend, Metric
from retromae_ds.search.exact import ExactIndex

DEFAULT_MAX_LENGTH = 512
"""Tokens per text for a model that records no length of its own."""


def retrieve(
    query_emb_QD: np.ndarray,
    corpus_emb_ND: np.ndarray,
    query_ids: Sequence[str],
    corpus_ids: Sequence[str],
    k: int,
    *,
    metric: Metric = "ip",
    backend: Backend = "auto",
    ignore_identical_ids: bool = True,
) -> Run:
    """``{qid: {doc id: score}}``, the top k documents of each query by exact search.

    ``ignore_identical_ids`` drops a document whose id equals the query id (BEIR's default,
    for datasets such as ArguAna and Quora where a query is also in the corpus); one extra
    document is retrieved so that k remain.
    """
    return retrieve_counting(
        query_emb_QD,
        corpus_emb_ND,
        query_ids,
        corpus_ids,
        k,
        metric=metric,
        backend=backend,
        ignore_identical_ids=ignore_identical_ids,
    )[0]


def retrieve_counting(
    query_emb_QD: np.ndarray,
    corpus_emb_ND: np.ndarray,
    query_ids: Sequence[str],
    corpus_ids: Sequence[str],
    k: int,
    *,
    metric: Metric = "ip",
    backend: Backend = "auto",
    ignore_identical_ids: bool = True,
) -> tuple[Run, int]:
    """``retrieve``, and how many retrieved documents ``ignore_identical_ids`` dropped."""
    if len(query_ids) != len(query_emb_QD) or len(corpus_ids) != len(corpus_emb_ND):
        raise ValueError("ids and embeddings differ in length")
    index = ExactIndex.build(corpus_emb_ND, metric=metric, backend=backend)
    scores_QK, ids_QK = index.search(query_emb_QD, k + 1 if ignore_identical_ids else k)
    run: dict[str, dict[str, float]] = {}
    dropped = 0
    for qid, scores, rows in zip(query_ids, scores_QK.tolist(), ids_QK.tolist(), strict=True):
        docs = {}
        for score, row in zip(scores, rows, strict=True):
            if row < 0 or len(docs) == k:
                break
            if ignore_identical_ids and corpus_ids[row] == qid:
                dropped += 1
            else:
                docs[corpus_ids[row]] = score
        run[qid] = docs
    return run, dropped


def identical_judged(data: BeirData) -> int:
    """Judged relevant (query, document) pairs whose two ids are equal: with
    ``ignore_identical_ids`` such a document is never retrieved, so it counts as a miss."""
    return sum(1 for qid, docs in data.qrels.items() if docs.get(qid, 0) > 0)


def evaluate_embeddings(
    data: BeirData,
    query_emb_QD: np.ndarray,
    corpus_emb_ND: np.ndarray,
    measures: Sequence[str] = DEFAULT_MEASURES,
    **retrieve_kwargs: Any,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(mean, per-query) metrics of embeddings already computed for ``data``."""
    run = retrieve(
        query_emb_QD,
        corpus_emb_ND,
        data.query_ids,
        data.corpus_ids,
        max_cutoff(measures),
        **retrieve_kwargs,
    )
    return evaluate_run(data.qrels, run, measures)


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary printed by ``evaluate_beir``."""
    lines = [
        f"{result['dataset']} [{result['split']}]: {result['num_queries']} queries, "
        f"{result['num_corpus']} documents"
    ]
    lines += [f"  {name:<12} {value:.4f}" for name, value in result["metrics"].items()]
    if "rerank" in result:
        rr = result["rerank"]
        lines.append(f"  reranking {rr['num_queries']} candidate lists ({rr['candidates']}):")
        lines += [f"  {name:<12} {value:.4f}" for name, value in rr["metrics"].items()]
    return "\n".join(lines)


def load_towers(
    towers: Towers,
    pooling: str,
    normalize: bool | None,
    max_length: int | None,
    *,
    queries: bool = True,
    **kwargs: Any,
) -> tuple[HFEncoder, HFEncoder | None, sbert.EmbeddingSpec]:
    """(passage encoder, query encoder of separate towers or None, the embedding settings):
    ``pooling`` / ``normalize`` / ``max_length`` over the passage tower's own
    (``sbert.resolve``; a length of neither: ``DEFAULT_MAX_LENGTH``), the same for both
    towers; ``queries=False`` leaves the query tower unloaded. ``kwargs``: ``HFEncoder``'s
    (batch size, device, ...)."""
    spec = sbert.resolve(towers.passage, pooling, normalize)
    settings = {
        "pooling": spec.pooling,
        "normalize": spec.normalize,
        "max_length": max_length or spec.max_length or DEFAULT_MAX_LENGTH,
        **kwargs,
    }
    # resolved and checked against their checkpoint's record once, by ``resolve_towers``
    passage = HFEncoder.from_dir(towers.passage, resolved=True, **settings)
    query = None
    if queries and towers.query is not None:
        query = HFEncoder.from_dir(towers.query, resolved=True, **settings)
    return passage, query, spec


def evaluate_beir(
    encoder: str | Path | Encoder,
    beir_dir: str | Path | BeirData,
    split: str = "test",
    *,
    query_encoder: Encoder | None = None,
    measures: Sequence[str] = DEFAULT_MEASURES,
    pooling: str = "auto",
    normalize: bool | None = None,
    max_length: int | None = None,
    batch_size: int = 64,
    device: str = "auto",
    amp_dtype: torch.dtype | None = None,
    metric: Metric = "ip",
    backend: Backend = "auto",
    ignore_identical_ids: bool = True,
    out_json: str | Path | None = None,
    progress: bool = True,
    verbose: bool = True,
    rerank: bool = False,
    rerank_negatives: int = DEFAULT_NEGATIVES,
    candidates: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate a dense retriever on one split of a BEIR dataset.

    Args:
        encoder: a Hugging Face model folder, a checkpoint or a run folder (its newest
            checkpoint that verifies against its record; ``encoder_dir`` in the result names
            the folder used, ``query_encoder_dir`` the query tower of a model with separate
            towers, which encodes the queries: ``retromae_ds.eval.towers``) (loaded with
            ``pooling``, ``normalize``,
            ``max_length``, ``batch_size``, ``device``, ``amp_dtype``; see ``HFEncoder``;
            ``auto`` / None: the folder's own pooling, normalisation and length, read by
            ``retromae_ds.hf.sbert``, else CLS, raw, 512), or any ``list[str] -> [N, D]``
            callable (those arguments are then ignored). It encodes the corpus and the
            queries unless ``query_encoder`` is given for the queries.
        beir_dir: a BEIR dataset folder, or a ``BeirData`` already loaded (with its split).
        measures: metric names ``name@k``; the search depth is the largest k.
        ignore_identical_ids: drop a retrieved document whose id is its query's (BEIR's
            default); what it drops is said in one line and counted in ``identical_ids``.
        out_json: write the result there as JSON (atomically); never inside the model's or
            the BEIR folder, nor over a file that is not an earlier result (``ValueError``,
            before anything is encoded).
        rerank: also rerank each query's candidates (its positives and ``rerank_negatives``
            BM25 negatives, or the lists of the JSONL file ``candidates``): ``"rerank"`` key.
        verbose: print the summary table.

    Raises ``ValueError`` for an empty corpus, no judged queries, or no judged document in the
    corpus; judged documents missing from the corpus are counted, with a warning on stderr.

    Returns:
        ``{"dataset", "split", "model", "encoder_dir", "query_encoder_dir", "num_corpus",
        "num_queries", "num_queries_skipped", "qrels_docs_missing", "identical_ids":
        {"dropped", "judged_relevant"}, "metrics": {measure: mean},
        "per_query": {qid: {measure: value}}, "settings", "seconds"}``.
    """
    if out_json is not None:
        check_out(
            out_json,
            model=encoder if isinstance(encoder, (str, Path)) else None,
            beir=None if isinstance(beir_dir, BeirData) else beir_dir,
        )
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    data = beir_dir if isinstance(beir_dir, BeirData) else load_beir(beir_dir, split)
    seconds["load"] = time.perf_counter() - t
    missing_docs = _warn_missing(data)
    # resolve: the towers and the settings they really use
    model = _resolve(
        encoder, query_encoder, pooling, normalize, max_length,
        dict(batch_size=batch_size, device=device, amp_dtype=amp_dtype, progress=progress),
    )  # fmt: skip
    # encode
    t = time.perf_counter()
    corpus_emb = encode_texts(model.encoder, data.corpus_texts, desc="corpus")
    seconds["encode_corpus"] = time.perf_counter() - t
    t = time.perf_counter()
    query_emb = encode_texts(model.query_encoder, data.query_texts, desc="queries")
    seconds["encode_queries"] = time.perf_counter() - t
    if query_emb.shape[1] != corpus_emb.shape[1]:
        raise ValueError(
            f"query embeddings have dimension {query_emb.shape[1]}, corpus {corpus_emb.shape[1]}"
        )
    # score
    t = time.perf_counter()
    run, dropped = retrieve_counting(
        query_emb, corpus_emb, data.query_ids, data.corpus_ids, max_cutoff(measures),
        metric=metric, backend=backend, ignore_identical_ids=ignore_identical_ids,
    )  # fmt: skip
    mean, per_query = evaluate_run(data.qrels, run, measures)
    seconds["search_and_metrics"] = time.perf_counter() - t
    judged_identical = identical_judged(data)
    if ignore_identical_ids and (dropped or judged_identical):
        print(
            f"eval: ignore_identical_ids (BEIR's default): dropped {dropped} retrieved "
            f"document(s) whose id is their query's; {judged_identical} judged relevant "
            "(query, document) pair(s) share one id and count as misses; "
            "--ignore_identical_ids false keeps them",
            file=sys.stderr,
            flush=True,
        )
    reranked = None
    if rerank or candidates is not None:
        t = time.perf_counter()
        reranked = _rerank(data, query_emb, corpus_emb, candidates, rerank_negatives)
        seconds["rerank"] = time.perf_counter() - t

    result = {
        "dataset": str(beir_dir) if not isinstance(beir_dir, BeirData) else "<BeirData>",
        "split": split,
        "model": model.name,
        "encoder_dir": None if model.towers is None else str(model.towers.passage),
        "query_encoder_dir": (
            None if model.towers is None or model.towers.query is None else str(model.towers.query)
        ),
        "num_corpus": len(data.corpus_ids),
        "num_queries": len(per_query),
        "num_queries_skipped": len(data.qrels) - len(per_query),
        "qrels_docs_missing": len(missing_docs),
        "identical_ids": {"dropped": dropped, "judged_relevant": judged_identical},
        "metrics": mean,
        "settings": {
            **model.settings(),
            "amp_dtype": str(amp_dtype).removeprefix("torch.") if amp_dtype else None,
            "metric": metric,
            "ignore_identical_ids": ignore_identical_ids,
            "dim": int(corpus_emb.shape[1]),
            # where the encoder ran (an encoder given as a callable: not known here)
            "device": str(model.encoder.device) if isinstance(model.encoder, HFEncoder) else None,
        },
        "seconds": {name: round(value, 3) for name, value in seconds.items()},
        "per_query": per_query,
    }
    if reranked is not None:
        result["rerank"] = reranked
    if verbose:
        print(format_table(result))
    if out_json is not None:
        write_result(out_json, result)
        if verbose:
            print(f"wrote {out_json}")
    return result


def _warn_missing(data: BeirData) -> list[str]:
    """Judged documents not in the corpus (they count as misses), said in one line."""
    missing_docs = check_beir(data)
    if missing_docs:
        print(
            f"eval: warning: {len(missing_docs)} judged document(s) of {data.qrels_source} are "
            f"not in {data.corpus_source} and count as misses (first: {missing_docs[:5]})",
            file=sys.stderr,
            flush=True,
        )
    return missing_docs


@dataclass
class _Resolved:
    """The encoders an evaluation runs and the settings they really use."""

    name: str
    encoder: Encoder
    query_encoder: Encoder
    towers: Towers | None
    """The folders the towers came from (None for a callable)."""
    pooling: str
    normalize: bool | None
    max_length: int | None
    requested_length: int | None

    def settings(self) -> dict[str, Any]:
        capped = self.requested_length and self.requested_length != self.max_length
        return {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "max_length": self.max_length,
            **({"max_length_requested": self.requested_length} if capped else {}),
        }


def _resolve(
    encoder: str | Path | Encoder,
    query_encoder: Encoder | None,
    pooling: str,
    normalize: bool | None,
    max_length: int | None,
    load: dict[str, Any],
) -> _Resolved:
    """A folder's towers loaded (its newest checkpoint that verifies; its own pooling,
    normalisation and length where asked ``auto`` / None), or the callable as given; a
    length capped by the model said in one line."""
    requested, towers = max_length, None
    if isinstance(encoder, (str, Path)):
        name = str(encoder)
        towers, (encoder, query_tower, spec) = load_newest(
            encoder,
            lambda found: load_towers(
                found, pooling, normalize, max_length, queries=query_encoder is None, **load
            ),
        )
        query_encoder = query_encoder or query_tower
        pooling, normalize = spec.pooling, spec.normalize
    else:
        name = getattr(encoder, "__name__", type(encoder).__name__)
    if isinstance(encoder, HFEncoder):  # the length it really uses, said when capped
        if requested and encoder.capped_by and encoder.max_length < requested:
            print(
                f"eval: --max_length {requested} capped at {encoder.max_length}, "
                f"{encoder.capped_by}",
                file=sys.stderr,
                flush=True,
            )
        max_length = encoder.max_length
    return _Resolved(
        name, encoder, query_encoder or encoder, towers, pooling, normalize, max_length, requested
    )


def _rerank(
    data: BeirData,
    query_emb: np.ndarray,
    corpus_emb: np.ndarray,
    candidates: str | Path | None,
    negatives: int,
) -> dict[str, Any]:
    """Each query's candidates (the JSONL ``candidates``, else its positives and
    ``negatives`` BM25 negatives) reranked by the embeddings: the ``rerank`` result."""
    if candidates is not None:
        lists, source = load_candidates(candidates, data), str(candidates)
    else:
        lists = bm25_candidates(data, negatives)
        source = f"positives + {negatives} BM25 negatives"
    mean, per_query = evaluate_rerank(data, lists, query_emb, corpus_emb)
    return {
        "candidates": source,
        "num_queries": len(per_query),
        "metrics": mean,
        "per_query": per_query,
    }


@dataclass(kw_only=True)
class EvalConfig:
    """``retromae-ds eval``: retrieval metrics of an encoder on a BEIR folder."""

    model: str
    """A local Hugging Face encoder folder, a checkpoint, or a run folder (its newest)."""
    beir: str
    """BEIR dataset folder (corpus/queries/qrels)."""
    split: str = "test"
    """Qrels split."""
    pooling: str = flag("auto", choices=("auto", "cls", "mean", "dupmae", "dupmae_bow"))
    """Sentence embedding (auto: the model's own, read from its sentence-transformers files,
    else cls)."""
    normalize: bool | None = None
    """L2-normalise embeddings, cosine (none: the model's own, else no)."""
    max_length: int | None = None
    """Tokens per text (none: the model's max_seq_length, else 512)."""
    batch_size: int = 64
    """Texts per forward pass."""
    out: str | None = None
    """Write the results as JSON to this file."""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda:1, ..."""
    progress: bool = True
    """Progress bars on stderr."""
    rerank: bool = False
    """Also rerank each query's candidates (positives + BM25 negatives): MAP, MRR@10."""
    rerank_negatives: int = DEFAULT_NEGATIVES
    """BM25 negatives per candidate list."""
    candidates: str | None = None
    """JSONL candidate lists (query_id, negative[, positive]) instead of BM25's."""
    ignore_identical_ids: bool = True
    """Drop a retrieved document whose id is its query's, as BEIR does (ArguAna and Quora hold
    their queries in the corpus); what it drops is said in one line and recorded."""


def eval_command(cfg: EvalConfig) -> int:
    """``retromae-ds eval``; returns the exit status."""
    evaluate_beir(
        cfg.model,
        cfg.beir,
        cfg.split,
        pooling=cfg.pooling,
        normalize=cfg.normalize,
        max_length=cfg.max_length,
        batch_size=cfg.batch_size,
        device=cfg.device,
        out_json=cfg.out,
        progress=cfg.progress,
        rerank=cfg.rerank,
        rerank_negatives=cfg.rerank_negatives,
        candidates=cfg.candidates,
        ignore_identical_ids=cfg.ignore_identical_ids,
    )
    return 0
