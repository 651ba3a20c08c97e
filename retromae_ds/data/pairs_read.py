"""Streaming readers of the fine-tuning pairs (:func:`read_examples`): FlagEmbedding,
Tevatron and mined jsonl line by line, sentence-transformers tables (jsonl, parquet, a
``datasets`` folder) in two passes grouping a repeated anchor into one example. The formats,
the errors and the memory bounds are described in :mod:`retromae_ds.data.pairs`."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retromae_ds.data.pairs_records import (
    KNOWN,
    LABEL_COLUMNS,
    READ_FORMATS,
    WRITE_FORMATS,
    Corpus,
    Example,
    Passage,
    has_positive,
    json_records,
    kind_of,
    list_field,
    need,
    number_field,
    optional_string,
    rank_field,
    scores_field,
    string_field,
)
from retromae_ds.data.sources import InputError


# --------------------------------------------------------------------------- ids to texts
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


def _fe_example(record: dict, where: str, corpus: Corpus | None, by_id: bool) -> Example:
    query = string_field(need(record, "query", where), "query", where, is_id=by_id)
    lists = {}
    for name in ("pos", "neg"):
        value = need(record, name, where) if name == "pos" else record.get(name) or []
        items = list_field(value, name, where)
        texts = [string_field(v, f"{name}[{i}]", where, is_id=by_id) for i, v in enumerate(items)]
        scores = scores_field(record, f"{name}_scores", where, len(texts), name)
        if by_id:
            lists[name] = tuple(
                _by_id(t, f"{name}[{i}]", where, corpus, s)
                for i, (t, s) in enumerate(zip(texts, scores, strict=True))
            )
        else:
            lists[name] = tuple(
                Passage(text=t, score=s) for t, s in zip(texts, scores, strict=True)
            )
    has_positive(lists["pos"], "pos", where)
    query_id = query if by_id else None
    text = _query_text(query, "query", where, corpus) if by_id else query
    return Example(
        text,
        lists["pos"],
        lists["neg"],
        query_id=query_id,
        prompt=optional_string(record, "prompt", where),
        type=optional_string(record, "type", where),
        where=where,
    )


def _tevatron_passage(value: Any, name: str, where: str, corpus: Corpus | None) -> Passage:
    if not isinstance(value, dict):
        raise InputError(f"{where}: field {name!r} is {kind_of(value)}, not an object")
    doc_id = value.get("docid")
    if doc_id is not None and doc_id != "":
        doc_id = string_field(doc_id, f"{name}.docid", where, is_id=True)
    else:
        doc_id = None
    text, title = value.get("text"), value.get("title")
    if title is not None and not isinstance(title, str):
        raise InputError(f"{where}: field {name + '.title'!r} is {kind_of(title)}, not a string")
    score = number_field(value.get("score"), f"{name}.score", where)  # a distillation score
    if text is None and doc_id is not None:
        return _by_id(doc_id, f"{name}.docid", where, corpus, score)
    if text is None:
        raise InputError(f"{where}: missing field {name + '.text'!r} (and no docid to look up)")
    string_field(text, f"{name}.text", where)
    return Passage(text=text, id=doc_id, title=title or None, score=score)


def _tevatron_example(record: dict, where: str, corpus: Corpus | None) -> Example:
    query_id = record.get("query_id")
    query_id = (
        None if query_id in (None, "") else string_field(query_id, "query_id", where, is_id=True)
    )
    if "positive_document_ids" in record:  # Tevatron's id form
        lists = {}
        for side in ("positive", "negative"):
            name = f"{side}_document_ids"
            value = need(record, name, where) if side == "positive" else record.get(name) or []
            ids = [string_field(v, f"{name}[{i}]", where, is_id=True) for i, v in enumerate(value)]
            lists[side] = tuple(_by_id(d, f"{name}[{i}]", where, corpus) for i, d in enumerate(ids))
        has_positive(lists["positive"], "positive_document_ids", where)
        query = record.get("query_text") or record.get("query")
        if query is not None:
            query = string_field(query, "query_text", where)
        elif query_id is not None:
            query = _query_text(query_id, "query_id", where, corpus)
        return Example(query, lists["positive"], lists["negative"], query_id, where=where)
    query = string_field(need(record, "query", where), "query", where)
    lists = {}
    for side in ("positive", "negative"):
        name = f"{side}_passages"
        value = need(record, name, where) if side == "positive" else record.get(name) or []
        items = list_field(value, name, where)
        lists[side] = tuple(
            _tevatron_passage(v, f"{name}[{i}]", where, corpus) for i, v in enumerate(items)
        )
    has_positive(lists["positive"], "positive_passages", where)
    return Example(query, lists["positive"], lists["negative"], query_id, where=where)


def _mined_example(record: dict, where: str, corpus: Corpus | None) -> Example:
    query_id = string_field(need(record, "query_id", where), "query_id", where, is_id=True)
    query = record.get("query")
    if query is not None:
        query = string_field(query, "query", where)
    else:
        query = _query_text(query_id, "query_id", where, corpus)
    lists = {}
    for side in ("positives", "negatives"):
        value = need(record, side, where) if side == "positives" else record.get(side) or []
        passages = []
        for i, item in enumerate(list_field(value, side, where)):
            name = f"{side}[{i}]"
            if not isinstance(item, dict):
                raise InputError(f"{where}: field {name!r} is {kind_of(item)}, not an object")
            doc_id = string_field(need(item, "id", where), f"{name}.id", where, is_id=True)
            score = number_field(item.get("score"), f"{name}.score", where)
            rank = rank_field(item.get("rank"), f"{name}.rank", where)
            passages.append(_by_id(doc_id, f"{name}.id", where, corpus, score, rank))
        lists[side] = tuple(passages)
    has_positive(lists["positives"], "positives", where)
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
    first = next(json_records(path), None)
    if first is None:
        return [], lambda: iter(())
    columns = list(first[1])

    def json_rows() -> Iterator[tuple[str, dict]]:
        for where, record in json_records(path):
            for name in columns:
                need(record, name, where)
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
        docs = list_field(row[lay.second], lay.second, where)
        texts = [
            string_field(d, f"{lay.second}[{i}]", where, is_id=True) for i, d in enumerate(docs)
        ]
        if lay.label == "labels":
            labels = list_field(row["labels"], "labels", where)
            if len(labels) != len(texts):
                raise InputError(f"{where}: field 'labels' has {len(labels)} for {len(texts)}")
            flags = [_st_label(v, f"labels[{i}]", where) for i, v in enumerate(labels)]
            scores = [None] * len(texts)
        else:  # ST's labeled-list with scores: the first text is the positive
            flags = [i == 0 for i in range(len(texts))]
            scores = scores_field(row, "scores", where, len(texts), lay.second)
        pairs = list(zip(texts, scores, strict=True))
        return [p for p, f in zip(pairs, flags, strict=True) if f], [
            p for p, f in zip(pairs, flags, strict=True) if not f
        ]
    text = string_field(row[lay.second], lay.second, where, is_id=True)
    if lay.label == "label":
        return (
            ([(text, None)], [])
            if _st_label(row["label"], "label", where)
            else ([], [(text, None)])
        )
    negs = [string_field(row[c], c, where, is_id=True) for c in lay.negatives]
    scores = scores_field(row, "scores", where, 1 + len(negs), "positive and negatives")
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
    anchor = string_field(group[0][1][lay.anchor], lay.anchor, where, is_id=by_id)
    found: dict[str, dict] = {"positives": {}, "negatives": {}}
    for row_where, row in group:
        pos, neg = _st_row(row, row_where, lay)
        for side, pairs in (("positives", pos), ("negatives", neg)):
            for text, score in pairs:
                found[side].setdefault(text, (score, row_where))
    named = lay.label if lay.label in ("label", "labels") else lay.second
    has_positive(found["positives"], named, where)

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
    first = next(json_records(path), None)
    if first is None:
        return "st"  # an empty file: no examples in any format
    found = format_of_record(first[1])
    if found is not None:
        return found
    raise InputError(
        f"{first[0]}: cannot tell the format of this record (keys {sorted(first[1])}); "
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
        for where, record in json_records(path):
            if kind == "flagembedding":
                yield _fe_example(record, where, corpus, by_id)
            elif kind == "tevatron":
                yield _tevatron_example(record, where, corpus)
            else:
                yield _mined_example(record, where, corpus)
    finally:
        if owned and corpus is not None:
            corpus.close()


def format_of_record(record: dict[str, Any]) -> str | None:
    """The pairs format a jsonl record's keys say (tevatron, flagembedding, mined, st), or
    None: what ``--pairs_format auto`` and the teacher-score files' detection both read."""
    keys = set(record)
    if keys & {"positive_passages", "positive_document_ids"}:
        return "tevatron"
    if {"query", "pos"} <= keys:
        return "flagembedding"
    if {"query_id", "positives"} <= keys:
        return "mined"
    if len(keys) >= 2 and not any(isinstance(v, dict) for v in record.values()):
        return "st"
    return None
