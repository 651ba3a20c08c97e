"""Fine-tuning pairs in the anchors' formats: one typed record (:class:`Example`, its
:class:`Passage` s), streaming readers (:func:`read_examples`) and atomic writers
(:func:`write_examples`) for sentence-transformers (ST), FlagEmbedding (FE), Tevatron and the
id-level file ``retromae-ds mine`` writes.

**The record.** An :class:`Example` is one query (``query`` text and/or ``query_id``) with its
``positives`` and ``negatives``; each :class:`Passage` has ``text`` and/or a corpus ``id``, an
optional ``title``, ``score`` (FE's ``pos_scores``/``neg_scores``, mine's scores) and ``rank``
(mine's negatives). ``Passage.full_text`` is ``(title + " " + text).strip()``, as the BEIR
loader builds it; the formats holding one string per passage (ST, FE) write it. FE's
``prompt`` and ``type`` are kept. ``Example.where`` (``file:line`` or ``file: row N``) is not
part of equality.

**Formats read** (``format="auto"`` decides from the file kind and the first record):

- ``flagembedding``: jsonl ``{"query": str, "pos": [str], "neg"?: [str], "pos_scores"?:
  [float], "neg_scores"?: [float], "prompt"?: str, "type"?: str}`` (score lists as long as
  their passage lists).
- ``st``: an ST table: ``.jsonl`` (columns in the first object's key order), ``.parquet`` or a
  ``datasets.save_to_disk`` folder (one split). As ST's collator reads it: the label column is
  the first of ``label``, ``labels``, ``score``, ``scores``; of the other columns the first is
  the anchor, the second the positive, any further ones negatives (``negative`` or
  ``negative_1..n``). Also ST's labeled forms: ``(anchor, text, label 1|0)`` and
  ``(anchor, [texts], labels [1|0, ...])`` (or ``scores``, the first text the positive, as
  ``mine_hard_negatives(output_format="labeled-list", output_scores=True)`` writes it); a
  triplet's/n-tuple's ``scores`` column ``[positive, negative_1, ...]`` becomes the scores. A
  repeated anchor is one example with all its rows' positives and negatives (duplicates
  dropped, first seen kept). ``score`` alone (STS-style pairs) is refused: it does not say
  which text is positive.
- ``tevatron``: jsonl ``{"query_id", "query", "positive_passages": [{"docid", "title",
  "text"}], "negative_passages": [...]}``; a passage with a ``docid`` and no text is looked up
  in the corpus. Tevatron's id form ``{"query_id", "query_text"?, "positive_document_ids",
  "negative_document_ids"}`` is read too.
- ``mined`` (``retromae-ds mine``'s output), jsonl, one line per query::

      {"query_id": str, "query"?: str,
       "positives": [{"id": str, "score"?: float}],
       "negatives": [{"id": str, "rank"?: int, "score"?: float}]}

  ``rank`` is the negative's 1-based position in the query's retrieved list, ``score`` the
  encoder's similarity; negatives are listed best first. Keys whose value is unknown are left
  out.

**Texts or ids.** ``corpus=`` (a BEIR folder, or its ``corpus.jsonl`` with ``queries.jsonl``
beside it; ``_id``/``docid``, ``title``, ``text``) resolves passage ids, and query ids when a
queries file is there; without a corpus an id-only passage stays ``Passage(id=...)``.
``by_id=True`` reads FE's and ST's strings as ids (query ids and passage ids). The
:class:`Corpus` keeps one byte offset per id (about 100 bytes of memory each), never the texts.

**Errors.** Bad input raises ``ValueError`` (``InputError``) in one line naming the file, the
line (``path:N``; ``path: row N`` for parquet and ``datasets`` folders, both 1-based) and the
field: a missing field, a wrong type, an unknown corpus id, an empty query or passage, a query
with no positive, score lists of the wrong length. An unrecognisable file is one line naming
it and the known formats.

**Memory.** Readers stream: jsonl line by line, parquet in record batches, ``datasets``
folders memory-mapped. ST tables take two passes: the first hashes each anchor (16 bytes a
row, in numpy), the second yields an example as soon as its last row is read, holding only the
rows of anchors whose repeats are still ahead (none for a table sorted by anchor).

**Formats written** (``write_examples(examples, path, format)``; ST formats as ``.parquet``
when the path ends so, jsonl otherwise; one temporary file in the same folder, fsynced and
renamed: an interrupted write leaves no file at ``path`` and an older one there intact):

- ``st-triplet``: ``anchor, positive, negative``, one row per (positive, negative) pair,
  ``scores: [pos, neg]`` with ``scores=True`` (ST ``output_format="triplet"``).
- ``st-ntuple``: ``anchor, positive, negative_1..negative_n``, one row per positive; ``n`` is
  ``num_negatives`` or the first example's count; an example with fewer is skipped, with more
  keeps its first ``n`` (ST ``"n-tuple"``; ``scores: [pos, neg_1, ...]``).
- ``st-labeled-pair``: ``anchor, positive, label``: each positive (label 1) then each negative
  (label 0); ``score`` instead of ``label`` with ``scores=True`` (ST ``"labeled-pair"``).
- ``st-labeled-list``: ``anchor, positive, labels``: per positive, ``positive`` is the list
  ``[that positive, negatives...]`` and ``labels`` ``[1, 0, ...]`` (``scores`` with
  ``scores=True``) (ST ``"labeled-list"``, for cross-encoder listwise losses).
- ``flagembedding``: FE jsonl; ``pos_scores``/``neg_scores`` when every passage of the example
  has a score (``scores=None``), always (``True``, a missing score is an error) or never.
- ``tevatron``: Tevatron jsonl with texts (``docid``/``query_id`` ``""`` where unknown).
- ``mined``: the id-level format above.

ST triplet/n-tuple/labeled-list skip an example without negatives, as ST does; the returned
counts say how many (``skipped``) and how many were cut (``truncated``). What each loses:
ST and FE lose ids, ranks and titles (joined into the text); ST loses scores unless
``scores=True``; Tevatron loses scores and ranks; ``mined`` loses texts (ids only; read back
with ``corpus=``); only FE keeps ``prompt``/``type``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from retromae_ds.base.fsutil import atomic_open
from retromae_ds.data.sources import InputError, invalid_utf8, text_lines

READ_FORMATS = ("flagembedding", "st", "tevatron", "mined")
WRITE_FORMATS = (
    "st-triplet",
    "st-ntuple",
    "st-labeled-pair",
    "st-labeled-list",
    "flagembedding",
    "tevatron",
    "mined",
)
LABEL_COLUMNS = ("label", "labels", "score", "scores")
"""ST's label columns, in the order its data collator looks for them."""
KNOWN = (
    "flagembedding {query, pos, neg}, st (an anchor/positive[/negative...] table: jsonl, "
    "parquet or a datasets folder), tevatron {query_id, query, positive_passages, "
    "negative_passages}, mined {query_id, positives, negatives}"
)


@dataclass(frozen=True)
class Passage:
    """One passage, by text and/or corpus id."""

    text: str | None = None
    id: str | None = None
    title: str | None = None
    score: float | None = None
    rank: int | None = None

    @property
    def full_text(self) -> str | None:
        """``(title + " " + text).strip()``, the text an encoder sees (None without text)."""
        if self.text is None:
            return None
        return f"{self.title} {self.text}".strip() if self.title else self.text


@dataclass(frozen=True)
class Example:
    """One training query with its positive and negative passages."""

    query: str | None
    positives: tuple[Passage, ...]
    negatives: tuple[Passage, ...] = ()
    query_id: str | None = None
    prompt: str | None = None
    type: str | None = None
    where: str = field(default="", compare=False)


# --------------------------------------------------------------------------- field checks
def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "a value")


def _need(record: dict, name: str, where: str) -> Any:
    if name not in record:
        raise InputError(f"{where}: missing field {name!r}")
    return record[name]


def _string(value: Any, name: str, where: str, *, is_id: bool = False) -> str:
    if is_id and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # converted datasets write numeric ids
    if not isinstance(value, str):
        raise InputError(f"{where}: field {name!r} is {_kind(value)}, not a string")
    if not value.strip():
        raise InputError(f"{where}: field {name!r} is empty")
    return value


def _optional_string(record: dict, name: str, where: str) -> str | None:
    value = record.get(name)
    return None if value is None else _string(value, name, where)


def _list(value: Any, name: str, where: str) -> list:
    if not isinstance(value, list):
        raise InputError(f"{where}: field {name!r} is {_kind(value)}, not a list")
    return value


def _number(value: Any, name: str, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: field {name!r} is {_kind(value)}, not a number")
    if not math.isfinite(value):
        raise InputError(f"{where}: field {name!r} is {value}, not a finite number")
    return float(value)


def _rank(value: Any, name: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{where}: field {name!r} is {value!r}, not a rank (1, 2, ...)")
    return value


def _scores(record: dict, name: str, where: str, count: int, of: str) -> list[float | None]:
    if record.get(name) is None:
        return [None] * count
    values = _list(record[name], name, where)
    if len(values) != count:
        raise InputError(
            f"{where}: field {name!r} has {len(values)} scores for {count} passages in {of!r}"
        )
    return [_number(v, f"{name}[{i}]", where) for i, v in enumerate(values)]


def _has_positive(positives: Iterable, name: str, where: str) -> None:
    if not positives:
        raise InputError(f"{where}: field {name!r}: the query has no positive passage")


# --------------------------------------------------------------------------- the corpus
class _OffsetIndex:
    """Byte offsets of the records of a jsonl file by id, every record checked once."""

    def __init__(self, path: Path, id_fields: tuple[str, ...], text_fields: tuple[str, ...]):
        self.path, self.text_fields = path, text_fields
        self.offsets: dict[str, int] = {}
        self._file: IO[bytes] = open(path, "rb")  # noqa: SIM115 (kept open for lookups)
        try:
            self._index(id_fields)
        except BaseException:
            self._file.close()
            raise

    def _index(self, id_fields: tuple[str, ...]) -> None:
        path, offset = self.path, 0
        for line_no, raw in enumerate(self._file, start=1):
            start, offset = offset, offset + len(raw)
            if raw.strip():
                record = self._parse(raw, f"{path}:{line_no}")
                where = f"{path}:{line_no}"
                key = next((k for k in id_fields if k in record), id_fields[0])
                doc_id = _string(_need(record, key, where), key, where, is_id=True)
                if doc_id in self.offsets:
                    raise InputError(f"{where}: duplicate {key} {doc_id!r}")
                self.offsets[doc_id] = start

    def _parse(self, raw: bytes, where: str) -> dict:
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InputError(f"{where}: {invalid_utf8(raw, exc)}") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object, found {_kind(record)}")
        for name in ("title", *self.text_fields):
            if record.get(name) is not None and not isinstance(record[name], str):
                raise InputError(f"{where}: field {name!r} is {_kind(record[name])}, not a string")
        return record

    def get(self, key: str) -> dict | None:
        if key not in self.offsets:
            return None
        self._file.seek(self.offsets[key])
        return json.loads(self._file.readline())

    def close(self) -> None:
        self._file.close()


class Corpus:
    """A BEIR corpus (and its queries, when ``queries.jsonl`` is there) read by id: one pass
    records each id's byte offset; a lookup reads one line. ``path``: a BEIR folder or its
    ``corpus.jsonl``."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        docs = path / "corpus.jsonl" if path.is_dir() else path
        if not docs.is_file():
            raise FileNotFoundError(f"{docs}: no such file (the corpus to resolve ids against)")
        queries = docs.with_name("queries.jsonl")
        self.path = docs
        self._docs = _OffsetIndex(docs, ("_id", "docid"), ("text",))
        self._queries = (
            _OffsetIndex(queries, ("_id", "query_id"), ("text",)) if queries.is_file() else None
        )

    @property
    def has_queries(self) -> bool:
        return self._queries is not None

    def passage(self, doc_id: str) -> tuple[str, str] | None:
        """(title, text) of ``doc_id``, or None when the corpus lacks it."""
        record = self._docs.get(doc_id)
        if record is None:
            return None
        return record.get("title") or "", record.get("text") or ""

    def query(self, query_id: str) -> str | None:
        """The text of ``query_id`` (None without a queries file or when it lacks the id)."""
        record = self._queries.get(query_id) if self._queries else None
        return None if record is None else record.get("text") or ""

    def close(self) -> None:
        self._docs.close()
        if self._queries:
            self._queries.close()


def _by_id(
    doc_id: str, name: str, where: str, corpus: Corpus | None, score=None, rank=None
) -> Passage:
    if corpus is None:
        return Passage(id=doc_id, score=score, rank=rank)
    found = corpus.passage(doc_id)
    if found is None:
        raise InputError(f"{where}: field {name!r}: id {doc_id!r} is not in {corpus.path}")
    title, text = found
    if not f"{title}{text}".strip():
        raise InputError(f"{where}: field {name!r}: passage {doc_id!r} is empty in {corpus.path}")
    return Passage(text=text, id=doc_id, title=title or None, score=score, rank=rank)


def _query_text(query_id: str, name: str, where: str, corpus: Corpus | None) -> str | None:
    if corpus is None or not corpus.has_queries:
        return None
    text = corpus.query(query_id)
    if text is None:
        raise InputError(f"{where}: field {name!r}: query id {query_id!r} is not in the queries")
    if not text.strip():
        raise InputError(f"{where}: field {name!r}: query {query_id!r} is empty in the queries")
    return text


# --------------------------------------------------------------------------- jsonl formats
def _json_records(path: Path) -> Iterator[tuple[str, dict]]:
    for line_no, line in text_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object, found {_kind(record)}")
        yield where, record


def _fe_example(record: dict, where: str, corpus: Corpus | None, by_id: bool) -> Example:
    query = _string(_need(record, "query", where), "query", where, is_id=by_id)
    lists = {}
    for name in ("pos", "neg"):
        value = _need(record, name, where) if name == "pos" else record.get(name) or []
        items = _list(value, name, where)
        texts = [_string(v, f"{name}[{i}]", where, is_id=by_id) for i, v in enumerate(items)]
        scores = _scores(record, f"{name}_scores", where, len(texts), name)
        if by_id:
            lists[name] = tuple(
                _by_id(t, f"{name}[{i}]", where, corpus, s)
                for i, (t, s) in enumerate(zip(texts, scores, strict=True))
            )
        else:
            lists[name] = tuple(
                Passage(text=t, score=s) for t, s in zip(texts, scores, strict=True)
            )
    _has_positive(lists["pos"], "pos", where)
    query_id = query if by_id else None
    text = _query_text(query, "query", where, corpus) if by_id else query
    return Example(
        text,
        lists["pos"],
        lists["neg"],
        query_id=query_id,
        prompt=_optional_string(record, "prompt", where),
        type=_optional_string(record, "type", where),
        where=where,
    )


def _tevatron_passage(value: Any, name: str, where: str, corpus: Corpus | None) -> Passage:
    if not isinstance(value, dict):
        raise InputError(f"{where}: field {name!r} is {_kind(value)}, not an object")
    doc_id = value.get("docid")
    if doc_id is not None and doc_id != "":
        doc_id = _string(doc_id, f"{name}.docid", where, is_id=True)
    else:
        doc_id = None
    text, title = value.get("text"), value.get("title")
    if title is not None and not isinstance(title, str):
        raise InputError(f"{where}: field {name + '.title'!r} is {_kind(title)}, not a string")
    if text is None and doc_id is not None:
        return _by_id(doc_id, f"{name}.docid", where, corpus)
    if text is None:
        raise InputError(f"{where}: missing field {name + '.text'!r} (and no docid to look up)")
    _string(text, f"{name}.text", where)
    return Passage(text=text, id=doc_id, title=title or None)


def _tevatron_example(record: dict, where: str, corpus: Corpus | None) -> Example:
    query_id = record.get("query_id")
    query_id = None if query_id in (None, "") else _string(query_id, "query_id", where, is_id=True)
    if "positive_document_ids" in record:  # Tevatron's id form
        lists = {}
        for side in ("positive", "negative"):
            name = f"{side}_document_ids"
            value = _need(record, name, where) if side == "positive" else record.get(name) or []
            ids = [_string(v, f"{name}[{i}]", where, is_id=True) for i, v in enumerate(value)]
            lists[side] = tuple(_by_id(d, f"{name}[{i}]", where, corpus) for i, d in enumerate(ids))
        _has_positive(lists["positive"], "positive_document_ids", where)
        query = record.get("query_text") or record.get("query")
        if query is not None:
            query = _string(query, "query_text", where)
        elif query_id is not None:
            query = _query_text(query_id, "query_id", where, corpus)
        return Example(query, lists["positive"], lists["negative"], query_id, where=where)
    query = _string(_need(record, "query", where), "query", where)
    lists = {}
    for side in ("positive", "negative"):
        name = f"{side}_passages"
        value = _need(record, name, where) if side == "positive" else record.get(name) or []
        items = _list(value, name, where)
        lists[side] = tuple(
            _tevatron_passage(v, f"{name}[{i}]", where, corpus) for i, v in enumerate(items)
        )
    _has_positive(lists["positive"], "positive_passages", where)
    return Example(query, lists["positive"], lists["negative"], query_id, where=where)


def _mined_example(record: dict, where: str, corpus: Corpus | None) -> Example:
    query_id = _string(_need(record, "query_id", where), "query_id", where, is_id=True)
    query = record.get("query")
    if query is not None:
        query = _string(query, "query", where)
    else:
        query = _query_text(query_id, "query_id", where, corpus)
    lists = {}
    for side in ("positives", "negatives"):
        value = _need(record, side, where) if side == "positives" else record.get(side) or []
        passages = []
        for i, item in enumerate(_list(value, side, where)):
            name = f"{side}[{i}]"
            if not isinstance(item, dict):
                raise InputError(f"{where}: field {name!r} is {_kind(item)}, not an object")
            doc_id = _string(_need(item, "id", where), f"{name}.id", where, is_id=True)
            score = _number(item.get("score"), f"{name}.score", where)
            rank = _rank(item.get("rank"), f"{name}.rank", where)
            passages.append(_by_id(doc_id, f"{name}.id", where, corpus, score, rank))
        lists[side] = tuple(passages)
    _has_positive(lists["positives"], "positives", where)
    return Example(query, lists["positives"], lists["negatives"], query_id, where=where)


# --------------------------------------------------------------------------- ST tables
@dataclass(frozen=True)
class _Layout:
    anchor: str
    second: str
    negatives: tuple[str, ...]
    label: str | None  # the label column ST's collator would take, if any
    listwise: bool  # the second column holds a list of texts


def _st_layout(path: Path, columns: list[str], first: dict) -> _Layout:
    label = next((c for c in LABEL_COLUMNS if c in columns), None)
    inputs = [c for c in columns if c not in LABEL_COLUMNS]
    if len(inputs) < 2:
        raise InputError(
            f"{path}: an ST table needs an anchor and a positive column, found {columns}; "
            f"known formats: {KNOWN}"
        )
    listwise = isinstance(first.get(inputs[1]), list)
    if label == "score":
        raise InputError(
            f"{path}: column 'score' without 'label': the table does not say which text is "
            "positive (labeled pairs need 'label' 1 or 0)"
        )
    if (label in ("label", "labels") or listwise) and len(inputs) != 2:
        raise InputError(f"{path}: a labeled ST table has two text columns, found {inputs}")
    if label == "labels" and not listwise:
        raise InputError(f"{path}: column 'labels' needs a list of texts in {inputs[1]!r}")
    if listwise and label not in ("labels", "scores"):
        raise InputError(f"{path}: a list of texts in {inputs[1]!r} needs a 'labels' column")
    return _Layout(inputs[0], inputs[1], tuple(inputs[2:]), label, listwise)


def _st_source(path: Path) -> tuple[list[str], Callable[[], Iterator[tuple[str, dict]]]]:
    """Column names and a function giving (where, row) for each row of an ST table."""
    if path.is_dir():
        return _datasets_source(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        columns = list(pq.ParquetFile(path).schema_arrow.names)

        def rows() -> Iterator[tuple[str, dict]]:
            n = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    n += 1
                    yield f"{path}: row {n}", row

        return columns, rows
    first = next(_json_records(path), None)
    if first is None:
        return [], lambda: iter(())
    columns = list(first[1])

    def json_rows() -> Iterator[tuple[str, dict]]:
        for where, record in _json_records(path):
            for name in columns:
                _need(record, name, where)
            yield where, record

    return columns, json_rows


def _datasets_source(path: Path) -> tuple[list[str], Callable[[], Iterator[tuple[str, dict]]]]:
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise InputError(f"{path}: not a datasets folder ({exc}); known formats: {KNOWN}") from None
    if isinstance(data, datasets.DatasetDict):
        raise InputError(
            f"{path}: a datasets folder of several splits ({', '.join(data)}); name one, "
            f"e.g. {path / next(iter(data))}"
        )

    def rows() -> Iterator[tuple[str, dict]]:
        n = 0
        for batch in data.iter(batch_size=1024):
            names = list(batch)
            for values in zip(*(batch[c] for c in names), strict=True):
                n += 1
                yield f"{path}: row {n}", dict(zip(names, values, strict=True))

    return list(data.column_names), rows


def _st_label(value: Any, name: str, where: str) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise InputError(f"{where}: field {name!r} is {value!r}; labels are 1 (positive) or 0")


def _st_row(row: dict, where: str, lay: _Layout) -> tuple[list, list]:
    """(positives, negatives) of one row, each a list of (text, score)."""
    if lay.listwise:
        docs = _list(row[lay.second], lay.second, where)
        texts = [_string(d, f"{lay.second}[{i}]", where, is_id=True) for i, d in enumerate(docs)]
        if lay.label == "labels":
            labels = _list(row["labels"], "labels", where)
            if len(labels) != len(texts):
                raise InputError(f"{where}: field 'labels' has {len(labels)} for {len(texts)}")
            flags = [_st_label(v, f"labels[{i}]", where) for i, v in enumerate(labels)]
            scores = [None] * len(texts)
        else:  # ST's labeled-list with scores: the first text is the positive
            flags = [i == 0 for i in range(len(texts))]
            scores = _scores(row, "scores", where, len(texts), lay.second)
        pairs = list(zip(texts, scores, strict=True))
        return [p for p, f in zip(pairs, flags, strict=True) if f], [
            p for p, f in zip(pairs, flags, strict=True) if not f
        ]
    text = _string(row[lay.second], lay.second, where, is_id=True)
    if lay.label == "label":
        return (
            ([(text, None)], [])
            if _st_label(row["label"], "label", where)
            else ([], [(text, None)])
        )
    negs = [_string(row[c], c, where, is_id=True) for c in lay.negatives]
    scores = _scores(row, "scores", where, 1 + len(negs), "positive and negatives")
    return [(text, scores[0])], list(zip(negs, scores[1:], strict=True))


def _grouped_rows(rows: Callable[[], Iterator[tuple[str, dict]]], anchor: str):
    """Lists of (where, row) sharing one anchor, each yielded once its last row is read."""
    import numpy as np

    def key(row: dict) -> int:
        text = str(row.get(anchor)).encode("utf-8", "surrogatepass")
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")

    hashes = np.fromiter((key(row) for _, row in rows()), dtype=np.uint64)
    _, inverse, counts = np.unique(hashes, return_inverse=True, return_counts=True)
    per_row = counts[inverse]
    del hashes, inverse
    pending: dict[Any, list] = {}
    for i, (where, row) in enumerate(rows()):
        if per_row[i] == 1:
            yield [(where, row)]
            continue
        group = pending.setdefault(row.get(anchor), [])
        group.append((where, row))
        if len(group) == per_row[i]:
            yield pending.pop(row.get(anchor))
    yield from pending.values()  # only where two anchors share a 64-bit hash


def _st_example(group: list, lay: _Layout, corpus: Corpus | None, by_id: bool) -> Example:
    where = group[0][0]
    anchor = _string(group[0][1][lay.anchor], lay.anchor, where, is_id=by_id)
    found: dict[str, dict] = {"positives": {}, "negatives": {}}
    for row_where, row in group:
        pos, neg = _st_row(row, row_where, lay)
        for side, pairs in (("positives", pos), ("negatives", neg)):
            for text, score in pairs:
                found[side].setdefault(text, (score, row_where))
    named = lay.label if lay.label in ("label", "labels") else lay.second
    _has_positive(found["positives"], named, where)

    def passages(side: str) -> tuple[Passage, ...]:
        items = found[side].items()
        if by_id:
            return tuple(_by_id(t, lay.second, w, corpus, s) for t, (s, w) in items)
        return tuple(Passage(text=t, score=s) for t, (s, _) in items)

    query = _query_text(anchor, lay.anchor, where, corpus) if by_id else anchor
    return Example(
        query,
        passages("positives"),
        passages("negatives"),
        query_id=anchor if by_id else None,
        where=where,
    )


def _read_st(path: Path, corpus: Corpus | None, by_id: bool) -> Iterator[Example]:
    columns, rows = _st_source(path)
    first = next(rows(), None)
    if first is None:
        return
    layout = _st_layout(path, columns, first[1])
    for group in _grouped_rows(rows, layout.anchor):
        yield _st_example(group, layout, corpus, by_id)


# --------------------------------------------------------------------------- reading
def _detect(path: Path) -> str:
    if path.is_dir() or path.suffix == ".parquet":
        return "st"
    first = next(_json_records(path), None)
    if first is None:
        return "st"  # an empty file: no examples in any format
    keys = set(first[1])
    if keys & {"positive_passages", "positive_document_ids"}:
        return "tevatron"
    if {"query", "pos"} <= keys:
        return "flagembedding"
    if {"query_id", "positives"} <= keys:
        return "mined"
    if len(keys) >= 2 and not any(isinstance(v, dict) for v in first[1].values()):
        return "st"
    raise InputError(
        f"{first[0]}: cannot tell the format of this record (keys {sorted(keys)}); "
        f"known formats: {KNOWN}"
    )


def _format(path: Path, format: str) -> str:
    if format in ("st", "sentence-transformers") or format.startswith("st-"):
        if format.startswith("st-") and format not in WRITE_FORMATS:
            raise ValueError(f"unknown pairs format {format!r}; known: auto, {KNOWN}")
        return "st"
    if format == "auto":
        return _detect(path)
    if format not in READ_FORMATS:
        raise ValueError(f"unknown pairs format {format!r}; known: auto, {KNOWN}")
    if path.is_dir() or path.suffix == ".parquet":
        raise InputError(f"{path}: {format} files are jsonl; a table is read as format 'st'")
    return format


def read_examples(
    path: str | Path,
    format: str = "auto",
    corpus: str | Path | Corpus | None = None,
    *,
    by_id: bool = False,
) -> Iterator[Example]:
    """The examples of a pairs file, streamed. ``format``: ``auto`` or one of
    ``READ_FORMATS`` (``st-*`` names read as ``st``). ``corpus``: a BEIR folder, its
    ``corpus.jsonl`` or a :class:`Corpus`, to resolve ids. ``by_id``: FE's and ST's strings
    are query and passage ids. The file and the format are checked before this returns."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder (the training pairs)")
    kind = _format(path, format)
    store = Corpus(corpus) if corpus is not None and not isinstance(corpus, Corpus) else corpus
    return _stream(path, kind, store, by_id, owned=store is not corpus)


def _stream(
    path: Path, kind: str, corpus: Corpus | None, by_id: bool, owned: bool
) -> Iterator[Example]:
    try:
        if kind == "st":
            yield from _read_st(path, corpus, by_id)
            return
        for where, record in _json_records(path):
            if kind == "flagembedding":
                yield _fe_example(record, where, corpus, by_id)
            elif kind == "tevatron":
                yield _tevatron_example(record, where, corpus)
            else:
                yield _mined_example(record, where, corpus)
    finally:
        if owned and corpus is not None:
            corpus.close()


# --------------------------------------------------------------------------- writing
class _Writer:
    """Rows of one output format from examples, counting what the format could not hold."""

    def __init__(self, format: str, scores: bool | None, num_negatives: int | None) -> None:
        self.format, self.scores, self.n = format, scores, num_negatives
        self.counts = {"examples": 0, "rows": 0, "skipped": 0, "truncated": 0}
        self.index = 0

    def _where(self, example: Example) -> str:
        named = f" (query id {example.query_id!r})" if example.query_id else ""
        return f"example {self.index}{named}"

    def query(self, example: Example) -> str:
        if example.query is None:
            raise ValueError(
                f"{self._where(example)}: {self.format} needs the query text; read the pairs "
                "with corpus= (a BEIR folder with queries.jsonl) to resolve query ids"
            )
        return example.query

    def text(self, example: Example, passage: Passage) -> str:
        if passage.text is None:
            raise ValueError(
                f"{self._where(example)}: passage id {passage.id!r} has no text and "
                f"{self.format} holds texts; read the pairs with corpus= to resolve ids"
            )
        return passage.full_text or ""

    def score(self, example: Example, passage: Passage) -> float:
        if passage.score is None:
            raise ValueError(
                f"{self._where(example)}: a passage has no score; write with scores=False"
            )
        return passage.score

    def rows(self, examples: Iterable[Example]) -> Iterator[dict]:
        make = getattr(self, "_" + self.format.replace("-", "_"))
        for example in examples:
            self.index += 1
            self.counts["examples"] += 1
            for row in make(example):
                self.counts["rows"] += 1
                yield row

    def _st_triplet(self, ex: Example) -> Iterator[dict]:
        if not ex.negatives:
            self.counts["skipped"] += 1
        for pos in ex.positives:
            for neg in ex.negatives:
                row = {"anchor": self.query(ex), "positive": self.text(ex, pos)}
                row["negative"] = self.text(ex, neg)
                if self.scores:
                    row["scores"] = [self.score(ex, pos), self.score(ex, neg)]
                yield row

    def _st_ntuple(self, ex: Example) -> Iterator[dict]:
        if self.n is None:
            self.n = len(ex.negatives)
        if len(ex.negatives) < self.n or not ex.negatives:
            self.counts["skipped"] += 1
            return
        self.counts["truncated"] += len(ex.negatives) > self.n
        negatives = ex.negatives[: self.n]
        for pos in ex.positives:
            row = {"anchor": self.query(ex), "positive": self.text(ex, pos)}
            for i, neg in enumerate(negatives, start=1):
                row[f"negative_{i}"] = self.text(ex, neg)
            if self.scores:
                row["scores"] = [self.score(ex, p) for p in (pos, *negatives)]
            yield row

    def _st_labeled_pair(self, ex: Example) -> Iterator[dict]:
        for label, passages in ((1, ex.positives), (0, ex.negatives)):
            for p in passages:
                row: dict[str, Any] = {"anchor": self.query(ex), "positive": self.text(ex, p)}
                if self.scores:
                    row["score"] = self.score(ex, p)
                else:
                    row["label"] = label
                yield row

    def _st_labeled_list(self, ex: Example) -> Iterator[dict]:
        if not ex.negatives:
            self.counts["skipped"] += 1
        for pos in ex.positives if ex.negatives else ():
            docs = (pos, *ex.negatives)
            row: dict[str, Any] = {"anchor": self.query(ex)}
            row["positive"] = [self.text(ex, p) for p in docs]
            if self.scores:
                row["scores"] = [self.score(ex, p) for p in docs]
            else:
                row["labels"] = [1] + [0] * len(ex.negatives)
            yield row

    def _flagembedding(self, ex: Example) -> Iterator[dict]:
        row: dict[str, Any] = {"query": self.query(ex)}
        row["pos"] = [self.text(ex, p) for p in ex.positives]
        row["neg"] = [self.text(ex, p) for p in ex.negatives]
        every = all(p.score is not None for p in (*ex.positives, *ex.negatives))
        if self.scores or (self.scores is None and every):
            row["pos_scores"] = [self.score(ex, p) for p in ex.positives]
            row["neg_scores"] = [self.score(ex, p) for p in ex.negatives]
        for name in ("prompt", "type"):
            if getattr(ex, name) is not None:
                row[name] = getattr(ex, name)
        yield row

    def _tevatron(self, ex: Example) -> Iterator[dict]:
        def passage(p: Passage) -> dict:
            self.text(ex, p)
            return {"docid": p.id or "", "title": p.title or "", "text": p.text}

        yield {
            "query_id": ex.query_id or "",
            "query": self.query(ex),
            "positive_passages": [passage(p) for p in ex.positives],
            "negative_passages": [passage(p) for p in ex.negatives],
        }

    def _mined(self, ex: Example) -> Iterator[dict]:
        if ex.query_id is None or any(p.id is None for p in (*ex.positives, *ex.negatives)):
            raise ValueError(f"{self._where(ex)}: the mined format needs query and passage ids")
        keep = self.scores is not False

        def entry(p: Passage, fields: tuple[str, ...]) -> dict:
            out: dict[str, Any] = {"id": p.id}
            for name in fields:
                if getattr(p, name) is not None and (keep or name == "rank"):
                    out[name] = getattr(p, name)
            return out

        row: dict[str, Any] = {"query_id": ex.query_id}
        if ex.query is not None:
            row["query"] = ex.query
        row["positives"] = [entry(p, ("score",)) for p in ex.positives]
        row["negatives"] = [entry(p, ("rank", "score")) for p in ex.negatives]
        yield row


def _arrow_type(name: str, value: Any):
    import pyarrow as pa

    types = {"label": pa.int64(), "score": pa.float64(), "labels": pa.list_(pa.int64())}
    if name in types:
        return types[name]
    if name == "scores":
        return pa.list_(pa.float64())
    return pa.list_(pa.string()) if isinstance(value, list) else pa.string()


def _write_parquet(rows: Iterator[dict], f: IO[bytes], batch_rows: int = 1024) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    try:
        batch: list[dict] = []
        for row in rows:
            batch.append(row)
            if len(batch) == batch_rows:
                writer = writer or pq.ParquetWriter(f, _schema(batch[0]))
                writer.write_table(pa.Table.from_pylist(batch, schema=writer.schema))
                batch = []
        if batch or writer is None:
            sample = batch[0] if batch else {"anchor": "", "positive": ""}
            writer = writer or pq.ParquetWriter(f, _schema(sample))
            writer.write_table(pa.Table.from_pylist(batch, schema=writer.schema))
    finally:
        if writer is not None:
            writer.close()


def _schema(row: dict):
    import pyarrow as pa

    return pa.schema([(name, _arrow_type(name, value)) for name, value in row.items()])


def write_examples(
    examples: Iterable[Example],
    path: str | Path,
    format: str,
    *,
    scores: bool | None = None,
    num_negatives: int | None = None,
) -> dict[str, int]:
    """Write ``examples`` to ``path`` in ``format`` (one of ``WRITE_FORMATS``), atomically:
    nothing is at ``path`` until the whole file is written and fsynced. ``scores``: write the
    passages' scores (ST formats: ST's ``scores``/``score`` columns, off unless True; FE and
    mined: when known unless False). ``num_negatives``: ``st-ntuple``'s n. Returns the counts
    ``examples``, ``rows``, ``skipped`` (examples the format cannot hold) and ``truncated``."""
    if format not in WRITE_FORMATS:
        raise ValueError(f"unknown output format {format!r}; known: {', '.join(WRITE_FORMATS)}")
    path = Path(path)
    parquet = path.suffix == ".parquet"
    if parquet and not format.startswith("st-"):
        raise ValueError(f"{path}: {format} is written as jsonl; only ST tables go to parquet")
    writer = _Writer(format, scores, num_negatives)
    if parquet:
        with atomic_open(path, "wb") as f:
            _write_parquet(writer.rows(examples), f)
    else:
        with atomic_open(path, "w") as f:
            for row in writer.rows(examples):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return writer.counts
