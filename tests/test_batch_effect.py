"""The batch-size experiment (retromae_recipes/batch_effect.py) end to end on a tiny
inverse-cloze task with a tiny encoder: a row per batch and seed, GradCache above the chunk,
the learning-rate rule, the report, and a rerun that trains and evaluates nothing. The full
experiment is in docs/results.md, not a test."""

from __future__ import annotations

import json
import math

import pytest

from retromae_recipes.batch_effect import EffectOptions, Experiment, main

from helpers_ance import write_tiny_encoder


def _wikitext(folder):
    def paragraph(k: int, p: int) -> str:
        return " ".join(
            f"Item{k}x{p} sentence {s} tells how {['red', 'blue', 'green'][s % 3]} thing{k} grows "
            f"near place{p}x{s} ."
            for s in range(4)
        )

    text = "".join(
        f" = Article {k} = \n \n " + " \n \n ".join(paragraph(k, p) for p in range(3)) + " \n"
        for k in range(16)
    )
    folder.mkdir()
    (folder / "wiki.test.raw").write_text(text, encoding="utf-8")
    return folder


@pytest.mark.slow
def test_batches_and_seeds_end_to_end_and_a_rerun_trains_nothing(tmp_path, tokenizer_dir):
    wikitext = _wikitext(tmp_path / "wikitext")
    init = write_tiny_encoder(tmp_path / "init", tokenizer_dir)
    out = tmp_path / "out"
    argv = [
        *("--wikitext", str(wikitext), "--out", str(out), "--init", str(init)),
        *("--seeds", "0", "1", "--batches", "2", "8", "--chunk", "4", "--epochs", "1"),
        *("--lr", "1e-4", "--lr_batch", "2", "--q_max_len", "16", "--p_max_len", "32"),
        *("--precision", "fp32", "--eval_bf16", "false", "--top_k", "5", "--num_negatives", "3"),
        *("--dev_fraction", "0.2", "--test_fraction", "0.2"),
    ]
    assert main(argv) == 0
    results = json.loads((out / "batch_effect_results.json").read_text())
    train = results["task"]["queries"]["train"]
    rows = {(r["batch"], r["seed"]): r for r in results["rows"]}
    assert set(rows) == {(2, 0), (8, 0), (2, 1), (8, 1)}
    for (batch, _), row in rows.items():
        assert row["steps"] == train // batch  # one epoch: the partial last batch skipped
        assert row["lr"] == 1e-4 * math.sqrt(batch / 2)
        assert row["grad_cache_chunk"] == (4 if batch == 8 else 0)
        assert row["train_seconds"] > 0
        for split in ("metrics", "dev"):
            assert set(row[split]) >= {"ndcg@10", "mrr@10", "recall@100"}
            assert all(0 <= v <= 1 for v in row[split].values())
    config = json.loads((out / "runs" / "b8_s0_config.json").read_text())
    assert config["grad_cache"]["query_chunk"] == 4 and config["micro_batch_size"] == 8
    report = (out / "batch_effect.md").read_text()
    assert "| 2 | " in report and "| 8 | " in report
    assert "nDCG@10 at batch 8 vs 2" in report and "python scripts/batch_effect.py" in report
    assert (out / "batch_effect.png").is_file()

    logs = {p.name: p.read_text() for p in (out / "runs").glob("*.log")}
    evals = {p.name: p.stat().st_mtime_ns for p in (out / "eval").glob("*.json")}
    assert len(logs) == 4 and len(evals) == 4 * 2 + 2  # test and dev per run, init, BM25
    Experiment(
        EffectOptions(**{**json.loads((out / "batch_effect_results.json").read_text())["options"]})
    ).run("rerun")
    assert {p.name: p.read_text() for p in (out / "runs").glob("*.log")} == logs
    assert {p.name: p.stat().st_mtime_ns for p in (out / "eval").glob("*.json")} == evals
    again = json.loads((out / "batch_effect_results.json").read_text())
    assert again["rows"] == results["rows"]
