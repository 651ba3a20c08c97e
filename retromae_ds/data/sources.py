"""Input formats for preprocessing, and their split into deterministic work units.

Supported inputs: ``.jsonl`` / ``.jsonl.gz`` (text field selectable, optional title field),
a BEIR ``corpus.jsonl`` (or a folder holding one; ``_id``/``title``/``text``), ``.txt`` (one
document per line, or per blank-line-separated paragraph), ``.parquet``, and a Hugging Face
``datasets`` folder written by ``save_to_disk``.

Every input is cut into *units* whose boundaries depend on the input bytes and the shard-size
target only (never on worker count), and each unit becomes exactly one shard. That is what
makes the output byte-identical for any number of workers or Slurm tasks, and lets a killed
run redo only the units whose shard is missing.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from retromae_ds.base.config import flag

# .raw: plain text under WikiText's naming
TEXT_SUFFIXES = {
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".txt": "txt",
    ".raw": "txt",
    ".parquet": "parquet",
}
SUPPORTED = (
    "a .jsonl, .jsonl.gz, .txt/.raw or .parquet file, a BEIR corpus.jsonl, or a datasets folder"
)


class InputError(ValueError):
    """Bad input, with the location (file and line or row) in the message."""


@dataclass(frozen=True)
class SourceOptions:
    """How documents are read out of the inputs."""

    text_field: str = "text"
    """JSON key / column holding the document text."""
    title_field: str | None = None
    """Optional JSON key / column whose value is prepended to the text (BEIR: ``title``)."""
    id_field: str | None = None
    """JSON key / column with the document id; default ``_id`` or ``id`` when present."""
    title_sep: str = " "
    """Joins title and text."""
    txt_mode: str = flag("line", choices=("line", "paragraph"))
    """``line``: one document per line; ``paragraph``: blank-line-separated paragraphs."""
    split: str | None = None
    """Split to read from a ``datasets.DatasetDict`` folder (default: ``train``)."""

    def __post_init__(self) -> None:
        if self.txt_mode not in ("line", "paragraph"):
            raise ValueError(f"txt_mode must be 'line' or 'paragraph', not {self.txt_mode!r}")


@dataclass(frozen=True)
class InputFile:
    path: str
    kind: str  # jsonl | beir | txt | parquet | hf
    label: str  # short name used in synthetic document ids


@dataclass(frozen=True)
class Unit:
    """A contiguous piece of one input: bytes [start, stop) or rows [start, stop)."""

    index: int
    path: str
    kind: str
    label: str
    start: int
    stop: int
    first_line: int  # 1-based line (text kinds) or 0-based row (row kinds) of the first record

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class UnitDocuments:
    ids: list[str]
    texts: list[str]
    rejects: list[dict[str, Any]]


def _kind_of(path: str) -> str | None:
    name = path.lower()
    if name.endswith(".jsonl.gz"):
        return "beir" if os.path.basename(name) == "corpus.jsonl.gz" else "jsonl"
    if os.path.basename(name) == "corpus.jsonl":
        return "beir"
    return TEXT_SUFFIXES.get(Path(name).suffix)


def expand_inputs(patterns: list[str]) -> list[InputFile]:
    """Resolve files, globs and folders into a sorted, de-duplicated input list."""
    found: list[tuple[str, str]] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            if any(
                os.path.exists(os.path.join(pattern, f))
                for f in ("dataset_info.json", "state.json", "dataset_dict.json")
            ):
                found.append((pattern, "hf"))
            elif os.path.exists(os.path.join(pattern, "corpus.jsonl")):
                found.append((os.path.join(pattern, "corpus.jsonl"), "beir"))
            else:
                raise InputError(
                    f"{pattern}: folder is neither a datasets folder nor BEIR; expected {SUPPORTED}"
                )
            continue
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise InputError(f"{pattern}: no file matches")
        for path in matches:
            kind = _kind_of(path)
            if kind is None:
                raise InputError(f"{path}: unsupported input format; expected {SUPPORTED}")
            found.append((path, kind))
    unique = sorted(dict.fromkeys(found))
    if not unique:
        raise InputError("no inputs given")
    parents = [os.path.dirname(os.path.abspath(p)) for p, _ in unique]
    root = os.path.commonpath(parents)
    return [InputFile(p, k, os.path.relpath(os.path.abspath(p), root)) for p, k in unique]


SAMPLE_BLOCK = 64 * 1024
SAMPLE_BLOCKS = 16


def input_signature(path: str) -> dict[str, Any]:
    """What a resumed run must find unchanged in an input: size, modification time (ns) and
    a content hash. The hash covers the whole file up to 1 MiB and 16 evenly spread 64 KiB
    blocks of a larger one, so it costs at most 1 MiB of reading per file however large the
    corpus. A folder (a ``datasets`` folder) is summed over its files."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
    digest = hashlib.sha256()
    size, mtime = 0, 0
    for f in files:
        st = f.stat()
        size += st.st_size
        mtime = max(mtime, st.st_mtime_ns)
        name = "" if f == root else f.relative_to(root).as_posix()
        digest.update(f"{name}\0{st.st_size}\0".encode())
        _sample_into(digest, f, st.st_size)
    return {"bytes": size, "mtime_ns": mtime, "sample_sha256": digest.hexdigest()}


def _sample_into(digest: Any, path: Path, size: int) -> None:
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCK * SAMPLE_BLOCKS:
            digest.update(f.read())
            return
        step = (size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
        for k in range(SAMPLE_BLOCKS):
            f.seek(k * step)
            digest.update(f.read(SAMPLE_BLOCK))


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def plan_units(
    inputs: list[InputFile], shard_bytes: int, opts: SourceOptions, on_error: str = "raise"
) -> tuple[list[Unit], list[dict[str, Any]]]:
    """Cut every input into units of about ``shard_bytes`` of input text.

    Returns the units and, with ``on_error="skip"``, rejects for files that cannot be read.
    """
    units: list[Unit] = []
    rejects: list[dict[str, Any]] = []
    for inp in inputs:
        try:
            if inp.kind in ("jsonl", "beir", "txt"):
                spans = _plan_text(
                    inp.path,
                    shard_bytes,
                    paragraphs=inp.kind == "txt" and opts.txt_mode == "paragraph",
                )
            elif inp.kind == "parquet":
                spans = _plan_parquet(inp.path, shard_bytes)
            else:
                spans = _plan_hf(inp.path, shard_bytes, opts)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            if on_error != "skip":
                raise InputError(f"{inp.path}: cannot read file: {exc}") from exc
            rejects.append({"file": inp.path, "line": None, "reason": f"cannot read file: {exc}"})
            continue
        for start, stop, first in spans:
            units.append(Unit(len(units), inp.path, inp.kind, inp.label, start, stop, first))
    return units, rejects


def _plan_text(path: str, shard_bytes: int, paragraphs: bool) -> list[tuple[int, int, int]]:
    spans = []
    start, offset, line_no, start_line = 0, 0, 0, 1
    with _open_binary(path) as f:
        for line in f:
            line_no += 1
            offset += len(line)
            if offset - start >= shard_bytes and (not paragraphs or not line.strip()):
                spans.append((start, offset, start_line))
                start, start_line = offset, line_no + 1
    if offset > start:
        spans.append((start, offset, start_line))
    return spans


def _plan_parquet(path: str, shard_bytes: int) -> list[tuple[int, int, int]]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    rows = meta.num_rows
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return _row_spans(rows, size, shard_bytes)


def _plan_hf(path: str, shard_bytes: int, opts: SourceOptions) -> list[tuple[int, int, int]]:
    ds = _load_hf(path, opts)
    return _row_spans(ds.num_rows, ds.data.nbytes, shard_bytes)


def _row_spans(rows: int, size: int, shard_bytes: int) -> list[tuple[int, int, int]]:
    per_unit = max(1, int(shard_bytes * rows / max(size, 1)))
    return [(s, min(s + per_unit, rows), s) for s in range(0, rows, per_unit)]


def _load_hf(path: str, opts: SourceOptions):
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        split = opts.split or "train"
        if split not in ds:
            raise InputError(f"{path}: split {split!r} not found (splits: {sorted(ds)})")
        ds = ds[split]
    return ds


def read_unit(unit: Unit, opts: SourceOptions, on_error: str = "raise") -> UnitDocuments:
    """Read the documents of one unit. Raises InputError naming file and line on bad input,
    unless ``on_error == "skip"``, in which case the bad record is skipped and reported."""
    docs = UnitDocuments([], [], [])

    def reject(where: int | None, reason: str, unit_kind: str = "line") -> None:
        if on_error != "skip":
            loc = f"{unit.path}:{where}" if unit_kind == "line" else f"{unit.path}: row {where}"
            raise InputError(f"{loc}: {reason}")
        docs.rejects.append({"file": unit.path, unit_kind: where, "reason": reason})

    if unit.kind in ("parquet", "hf"):
        _read_rows(unit, opts, docs, reject)
        return docs
    try:
        with _open_binary(unit.path) as f:
            f.seek(unit.start)
            data = f.read(unit.stop - unit.start)
    except (OSError, EOFError) as exc:
        raise InputError(f"{unit.path}: cannot read file: {exc}") from exc
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if unit.kind == "txt":
        _read_txt(unit, opts, lines, docs, reject)
    else:
        _read_jsonl(unit, opts, lines, docs, reject)
    return docs


def _decode(raw: bytes, line_no: int, reject) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reject(line_no, invalid_utf8(raw, exc))
        return None


def invalid_utf8(raw: bytes, exc: UnicodeDecodeError) -> str:
    """The reason for a line that is not UTF-8: the first bad byte and its 1-based column in
    characters (everything before it decodes), so an editor finds it."""
    column = len(raw[: exc.start].decode("utf-8")) + 1
    return f"invalid UTF-8 (byte 0x{raw[exc.start]:02x} at column {column})"


def text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its line break) of a UTF-8 text file (``.gz``
    too). Read as bytes and decoded line by line: text-mode reading decodes 8 KiB blocks and
    reports a bad byte by its offset in a block, naming neither the file nor the line; here it
    is an InputError ``path:line: invalid UTF-8 (byte 0xNN at column N)``."""
    with _open_binary(str(path)) as f:
        for line_no, raw in enumerate(f, start=1):
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{line_no}: {invalid_utf8(raw, exc)}") from None


def _read_txt(
    unit: Unit, opts: SourceOptions, lines: list[bytes], docs: UnitDocuments, reject
) -> None:
    para: list[str] = []
    para_line = 0
    for i, raw in enumerate(lines):
        line_no = unit.first_line + i
        text = _decode(raw.rstrip(b"\r"), line_no, reject)
        if text is None:
            continue
        if opts.txt_mode == "line":
            docs.ids.append(f"{unit.label}:{line_no}")
            docs.texts.append(text)
        elif text.strip():
            if not para:
                para_line = line_no
            para.append(text)
        elif para:
            docs.ids.append(f"{unit.label}:{para_line}")
            docs.texts.append("\n".join(para))
            para = []
    if para:
        docs.ids.append(f"{unit.label}:{para_line}")
        docs.texts.append("\n".join(para))


def _read_jsonl(
    unit: Unit, opts: SourceOptions, lines: list[bytes], docs: UnitDocuments, reject
) -> None:
    title_field = opts.title_field or ("title" if unit.kind == "beir" else None)
    for i, raw in enumerate(lines):
        line_no = unit.first_line + i
        if not raw.strip():
            continue  # blank separator lines are not documents
        text = _decode(raw, line_no, reject)
        if text is None:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            reject(line_no, f"malformed JSON: {exc.msg} at column {exc.colno}")
            continue
        doc = _document_from_record(record, opts, title_field)
        if isinstance(doc, str):
            reject(line_no, doc)
            continue
        doc_id, body = doc
        docs.ids.append(doc_id if doc_id is not None else f"{unit.label}:{line_no}")
        docs.texts.append(body)


def _document_from_record(record: Any, opts: SourceOptions, title_field: str | None):
    """(id or None, text) from a JSON object / row, or an error string."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    if opts.text_field not in record:
        return f"missing text field {opts.text_field!r}"
    body = record[opts.text_field]
    if not isinstance(body, str):
        return f"text field {opts.text_field!r} is {type(body).__name__}, not a string"
    if title_field:
        title = record.get(title_field)
        if title is not None and not isinstance(title, str):
            return f"title field {title_field!r} is {type(title).__name__}, not a string"
        if title:
            body = f"{title}{opts.title_sep}{body}" if body else title
    id_field = opts.id_field or next((k for k in ("_id", "id") if k in record), None)
    doc_id = None
    if id_field is not None:
        if id_field not in record:
            return f"missing id field {id_field!r}"
        doc_id = str(record[id_field])
    return doc_id, body


def _read_rows(unit: Unit, opts: SourceOptions, docs: UnitDocuments, reject) -> None:
    if unit.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(unit.path, memory_map=True).slice(unit.start, unit.stop - unit.start)
    else:
        table = _load_hf(unit.path, opts).data.table.slice(unit.start, unit.stop - unit.start)
    names = table.column_names
    wanted = [f for f in (opts.text_field, opts.title_field, opts.id_field) if f]
    missing = [f for f in wanted if f not in names]
    if missing:
        raise InputError(f"{unit.path}: column(s) {missing} not found (columns: {names})")
    id_field = opts.id_field or next((k for k in ("_id", "id") if k in names), None)
    keep = [f for f in dict.fromkeys([opts.text_field, opts.title_field, id_field]) if f]
    columns = {name: table.column(name).to_pylist() for name in keep}
    for i in range(table.num_rows):
        row = unit.start + i
        record = {name: values[i] for name, values in columns.items()}
        if record.get(opts.text_field) is None:
            reject(row, f"text field {opts.text_field!r} is null", "row")
            continue
        doc = _document_from_record(record, opts, opts.title_field)
        if isinstance(doc, str):
            reject(row, doc, "row")
            continue
        doc_id, body = doc
        docs.ids.append(doc_id if doc_id is not None else f"{unit.label}:{row}")
        docs.texts.append(body)


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
