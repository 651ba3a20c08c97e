"""The README's main job (`retromae-ds demo`) and the small CLI commands, run for real."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from retromae_ds.base.config import parse_size
from retromae_ds.data.builtin_corpus import iter_documents

REPO = Path(__file__).resolve().parents[1]


def test_builtin_corpus_is_deterministic_and_has_unique_ids():
    first = list(iter_documents(max_docs=500))
    assert first == list(iter_documents(max_docs=500))
    assert len({d["_id"] for d in first}) == len(first) == 500
    assert all(d["text"].strip() for d in first)


def test_demo_runs_end_to_end(tmp_path):
    """The README's main job, shortened (1,500 documents, 1 seed, a 10-step MLM base, 4-step
    continuations, 4 fine-tuning steps): the base is trained once and every arm continues it,
    every objective of the demo, stage and pooling runs, BM25 is the reference row, the report has the
    table, verdicts, the bar plot and the zero-shot curve, and ``--beir`` evaluates every
    encoder on another collection too."""
    from retromae_ds.data.builtin_corpus import split_for_retrieval, write_beir
    from retromae_recipes.study_config import DEMO

    extra = write_beir(tmp_path / "extra", *split_for_retrieval(list(iter_documents(400)), 4))
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "retromae_ds.cli", "demo", "--out", str(out), "--max_docs"]
    cmd += ["1500", "--base_steps", "10", "--steps", "4", "--finetune_steps", "4"]
    cmd += ["--seeds", "0"]  # the demo's objectives: none, mlm, retromae (seeds: test_study)
    result = subprocess.run(
        cmd + ["--beir", str(extra)], capture_output=True, text=True, cwd=REPO, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "built-in task: 1,500 documents" in result.stdout
    manifest = json.loads((out / "shards_scratch" / "manifest.json").read_text())
    assert manifest["counts"]["documents"] == 1500
    summary = json.loads((out / "study_results.json").read_text())
    dense = [r for r in summary["rows"] if r["start"] == "bert"]
    cells = {(r["task"], r["objective"], r["stage"], r["pooling"], r["seed"]) for r in dense}
    assert cells == {
        (t, o, s, p, seed)
        for t in ("builtin", "extra")
        for o in ("none", "mlm", "retromae")
        for s in ("zero_shot", "bm25")
        for p in ("cls", "mean")
        for seed in (0,)
    }
    bm25 = [r for r in summary["rows"] if r["start"] == "lexical"]
    assert {r["task"] for r in bm25} == {"builtin", "extra"}
    assert all(r["metrics"]["ndcg@10"] > 0.2 for r in bm25)  # a real lexical baseline
    assert all(0.0 <= r["metrics"]["ndcg@10"] <= 1.0 for r in summary["rows"])
    steps = {(p["objective"], p["seed"], p["steps"]) for p in summary["pretraining"]}
    assert steps == {("base", 0, 10)} | {(o, seed, 4) for o in ("mlm", "retromae") for seed in (0,)}
    # one base, trained once, and every arm continued it (its run, MLM head included)
    base_run = out / "cells" / "bert" / "base" / "seed0" / "pretrain"
    assert len(list((out / "cells" / "bert").glob("base/seed*/pretrain.log"))) == 1
    for config in (out / "cells" / "bert").glob("*/seed*/pretrain_config.json"):
        if "base" not in config.parts:
            assert json.loads(config.read_text())["model"]["encoder"]["name"] == str(base_run)
    # the curve: evaluations logged during pre-training, with the tokens seen
    every = max(1, 4 // DEMO.curve_points)  # curve_every of the 4-step continuations
    for p in summary["pretraining"]:
        points = list(range(0, p["steps"] + 1, every))
        points += [] if p["steps"] % every == 0 else [p["steps"]]
        assert [c["step"] for c in p["curve"]] == points
        assert p["curve"][-1]["tokens_seen"] == p["tokens_seen"] > 0
    report = (out / "study.md").read_text()
    assert "| builtin | bert | retromae | zero_shot | cls | 1 |" in report
    assert "| builtin | — | BM25 |" in report
    assert "builtin, bert, zero_shot: retromae " in report and "(paper: retromae > mlm)" in report
    assert "(RetroMAE report: continued pre-training lifts an MLM base: retromae > none)" in report
    assert report in result.stdout
    assert str(out / "study_curve.png") in result.stdout
    for png in ("study.png", "study_curve.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    encoder = out / "cells" / "bert" / "retromae" / "seed0" / "encoder"
    assert (encoder / "model.safetensors").is_file()
    inspect = subprocess.run(
        [sys.executable, "-m", "retromae_ds.cli", "inspect", str(out / "shards_scratch"),
         "--verify"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["samples"] == manifest["counts"]["rows"]
    # a rerun finds every cell finished (the base too) and only rewrites the report
    base_mtime = (base_run / "metrics.jsonl").stat().st_mtime_ns
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (base_run / "metrics.jsonl").stat().st_mtime_ns == base_mtime
    assert json.loads((out / "study_results.json").read_text())["rows"] == [
        r for r in summary["rows"] if r["task"] == "builtin"
    ]
    # the knob table (scripts/knobs.py) continues this base, one knob changed per run (what
    # each knob changes in the config: tests/test_recipes.py, without running)
    knobs = tmp_path / "knobs"
    kcmd = [sys.executable, "scripts/knobs.py", "--study", str(out), "--out", str(knobs)]
    kcmd += ["--steps", "4", "--every", "2", "--target", "0", "--jobs", "2"]
    kcmd += ["--rates", "--rate_steps", "3"]
    kcmd += ["--knobs", "reference", "shard_length=64"]
    ran = subprocess.run(kcmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    configs = {
        name: json.loads((knobs / "runs" / f"{name}_config.json").read_text())
        for name in ("reference", "shard_length_64")
    }
    ref = configs["reference"]
    assert ref["model"]["objective"]["name"] == "retromae"
    assert ref["model"]["encoder"]["name"] == str(base_run)
    assert configs["shard_length_64"]["optim"] == ref["optim"]
    cut = json.loads(
        Path(configs["shard_length_64"]["data"]["shards"], "manifest.json").read_text()
    )
    assert cut["max_length"] == 64 and cut["counts"]["documents"] == 1500
    results = {r["knob"]: r for r in json.loads((knobs / "knobs.json").read_text())}
    assert set(results) == {"reference", "shard_length=64"}
    for r in results.values():
        assert [c[0] for c in r["curve"]] == [0, 2, 4] and r["hit_step"] == 0
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_alone"] > 0 and r["decoder_loss"] > 0
    rates = sorted(p.name for p in (knobs / "rates").iterdir() if p.is_dir())
    assert rates == ["retromae_batch32_shards_64", "retromae_batch32_shards_scratch"]
    assert "| shard_length=64 |" in (knobs / "knobs.md").read_text()


def test_builtin_task_splits_queries_into_train_and_test(tmp_path):
    from retromae_ds.retrieval.beir import load_beir
    from retromae_recipes.demo import builtin_task

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


def test_demo_full_is_the_longer_budget_and_given_sizes_replace_the_budgets():
    from retromae_ds.base.options import parse_command
    from retromae_recipes.commands import DemoConfig
    from retromae_recipes.demo import with_sizes
    from retromae_recipes.study_config import DEMO, DEMO_FULL

    args = parse_command(DemoConfig, ["--full", "--seeds", "0"])
    assert args.full and args.out is None and args.steps is None and args.seeds == [0]
    assert DEMO_FULL.steps > DEMO.steps
    # only the continuations' length and the curve's points differ from the main job
    full = asdict(DEMO_FULL)
    assert {k for k, v in asdict(DEMO).items() if v != full[k]} == {"steps", "curve_points"}
    assert with_sizes(DEMO_FULL, steps=None, max_docs=None) == DEMO_FULL
    resized = with_sizes(DEMO_FULL, steps=8, max_docs=0)
    assert (resized.steps, resized.max_docs, resized.lr) == (8, 0, DEMO_FULL.lr)
    with pytest.raises(ValueError, match="stepz"):
        with_sizes(DEMO, stepz=3)
