"""Training pairs in the anchors' formats (``data.pairs``: FlagEmbedding jsonl, a
sentence-transformers table, Tevatron jsonl or ``retromae-ds mine``'s file; read by
``retromae_ds.data.pairs``) staged as a BEIR folder, so that the tokenizing, fingerprinting,
resume and refresher paths of a BEIR fine-tuning run serve them unchanged.

``stage(...)`` streams the examples once and writes, under a hidden temporary folder renamed
into place when complete:

- ``corpus.jsonl``: the whole ``corpus`` (when given: its ids resolve the file's ids, and its
  other passages are mined from by a refresher), then every passage the file gives by text
  alone, once, under the id ``t-`` + the first 16 hex digits of its text's BLAKE2b;
- ``queries.jsonl`` and ``qrels/train.tsv``: one query per distinct query id (the file's, else
  ``q-`` + its text's hash), its positives merged over the examples that repeat it;
- ``negatives.jsonl``: per query, the file's negatives (ids, best first as given, duplicates
  and the query's own positives dropped), and any scores the file gave (FlagEmbedding's
  ``pos_scores``/``neg_scores``, mine's scores), kept for distillation;
- ``STAGED.json``: the source's fingerprint (sha256 of the file, or of every file of a
  ``datasets`` folder), the format, the counts.

A staged folder is reused while its source is unchanged; an edited source is refused in one
line naming it (the tokenized run would otherwise train on the old text). Bad input is one line
naming file and line (the readers' errors); nothing is half written.

Memory: one id set of the passages written (about 70 bytes each) and, per distinct query,
its positive and negative ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.base.fsutil import atomic_write_text, fsync_dir, sha256_file
from retromae_ds.data.pairs import Example, Passage, read_examples
from retromae_ds.data.pairs_records import json_records

STAGED = "STAGED.json"
NEGATIVES = "negatives.jsonl"


def source_fingerprint(path: str | Path) -> dict[str, str]:
    """sha256 of the pairs file, or of every file under a ``datasets`` folder (by relative
    path)."""
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    return {
        str(p.relative_to(path)): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()
    }


def _text_id(prefix: str, text: str) -> str:
    return prefix + hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


@dataclass
class _Query:
    text: str
    positives: dict[str, float | None] = field(default_factory=dict)
    negatives: dict[str, float | None] = field(default_factory=dict)


class _Stager:
    """Writes corpus lines as passages arrive; keeps the queries until the end."""

    def __init__(self, corpus_out, corpus: str | Path | None) -> None:
        self.out, self.ids, self.queries = corpus_out, set(), {}
        self.copied = 0
        if corpus:
            self._copy_corpus(corpus)

    def _copy_corpus(self, corpus: str | Path) -> None:
        path = Path(corpus)
        path = path / "corpus.jsonl" if path.is_dir() else path
        for _, record in json_records(path):
            doc_id = str(record.get("_id", record.get("docid")))
            if doc_id not in self.ids:
                self.ids.add(doc_id)
                self.out.write(json.dumps({"_id": doc_id, "title": record.get("title") or "",
                                           "text": record.get("text") or ""}) + "\n")  # fmt: skip
                self.copied += 1

    def passage(self, p: Passage, where: str) -> str:
        """The passage's id in the staged corpus (written there the first time)."""
        if p.id is not None and p.id in self.ids:
            return p.id
        if p.text is None:
            raise ValueError(
                f"{where}: passage id {p.id!r} has no text and is not in the corpus: give "
                "data.corpus, the BEIR corpus the file's ids name"
            )
        pid = p.id if p.id is not None else _text_id("t-", p.full_text or "")
        if pid not in self.ids:
            self.ids.add(pid)
            record = {"_id": pid, "title": p.title or "", "text": p.text or ""}
            self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        return pid

    def add(self, ex: Example) -> None:
        if not ex.query:
            raise ValueError(
                f"{ex.where}: query {ex.query_id!r} has no text: give data.corpus, a BEIR "
                "folder whose queries.jsonl holds it"
            )
        qid = ex.query_id if ex.query_id is not None else _text_id("q-", ex.query)
        q = self.queries.setdefault(qid, _Query(ex.query))
        for p in ex.positives:
            q.positives.setdefault(self.passage(p, ex.where), p.score)
        for p in ex.negatives:
            q.negatives.setdefault(self.passage(p, ex.where), p.score)


def _write_queries(tmp: Path, queries: dict[str, _Query]) -> dict[str, int]:
    """queries.jsonl, qrels/train.tsv and negatives.jsonl; returns the counts."""
    (tmp / "qrels").mkdir()
    dropped = with_negatives = 0
    with (
        open(tmp / "queries.jsonl", "w", encoding="utf-8") as fq,
        open(tmp / "qrels" / "train.tsv", "w", encoding="utf-8") as fr,
        open(tmp / NEGATIVES, "w", encoding="utf-8") as fn,
    ):
        fr.write("query-id\tcorpus-id\tscore\n")
        for qid, q in queries.items():
            fq.write(json.dumps({"_id": qid, "text": q.text}, ensure_ascii=False) + "\n")
            for pid in q.positives:
                fr.write(f"{qid}\t{pid}\t1\n")
            negs = {p: s for p, s in q.negatives.items() if p not in q.positives}
            dropped += len(q.negatives) - len(negs)
            with_negatives += bool(negs)
            record: dict[str, Any] = {"query_id": qid, "negatives": list(negs)}
            if any(s is not None for s in negs.values()):
                record["negative_scores"] = list(negs.values())
            if any(s is not None for s in q.positives.values()):
                record["positive_scores"] = q.positives
            fn.write(json.dumps(record) + "\n")
    return {
        "queries": len(queries),
        "queries_with_negatives": with_negatives,
        "negatives_that_were_positives": dropped,
    }


def _stage_into(
    tmp: Path,
    pairs: Path,
    format: str,
    corpus: str | Path | None,
    by_id: bool,
    fingerprint: dict[str, str],
) -> None:
    with open(tmp / "corpus.jsonl", "w", encoding="utf-8") as fc:
        stager = _Stager(fc, corpus)
        n = 0
        for n, ex in enumerate(read_examples(pairs, format, corpus, by_id=by_id), 1):  # noqa: B007
            stager.add(ex)
    if n == 0:
        raise ValueError(f"data.pairs {pairs}: no training example in it")
    counts = {"examples": n, "passages": len(stager.ids), "corpus_passages": stager.copied}
    counts.update(_write_queries(tmp, stager.queries))
    record = {"source": str(pairs.resolve()), "source_sha256": fingerprint, "format": format,
              "corpus": str(Path(corpus).resolve()) if corpus else None, "by_id": by_id,
              "counts": counts}  # fmt: skip
    atomic_write_text(tmp / STAGED, json.dumps(record, indent=2))


def stage(
    pairs: str | Path,
    out: str | Path,
    *,
    format: str = "auto",
    corpus: str | Path | None = None,
    by_id: bool = False,
) -> Path:
    """Stage ``pairs`` as a BEIR folder at ``out`` (split ``train``), or reuse the folder staged
    from the same source; returns ``out``."""
    pairs, out = Path(pairs), Path(out)
    if not pairs.exists():
        raise FileNotFoundError(f"data.pairs {pairs}: no such file or folder")
    fingerprint = source_fingerprint(pairs)
    if (out / STAGED).is_file():
        done = json.loads((out / STAGED).read_text())
        if done["source_sha256"] != fingerprint:
            raise ValueError(
                f"data.pairs {pairs} changed since this run staged and tokenized it "
                f"({out}): restore it, or start a new run_dir"
            )
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _stage_into(tmp, pairs, format, corpus, by_id, fingerprint)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half written is left
        raise
    shutil.rmtree(out, ignore_errors=True)  # an older staging of a source since fixed
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return out


def given_negatives(staged: str | Path, query_ids: list[str], passage_ids: list[str]):
    """Per training query (in ``query_ids`` order), the staged file's negatives as passage
    indices into ``passage_ids`` (negatives whose passage was dropped as empty are skipped),
    and the indices of the queries left with none."""
    row = {pid: i for i, pid in enumerate(passage_ids)}
    given: dict[str, list[int]] = {}
    for record in _records(Path(staged) / NEGATIVES):
        given[record["query_id"]] = [row[p] for p in record["negatives"] if p in row]
    negatives = [np.asarray(given.get(q, []), dtype=np.int64) for q in query_ids]
    lacking = [i for i, n in enumerate(negatives) if len(n) == 0]
    return negatives, lacking


def _records(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def staged_record(staged: str | Path) -> dict[str, Any] | None:
    """``STAGED.json`` of a staged folder (None for a plain BEIR folder)."""
    path = Path(staged) / STAGED
    return json.loads(path.read_text()) if path.is_file() else None


def staged_scores(staged: str | Path) -> dict[str, dict[str, float]]:
    """Per query id, the teacher scores the staged file gave (``{passage id: score}``, its
    positives' and negatives'; a passage given without a score is left out), for distillation."""
    scored: dict[str, dict[str, float]] = {}
    for record in _records(Path(staged) / NEGATIVES):
        given = {p: s for p, s in (record.get("positive_scores") or {}).items() if s is not None}
        negs = zip(record["negatives"], record.get("negative_scores") or [], strict=False)
        given.update({p: s for p, s in negs if s is not None})
        if given:
            scored[record["query_id"]] = given
    return scored
