"""Loader for a dataset in the BEIR layout: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/*.tsv``.

- ``corpus.jsonl``: one JSON object a line with ``_id``, ``text`` and optionally ``title``;
  the text to encode is ``(title + " " + text).strip()``, as BEIR's dense retrievers build it.
- ``queries.jsonl``: ``_id`` and ``text``.
- ``qrels/{split}.tsv``: ``query-id <TAB> corpus-id <TAB> score`` with a header line (a first
  line whose score is an integer is read as data, not skipped); a pair listed twice keeps its
  last score, as in BEIR.

Only the queries named in the split's qrels are kept, in qrels order (as BEIR does). Malformed
input raises ``ValueError`` naming the file and line; a missing file raises
``FileNotFoundError`` naming the path. ``check_beir`` refuses data that cannot give a
meaningful score (no documents, no judged queries, no judged document in the corpus) and
returns the judged documents absent from the corpus, which BEIR would silently score as misses.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retromae_ds.data.sources import text_lines


@dataclass
class BeirData:
    """One split of a BEIR dataset, ready to encode."""

    corpus_ids: list[str]
    corpus_texts: list[str]
    query_ids: list[str]
    query_texts: list[str]
    qrels: dict[str, dict[str, int]]  # query id -> {doc id: relevance level}
    corpus_source: str = "<corpus>"  # where the corpus and qrels came from, for messages
    qrels_source: str = "<qrels>"

    def missing_judged_docs(self) -> list[str]:
        """Documents named in the qrels but absent from the corpus, sorted."""
        corpus = set(self.corpus_ids)
        return sorted({d for docs in self.qrels.values() for d in docs if d not in corpus})

    def summary(self) -> str:
        pairs = sum(len(v) for v in self.qrels.values())
        return f"{len(self.corpus_ids)} documents, {len(self.query_ids)} queries, {pairs} qrels"


def _require(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a BEIR dataset folder)")
    return path


def _read_jsonl(path: Path, fields: tuple[str, ...]):
    """Yields (line number, record) for the non-blank lines, checking the required fields."""
    for lineno, line in text_lines(_require(path)):  # a bad byte is named by file:line
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object")
        for name in fields:
            if name not in record:
                raise ValueError(f"{path}:{lineno}: missing field {name!r}")
        yield lineno, record


def _string_field(record: dict, name: str, where: str, *, allow_none: bool = False) -> str:
    value = record.get(name)
    if value is None and allow_none:
        return ""
    if name == "_id" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # some converted datasets write numeric ids
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} is {type(value).__name__}, not a string")
    return value


def load_corpus(path: str | Path) -> tuple[list[str], list[str]]:
    """(doc ids, texts) from a BEIR ``corpus.jsonl`` in file order; title and text joined."""
    path = Path(path)
    ids, texts, seen = [], [], {}
    for lineno, record in _read_jsonl(path, ("_id", "text")):
        where = f"{path}:{lineno}"
        doc_id = _string_field(record, "_id", where)
        if doc_id in seen:
            raise ValueError(f"{where}: duplicate _id {doc_id!r} (first on line {seen[doc_id]})")
        seen[doc_id] = lineno
        title = _string_field(record, "title", where, allow_none=True)
        text = _string_field(record, "text", where, allow_none=True)
        ids.append(doc_id)
        texts.append(f"{title} {text}".strip())
    return ids, texts


def load_queries(path: str | Path) -> dict[str, str]:
    """{query id: text} from a BEIR ``queries.jsonl``."""
    path = Path(path)
    queries: dict[str, str] = {}
    for lineno, record in _read_jsonl(path, ("_id", "text")):
        where = f"{path}:{lineno}"
        qid = _string_field(record, "_id", where)
        if qid in queries:
            raise ValueError(f"{where}: duplicate query _id {qid!r}")
        queries[qid] = _string_field(record, "text", where)
    return queries


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """{query id: {doc id: level}} from a BEIR qrels ``.tsv`` (header line skipped)."""
    path = Path(path)
    qrels: dict[str, dict[str, int]] = {}
    for lineno, line in text_lines(_require(path)):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(
                f"{path}:{lineno}: expected 3 tab-separated fields "
                f"(query-id, corpus-id, score), found {len(fields)}"
            )
        qid, doc_id, score = (field.strip() for field in fields)
        try:
            level = int(score)
        except ValueError:
            if lineno == 1:
                continue  # the header
            raise ValueError(f"{path}:{lineno}: score {score!r} is not an integer") from None
        if not qid or not doc_id:
            raise ValueError(f"{path}:{lineno}: empty query or corpus id")
        qrels.setdefault(qid, {})[doc_id] = level
    if qrels and not any(level > 0 for docs in qrels.values() for level in docs.values()):
        # every metric would be 0 whatever the model: say so instead of a table of zeros
        print(
            f"warning: {path}: no judgement above 0 in {sum(map(len, qrels.values()))} lines: "
            "nothing counts as relevant, every metric is 0 whatever the model",
            file=sys.stderr,
            flush=True,
        )
    return qrels


def available_splits(folder: str | Path) -> list[str]:
    """Names of the ``qrels/*.tsv`` files of a BEIR folder."""
    return sorted(p.stem for p in (Path(folder) / "qrels").glob("*.tsv"))


def load_beir(folder: str | Path, split: str = "test") -> BeirData:
    """Corpus, the split's queries and its qrels from a BEIR dataset folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such BEIR dataset folder")
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        splits = ", ".join(available_splits(folder)) or "none"
        raise FileNotFoundError(f"{qrels_path}: no such file (splits available: {splits})")
    qrels = load_qrels(qrels_path)
    queries = load_queries(folder / "queries.jsonl")
    missing = [qid for qid in qrels if qid not in queries]
    if missing:
        raise ValueError(
            f"{qrels_path}: {len(missing)} query ids have no entry in "
            f"{folder / 'queries.jsonl'} (first: {missing[:5]})"
        )
    corpus_ids, corpus_texts = load_corpus(folder / "corpus.jsonl")
    return BeirData(
        corpus_ids=corpus_ids,
        corpus_texts=corpus_texts,
        query_ids=list(qrels),
        query_texts=[queries[qid] for qid in qrels],
        qrels=qrels,
        corpus_source=str(folder / "corpus.jsonl"),
        qrels_source=str(qrels_path),
    )


def check_beir(data: BeirData) -> list[str]:
    """Raise ``ValueError`` naming the file when ``data`` has no documents, no judged queries,
    or none of its judged documents in the corpus; return the judged documents that are
    missing from the corpus (scored as misses)."""
    if not data.corpus_ids:
        raise ValueError(f"{data.corpus_source}: the corpus has no documents")
    if not data.query_ids or not any(data.qrels.values()):
        raise ValueError(f"{data.qrels_source}: no queries with qrels")
    missing = data.missing_judged_docs()
    judged = {d for docs in data.qrels.values() for d in docs}
    if len(missing) == len(judged):
        raise ValueError(
            f"{data.qrels_source}: none of the {len(judged)} judged documents is in "
            f"{data.corpus_source} (first: {missing[:5]}); wrong corpus or split?"
        )
    return missing
