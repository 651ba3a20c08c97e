"""``retromae-ds mine``: offline hard-negative mining into a file every tool reads.

``retromae-ds mine --model ENCODER --beir FOLDER [--split train] --out negatives.jsonl`` (or
``--pairs FILE`` in place of ``--beir``: FlagEmbedding, sentence-transformers or Tevatron
pairs, or a mined file) encodes and searches with the refresher's own stages
(``refresher.offline``: checksummed shards resumable in the work folder, the embedding cache,
the ``--index`` kinds) and keeps, per query, the negatives that sentence-transformers'
``mine_hard_negatives`` options say (``refresher.filters``: ``range_min``, ``range_max``,
``num_negatives``, ``sampling_strategy``, the margins, the score bounds,
``include_positives``; FlagEmbedding's ``range_for_sampling``). It writes the id-level jsonl
(``data.pairs``'s ``mined`` format: positives with scores, negatives with rank and score),
each ``--format`` export beside it, then the manifest (``NAME.manifest.json``: the model's and
the corpus's hashes, every setting, what each filter removed, score statistics, shortfalls,
``--holdout_positive``'s false-negative counts), last: a manifest names complete files.
docs/ance.md ("mine") describes it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.base.commands import DESCRIPTIONS
from retromae_ds.base.config import flag
from retromae_ds.base.fsutil import atomic_write_text, sha256_file
from retromae_ds.base.options import run_command
from retromae_ds.data.pairs import WRITE_FORMATS, Example, Passage, read_examples, write_examples
from retromae_ds.hf import sbert
from retromae_ds.hf.pooling import Choices, check_pooling
from retromae_ds.refresher import filters, offline
from retromae_ds.refresher.config import RefresherConfig, RefresherMiningConfig
from retromae_ds.refresher.denoise import DenoiseSettings, Judged, judge
from retromae_ds.refresher.filters import FilterSettings, Selection
from retromae_ds.refresher.mining import identical_passages

EXPORTS = tuple(f for f in WRITE_FORMATS if f != "mined")
MANIFEST_FORMAT = 1


@dataclass(kw_only=True)
class MineConfig:
    """``retromae-ds mine``: hard negatives of a BEIR split or a pairs file, as a file."""

    model: str
    """The encoder: a Hugging Face folder, a checkpoint or a run folder (its newest), as
    ``eval`` takes it."""
    out: str
    """The id-level jsonl written (the ``mined`` format); the manifest goes beside it as
    NAME.manifest.json, each export as NAME.FORMAT.jsonl."""
    beir: str = ""
    """A BEIR folder whose ``split`` queries are mined (or ``pairs``)."""
    split: str = "train"
    """The BEIR qrels split."""
    pairs: str = ""
    """A pairs file (FlagEmbedding jsonl, an ST table: jsonl, parquet or a datasets folder,
    Tevatron jsonl, a mined file); its positives are the corpus, beside ``corpus``."""
    pairs_format: str = "auto"
    """The pairs file's format: auto, flagembedding, st, tevatron or mined."""
    corpus: str = ""
    """An extra corpus (a BEIR folder or its corpus.jsonl) searched too; it also resolves
    a pairs file's ids (and query ids, from its queries.jsonl)."""
    format: list[str] = field(default_factory=list)
    """Exports beside the jsonl: st-triplet, st-ntuple, st-labeled-pair, st-labeled-list,
    flagembedding, tevatron."""
    scores: bool = False
    """The exports carry the scores (ST's output_scores; FE's pos_scores/neg_scores)."""
    num_negatives: int = 3
    """Negatives per query (ST's num_negatives)."""
    range_min: int = 0
    """Skip this many best candidates left after the positives and filters (ST's)."""
    range_max: int | None = None
    """Consider at most this many candidates left (ST's; none: range_min + num_negatives
    (x10 with a margin or max_score) + the most positives a query has)."""
    sampling_strategy: str = "top"
    """top: the best num_negatives left; random: drawn among them (seed)."""
    absolute_margin: float | None = None
    """Drop a candidate whose score + margin exceeds the query's lowest positive score."""
    relative_margin: float | None = None
    """Drop a candidate scoring above p - |p| x margin (p: the lowest positive score)."""
    max_score: float | None = None
    """Drop a candidate scoring above this."""
    min_score: float | None = None
    """Drop a candidate scoring below this."""
    include_positives: bool = False
    """Positives keep their ranks and slots (ST's); they are never written as negatives."""
    range_for_sampling: str = ""
    """FlagEmbedding's A-B: candidates are raw ranks A..B-1 of the retrieved list (0-based,
    positives and the query's own document among them, then removed); replaces range_min
    and range_max."""
    seed: int = 0
    """Seeds random sampling and the held-out positive."""
    holdout_positive: bool = False
    """Hide one positive of each query that has two or more and count how often it comes
    back as a negative, step by step (the manifest's holdout)."""
    ignore_identical_ids: bool = True
    """Never mine a query's own document (the passage with the query's id)."""
    pooling: str = flag("auto", choices=Choices())
    """Sentence embedding: auto (the model's own, else cls) or a registered pooling."""
    normalize: bool | None = None
    """L2-normalise embeddings (none: the model's own, else no)."""
    max_length: int | None = None
    """Tokens per query and passage (none: the model's max_seq_length, else 512)."""
    batch_size: int = 128
    """Texts per forward pass."""
    device: str = "auto"
    """auto (CUDA when available), cpu, cuda:1, ..."""
    bf16: bool = True
    """Encode under bf16 autocast on CUDA."""
    index: str = "flat"
    """The index searched: any refresh.index setting (flat, ivf, ivfpq, hnsw, auto, a faiss
    index_factory string); approximate scores are recomputed exactly."""
    search_backend: str = "auto"
    """auto / faiss / torch (exact only)."""
    nprobe: int = 0
    """IVF lists probed per query (0: auto)."""
    ef_search: int = 0
    """HNSW candidate-list size per query (0: auto)."""
    train_size: int = 0
    """Passages sampled to train an IVF or PQ index (0: auto)."""
    shard_rows: int = 65536
    """Passages per embedding shard (one shard in memory at a time)."""
    embedding_dtype: str = "float32"
    """How shards are stored: float32 or float16."""
    cache_dir: str = ""
    """The refresher's embedding cache, shared between runs (empty: off)."""
    work_dir: str = ""
    """Tokenized data and resumable shards (default: .NAME.work beside out)."""
    progress: bool = True
    """Progress bars on stderr."""
    cross_encoder: str = ""
    """A cross-encoder (folder, checkpoint or run folder) that scores every query's
    positives and mined negatives: written as NAME.teacher.tsv (RetroMAE's ``qid did score``
    lines, what ``finetune --distill.scores`` reads), and what ``denoise`` judges."""
    ce_batch_size: int = 64
    """Pairs per cross-encoder forward pass."""
    ce_max_length: int | None = None
    """Tokens per pair (none: the cross-encoder's own, else 512)."""
    ce_bf16: bool = False
    """Score under bf16 autocast: about 2× the pairs per second on a CPU with AMX or
    AVX512-BF16 (and on CUDA); the logits move in the second or third digit."""
    denoise: str = "none"
    """False negatives by the cross-encoder's scores (``refresher.denoise``): none, threshold
    (its probability above denoise_value, default 0.1), margin (a logit above the weakest
    positive's minus denoise_value, default 0) or relative_margin."""
    denoise_value: float | None = None
    """The threshold or margin of ``denoise``."""
    denoise_action: str = "drop"
    """What a false negative becomes: drop (removed), relabel (a positive) or drop_query."""
    denoise_fit: bool = False
    """Fit denoise_value on the held-out positives (--holdout_positive): the best F1 of
    finding them among the candidates; the manifest gives its precision and recall."""

    def __post_init__(self) -> None:
        self.pooling = check_pooling(self.pooling, "--pooling")
        self.denoising()
        if self.denoise != "none" and not self.cross_encoder:
            raise ValueError(f"--denoise {self.denoise} judges by a --cross_encoder's scores")
        if self.denoise_fit and not (self.holdout_positive and self.denoise != "none"):
            raise ValueError("--denoise_fit fits --denoise on --holdout_positive's positives")
        if bool(self.beir) == bool(self.pairs):
            raise ValueError("give one of --beir FOLDER or --pairs FILE")
        unknown = [f for f in self.format if f not in EXPORTS]
        if unknown:
            raise ValueError(f"--format {unknown[0]!r}: not one of {', '.join(EXPORTS)}")
        if self.max_length is not None and self.max_length < 3:
            raise ValueError(f"--max_length must be >= 3, not {self.max_length}")
        self.filters()
        self.refresh_config(1)

    def denoising(self) -> DenoiseSettings:
        return DenoiseSettings(
            mode=self.denoise, value=self.denoise_value, action=self.denoise_action
        )

    def filters(self) -> FilterSettings:
        names = [f.name for f in FilterSettings.__dataclass_fields__.values()]
        return FilterSettings(**{name: getattr(self, name) for name in names})

    def refresh_config(self, depth: int) -> RefresherConfig:
        """The refresher's settings this mining encodes and searches with."""
        return RefresherConfig(
            mining=RefresherMiningConfig(top_k=depth, seed=self.seed),
            index=self.index, search_backend=self.search_backend, nprobe=self.nprobe,
            ef_search=self.ef_search, train_size=self.train_size, batch_size=self.batch_size,
            shard_rows=self.shard_rows, embedding_dtype=self.embedding_dtype,
            device=self.device, bf16=self.bf16, cache_dir=self.cache_dir,
            progress=self.progress,
        )  # fmt: skip

    def paths(self) -> tuple[Path, Path, Path]:
        """(the jsonl, its manifest, the work folder)."""
        out = Path(self.out)
        stem = out.name.removesuffix(".jsonl")
        work = Path(self.work_dir) if self.work_dir else out.with_name(f".{stem}.work")
        return out, out.with_name(f"{stem}.manifest.json"), work

    def export_path(self, fmt: str) -> Path:
        out = Path(self.out)
        return out.with_name(f"{out.name.removesuffix('.jsonl')}.{fmt}.jsonl")


# --------------------------------------------------------------------------- the job
def mine_command(cfg: MineConfig) -> int:
    """``retromae-ds mine``."""
    run_mine(cfg)
    return 0


def run_mine(cfg: MineConfig) -> dict[str, Any]:
    """Mine, write the jsonl, the exports and the manifest; returns the manifest."""
    from retromae_ds.components.checkpoint import resolve_encoder
    from retromae_ds.refresher.embed_cache import folder_digest

    t0 = time.perf_counter()
    out, manifest_path, work = cfg.paths()
    out.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # an old manifest never describes new files
    encoder = resolve_encoder(cfg.model)
    spec = sbert.resolve(encoder, cfg.pooling, cfg.normalize)
    beir, split, inputs = _input(cfg, work)
    ts, data_dir = _training_set(cfg, beir, split, encoder, spec, work)
    positives, watch = _holdout(ts.positives, cfg.seed) if cfg.holdout_positive else (
        ts.positives, None
    )  # fmt: skip
    settings = cfg.filters()
    depth = settings.depth(max(len(p) for p in positives))
    ranking, job = offline.rank(cfg.refresh_config(depth), ts, encoder, work, spec, depth)
    pair_scores = np.asarray(ranking.positives, dtype=np.float64)
    excluded = (
        identical_passages(ts.query_ids, ts.passage_ids) if cfg.ignore_identical_ids else None
    )
    selection = filters.select(
        ranking.ids, ranking.scores, positives, settings,
        positive_min_Q=_lowest(pair_scores, ts.positives, positives), excluded_Q=excluded,
        watch_Q=watch,
    )  # fmt: skip
    judged = _judge(cfg, beir, ts, positives, selection, watch) if cfg.cross_encoder else None
    counts = {"dropped": 0, "negatives": 0, "short": 0, "missing": 0, "denoised": 0,
              "relabelled": 0, "queries_dropped": 0}  # fmt: skip
    teacher: dict[str, dict[str, float]] | None = {} if judged else None
    written = write_examples(
        _examples(ts, positives, pair_scores, selection, counts, settings.num_negatives,
                  judged, cfg.denoise_action, teacher),
        out,
        "mined",
    )  # fmt: skip
    if teacher is not None:
        from retromae_ds.data.teacher_scores import write_teacher_scores

        write_teacher_scores(_teacher_path(out), teacher)
    exports = _exports(cfg, out, beir)
    manifest = {
        "format": MANIFEST_FORMAT,
        "command": "mine",
        "file": out.name,
        "sha256": sha256_file(out),
        "model": {"path": str(encoder), "sha256": folder_digest(encoder), **asdict(spec)},
        "corpus": _corpus_record(cfg, beir, split, data_dir, ts),
        "inputs": inputs,
        "settings": {k: v for k, v in asdict(cfg).items() if k not in ("out",)},
        "depth": depth,
        "range_max": settings.resolved_range_max(max(len(p) for p in positives)),
        "queries": written["examples"],
        "negatives": counts["negatives"],
        "removed": selection.removed,
        "shortfall": {"queries": counts["short"], "negatives_missing": counts["missing"]},
        "positives_selected": selection.positives_selected,
        "scores": _score_stats(pair_scores, ts.positives, positives, selection),
        "holdout": _holdout_record(selection, counts["dropped"]) if watch is not None else None,
        "exports": exports,
        "timings": {**{k: round(v, 3) for k, v in job.timings.items()}},
    }
    if judged is not None:
        manifest["cross_encoder"] = {
            **judged.record.pop("scorer"), "teacher_file": _teacher_path(out).name,
            "teacher_sha256": sha256_file(_teacher_path(out)),
        }  # fmt: skip
        manifest["denoise"] = {**judged.record, **{k: counts[k] for k in
                               ("denoised", "relabelled", "queries_dropped")}}  # fmt: skip
    manifest["timings"]["total_s"] = round(time.perf_counter() - t0, 3)
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2))
    print(_summary(manifest, out, manifest_path), flush=True)
    return manifest


def _input(cfg: MineConfig, work: Path) -> tuple[Path, str, dict[str, Any]]:
    """(the BEIR folder prepared, its split, what the input held)."""
    if cfg.pairs:
        folder = work / "pairs"
        counts = offline.from_pairs(
            Path(cfg.pairs), cfg.pairs_format, Path(cfg.corpus) if cfg.corpus else None, folder
        )
        return folder, offline.PAIRS_SPLIT, {"pairs": str(cfg.pairs), **counts}
    beir = Path(cfg.beir)
    if not (beir / "corpus.jsonl").is_file():
        raise FileNotFoundError(f"{beir / 'corpus.jsonl'}: no such file (--beir: a BEIR folder)")
    if cfg.corpus:
        return offline.with_extra_corpus(beir, cfg.split, Path(cfg.corpus), work / "beir"), cfg.split, {
            "beir": str(beir), "extra_corpus": cfg.corpus
        }  # fmt: skip
    return beir, cfg.split, {"beir": str(beir)}


def _training_set(cfg, beir: Path, split: str, encoder: Path, spec, work: Path):
    """The split tokenized (once, in a folder named by the inputs and settings) and loaded."""
    from retromae_ds.finetuning import data as ance_data

    length = cfg.max_length or spec.max_length or 512
    tokenizer = ance_data.tokenizer_fingerprint(encoder)
    key = json.dumps([str(beir.resolve()), split, length, tokenizer], sort_keys=True)
    folder = work / f"data-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    ance_data.prepare(
        beir, split, encoder, folder, q_max_len=length, p_max_len=length,
        progress=cfg.progress, tokenizer=tokenizer,
    )  # fmt: skip
    return ance_data.load(folder), folder


def _holdout(positives: list[np.ndarray], seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """(the positives with one hidden per query that has two or more, the hidden one or -1)."""
    kept, watch = [], np.full(len(positives), -1, dtype=np.int64)
    for q, pos in enumerate(positives):
        if len(pos) < 2:
            kept.append(pos)
            continue
        hide = int(np.random.default_rng([seed, q, 1]).integers(len(pos)))
        watch[q] = pos[hide]
        kept.append(np.delete(pos, hide))
    return kept, watch


def _pair_lookup(pair_scores: np.ndarray, all_pos: list[np.ndarray]) -> Iterator[dict[int, float]]:
    """Per query ``{positive passage: score}`` from the ranking's per-pair scores."""
    at = 0
    for pos in all_pos:
        yield {int(p): float(s) for p, s in zip(pos, pair_scores[at : at + len(pos)], strict=True)}
        at += len(pos)


def _lowest(pair_scores: np.ndarray, all_pos: list[np.ndarray], visible) -> np.ndarray:
    """The lowest score among each query's visible positives (the margins' reference)."""
    return np.asarray(
        [
            min(score[int(p)] for p in vis)
            for score, vis in zip(_pair_lookup(pair_scores, all_pos), visible, strict=True)
        ],
        dtype=np.float64,
    )


def _examples(
    ts, positives, pair_scores, sel: Selection, counts: dict[str, int], n: int,
    judged: Judged | None = None, action: str = "drop",
    teacher: dict[str, dict[str, float]] | None = None,
) -> Iterator[Example]:  # fmt: skip
    """One ``mined`` example per query; a labelled positive is never written as a negative
    (a held-out one that came back is counted in ``dropped``); a negative ``judged`` a false
    negative is dropped, relabelled as a positive, or drops its query (``action``);
    ``counts`` also sums what is written: negatives, queries short of ``n`` and the
    negatives they miss. ``teacher`` collects the cross-encoder's score of every passage
    written."""
    import pyarrow as pa

    ids = (
        ts.passage_ids.combine_chunks()
        if isinstance(ts.passage_ids, pa.ChunkedArray)
        else ts.passage_ids
    )
    lookup = _pair_lookup(pair_scores, ts.positives)
    for q, score_of in enumerate(lookup):
        labelled = set(ts.positives[q].tolist())
        flags = judged.flags[q] if judged is not None else np.zeros(len(sel.negatives[q]), bool)
        if action == "drop_query" and flags.any():
            counts["queries_dropped"] += 1
            continue
        keep = [i for i, p in enumerate(sel.negatives[q].tolist()) if p not in labelled]
        counts["dropped"] += len(sel.negatives[q]) - len(keep)
        false = [i for i in keep if flags[i]]
        keep = [i for i in keep if not flags[i]]
        counts["denoised"] += len(false)
        counts["negatives"] += len(keep)
        counts["short"] += len(keep) < n
        counts["missing"] += max(0, n - len(keep))
        neg_ids = ids.take(pa.array(sel.negatives[q][keep], pa.int64())).to_pylist()
        pos = positives[q]
        pos_ids = ids.take(pa.array(pos, pa.int64())).to_pylist()
        extra = []
        if action == "relabel" and false:
            counts["relabelled"] += len(false)
            extra_ids = ids.take(pa.array(sel.negatives[q][false], pa.int64())).to_pylist()
            extra = [Passage(id=d, score=round(float(sel.scores[q][i]), 6))
                     for d, i in zip(extra_ids, false, strict=True)]  # fmt: skip
        if teacher is not None and judged is not None:
            got = dict(zip(pos_ids, judged.positive[q].tolist(), strict=True))
            chosen = keep + (false if action == "relabel" else [])
            chosen_ids = ids.take(pa.array(sel.negatives[q][chosen], pa.int64())).to_pylist()
            got.update(zip(chosen_ids, judged.candidate[q][chosen].tolist(), strict=True))
            teacher[ts.query_ids[q]] = got
        yield Example(
            query=None,
            query_id=ts.query_ids[q],
            positives=tuple(
                Passage(id=d, score=round(score_of[int(p)], 6))
                for d, p in zip(pos_ids, pos, strict=True)
            )
            + tuple(extra),
            negatives=tuple(
                Passage(id=d, rank=int(sel.ranks[q][i]), score=round(float(sel.scores[q][i]), 6))
                for d, i in zip(neg_ids, keep, strict=True)
            ),
        )


def _teacher_path(out: Path) -> Path:
    return out.with_name(f"{out.name.removesuffix('.jsonl')}.teacher.tsv")


def _judge(cfg: MineConfig, beir: Path, ts, positives, sel: Selection, watch) -> Judged:
    """The cross-encoder's scores of every visible positive and selected candidate, and the
    false negatives ``cfg.denoising()`` flags (its figures on the held-out positives)."""
    from retromae_ds.retrieval.beir import load_corpus, load_queries
    from retromae_ds.retrieval.cross_encoder import CrossEncoderScorer

    scorer = CrossEncoderScorer.from_dir(
        cfg.cross_encoder, device=cfg.device, max_length=cfg.ce_max_length,
        batch_size=cfg.ce_batch_size, bf16=cfg.ce_bf16,
    )  # fmt: skip
    doc_ids, texts = load_corpus(beir / "corpus.jsonl")
    text_of = dict(zip(doc_ids, texts, strict=True))
    passages = [text_of[d] for d in ts.passage_ids.to_pylist()]
    query_text = load_queries(beir / "queries.jsonl")
    judged = judge(
        scorer, [query_text[q] for q in ts.query_ids], passages, positives, sel.negatives,
        cfg.denoising(), watch=watch, fit=cfg.denoise_fit,
    )  # fmt: skip
    judged.record["scorer"] = scorer.record()
    return judged


def _exports(cfg: MineConfig, out: Path, beir: Path) -> dict[str, Any]:
    """Each ``--format`` written from the jsonl just written, texts from the BEIR folder."""
    done = {}
    for fmt in cfg.format:
        path = cfg.export_path(fmt)
        examples = read_examples(out, "mined", corpus=beir)
        counts = write_examples(
            examples, path, fmt, scores=cfg.scores, num_negatives=cfg.num_negatives
        )
        done[fmt] = {"file": path.name, **counts}
    return done


def _corpus_record(cfg, beir: Path, split: str, data_dir: Path, ts) -> dict[str, Any]:
    from retromae_ds.finetuning import data as ance_data

    ready = json.loads((data_dir / ance_data.READY).read_text())
    shards = "".join(ts.fingerprint()["corpus_shards_sha256"])
    return {
        "folder": str(beir),
        "split": split,
        "files_sha256": ready.get(ance_data.FINGERPRINT),
        "passages": ts.num_passages,
        "tokens_sha256": hashlib.sha256(shards.encode()).hexdigest(),
    }


def _stats(values: np.ndarray) -> dict[str, float] | None:
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    q = np.percentile(values, [25, 50, 75])
    return {
        "count": int(len(values)), "mean": round(float(values.mean()), 6),
        "std": round(float(values.std()), 6), "min": round(float(values.min()), 6),
        "p25": round(float(q[0]), 6), "p50": round(float(q[1]), 6), "p75": round(float(q[2]), 6),
        "max": round(float(values.max()), 6),
    }  # fmt: skip


def _score_stats(pair_scores, all_pos, visible, sel: Selection) -> dict[str, Any]:
    """Statistics of the positives' scores, the negatives', and (per negative) the query's
    lowest positive score minus the negative's (ST's "difference")."""
    pos, diff = [], []
    for score_of, vis, neg in zip(
        _pair_lookup(pair_scores, all_pos), visible, sel.scores, strict=True
    ):
        mine = [score_of[int(p)] for p in vis]
        pos += mine
        diff += [min(mine) - float(s) for s in neg]
    negs = np.concatenate(sel.scores) if sel.scores else np.zeros(0)
    return {
        "positive": _stats(np.asarray(pos, dtype=np.float64)),
        "negative": _stats(np.asarray(negs, dtype=np.float64)),
        "difference": _stats(np.asarray(diff, dtype=np.float64)),
    }


def _holdout_record(sel: Selection, written_dropped: int) -> dict[str, Any]:
    w = dict(sel.watched)
    queries = max(1, w["queries"])
    w["mined_rate"] = round(w["mined"] / queries, 6)
    w["kept_out_of_the_file"] = written_dropped
    return w


def _summary(m: dict[str, Any], out: Path, manifest: Path) -> str:
    removed = ", ".join(f"{k} {v}" for k, v in m["removed"].items() if v)
    line = (
        f"mine: {m['queries']} queries, {m['negatives']} negatives (up to "
        f"{m['settings']['num_negatives']} each); shortfall {m['shortfall']['queries']} "
        f"queries ({m['shortfall']['negatives_missing']} negatives missing); removed: "
        f"{removed or 'none'}; wrote {out} and {manifest}"
    )
    if m["holdout"]:
        h = m["holdout"]
        line += f"; held-out positives mined as negatives: {h['mined']} of {h['queries']}"
    return line


def main(argv: list[str] | None = None) -> int:
    """``python -m retromae_ds.mine``: the same command as ``retromae-ds mine``."""
    return run_command(
        MineConfig, mine_command, argv, prog="retromae-ds mine", description=DESCRIPTIONS["mine"]
    )


if __name__ == "__main__":
    sys.exit(main())
