"""Fine-tuning data: a BEIR split tokenized once into shards, and batches of token ids.

``prepare(beir_dir, split, tokenizer_dir, out)`` writes ``out/corpus`` and ``out/queries``
with the preprocessing tool (the shard format of pre-training: memory-mapped, resumable, with
the tokenizer fingerprint), passages cut at ``p_max_len`` and queries at ``q_max_len`` tokens
(special tokens included; a passage is the first chunk of its document, i.e. truncated as
dense retrievers do). ``load(out)`` returns a ``TrainingSet``: the passage
table (one passage per non-empty document, in corpus order), the split's queries that have
at least one positive, and every positive (relevance > 0) of each as passage indices.
``token_batch`` turns shard rows into ``[CLS] ids [SEP]`` tensors.

The BEIR files a folder is prepared from (the corpus, the queries and the split's qrels) are
fingerprinted by their sha256 in ``READY``. A later ``prepare`` of the folder (every start of
the run, a resume, another run reusing ``data.prepared``) hashes them again and refuses, naming
them, files that changed since: the tokenized corpus and queries would otherwise be trained
with the edited qrels. ``load``, which reads the qrels themselves, checks their hash too.
Hashing reads the files once per start: 0.66 s for 512 MB on one core here (MS MARCO's
3 GB corpus: about 4 s).

``READY`` records the tokenizer by its fingerprint (class, vocabulary hash, special ids), not
its path: a run initialised from a pre-training run folder resolves to that run's newest
checkpoint, which changes when the run goes on, and the tokens do not. A mismatch is one line
naming the settings that differ. An unfinished folder (no ``READY``: a run stopped, or refused
an input, while tokenizing) is resumed when ``PREPARING`` records the same settings and BEIR
files, else tokenized again: a fixed input file and a rerun are enough.

``load`` (the trainer's and the refresher's only way in) checks every corpus and queries shard
against its manifest (sha256, and token ids against the vocabulary) before a row is read, so
the trainer never trains on, and a refresher never encodes nor caches (its embedding cache is
keyed by the manifest's sha256), bytes that changed since tokenization; a bad shard is one
line naming it and saying how to make the folder again. Cost, per start of each process
(``benchmarks/bench_data_check.py``, docs/benchmarks.md): 8 ms of a 14 ms ``load`` for
SciFact's prepared corpus and queries (9 MB), about 0.6 s per GB on 2 cores here (sha256 and
the id range; shards are read in up to 8 threads).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from retromae_ds.base.fsutil import atomic_write_text, sha256_file
from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.data import schema
from retromae_ds.data.dataset import ShardDataset

READY = "READY"
FINGERPRINT = "beir_sha256"
"""``READY``'s record of the BEIR files' sha256: ``{path relative to the folder: digest}``."""
PREPARING = "PREPARING"
"""What an unfinished folder was started with (``READY``'s record): resumed only with that."""
PREPROCESS_NAMES = {"plan.json", "manifest.json", "rejects.jsonl", "shards", "tokenizer", "tasks"}
PREPROCESS_TEMPORARIES = ("tokenizer.tmp-", "backend.tmp-", ".")
"""What the preprocessing tool writes into its output folder (temporaries by prefix)."""


def beir_files(split: str) -> list[str]:
    """The files of a BEIR folder that a prepared folder is made from."""
    return ["corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv"]


def beir_fingerprint(beir_dir: str | Path, split: str) -> dict[str, str]:
    """``{file: sha256}`` of the BEIR files the split's training data is made from."""
    fingerprint = {}
    for rel in beir_files(split):
        path = Path(beir_dir) / rel
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (expected a BEIR dataset folder)")
        fingerprint[rel] = sha256_file(path)
    return fingerprint


def changed_files(beir_dir: str | Path, recorded: dict[str, str]) -> list[str]:
    """The files of ``recorded`` whose sha256 is not the one recorded (or that are gone)."""
    changed = []
    for rel, digest in recorded.items():
        path = Path(beir_dir) / rel
        if not path.is_file():
            changed.append(f"{rel} (missing)")
        elif sha256_file(path) != digest:
            changed.append(rel)
    return changed


def _refuse_changed(beir_dir: str | Path, out: Path, changed: list[str]) -> ValueError:
    return ValueError(
        f"{beir_dir}: changed since {out} was tokenized from it ({out / READY} records the "
        f"sha256 of its files): {', '.join(changed)}; resuming would train the tokenized old "
        "corpus and queries with the new qrels: restore those files, or train on the new "
        "ones in a new run (another --run_dir, or another data.prepared)"
    )


@dataclass
class TrainingSet:
    corpus: ShardDataset
    passage_rows: np.ndarray  # int64 [P]: shard row of passage p
    passage_ids: pa.ChunkedArray  # [P] BEIR document ids (Arrow strings; .to_pylist())
    queries: ShardDataset
    query_rows: np.ndarray  # int64 [Q]: shard row of training query q
    query_ids: list[str]  # [Q]
    positives: list[np.ndarray]  # [Q] passage indices with relevance > 0
    special: SpecialIds

    @property
    def num_passages(self) -> int:
        return len(self.passage_rows)

    @property
    def num_queries(self) -> int:
        return len(self.query_rows)

    def fingerprint(self) -> dict:
        """What a negatives file refers to: the same passages and queries, in this order."""
        return {
            "num_passages": self.num_passages,
            "num_queries": self.num_queries,
            "corpus_shards_sha256": [s["sha256"] for s in self.corpus.manifest["shards"]],
            "queries_shards_sha256": [s["sha256"] for s in self.queries.manifest["shards"]],
        }


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> dict[str, Any]:
    """The fingerprint (class, vocabulary hash, special ids: ``data.tokenizer.fingerprint``)
    of the tokenizer in ``tokenizer_dir``, the initial encoder's folder, which must hold the
    model's own (``load_tokenizer_checked``, else a ``ValueError`` naming it)."""
    from retromae_ds.data.tokenizer import fingerprint
    from retromae_ds.hf.util import load_tokenizer_checked

    return fingerprint(load_tokenizer_checked(tokenizer_dir))


def prepare(
    beir_dir: str | Path,
    split: str,
    tokenizer_dir: str | Path,
    out: str | Path,
    *,
    q_max_len: int,
    p_max_len: int,
    workers: int = 1,
    progress: bool = True,
    tokenizer: dict[str, Any] | None = None,
) -> Path:
    """Tokenize the corpus and the split's queries into ``out`` (skipped when already done:
    ``READY``). ``tokenizer_dir`` (the initial encoder's folder) must hold the model's own
    tokenizer (``load_tokenizer_checked``), else a ``ValueError`` naming it; ``tokenizer``,
    its ``tokenizer_fingerprint`` when the caller has it already. An unfinished
    ``out`` (no ``READY``) is resumed when it was started with these settings and inputs, else
    started over."""
    from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
    from retromae_ds.retrieval.beir import load_qrels, load_queries

    out = Path(out)
    settings = {
        "beir": str(Path(beir_dir).resolve()),
        "split": split,
        "tokenizer": tokenizer or tokenizer_fingerprint(tokenizer_dir),
        "q_max_len": q_max_len,
        "p_max_len": p_max_len,
    }
    if (out / READY).is_file():
        return _check_ready(out, settings, beir_dir, split)
    beir_dir = Path(beir_dir)
    qrels = load_qrels(beir_dir / "qrels" / f"{split}.tsv")
    queries = load_queries(beir_dir / "queries.jsonl")
    missing = [q for q in qrels if q not in queries]
    if missing:
        raise ValueError(f"{beir_dir}: {len(missing)} {split} qrels queries are missing")
    record = {**settings, FINGERPRINT: beir_fingerprint(beir_dir, split)}  # before tokenizing
    _start_over_unless_resumable(out, record)
    query_file = out / f"queries.{split}.jsonl"
    atomic_write_text(
        query_file, "".join(json.dumps({"_id": q, "text": queries[q]}) + "\n" for q in qrels)
    )
    for name, inputs, length in (
        ("corpus", [str(beir_dir / "corpus.jsonl")], p_max_len),
        ("queries", [str(query_file)], q_max_len),
    ):
        run_preprocess(
            PreprocessConfig(
                inputs=inputs,
                out=str(out / name),
                tokenizer=str(tokenizer_dir),
                max_length=length,
                workers=workers,
                progress=progress,
            )
        )
    atomic_write_text(out / READY, json.dumps(record))
    (out / PREPARING).unlink(missing_ok=True)
    return out


def _check_ready(out: Path, settings: dict[str, Any], beir_dir: str | Path, split: str) -> Path:
    """``out`` is prepared: refuse, in one line naming what differs, settings other than
    ``settings`` or BEIR files changed since; an older ``READY`` (the tokenizer's path, no
    fingerprint of the BEIR files) is brought up to date."""
    done = json.loads((out / READY).read_text())
    recorded = done.pop(FINGERPRINT, None)
    upgrade = recorded is None or not isinstance(done.get("tokenizer"), dict)
    if not isinstance(done.get("tokenizer"), dict):
        # an older READY records the tokenizer's path: the shards record what counts
        done["tokenizer"] = _shards_tokenizer(out)
    differs = _settings_differ(done, settings)
    if differs:
        raise ValueError(
            f"{out}: tokenized with other settings than this run's ({'; '.join(differs)}); "
            "the run's checkpoints and negatives refer to that data: keep those settings, "
            "or train with these in a new run (another --run_dir, or another data.prepared)"
        )
    if recorded is None:  # prepared before the files were fingerprinted
        print(
            f"{out}: {READY} records no fingerprint of {beir_dir} (prepared by an older "
            "version): recording it now, so that a later change is caught",
            file=sys.stderr,
            flush=True,
        )
        recorded = beir_fingerprint(beir_dir, split)
    else:
        changed = changed_files(beir_dir, recorded)
        if changed:
            raise _refuse_changed(beir_dir, out, changed)
    if upgrade:
        atomic_write_text(out / READY, json.dumps({**settings, FINGERPRINT: recorded}))
    return out


def _shards_tokenizer(out: Path) -> dict[str, Any]:
    """The tokenizer fingerprint ``out``'s corpus shards were made with (their manifest)."""
    manifest = out / "corpus" / schema.MANIFEST_NAME
    try:
        return json.loads(manifest.read_text(encoding="utf-8"))["tokenizer"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"{manifest}: unreadable ({exc}) though {out / READY} says the folder is prepared; "
            f"remove {out} to tokenize the BEIR files again"
        ) from None


def _settings_differ(done: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """What differs between the settings a folder was prepared with and ``settings``, one
    readable phrase each (the tokenizer by the parts of its fingerprint that differ)."""
    differs = []
    for key, wanted in settings.items():
        had = done.get(key)
        if had == wanted:
            continue
        if key == "tokenizer":
            parts = [k for k in sorted({*had, *wanted}) if had.get(k) != wanted.get(k)]
            differs.append(f"the tokenizer: its {', '.join(parts)} differ")
        else:
            differs.append(f"{key} {had!r}, this run {wanted!r}")
    return differs


def _start_over_unless_resumable(out: Path, record: dict[str, Any]) -> None:
    """An unfinished ``out`` (no ``READY``: a run stopped or refused while tokenizing) is
    resumed when ``PREPARING`` records the same settings and BEIR files (the preprocessing
    tool keeps its finished shards); else what an earlier attempt wrote is removed, saying so,
    and tokenized again (a fixed input file, other settings). A folder there that this module
    did not write is named, never removed. Records the attempt in ``PREPARING``."""
    marker = out / PREPARING
    try:
        started = json.loads(marker.read_text()) if marker.is_file() else None
    except (OSError, ValueError):
        started = None
    if started != record:
        written = [out / "corpus", out / "queries", *out.glob("queries.*.jsonl")]
        written = [p for p in written if p.exists() or p.is_symlink()]
        for path in written:
            if path.is_dir() and not _preprocess_output(path):
                raise ValueError(
                    f"{path}: not a folder this tool tokenized, in {out}, which is not "
                    f"prepared (no {READY}); move it away, or use another data.prepared"
                )
        if written:
            print(
                f"{out}: an unfinished preparation with other inputs or settings (or of an "
                "older version): tokenizing again",
                file=sys.stderr,
                flush=True,
            )
        for path in written:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps(record))


def _preprocess_output(folder: Path) -> bool:
    """Whether ``folder`` holds only what the preprocessing tool writes (or nothing)."""
    names = [p.name for p in folder.iterdir()]
    return all(n in PREPROCESS_NAMES or n.startswith(PREPROCESS_TEMPORARIES) for n in names)


def _first_chunks(ds: ShardDataset) -> tuple[np.ndarray, pa.ChunkedArray]:
    """(shard rows, document ids: Arrow strings, a chunk per shard) of every document's first
    chunk, in shard order. The ids stay in Arrow: about 30 bytes a passage with its row,
    where a list of Python strings and a dict over it cost about 90 (measured at 1M in
    docs/ance.md)."""
    rows, ids = [], []
    start = 0
    for meta in ds.manifest["shards"]:
        with pa.memory_map(str(ds.folder / meta["file"])) as source:
            table = pa.ipc.open_file(source).read_all()
        chunk = table.column(schema.CHUNK_INDEX).to_numpy()
        first = np.flatnonzero(chunk == 0)
        rows.append(first + start)
        # a copy (take), so nothing keeps the memory-mapped shard alive
        ids += table.column(schema.DOC_ID).take(pa.array(first)).chunks
        start += meta["rows"]
    if ds.packed:
        raise ValueError(f"{ds.folder}: packed shards cannot serve as passages")
    return (
        (np.concatenate(rows) if rows else np.zeros(0, np.int64)).astype(np.int64),
        pa.chunked_array(ids, type=pa.string()),
    )


def _rows_of(ids: pa.ChunkedArray, wanted: set[str]) -> dict[str, int]:
    """{id: its row in ``ids``} for the ``wanted`` ids found there (the last row of an id
    that repeats), without a Python object per row of ``ids``."""
    if not wanted:
        return {}
    values = sorted(wanted)
    where = pc.index_in(ids, value_set=pa.array(values, pa.string()))
    where_N = where.fill_null(-1).to_numpy(zero_copy_only=False)
    found = np.flatnonzero(where_N >= 0)
    return {values[int(where_N[i])]: int(i) for i in found}


def load(prepared: str | Path) -> TrainingSet:
    """The training set of a folder written by ``prepare`` (qrels are read from the BEIR
    folder it was prepared from)."""
    from retromae_ds.retrieval.beir import load_qrels

    prepared = Path(prepared)
    if not (prepared / READY).is_file():
        raise FileNotFoundError(f"{prepared}: not a prepared fine-tuning data folder")
    settings = json.loads((prepared / READY).read_text())
    beir_dir, split = settings["beir"], settings["split"]
    qrels_file = f"qrels/{split}.tsv"
    recorded = settings.get(FINGERPRINT, {})
    if qrels_file in recorded:  # read here, live: the qrels must be those tokenized with
        changed = changed_files(beir_dir, {qrels_file: recorded[qrels_file]})
        if changed:
            raise _refuse_changed(beir_dir, prepared, changed)
    corpus = _verified(prepared, "corpus")
    queries = _verified(prepared, "queries")
    if corpus.manifest["tokenizer"] != queries.manifest["tokenizer"]:
        raise ValueError(f"{prepared}: corpus and queries were tokenized differently")
    passage_rows, passage_ids = _first_chunks(corpus)
    query_rows_all, query_id_array = _first_chunks(queries)
    query_ids_all = query_id_array.to_pylist()
    qrels = load_qrels(Path(beir_dir) / "qrels" / f"{split}.tsv")
    judged = {d for q in query_ids_all for d, rel in qrels.get(q, {}).items() if rel > 0}
    passage_of = _rows_of(passage_ids, judged)
    query_rows, query_ids, positives = [], [], []
    for row, qid in zip(query_rows_all.tolist(), query_ids_all, strict=True):
        pos = sorted(
            {passage_of[d] for d, rel in qrels.get(qid, {}).items() if rel > 0 and d in passage_of}
        )
        if pos:  # a query without a positive passage cannot be trained on
            query_rows.append(row)
            query_ids.append(qid)
            positives.append(np.asarray(pos, dtype=np.int64))
    if not query_rows:
        raise ValueError(f"{prepared}: no {split} query has a positive passage in the corpus")
    return TrainingSet(
        corpus=corpus,
        passage_rows=passage_rows,
        passage_ids=passage_ids,
        queries=queries,
        query_rows=np.asarray(query_rows, dtype=np.int64),
        query_ids=query_ids,
        positives=positives,
        special=SpecialIds.from_fingerprint(corpus.manifest["tokenizer"]),
    )


def _verified(prepared: Path, name: str) -> ShardDataset:
    """``prepared/name``'s shards, each checked against its manifest (sha256, token ids)
    before anything reads a row: a refused folder is made again from the BEIR files."""
    ds = ShardDataset(prepared / name)
    problem = ds.shards_problem()
    if problem is not None:
        raise ValueError(
            f"{problem}; {prepared} is tokenized again from the BEIR files {READY} records "
            f"(their sha256 is checked): remove {prepared} and rerun finetune (a resume "
            "goes on from its checkpoint, on the same tokens)"
        )
    return ds


def token_batch(
    ds: ShardDataset, rows: np.ndarray, special: SpecialIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids_BL, attention_mask_BL)`` int64: ``[CLS] row [SEP]`` right-padded."""
    batch = ds.get_batch(rows)
    lengths = batch.lengths
    width = int(lengths.max(initial=0)) + 2
    ids = np.full((len(lengths), width), special.pad, dtype=np.int64)
    ids[:, 0] = special.cls
    body = (np.arange(width) >= 1) & (np.arange(width) <= lengths[:, None])
    ids[body] = batch.input_ids
    ids[np.arange(len(lengths)), lengths + 1] = special.sep
    mask = np.arange(width) < (lengths[:, None] + 2)
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))
