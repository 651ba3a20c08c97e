"""Atomic writers of the fine-tuning pairs (:func:`write_examples`): sentence-transformers
tables (triplet, n-tuple, labeled pair, labeled list; jsonl or parquet), FlagEmbedding,
Tevatron and the mined id-level jsonl, each through one temporary file fsynced and renamed.
What each format keeps and loses is described in :mod:`retromae_ds.data.pairs`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from retromae_ds.base.fsutil import atomic_open
from retromae_ds.data.pairs_records import WRITE_FORMATS, Example, Passage


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
