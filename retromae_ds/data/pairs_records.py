"""The records and the shared checks of the fine-tuning pairs (:mod:`retromae_ds.data.pairs`
describes every format): :class:`Passage` and :class:`Example`, the format names, the field
checks the readers use (each raising a one-line ``InputError`` naming the place and the field)
and :class:`Corpus`, which resolves corpus and query ids by byte offset. Readers live in
:mod:`retromae_ds.data.pairs_read`, writers in :mod:`retromae_ds.data.pairs_write`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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
def kind_of(value: Any) -> str:
    """What ``value`` is, in words for an error message ("a string", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "a value")


def json_records(path: Path) -> Iterator[tuple[str, dict]]:
    """``(file:line, object)`` of each non-blank line of a jsonl file; a line that is not a
    JSON object is a one-line ``InputError`` naming file and line."""
    for line_no, line in text_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object, found {kind_of(record)}")
        yield where, record


def need(record: dict, name: str, where: str) -> Any:
    """``record[name]``; a missing field is an error naming ``where`` and ``name``."""
    if name not in record:
        raise InputError(f"{where}: missing field {name!r}")
    return record[name]


def string_field(value: Any, name: str, where: str, *, is_id: bool = False) -> str:
    """``value`` as a non-empty string (an integer too when ``is_id``), else an error."""
    if is_id and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # converted datasets write numeric ids
    if not isinstance(value, str):
        raise InputError(f"{where}: field {name!r} is {kind_of(value)}, not a string")
    if not value.strip():
        raise InputError(f"{where}: field {name!r} is empty")
    return value


def optional_string(record: dict, name: str, where: str) -> str | None:
    """``record[name]`` as a non-empty string, or None when absent or null."""
    value = record.get(name)
    return None if value is None else string_field(value, name, where)


def list_field(value: Any, name: str, where: str) -> list:
    """``value`` when it is a list, else an error."""
    if not isinstance(value, list):
        raise InputError(f"{where}: field {name!r} is {kind_of(value)}, not a list")
    return value


def number_field(value: Any, name: str, where: str) -> float | None:
    """``value`` as a finite float (None stays None), else an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: field {name!r} is {kind_of(value)}, not a number")
    if not math.isfinite(value):
        raise InputError(f"{where}: field {name!r} is {value}, not a finite number")
    return float(value)


def rank_field(value: Any, name: str, where: str) -> int | None:
    """``value`` as a 1-based rank (None stays None), else an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{where}: field {name!r} is {value!r}, not a rank (1, 2, ...)")
    return value


def scores_field(record: dict, name: str, where: str, count: int, of: str) -> list[float | None]:
    """The ``count`` scores of list field ``name`` (all None when absent), else an error."""
    if record.get(name) is None:
        return [None] * count
    values = list_field(record[name], name, where)
    if len(values) != count:
        raise InputError(
            f"{where}: field {name!r} has {len(values)} scores for {count} passages in {of!r}"
        )
    return [number_field(v, f"{name}[{i}]", where) for i, v in enumerate(values)]


def has_positive(positives: Iterable, name: str, where: str) -> None:
    """An error unless the query has a positive passage."""
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
                doc_id = string_field(need(record, key, where), key, where, is_id=True)
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
            raise InputError(f"{where}: expected a JSON object, found {kind_of(record)}")
        for name in ("title", *self.text_fields):
            if record.get(name) is not None and not isinstance(record[name], str):
                raise InputError(
                    f"{where}: field {name!r} is {kind_of(record[name])}, not a string"
                )
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
