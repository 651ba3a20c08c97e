"""The README's main job (`retromae-ds demo`) and the small CLI commands, run for real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from retromae_ds.cli import parse_size
from retromae_ds.data.builtin_corpus import iter_documents

REPO = Path(__file__).resolve().parents[1]


def test_builtin_corpus_is_deterministic_and_has_unique_ids():
    first = list(iter_documents(max_docs=500))
    assert first == list(iter_documents(max_docs=500))
    assert len({d["_id"] for d in first}) == len(first) == 500
    assert all(d["text"].strip() for d in first)


def test_demo_runs_end_to_end(tmp_path):
    """The README's main job, shortened (1,500 documents, 10 steps): every stage runs."""
    result = subprocess.run(
        [sys.executable, "-m", "retromae_ds.cli", "demo", "--out", str(tmp_path)]
        + ["--max-docs", "1500", "--steps", "10"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "preprocess: 1,500 documents" in result.stdout
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["counts"]["documents"] == 1500 and len(manifest["shards"]) >= 1
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["steps"] == 10 and summary["last"]["step"] == 10
    rows = {(r["task"], r["encoder"]): r for r in summary["results"]}
    assert {e for _, e in rows} == {"untrained", "RetroMAE"}
    assert all(0.0 <= r["ndcg@10"] <= 1.0 for r in rows.values())
    assert (tmp_path / "encoder" / "model.safetensors").is_file()
    assert "| task | encoder | nDCG@10" in (tmp_path / "results.md").read_text()
    inspect = subprocess.run(
        [sys.executable, "-m", "retromae_ds.cli", "inspect", str(tmp_path / "shards"), "--verify"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["samples"] == manifest["counts"]["rows"]


def test_builtin_retrieval_task_holds_queries_out_of_the_corpus():
    from retromae_ds.data.builtin_corpus import split_for_retrieval

    records = list(iter_documents(max_docs=3000))
    corpus, queries, qrels = split_for_retrieval(records, every=8)
    assert len(corpus) == len(records) and len(queries) == len(qrels) > 10
    text_of = {d["_id"]: d["text"] for d in corpus}
    for query, (qid, did) in zip(queries, qrels, strict=True):
        assert query["_id"] == qid and query["text"] not in text_of[did]


def test_parse_size():
    assert parse_size("64MB") == 64 * 2**20
    assert parse_size("512KiB") == 512 * 2**10
    assert parse_size("1g") == 2**30
    assert parse_size("1000") == 1000
