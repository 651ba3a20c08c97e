"""Dense-retrieval evaluation on a BEIR dataset: encode, search, metrics, report.

``evaluate_beir(model_dir_or_encoder, beir_dir, split="test")`` encodes the corpus and the
split's queries, searches the top ``max(k)`` documents per query by inner product with the
index ``index`` names (``retromae_ds.search``; default ``flat``, exact search; any setting of
the refresher's ``refresh.index``, with ``nprobe`` / ``ef_search`` / ``train_size``),
computes the measures asked (default nDCG@10, MRR@10, Recall@100/1000; any measure
registered in ``retromae_ds.retrieval.metrics``), prints a small table
and optionally writes everything (means, per-query values, settings, timings) to a JSON file. ``retrieve`` and ``evaluate_embeddings`` are the same steps for callers
that already hold embeddings. Command line (wired as ``retromae-ds eval``)::

    retromae-ds eval --model DIR --beir DIR [--split test] [--pooling auto|POOLING] [--normalize]
                     [--measures ndcg@10 recall@100 ...] [--index flat|ivf|hnsw|IVF4096,Flat|... [--nprobe N]]
                     [--rerank.model CE [--rerank.depth K] [--rerank.batch_size N]]
                     [--rerank.lists [--rerank.negatives N | --rerank.candidates FILE]]
                     [--ignore_identical_ids false]
    retromae-ds eval --model bm25 --beir DIR [--rerank.model CE ...]

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

``--rerank.model CE`` reranks the first stage's top ``--rerank.depth`` with a cross-encoder
and reports the reranked run's measures, the first stage's beside them, and the pairs scored
per second (``retromae_ds.eval.two_stage``); ``--model bm25`` makes BM25 the first stage.
``--rerank.lists`` (formerly ``--rerank``) also ranks each query's candidate list with the
same embeddings and reports MAP and MRR@10 (C-MTEB's reranking measures;
``retromae_ds.eval.rerank``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from retromae_ds.base.config import flag
from retromae_ds.eval.rerank import (
    DEFAULT_NEGATIVES,
    bm25_candidates,
    evaluate_rerank,
    load_candidates,
)
from retromae_ds.eval.result_file import check_out, write_result
from retromae_ds.eval.towers import Towers, load_newest
from retromae_ds.eval.two_stage import (
    BM25,
    CrossEncoderStage,
    RerankConfig,
    reranking_lines,
    with_reranking,
)
from retromae_ds.hf import sbert
from retromae_ds.hf.pooling import Choices, check_pooling
from retromae_ds.retrieval.beir import BeirData, check_beir, load_beir
from retromae_ds.retrieval.encode import Encoder, HFEncoder, encode_texts
from retromae_ds.retrieval.metrics import (
    DEFAULT_MEASURES,
    Run,
    check_measures,
    evaluate_run,
    max_cutoff,
)
from retromae_ds.search.arrays import Backend, Metric, check_matrix
from retromae_ds.search.build import build
from retromae_ds.search.index import IndexChoice, spelled_as
from retromae_ds.search.kinds import IndexSetting, index_setting

DEFAULT_MAX_LENGTH = 512
"""Tokens per text for a model that records no length of its own."""


def retrieve(*args: Any, **settings: Any) -> Run:
    """``{qid: {doc id: score}}``: ``retrieve_counting``'s run alone (the same arguments).

    ``ignore_identical_ids`` drops a document whose id equals the query id (BEIR's default,
    for datasets such as ArguAna and Quora where a query is also in the corpus); one extra
    document is retrieved so that k remain.
    """
    return retrieve_counting(*args, **settings)[0]


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
    index: IndexSetting | None = None,
) -> tuple[Run, int, IndexChoice]:
    """``retrieve``, how many retrieved documents ``ignore_identical_ids`` dropped, and what
    the index setting resolved to for this corpus."""
    if len(query_ids) != len(query_emb_QD) or len(corpus_ids) != len(corpus_emb_ND):
        raise ValueError("ids and embeddings differ in length")
    corpus_emb_ND = check_matrix(corpus_emb_ND, "embeddings")
    depth = k + 1 if ignore_identical_ids else k
    setting = index or index_setting("flat", backend=backend)
    searcher = build(
        setting, n=len(corpus_emb_ND), dim=corpus_emb_ND.shape[1], k=depth, metric=metric
    )
    searcher.add(corpus_emb_ND)
    scores_QK, ids_QK = searcher.search(query_emb_QD, depth)
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
    assert searcher.choice is not None
    return run, dropped, searcher.choice


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
    if "cross_encoder" in result:
        lines += reranking_lines(result)
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


@dataclass(kw_only=True)
class EncodeSettings:
    """How an evaluation turns texts into vectors (``resolve``, ``encode``); ``auto`` / None:
    the model folder's own, read by ``retromae_ds.hf.sbert``, else CLS, raw, 512 tokens. A
    callable encoder ignores them."""

    pooling: str = "auto"
    normalize: bool | None = None
    max_length: int | None = None
    batch_size: int = 64
    device: str = "auto"
    amp_dtype: torch.dtype | None = None
    progress: bool = True


@dataclass(kw_only=True)
class ScoreSettings:
    """How an evaluation turns vectors into metrics (``score``)."""

    measures: Sequence[str] = DEFAULT_MEASURES
    """Metric names ``name@k`` (``retromae_ds.retrieval.metrics.MEASURES``), the result's keys as
    given; the search depth is the largest k."""
    metric: Metric = "ip"
    backend: Backend = "auto"
    index: str | IndexSetting = "flat"
    """The index searched (``retromae_ds.search.kinds``): ``flat`` (exact), ``ivf``,
    ``ivfpq``, ``hnsw``, ``auto`` or a faiss index_factory string, with ``backend``,
    ``nprobe``, ``ef_search`` and ``train_size``; or an ``IndexSetting`` already checked,
    which carries its own."""
    nprobe: int = 0
    ef_search: int = 0
    train_size: int = 0
    ignore_identical_ids: bool = True
    """Drop a retrieved document whose id is its query's (BEIR's default)."""
    rerank: bool = False
    """Also rerank each query's candidates (positives + ``rerank_negatives`` BM25 negatives,
    or the JSONL lists of ``candidates``)."""
    rerank_negatives: int = DEFAULT_NEGATIVES
    candidates: str | Path | None = None
    cross_encoder: CrossEncoderStage | None = None
    """Rerank the top ``depth`` of the search with this cross-encoder
    (``eval.two_stage``): the measures are then the reranked run's."""

    def __post_init__(self) -> None:
        check_measures(self.measures, "measures")  # before anything is loaded or encoded
        if not isinstance(self.index, IndexSetting):
            self.index = index_setting(
                self.index, backend=self.backend, nprobe=self.nprobe, ef_search=self.ef_search,
                train_size=self.train_size,
            )  # fmt: skip


def split_settings(settings: dict[str, Any]) -> tuple[EncodeSettings, ScoreSettings]:
    """``evaluate_beir``'s keyword settings, each to the step that uses it; an unknown name
    is a TypeError naming it."""
    names = [{f.name for f in fields(cls)} for cls in (EncodeSettings, ScoreSettings)]
    unknown = sorted(set(settings) - names[0] - names[1])
    if unknown:
        raise TypeError(f"evaluate_beir: unknown setting(s) {', '.join(unknown)}")
    encode_cfg = EncodeSettings(**{k: v for k, v in settings.items() if k in names[0]})
    return encode_cfg, ScoreSettings(**{k: v for k, v in settings.items() if k in names[1]})


def evaluate_beir(
    encoder: str | Path | Encoder,
    beir_dir: str | Path | BeirData,
    split: str = "test",
    *,
    query_encoder: Encoder | None = None,
    out_json: str | Path | None = None,
    verbose: bool = True,
    **settings: Any,
) -> dict[str, Any]:
    """Evaluate a dense retriever on one split of a BEIR dataset: load, ``resolve`` the
    encoders, ``encode`` corpus and queries, ``score``, report.

    Args:
        encoder: a Hugging Face model folder, a checkpoint or a run folder (its newest
            checkpoint that verifies against its record; ``encoder_dir`` in the result names
            the folder used, ``query_encoder_dir`` the query tower of a model with separate
            towers, which encodes the queries: ``retromae_ds.eval.towers``), or any
            ``list[str] -> [N, D]`` callable. It encodes the corpus and the queries unless
            ``query_encoder`` is given for the queries.
        beir_dir: a BEIR dataset folder, or a ``BeirData`` already loaded (with its split).
        out_json: write the result there as JSON (atomically); never inside the model's or
            the BEIR folder, nor over a file that is not an earlier result (``ValueError``,
            before anything is encoded).
        verbose: print the summary table.
        settings: the fields of :class:`EncodeSettings` (pooling, normalize, max_length,
            batch_size, device, amp_dtype, progress) and :class:`ScoreSettings` (measures,
            metric, backend, index and its settings, ignore_identical_ids, rerank, ...).

    Raises ``ValueError`` for an empty corpus, no judged queries, or no judged document in the
    corpus; judged documents missing from the corpus are counted, with a warning on stderr.

    Returns:
        ``{"dataset", "split", "model", "encoder_dir", "query_encoder_dir", "num_corpus",
        "num_queries", "num_queries_skipped", "qrels_docs_missing", "identical_ids":
        {"dropped", "judged_relevant"}, "metrics": {measure: mean},
        "per_query": {qid: {measure: value}}, "settings", "seconds"}`` (and ``"rerank"``).
    """
    encode_cfg, score_cfg = split_settings(settings)
    t = time.perf_counter()
    _refuse_early(out_json, encoder, beir_dir, score_cfg)
    data = beir_dir if isinstance(beir_dir, BeirData) else load_beir(beir_dir, split)
    seconds = {"load": time.perf_counter() - t}
    missing_docs = _warn_missing(data)
    model = resolve(encoder, query_encoder, encode_cfg)
    emb = encode(model, data, seconds)
    scores = score(data, emb, score_cfg, seconds)
    result = {
        "dataset": str(beir_dir) if not isinstance(beir_dir, BeirData) else "<BeirData>",
        "split": split,
        **model.record(),
        "num_corpus": len(data.corpus_ids),
        "num_queries": len(scores.per_query),
        "num_queries_skipped": len(data.qrels) - len(scores.per_query),
        "qrels_docs_missing": len(missing_docs),
        "identical_ids": {"dropped": scores.dropped, "judged_relevant": scores.judged_identical},
        "metrics": scores.mean,
        "settings": {
            **model.settings(),
            "amp_dtype": str(encode_cfg.amp_dtype).removeprefix("torch.")
            if encode_cfg.amp_dtype
            else None,
            "metric": score_cfg.metric,
            "index": scores.index.record(),
            "ignore_identical_ids": score_cfg.ignore_identical_ids,
            "dim": int(emb.corpus.shape[1]),
            # where the encoder ran (an encoder given as a callable: not known here)
            "device": str(model.encoder.device) if isinstance(model.encoder, HFEncoder) else None,
        },
        "seconds": {name: round(value, 3) for name, value in seconds.items()},
        "per_query": scores.per_query,
        **({"rerank": scores.reranked} if scores.reranked is not None else {}),
    }
    if scores.cross_encoder is not None:
        with_reranking(result, scores.cross_encoder)
    _report(result, out_json, verbose)
    return result


def _refuse_early(
    out_json: str | Path | None,
    encoder: str | Path | Encoder,
    beir_dir: str | Path | BeirData,
    score_cfg: ScoreSettings,
) -> None:
    """What is refused before anything is encoded: an output file that must not be written
    (``result_file.check_out``), a reranker that is not a cross-encoder (loaded now)."""
    if out_json is not None:
        check_out(
            out_json,
            model=encoder if isinstance(encoder, (str, Path)) else None,
            beir=None if isinstance(beir_dir, BeirData) else beir_dir,
        )
    if score_cfg.cross_encoder is not None:
        score_cfg.cross_encoder.load()


def _not_a_cross_encoder(towers: Towers) -> Towers:
    """``towers``, unless their folder is a cross-encoder: one line, it embeds nothing."""
    from retromae_ds.retrieval.cross_encoder import is_cross_encoder

    if (towers.passage / "config.json").is_file() and is_cross_encoder(towers.passage):
        raise ValueError(
            f"{towers.passage}: a cross-encoder scores (query, passage) pairs and embeds "
            "nothing: give it as --rerank.model over a first stage (--model bm25 or a dense "
            "model)"
        )
    return towers


@dataclass
class Embeddings:
    """The query and corpus vectors of one evaluation (rows in ``BeirData`` order)."""

    query: np.ndarray
    corpus: np.ndarray


def encode(model: Resolved, data: BeirData, seconds: dict[str, float]) -> Embeddings:
    """Corpus and queries of ``data`` through the resolved encoders (their seconds into
    ``seconds``); the two must agree on the dimension."""
    t = time.perf_counter()
    corpus = encode_texts(model.encoder, data.corpus_texts, desc="corpus")
    seconds["encode_corpus"] = time.perf_counter() - t
    t = time.perf_counter()
    query = encode_texts(model.query_encoder, data.query_texts, desc="queries")
    seconds["encode_queries"] = time.perf_counter() - t
    if query.shape[1] != corpus.shape[1]:
        raise ValueError(
            f"query embeddings have dimension {query.shape[1]}, corpus {corpus.shape[1]}"
        )
    return Embeddings(query, corpus)


@dataclass
class Scores:
    """What ``score`` measured: metrics (mean, per query), identical ids dropped and judged,
    and the reranking result when asked."""

    mean: dict[str, float]
    per_query: dict[str, dict[str, float]]
    dropped: int
    judged_identical: int
    reranked: dict[str, Any] | None
    index: IndexChoice
    """What the index setting resolved to for this corpus."""
    cross_encoder: dict[str, Any] | None = None
    """The cross-encoder's reranking of the run (``eval.two_stage``), when asked."""


def score(data: BeirData, emb: Embeddings, cfg: ScoreSettings, seconds: dict[str, float]) -> Scores:
    """The search of every query (``cfg.index``), its metrics, the identical-ids line when it
    dropped or misses anything, and the reranking when asked (their seconds into
    ``seconds``)."""
    t = time.perf_counter()
    ce = cfg.cross_encoder
    depth = ce.retrieve_depth(cfg.measures) if ce is not None else max_cutoff(cfg.measures)
    run, dropped, index = retrieve_counting(
        emb.query, emb.corpus, data.query_ids, data.corpus_ids, depth,
        metric=cfg.metric, backend=cfg.backend, ignore_identical_ids=cfg.ignore_identical_ids,
        index=cfg.index,
    )  # fmt: skip
    mean, per_query = evaluate_run(data.qrels, run, cfg.measures)
    seconds["search_and_metrics"] = time.perf_counter() - t
    judged_identical = identical_judged(data)
    if cfg.ignore_identical_ids and (dropped or judged_identical):
        print(
            f"eval: ignore_identical_ids (BEIR's default): dropped {dropped} retrieved "
            f"document(s) whose id is their query's; {judged_identical} judged relevant "
            "(query, document) pair(s) share one id and count as misses; "
            "--ignore_identical_ids false keeps them",
            file=sys.stderr,
            flush=True,
        )
    reranked = None
    if cfg.rerank or cfg.candidates is not None:
        t = time.perf_counter()
        reranked = _rerank(data, emb.query, emb.corpus, cfg.candidates, cfg.rerank_negatives)
        seconds["rerank"] = time.perf_counter() - t
    reranked_ce = None
    if ce is not None:
        t = time.perf_counter()
        reranked_ce = ce.run(data, run, cfg.measures)
        seconds["cross_encoder"] = time.perf_counter() - t
    return Scores(mean, per_query, dropped, judged_identical, reranked, index, reranked_ce)


def _report(result: dict[str, Any], out_json: str | Path | None, verbose: bool) -> None:
    """The summary table (``verbose``) and the JSON file (``out_json``, atomically)."""
    if verbose:
        print(format_table(result))
    if out_json is not None:
        write_result(out_json, result)
        if verbose:
            print(f"wrote {out_json}")


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
class Resolved:
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

    def record(self) -> dict[str, Any]:
        """What the result says about the model: its name and the towers' folders."""
        towers = self.towers
        return {
            "model": self.name,
            "encoder_dir": None if towers is None else str(towers.passage),
            "query_encoder_dir": (
                None if towers is None or towers.query is None else str(towers.query)
            ),
        }


def resolve(
    encoder: str | Path | Encoder, query_encoder: Encoder | None, cfg: EncodeSettings
) -> Resolved:
    """A folder's towers loaded (its newest checkpoint that verifies; its own pooling,
    normalisation and length where ``cfg`` says ``auto`` / None), or the callable as given; a
    length capped by the model said in one line."""
    pooling, normalize, requested, towers = cfg.pooling, cfg.normalize, cfg.max_length, None
    max_length = requested
    load = dict(
        batch_size=cfg.batch_size, device=cfg.device, amp_dtype=cfg.amp_dtype,
        progress=cfg.progress,
    )  # fmt: skip
    if isinstance(encoder, (str, Path)):
        name = str(encoder)
        towers, (encoder, query_tower, spec) = load_newest(
            encoder,
            lambda found: load_towers(
                _not_a_cross_encoder(found),
                pooling,
                normalize,
                requested,
                queries=query_encoder is None,
                **load,
            ),  # fmt: skip
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
    return Resolved(
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
    """A local Hugging Face encoder folder, a checkpoint, a run folder (its newest), or bm25
    (BM25 as the first stage; a folder named so: ./bm25)."""
    beir: str
    """BEIR dataset folder (corpus/queries/qrels)."""
    split: str = "test"
    """Qrels split."""
    pooling: str = flag("auto", choices=Choices())
    """Sentence embedding: auto (the model's own, read from its sentence-transformers files,
    else cls) or a registered pooling (retromae_ds.hf.pooling: the library's or an installed
    package's)."""
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
    rerank: RerankConfig = field(default_factory=RerankConfig)
    """A cross-encoder over the first stage's top K (rerank.model, rerank.depth), and
    C-MTEB's candidate lists (rerank.lists: what --rerank was)."""
    ignore_identical_ids: bool = True
    """Drop a retrieved document whose id is its query's, as BEIR does (ArguAna and Quora hold
    their queries in the corpus); what it drops is said in one line and recorded."""
    measures: list[str] = field(default_factory=lambda: list(DEFAULT_MEASURES))
    """Ranking measures reported, each name@k: ndcg, mrr, recall, map (or any measure
    registered with retromae_ds.retrieval.metrics.register_measure); the search depth is the largest
    k."""
    index: str = "flat"
    """The index searched: flat (exact), or any refresh.index setting: ivf, ivfpq, hnsw, auto
    (flat below 200,000 documents) or a faiss index_factory string (IVF4096,Flat,
    HNSW32,Flat, ...); the result records what it resolved to."""
    nprobe: int = 0
    """IVF lists probed per query (0: auto, 1/8 of the lists); IVF indexes only."""
    ef_search: int = 0
    """HNSW candidate-list size per query (0: auto, 4 x the search depth, at least 64)."""
    train_size: int = 0
    """Documents sampled to train an IVF or PQ index (0: auto, 64 per list or code)."""

    RENAMED: ClassVar[dict[str, str]] = {
        "rerank": "rerank.lists",
        "rerank_negatives": "rerank.negatives",
        "candidates": "rerank.candidates",
    }
    """The candidate-list reranking's options moved into the ``rerank`` section."""

    def __post_init__(self) -> None:
        self.pooling = check_pooling(self.pooling, "--pooling")
        self.measures = check_measures(self.measures, "--measures")
        if self.model == BM25:
            self._check_bm25()
        with spelled_as(self.option):  # checked once, here; sized to the corpus after loading
            self.index_setting = index_setting(
                self.index, nprobe=self.nprobe, ef_search=self.ef_search,
                train_size=self.train_size,
            )  # fmt: skip

    def _check_bm25(self) -> None:
        """``--model bm25`` has no embeddings: the dense model's options are refused."""
        dense = {
            "--pooling": self.pooling != "auto",
            "--normalize": self.normalize is not None,
            "--max_length": self.max_length is not None,
            "--index": self.index != "flat",
            "--rerank.lists": self.rerank.lists,
            "--rerank.candidates": self.rerank.candidates is not None,
        }
        given = [name for name, set_ in dense.items() if set_]
        if given:
            raise ValueError(
                f"{', '.join(given)}: a dense model's; --model bm25 (the lexical first stage) "
                "has no embeddings: leave them out (a folder named bm25: --model ./bm25)"
            )

    def cross_encoder(self) -> CrossEncoderStage | None:
        """The reranking step ``rerank.model`` asks for, or None."""
        r = self.rerank
        if not r.model:
            return None
        return CrossEncoderStage(
            r.model, depth=r.depth, batch_size=r.batch_size, max_length=r.max_length,
            device=self.device, bf16=r.bf16,
        )  # fmt: skip

    @staticmethod
    def option(setting: str) -> str:
        """How ``eval`` spells ``retromae_ds.search``'s setting ``setting`` (``--nprobe``)."""
        return f"--{setting}"


INDEX_OPTIONS = ("index", "nprobe", "ef_search", "train_size")
"""``EvalConfig``'s index options, handed to ``evaluate_beir`` as one checked setting."""
