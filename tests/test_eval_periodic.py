"""Zero-shot evaluation during pre-training (``--eval.beir DIR --eval.every N``): it logs what
``retromae-ds eval`` computes on the same weights, it never changes the losses (with or
without it, stopped and resumed: bit-identical), and its rows reach metrics.jsonl and
TensorBoard. Real pre-training (DeepSpeed on CPU), a retrieval task made from the built-in
corpus (docstring summary -> body)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_train import ENV, REPO, metrics, pretrain

from retromae_ds.data import builtin_corpus as bc
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
from retromae_ds.eval.periodic import PeriodicEvalConfig, sample_beir
from retromae_ds.retrieval.beir import load_beir

LOSSES = ("loss", "mlm_loss", "mlm_accuracy", "decoder_loss", "lr", "tokens_seen")


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> tuple[Path, Path]:
    """(shards, BEIR folder) of 600 built-in documents: 20-odd queries, a 3,000-token WordPiece."""
    root = tmp_path_factory.mktemp("builtin_task")
    records = list(bc.iter_documents(600))
    corpus, queries, qrels = bc.split_for_retrieval(records, every=3)
    beir = bc.write_beir(root / "beir", corpus, queries, qrels)
    text = root / "corpus.jsonl"
    text.write_text("".join(json.dumps(r) + "\n" for r in corpus))
    run_preprocess(
        PreprocessConfig(
            inputs=[str(text)],
            out=str(root / "shards"),
            train_tokenizer=3000,
            max_length=64,
            progress=False,
        )
    )
    return root / "shards", beir


def eval_rows(run: Path) -> list[dict]:
    return [r for r in metrics(run) if any(k.startswith("eval/") for k in r)]


def train_rows(run: Path) -> list[dict]:
    return [r for r in metrics(run) if "loss" in r]


def test_sample_is_fixed_and_keeps_the_judged_documents(task):
    data = load_beir(task[1], "test")
    a = sample_beir(data, max_queries=5, max_docs=50, seed=3)
    b = sample_beir(data, max_queries=5, max_docs=50, seed=3)
    assert a == b and len(a.query_ids) == 5 and len(a.corpus_ids) == 50
    judged = {d for docs in a.qrels.values() for d in docs}
    assert judged <= set(a.corpus_ids)
    assert a.query_ids != sample_beir(data, 5, 50, seed=4).query_ids
    whole = sample_beir(data, 0, 0, seed=0)
    assert whole.corpus_ids == data.corpus_ids and whole.query_ids == data.query_ids
    with pytest.raises(ValueError, match="poolings"):
        PeriodicEvalConfig(poolings=["max"])


def test_logged_scores_are_what_retromae_ds_eval_computes(tmp_path, task):
    shards, beir = task
    run = tmp_path / "run"
    pretrain(
        run, shards,
        "--max_steps", "4", "--log_every", "2",
        "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "0",
        "--eval.beir", str(beir), "--eval.every", "2",
        "--eval.max_queries", "0", "--eval.max_docs", "0", "--eval.max_length", "64",
    )  # fmt: skip
    rows = {r["step"]: r for r in eval_rows(run)}
    assert sorted(rows) == [0, 2, 4]
    assert rows[0].get("tokens_seen", 0) == 0 < rows[2]["tokens_seen"] < rows[4]["tokens_seen"]
    assert rows[4]["tokens_seen"] == train_rows(run)[-1]["tokens_seen"]
    name = beir.name
    for step in (2, 4):
        checkpoint = run / "checkpoints" / f"step_{step:08d}"
        for pooling in ("cls", "mean"):
            out = tmp_path / f"eval_{step}_{pooling}.json"
            subprocess.run(
                [sys.executable, "-m", "retromae_ds.cli", "eval", "--model", str(checkpoint),
                 "--beir", str(beir), "--pooling", pooling, "--max_length", "64",
                 "--device", "cpu", "--progress", "false", "--out", str(out)],
                cwd=REPO, env=ENV, check=True, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            expected = json.loads(out.read_text())["metrics"]
            for measure in ("ndcg@10", "mrr@10", "recall@100"):
                got = rows[step][f"eval/{name}/{pooling}/{measure}"]
                assert got == pytest.approx(expected[measure], abs=1e-6), (step, pooling, measure)
    # the scores move as the encoder trains (the hook does not log one frozen model)
    assert rows[0][f"eval/{name}/cls/mrr@10"] != rows[4][f"eval/{name}/cls/mrr@10"]


def test_evaluation_leaves_the_losses_and_exact_resume_alone(tmp_path, task):
    """Bit-identical losses: no evaluation vs evaluation every 2 steps, stopped after step 3
    and resumed; dropout is on (0.1), so a consumed random number would show."""
    shards, beir = task
    common = ["--max_steps", "6", "--log_every", "1", "--model.objective.name", "retromae"]
    evaluate = ["--eval.beir", str(beir), "--eval.every", "2", "--eval.max_queries", "10",
                "--eval.max_docs", "60", "--eval.max_length", "64"]  # fmt: skip
    plain, watched = tmp_path / "plain", tmp_path / "watched"
    pretrain(plain, shards, *common)
    pretrain(watched, shards, *common, *evaluate, "--stop_at_step", "3")
    pretrain(watched, shards, *common, *evaluate)
    a, b = train_rows(plain), train_rows(watched)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in LOSSES} == {k: y[k] for k in LOSSES}, x["step"]
    assert [r["step"] for r in eval_rows(watched)] == [0, 2, 4, 6]  # none repeated on resume
    assert eval_rows(plain) == []

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: list[int] = []
    for events in sorted((watched / "tensorboard").iterdir()):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tag = f"eval/{beir.name}/cls/ndcg@10"
        if tag in acc.Tags()["scalars"]:
            steps += [e.step for e in acc.Scalars(tag)]
    assert sorted(steps) == [0, 2, 4, 6]


def test_zero3_is_refused_with_a_clear_error(tmp_path, task):
    shards, beir = task
    result = pretrain(
        tmp_path / "z3", shards,
        "--max_steps", "2", "--deepspeed.config", "ds_configs/zero3.json",
        "--eval.beir", str(beir), check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "eval.beir needs ZeRO stage <= 2" in result.stderr


def test_keep_best_keeps_the_best_evaluated_checkpoint_beside_the_newest(tmp_path, task):
    """``--checkpoint.keep_best``: with one checkpoint kept, the run also keeps the one saved
    at the evaluation step with the highest first measure (ties to the newer); its record
    holds that value, which is what the metrics log says. Without it only the newest stays."""
    from retromae_ds.components.checkpoint import (
        best_checkpoint,
        complete_checkpoints,
        read_marker,
    )

    shards, beir = task
    common = ["--max_steps", "8", "--log_every", "1", "--checkpoint.every_steps", "2",
              "--checkpoint.keep_last", "1", "--optim.lr", "3e-3",
              "--eval.beir", str(beir), "--eval.every", "2", "--eval.max_queries", "10",
              "--eval.max_docs", "60", "--eval.max_length", "64"]  # fmt: skip
    kept, plain = tmp_path / "kept", tmp_path / "plain"
    pretrain(kept, shards, *common, "--checkpoint.keep_best", "true")
    pretrain(plain, shards, *common)
    key = f"eval/{beir.name}/cls/ndcg@10"
    scores = {r["step"]: r[key] for r in eval_rows(kept) if r["step"] > 0}
    assert sorted(scores) == [2, 4, 6, 8]
    best_step = max(sorted(scores), key=lambda s: (scores[s], s))
    assert best_step < 8  # at lr 3e-3 the score falls: the protection is what keeps it
    root = kept / "checkpoints"
    names = {p.name for p in complete_checkpoints(root)}
    assert names == {"step_00000008", f"step_{best_step:08d}"}
    best = best_checkpoint(root)
    assert best is not None and best.name == f"step_{best_step:08d}"
    assert read_marker(best)["eval"] == {key: scores[best_step]}
    assert {p.name for p in complete_checkpoints(plain / "checkpoints")} == {"step_00000008"}
