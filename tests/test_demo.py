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
    """The README's main job, shortened (1,500 documents, 2 seeds, 10 + 4 steps): every
    objective and stage runs, the report has the table, verdicts and plot, and ``--beir``
    evaluates every encoder on another collection too."""
    from retromae_ds.data.builtin_corpus import split_for_retrieval, write_beir

    extra = write_beir(tmp_path / "extra", *split_for_retrieval(list(iter_documents(400)), 4))
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "retromae_ds.cli", "demo", "--out", str(out), "--max-docs"]
    cmd += ["1500", "--steps", "10", "--finetune-steps", "4", "--seeds", "0", "1"]
    result = subprocess.run(
        cmd + ["--beir", str(extra)], capture_output=True, text=True, cwd=REPO, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "built-in task: 1,500 documents" in result.stdout
    manifest = json.loads((out / "shards_scratch" / "manifest.json").read_text())
    assert manifest["counts"]["documents"] == 1500
    summary = json.loads((out / "study_results.json").read_text())
    cells = {(r["task"], r["objective"], r["stage"], r["seed"]) for r in summary["rows"]}
    assert cells == {
        (t, o, s, seed)
        for t in ("builtin", "extra")
        for o in ("none", "mlm", "retromae", "seed")
        for s in ("zero_shot", "bm25")
        for seed in (0, 1)
    }
    assert all(0.0 <= r["metrics"]["ndcg@10"] <= 1.0 for r in summary["rows"])
    assert {(p["objective"], p["steps"]) for p in summary["pretraining"]} == {
        ("mlm", 10), ("retromae", 10), ("seed", 10)
    }  # fmt: skip
    report = (out / "study.md").read_text()
    assert "| builtin | scratch | retromae | zero_shot | 2 |" in report
    assert (
        "builtin, scratch, zero_shot: retromae " in report and "(paper: retromae > mlm)" in report
    )
    assert report in result.stdout
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG"
    encoder = out / "cells" / "scratch" / "retromae" / "seed0" / "encoder"
    assert (encoder / "model.safetensors").is_file()
    inspect = subprocess.run(
        [
            sys.executable,
            "-m",
            "retromae_ds.cli",
            "inspect",
            str(out / "shards_scratch"),
            "--verify",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["samples"] == manifest["counts"]["rows"]
    # a rerun finds every cell finished and only rewrites the report
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "study_results.json").read_text())["rows"] == [
        r for r in summary["rows"] if r["task"] == "builtin"
    ]


def test_builtin_task_splits_queries_into_train_and_test(tmp_path):
    from recipes.demo import builtin_task
    from retromae_ds.eval.beir import load_beir

    folder = builtin_task(tmp_path / "builtin", max_docs=3000)
    train, test = load_beir(folder, "train"), load_beir(folder, "test")
    assert len(test.qrels) > 20 and len(train.qrels) > len(test.qrels)
    assert not set(train.qrels) & set(test.qrels)


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
