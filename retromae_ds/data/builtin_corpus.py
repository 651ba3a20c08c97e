"""The built-in default corpus: text every Python installation carries.

Docstrings of the standard library's modules, classes and functions (read with ``ast``, never
imported, so nothing runs) and the ``pydoc_data`` help topics. It lets the main job and the
tests run offline on any machine without shipping anyone's text in this repository. The
corpus depends on the Python version, so a run records its own copy.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from pathlib import Path


def iter_documents(max_docs: int | None = None):
    """Yield ``{"_id", "title", "text"}`` records in a deterministic order."""
    count = 0
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield {"_id": f"pydoc:{name}", "title": name, "text": text}
            count += 1
            if max_docs is not None and count >= max_docs:
                return
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/idle_test/")) or "/test" in rel:
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        module = rel.removesuffix(".py").replace("/", ".")
        for node in ast.walk(tree):
            if not isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                continue
            doc = ast.get_docstring(node, clean=True)
            if not doc or len(doc) < 40:
                continue
            name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
            line = getattr(node, "lineno", 1)
            yield {"_id": f"{module}:{line}", "title": name, "text": doc}
            count += 1
            if max_docs is not None and count >= max_docs:
                return


def write_corpus(path: str | os.PathLike, max_docs: int | None = None) -> int:
    """Write the corpus as JSONL (atomically); returns the number of documents."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for record in iter_documents(max_docs):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def split_for_retrieval(
    records: list[dict], every: int = 20, min_body: int = 200
) -> tuple[list[dict], list[dict], list[tuple[str, str]]]:
    """A small retrieval task made from the built-in corpus, BEIR-style.

    Every ``every``-th document whose docstring has a one-line summary and a body of at least
    ``min_body`` characters becomes a query (the summary line); its body stays in the corpus as
    the one relevant passage. Returns (corpus, queries, qrels); the corpus holds every
    document, with the query documents' summary lines removed, so pre-training on it never sees
    a query.
    """
    corpus, queries, qrels = [], [], []
    candidates = 0
    for record in records:
        summary, _, body = record["text"].partition("\n")
        body = body.strip()
        if record["_id"].startswith("pydoc:") or len(body) < min_body or len(summary) < 20:
            corpus.append(record)
            continue
        candidates += 1
        if candidates % every:
            corpus.append(record)
            continue
        corpus.append({**record, "text": body})
        queries.append({"_id": f"q-{record['_id']}", "text": summary.strip()})
        qrels.append((f"q-{record['_id']}", record["_id"]))
    return corpus, queries, qrels


def write_beir(
    folder: str | os.PathLike, corpus: list[dict], queries: list[dict], qrels, train_qrels=()
) -> Path:
    """Write a BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv and, with
    ``train_qrels``, qrels/train.tsv); each file appears complete or not at all."""
    folder = Path(folder)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    files = {"corpus.jsonl": corpus, "queries.jsonl": queries}
    for name, rows in files.items():
        tmp = folder / (name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, folder / name)
    for split, pairs in (("test", qrels), ("train", train_qrels)):
        if split == "train" and not pairs:
            continue
        tmp = folder / "qrels" / f"{split}.tsv.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            for qid, did in pairs:
                f.write(f"{qid}\t{did}\t1\n")
        os.replace(tmp, folder / "qrels" / f"{split}.tsv")
    return folder
