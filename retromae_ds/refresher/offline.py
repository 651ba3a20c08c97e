"""Offline mining on the refresher's own stages: the body of ``retromae-ds mine``.

``training_folder`` turns what ``mine`` reads into the BEIR folder the fine-tuning data is
prepared from: a BEIR folder as it is, or one written under the work folder from a pairs file
(``data.pairs``: FlagEmbedding, sentence-transformers tables, Tevatron, mined; the positives
become the corpus, as ``mine_hard_negatives`` builds it, with an extra corpus's documents
beside them, a passage whose text is an extra document's taking that document's id) or from a
BEIR folder with an extra corpus appended. ``rank`` encodes and searches it exactly as a
refresher version does (``stages``: passages in checksummed shards, resumable in
``WORK/.work/v0``, the embedding cache, the index ``--index`` names, the merged top-K and every
positive's score), with an encoder folder in place of a checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from retromae_ds.base.fsutil import atomic_open, atomic_write_text, sha256_file
from retromae_ds.data.pairs import Example, read_examples
from retromae_ds.data.pairs_records import json_records
from retromae_ds.data.sources import InputError
from retromae_ds.finetuning import data as ance_data
from retromae_ds.hf import sbert
from retromae_ds.refresher.config import RefreshConfig
from retromae_ds.refresher.publish import Ranking
from retromae_ds.refresher.stages import Group, Job, encode_verified, merge_stage, open_work

PAIRS_SPLIT = "train"
"""The split a pairs file's queries are written as."""


def _corpus_file(path: Path) -> Path:
    docs = path / "corpus.jsonl" if path.is_dir() else path
    if not docs.is_file():
        raise FileNotFoundError(f"{docs}: no such file (the extra corpus, BEIR corpus.jsonl)")
    return docs


def _text_key(text: str) -> bytes:
    return hashlib.sha1(text.encode()).digest()


def _corpus_records(docs: Path) -> Iterator[tuple[str, dict]]:
    """``(file:line, record)`` of a BEIR corpus, each with a string ``_id``."""
    for where, record in json_records(docs):
        if not isinstance(record.get("_id"), str):
            raise InputError(f"{where}: field '_id': missing or not a string")
        yield where, record


def _copy_corpus(docs: Path, out, seen: dict[str, str], texts: dict[bytes, str] | None) -> None:
    """``docs``'s lines into ``out``; an id seen before is one line naming both places."""
    for where, record in _corpus_records(docs):
        doc_id = record["_id"]
        if doc_id in seen:
            raise InputError(f"{where}: field '_id': {doc_id!r} repeats {seen[doc_id]}")
        seen[doc_id] = where
        if texts is not None:
            full = f"{record.get('title') or ''} {record.get('text') or ''}".strip()
            texts.setdefault(_text_key(full), doc_id)
        out.write(json.dumps(record, ensure_ascii=False) + "\n")


def with_extra_corpus(beir: Path, split: str, extra: Path, folder: Path) -> Path:
    """``folder``: ``beir``'s corpus followed by ``extra``'s documents, its queries and the
    split's qrels (rewritten only when an input changed)."""
    beir, extra = Path(beir), _corpus_file(Path(extra))
    stamp = {"beir": str(beir.resolve()), "split": split, "extra": str(extra.resolve())}
    stamp.update(ance_data.beir_fingerprint(beir, split))
    stamp["extra_sha256"] = sha256_file(extra)
    if _stamped(folder, stamp):
        return folder
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    seen: dict[str, str] = {}
    with atomic_open(folder / "corpus.jsonl") as out:
        _copy_corpus(beir / "corpus.jsonl", out, seen, None)
        _copy_corpus(extra, out, seen, None)
    shutil.copy(beir / "queries.jsonl", folder / "queries.jsonl")
    shutil.copy(beir / "qrels" / f"{split}.tsv", folder / "qrels" / f"{split}.tsv")
    atomic_write_text(folder / "STAMP", json.dumps(stamp))
    return folder


def _stamped(folder: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / "STAMP").read_text()) == stamp
    except (OSError, ValueError):
        return False


def from_pairs(pairs: Path, fmt: str, extra: Path | None, folder: Path) -> dict[str, int]:
    """``folder``: a BEIR folder (split ``PAIRS_SPLIT``) made of the pairs file's queries and
    positives, and the extra corpus's documents; returns the counts (queries, passages
    added). A query with no text (an id the queries file lacks) is one line naming it."""
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    seen: dict[str, str] = {}
    texts: dict[bytes, str] = {}
    counts = {"queries": 0, "positives": 0, "passages_from_pairs": 0}
    qrels = ["query-id\tcorpus-id\tscore"]
    extra_docs = _corpus_file(Path(extra)) if extra else None
    with atomic_open(folder / "corpus.jsonl") as out, atomic_open(folder / "queries.jsonl") as qf:
        if extra_docs is not None:
            _copy_corpus(extra_docs, out, seen, texts)
        for i, ex in enumerate(read_examples(pairs, fmt, corpus=extra)):
            query_id = _query_id(ex, i, seen)
            qf.write(json.dumps({"_id": query_id, "text": ex.query}, ensure_ascii=False) + "\n")
            counts["queries"] += 1
            for p in ex.positives:
                doc_id = _passage_id(p, texts, seen, out, counts)
                qrels.append(f"{query_id}\t{doc_id}\t1")
                counts["positives"] += 1
    atomic_write_text(folder / "qrels" / f"{PAIRS_SPLIT}.tsv", "\n".join(qrels) + "\n")
    return counts


def _query_id(ex: Example, i: int, seen: dict[str, str]) -> str:
    if ex.query is None or not ex.query.strip():
        raise InputError(
            f"{ex.where}: field 'query_id': no query text for {ex.query_id!r}; give --corpus a "
            "BEIR folder whose queries.jsonl holds it"
        )
    query_id = ex.query_id or f"mine-q{i}"
    key = f"query {query_id}"
    if key in seen:
        raise InputError(f"{ex.where}: query id {query_id!r} repeats {seen[key]}")
    seen[key] = ex.where
    return query_id


def _passage_id(p, texts: dict[bytes, str], seen: dict[str, str], out, counts) -> str:
    """The corpus id of positive ``p``: its own id when the corpus has it, the id of an
    extra document with its text, else a new document (its id, or ``mine-p{n}``)."""
    if p.id is not None and p.id in seen:
        return p.id
    full = p.full_text or ""
    key = _text_key(full)
    if p.id is None and key in texts:
        return texts[key]
    doc_id = p.id or f"mine-p{len(seen)}"
    while doc_id in seen:
        doc_id = f"{doc_id}-"
    seen[doc_id] = "pairs"
    texts.setdefault(key, doc_id)
    record = {"_id": doc_id, "title": p.title or "", "text": p.text or ""}
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    counts["passages_from_pairs"] += 1
    return doc_id


def rank(
    cfg: RefreshConfig,
    ts: ance_data.TrainingSet,
    encoder: Path,
    root: Path,
    spec: sbert.EmbeddingSpec,
    depth: int,
) -> tuple[Ranking, Job]:
    """The top ``depth`` passages of every query of ``ts`` with their scores, and every
    positive's score, through the refresher's stages (encode, verify, search, merge) with
    ``encoder`` as the one tower; work files in ``root/.work/v0`` (kept shards reused by a
    rerun with the same encoder, corpus and settings; removed once ranked)."""
    group = Group(cfg.timeout_s)
    if group.world != 1:
        raise ValueError("retromae-ds mine runs as one process (a refresher's ranks need a run)")
    job = Job(cfg, ts, encoder, 0, 0, group, root / ".work" / "v0")
    job.encoder_dir, job.spec_override, job.search_k = encoder, spec, depth
    meta = {"encoder": str(encoder), "spec": asdict(spec), "depth": depth}
    open_work(root, 0, meta, group, job.shards())
    encode_verified(job)
    ranking = merge_stage(job)
    shutil.rmtree(root / ".work", ignore_errors=True)
    return ranking, job
