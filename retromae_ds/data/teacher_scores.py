"""Offline teacher scores (issue 58, distillation): one reader for every anchor's score file,
its format detected from the file, giving per query id a dict ``{doc id: score}``
(:func:`read_teacher_scores`), and an atomic writer of RetroMAE's lines
(:func:`write_teacher_scores`). ``scores[qid][did]`` is the teacher's score of the pair.

**Formats** (each checked against the anchor's own code; ``docs/distillation.md`` shows a line
of each):

- ``retromae``: ``qid did score`` lines split on whitespace, as ``read_teacher_score`` of
  staoxiao/RetroMAE ``src/bi_encoder/data.py`` reads its ``--teacher_score_files`` (it strips
  ``[]`` round the score, so ``[0.53]`` reads as 0.53 here too). SimLM's
  ``gen_teacher_scores.py`` shards (``qid<TAB>pid<TAB>score``) have the same layout.
- ``hofstatter``: ``pos_score neg_score qid pos_pid neg_pid``, tab separated: the
  cross-architecture teacher files of sebastian-hofstaetter/neural-ranking-kd (README, "Teacher
  Training Files"), as the ensembling script of his ``transformer-kernel-ranking`` reads them
  (columns 0-4, keyed by (qid, pid)). A (qid, pid) pair repeats over the triples.
- ``simlm``: jsonl ``{"query_id", "query", "positives": {"doc_id": [..], "score": [..]},
  "negatives": {"doc_id": [..], "score": [..]}}``, as microsoft/unilm ``simlm``'s
  ``src/inference/gen_teacher_scores.py`` writes ``kd_<split>.jsonl`` and
  ``src/loaders/biencoder_dataloader.py`` reads it (``do_kd_biencoder``). SimLM's plain
  ``train.jsonl`` has the same layout with retrieval scores (-1 where a positive was not
  retrieved): read as given, it is not a teacher.
- ``flagembedding``, ``st``, ``tevatron``, ``mined``: the pairs formats, read by
  :func:`retromae_ds.data.pairs.read_examples` with ``by_id=True`` (FE's ``pos_scores`` /
  ``neg_scores``, ST's ``scores`` column, Tevatron's per-passage ``score`` as its
  ``DistilTrainDataset`` reads it, mine's ``score``). Scores are keyed by ids: a query or
  passage given by text (a string holding whitespace, or a Tevatron passage with no
  ``docid``) is refused; such files train through ``--data.pairs``, whose staging keeps their
  scores in ``RUN/data_pairs/negatives.jsonl``.

``auto`` decides from the first non-empty line: a JSON object whose ``positives`` holds
``doc_id`` is ``simlm``, another JSON object (or a ``.parquet`` file or a folder) is one of the
pairs formats (detected as :mod:`retromae_ds.data.pairs` does), 3 columns with a number last
``retromae``, 5 columns with numbers first ``hofstatter``. Anything else is one line naming the
file and showing its first line.

**Errors**: one ``InputError`` line naming file, line (1-based) and field: a missing or
non-numeric score, NaN or inf, an id outside ``query_ids`` / ``corpus_ids`` (when given), score
and id lists of different lengths, an empty file, a query listed with no scores. A pair listed
twice with equal scores is kept once; with different scores it is an error naming both lines
(``repeats="last"`` keeps the last instead, what RetroMAE's and Hofstätter's own readers do).

**Memory**: the file is streamed; only the returned dict is held (fine for a few million
pairs). A conflict's first line is found by reading the file again, only when there is one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from retromae_ds.base.fsutil import atomic_open, sha256_file
from retromae_ds.data.pairs import read_examples
from retromae_ds.data.pairs_read import format_of_record
from retromae_ds.data.pairs_records import (
    json_records,
    kind_of,
    list_field,
    need,
    number_field,
    string_field,
)
from retromae_ds.data.sources import InputError, text_lines

QID_DID_SCORE = "retromae"
"""RetroMAE's ``qid did score`` lines: the format's name (also what the writer writes)."""
LINE_FORMATS = (QID_DID_SCORE, "hofstatter")
PAIRS_FORMATS = ("flagembedding", "st", "tevatron", "mined")
FORMATS = (*LINE_FORMATS, "simlm", *PAIRS_FORMATS)
KNOWN = (
    "retromae 'qid did score', hofstatter 'pos_score neg_score qid pos_pid neg_pid', "
    "simlm {query_id, positives: {doc_id, score}, negatives}, flagembedding {query, pos, "
    "pos_scores, neg, neg_scores}, st (a 'scores' column), tevatron (per-passage 'score'), "
    "mined {query_id, positives, negatives}"
)
REPEATS = ("error", "last")


class _Entry(NamedTuple):
    """One teacher score as read: where, the query id and passage id with the fields they
    came from, the score."""

    where: str
    qid: str
    qfield: str
    did: str
    dfield: str
    score: float


@dataclass(frozen=True)
class TeacherScores(Mapping[str, dict[str, float]]):
    """The scores of a teacher file: ``scores[qid][did]`` (a plain dict underneath)."""

    scores: dict[str, dict[str, float]]
    """Per query id, the teacher's score of each passage id."""
    format: str
    """The format read (one of ``FORMATS``)."""
    path: str
    """The file (or ``datasets`` folder) read."""
    sha256: str
    """sha256 of the file (of every file, by relative path, for a folder)."""
    pairs: int
    """How many (query, passage) scores."""

    def __getitem__(self, qid: str) -> dict[str, float]:
        return self.scores[qid]

    def __iter__(self) -> Iterator[str]:
        return iter(self.scores)

    def __len__(self) -> int:
        return len(self.scores)


# --------------------------------------------------------------------------- line formats
def _number(text: str, where: str, name: str) -> float:
    cleaned = text.strip("[]")  # RetroMAE's reader strips numpy's brackets
    try:
        if "_" in cleaned:  # float() takes 1_0; no score writer does
            raise ValueError
        value = float(cleaned)
    except ValueError:
        raise InputError(f"{where}: field {name!r} is {text!r}, not a number") from None
    if not math.isfinite(value):
        raise InputError(f"{where}: field {name!r} is {text!r}, not a finite number")
    return value


def _columns(line: str) -> list[str]:
    return line.split("\t") if "\t" in line else line.split()


def _line_entries(path: Path, format: str) -> Iterator[_Entry]:
    names = ("qid", "did", "score") if format == QID_DID_SCORE else _HOFSTATTER
    for line_no, line in text_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        cols = [c.strip() for c in _columns(line.strip())]
        if len(cols) != len(names):
            raise InputError(
                f"{where}: {len(cols)} columns, a {format} line has {len(names)} "
                f"({' '.join(names)})"
                + (": missing score" if len(cols) == 2 and format == QID_DID_SCORE else "")
            )
        for name, col in zip(names, cols, strict=True):
            if not col:
                raise InputError(f"{where}: field {name!r} is empty")
        if format == QID_DID_SCORE:
            yield _Entry(where, cols[0], "qid", cols[1], "did", _number(cols[2], where, "score"))
        else:
            pos, neg = _number(cols[0], where, "pos_score"), _number(cols[1], where, "neg_score")
            yield _Entry(where, cols[2], "qid", cols[3], "pos_pid", pos)
            yield _Entry(where, cols[2], "qid", cols[4], "neg_pid", neg)


_HOFSTATTER = ("pos_score", "neg_score", "qid", "pos_pid", "neg_pid")


# --------------------------------------------------------------------------- jsonl formats
def _simlm_entries(path: Path) -> Iterator[_Entry]:
    for where, record in json_records(path):
        qid = string_field(need(record, "query_id", where), "query_id", where, is_id=True)
        listed = 0
        for side in ("positives", "negatives"):
            group = need(record, side, where) if side == "positives" else record.get(side)
            if group is None:
                continue
            if not isinstance(group, dict):
                raise InputError(f"{where}: field {side!r} is {kind_of(group)}, not an object")
            ids = list_field(need(group, "doc_id", where), f"{side}.doc_id", where)
            if "score" not in group:
                raise InputError(f"{where}: missing field {side + '.score'!r} (teacher scores)")
            scores = list_field(group["score"], f"{side}.score", where)
            if len(scores) != len(ids):
                raise InputError(
                    f"{where}: field {side + '.score'!r} has {len(scores)} scores for "
                    f"{len(ids)} ids in {side + '.doc_id'!r}"
                )
            for i, (doc_id, score) in enumerate(zip(ids, scores, strict=True)):
                did = string_field(doc_id, f"{side}.doc_id[{i}]", where, is_id=True)
                value = number_field(score, f"{side}.score[{i}]", where)
                if value is None:
                    raise InputError(f"{where}: field {side + f'.score[{i}]'!r} is null")
                yield _Entry(where, qid, "query_id", did, f"{side}.doc_id[{i}]", value)
                listed += 1
        if not listed:
            raise InputError(f"{where}: field 'positives': query {qid!r} lists no scores")


_SCORE_FIELDS = {  # side -> (the passage's field name, its score's field name), i: index
    "flagembedding": ("{side}[{i}]", "{side}_scores[{i}]", ("pos", "neg")),
    "st": ("{side}[{i}]", "scores", ("positive", "negative")),
    "tevatron": (
        "{side}_passages[{i}].docid",
        "{side}_passages[{i}].score",
        ("positive", "negative"),
    ),
    "mined": ("{side}s[{i}].id", "{side}s[{i}].score", ("positive", "negative")),
}


def _keyable(value: str | None, name: str, where: str, what: str) -> str:
    if value is None or any(c.isspace() for c in value):
        shown = "has no id" if value is None else f"is given by text ({value[:40]!r}), not by id"
        raise InputError(
            f"{where}: field {name!r}: {what} {shown}; teacher scores are keyed by ids "
            "(train a file of texts through --data.pairs: its staging keeps the scores in "
            "RUN/data_pairs/negatives.jsonl)"
        )
    return value


def _pairs_entries(path: Path, format: str) -> Iterator[_Entry]:
    passage_name, score_name, sides = _SCORE_FIELDS[format]
    qname = {"flagembedding": "query", "st": "anchor"}.get(format, "query_id")
    for ex in read_examples(path, format, by_id=True):
        qid = _keyable(ex.query_id, qname, ex.where, "the query")
        listed = 0
        for side, passages in zip(sides, (ex.positives, ex.negatives), strict=True):
            for i, p in enumerate(passages):
                name = passage_name.format(side=side, i=i)
                did = _keyable(p.id, name, ex.where, "a passage")
                if p.score is None:
                    field = score_name.format(side=side, i=i)
                    raise InputError(f"{ex.where}: missing field {field!r} (no teacher score)")
                yield _Entry(ex.where, qid, qname, did, name, p.score)
                listed += 1
        if not listed:
            raise InputError(f"{ex.where}: field {qname!r}: query {qid!r} lists no scores")


# --------------------------------------------------------------------------- detection
def _first_line(path: Path) -> tuple[str, str] | None:
    for line_no, line in text_lines(path):
        if line.strip():
            return f"{path}:{line_no}", line.strip()
    return None


def _looks_number(text: str) -> bool:
    try:
        float(text.strip("[]"))
    except ValueError:
        return False
    return True


def detect_format(path: str | Path) -> str:
    """The teacher-score format of ``path`` (see the module docstring); an undetectable file
    is one line naming it and showing its first line."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".parquet":
        return "st"
    first = _first_line(path)
    if first is None:
        raise InputError(f"{path}: empty file: no teacher scores")
    where, line = first
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
        record = record if isinstance(record, dict) else {}
        if isinstance(record.get("positives"), dict) and "doc_id" in record["positives"]:
            return "simlm"
        found = format_of_record(record)
        if found is not None:
            return found
    cols = _columns(line)
    if len(cols) == 3 and _looks_number(cols[2]):
        return QID_DID_SCORE
    if len(cols) == 5 and _looks_number(cols[0]) and _looks_number(cols[1]):
        return "hofstatter"
    raise InputError(
        f"{where}: cannot tell the teacher-score format from the first line {line[:80]!r}; "
        f"known formats: {KNOWN}"
    )


# --------------------------------------------------------------------------- reading
def _fingerprint(path: Path) -> str:
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            digest.update(f"{p.relative_to(path)}\0{sha256_file(p)}\n".encode())
    return digest.hexdigest()


def _check_known(entry: _Entry, query_ids, corpus_ids) -> None:
    if query_ids is not None and entry.qid not in query_ids:
        raise InputError(
            f"{entry.where}: field {entry.qfield!r}: query id {entry.qid!r} is not among the "
            f"{len(query_ids)} known queries"
        )
    if corpus_ids is not None and entry.did not in corpus_ids:
        raise InputError(
            f"{entry.where}: field {entry.dfield!r}: doc id {entry.did!r} is not among the "
            f"{len(corpus_ids)} corpus ids"
        )


def _first_seen(entries: Callable[[], Iterator[_Entry]], entry: _Entry) -> _Entry:
    """Where the pair of ``entry`` was first listed (a second read, only for the error)."""
    found = (e for e in entries() if e.qid == entry.qid and e.did == entry.did)
    return next(found, entry)


def read_teacher_scores(
    path: str | Path,
    *,
    format: str = "auto",
    corpus_ids: Collection[str] | None = None,
    query_ids: Collection[str] | None = None,
    repeats: str = "error",
) -> TeacherScores:
    """The teacher scores of ``path`` (see the module docstring). ``format``: ``auto`` or
    one of ``FORMATS``. ``corpus_ids`` / ``query_ids``: the known ids, each score's ids
    checked against them. ``repeats``: ``error`` (a pair listed again with another score is
    an error naming both lines) or ``last`` (the last score is kept)."""
    path = Path(path)
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"unknown teacher-score format {format!r}; known: auto, {KNOWN}")
    if repeats not in REPEATS:
        raise ValueError(f"repeats must be one of {REPEATS}, not {repeats!r}")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder (the teacher scores)")
    kind = detect_format(path) if format == "auto" else format
    if kind in LINE_FORMATS:
        entries = lambda: _line_entries(path, kind)  # noqa: E731
    elif kind == "simlm":
        entries = lambda: _simlm_entries(path)  # noqa: E731
    else:
        entries = lambda: _pairs_entries(path, kind)  # noqa: E731
    scores: dict[str, dict[str, float]] = {}
    pairs = 0
    for entry in entries():
        _check_known(entry, query_ids, corpus_ids)
        per_query = scores.setdefault(entry.qid, {})
        old = per_query.get(entry.did)
        if old is None:
            pairs += 1
        elif old != entry.score and repeats == "error":
            first = _first_seen(entries, entry)
            raise InputError(
                f"{entry.where}: field {entry.dfield!r}: pair ({entry.qid!r}, {entry.did!r}) "
                f"scored {entry.score!r} here and {first.score!r} at {first.where} "
                "(repeats='last' keeps the last)"
            )
        per_query[entry.did] = entry.score
    if not scores:
        raise InputError(f"{path}: empty file: no teacher scores")
    return TeacherScores(
        scores=scores, format=kind, path=str(path), sha256=_fingerprint(path), pairs=pairs
    )


# --------------------------------------------------------------------------- writing
def write_teacher_scores(
    path: str | Path, scores: Mapping[str, Mapping[str, float]], format: str = QID_DID_SCORE
) -> int:
    """Write ``scores`` (``{qid: {did: score}}``) as RetroMAE's ``qid<TAB>did<TAB>score``
    lines through one temporary file renamed into place; the number of lines. Scores are
    written with ``repr`` (read back exactly); an id holding whitespace, or a score that is
    not finite, is a ``ValueError`` and nothing is written."""
    if format != QID_DID_SCORE:
        raise ValueError(f"teacher scores are written as 'retromae' lines, not {format!r}")
    lines = 0
    with atomic_open(path, "w") as f:
        for qid, per_query in scores.items():
            for did, score in per_query.items():
                for name, value in (("query id", qid), ("doc id", did)):
                    if not value or any(c.isspace() for c in str(value)):
                        raise ValueError(f"{path}: {name} {value!r} is empty or holds whitespace")
                score = float(score)
                if not math.isfinite(score):
                    raise ValueError(f"{path}: score of ({qid!r}, {did!r}) is {score}")
                f.write(f"{qid}\t{did}\t{score!r}\n")
                lines += 1
    return lines
