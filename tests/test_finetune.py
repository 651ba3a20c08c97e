"""ANCE fine-tuning for real: DeepSpeed on CPU under torchrun (two gloo ranks) with no
refresher running, a mid-run negatives swap and exact resume; and end to end on a slice of
SciFact with the local refresher, against the un-fine-tuned model measured in the same test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers_train import launch_cmd, run_logged

from retromae_ds.components import checkpoint as ckpt
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.refresher.mining import mine

from helpers_ance import (
    ENV,
    assert_refresher_threads,
    scifact_slice,
    write_synthetic_beir,
    write_tiny_encoder,
)


def finetune(
    run_dir: Path, *overrides: str, ranks: int = 1, timeout: int = 600, check: bool = True
):
    args = ["--run_dir", str(run_dir), "--progress", "false", *overrides]
    cmd = launch_cmd("retromae_ds.finetune", args, ranks)
    log = run_dir.parent / f"{run_dir.name}.log"
    return run_logged(cmd, log, env=ENV, timeout=timeout, check=check)


def tiny_task(
    tmp_path: Path, tokenizer_dir: Path, *, micro_batch: int, n_hard: int, steps: int, zero: int
) -> list[str]:
    """The arguments of a fine-tuning run of a tiny encoder on a synthetic set (90 passages,
    28 queries), one log row per step, ZeRO stage ``zero`` in fp32."""
    beir = write_synthetic_beir(tmp_path / "beir", num_docs=90, num_queries=28)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    ds = f'["ds_configs/zero{zero}.json", "ds_configs/fp32.json"]'
    return [
        "--data.beir", str(beir), "--model.init", str(encoder),
        "--data.q_max_len", "16", "--data.p_max_len", "32", "--micro_batch_size", str(micro_batch),
        "--negatives.n_hard", str(n_hard), "--refresh.mining.num_negatives", "3",
        "--max_steps", str(steps), "--log_every", "1", "--optim.lr", "1e-3",
        "--optim.warmup_steps", "1", "--deepspeed.config", ds,
    ]  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_without_refresher_swap_at_a_step_boundary_and_exact_resume(
    tmp_path, tokenizer_dir
):
    common = tiny_task(tmp_path, tokenizer_dir, micro_batch=3, n_hard=2, steps=6, zero=2)
    common += ["--negatives.refresh_every", "5"]
    # no refresher anywhere: the trainer publishes BM25 negatives (v0) and trains on them
    finetune(tmp_path / "straight", *common, ranks=2)
    straight = metrics(tmp_path / "straight")
    assert [r["step"] for r in straight] == [1, 2, 3, 4, 5, 6]
    assert {r["negatives_version"] for r in straight} == {0}
    assert [r["negatives_staleness"] for r in straight] == [1, 2, 3, 4, 5, 6]
    assert straight[-1]["epoch"] >= 1  # crossed an epoch boundary
    assert (tmp_path / "straight" / "FINISHED").is_file()
    final = ckpt.latest_complete(tmp_path / "straight" / "checkpoints")
    assert ckpt.read_marker(final)["negatives_version"] == 0
    assert json.loads((final / "encoder" / "dual_encoder.json").read_text())["pooling"] == "cls"
    assert ckpt.read_rank_state(final, 1)["negatives_version"] == 0

    run = tmp_path / "resumed"
    finetune(run, *common, "--stop_at_step", "3", ranks=2)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert not (run / "FINISHED").exists()
    # a refresher publishes v1 while the trainer is down; the resumed run must keep the
    # version its checkpoint used (v0) until its next look at the pointer (step 5)
    ts = ance_data.load(run / "data")
    ranked = np.tile(np.arange(ts.num_passages)[::-1], (ts.num_queries, 1))
    v1 = mine(ranked, ts.positives, 3, strategy="top", num_passages=ts.num_passages)
    handoff.publish(run / "negatives", 1, v1, step=2, meta={"data": ts.fingerprint()})
    finetune(run, *common, ranks=2)
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(straight[:5], resumed[:5], strict=True):
        assert (a["loss"], a["lr"], a["negatives_version"]) == (
            b["loss"],
            b["lr"],
            b["negatives_version"],
        ), (a, b)
    # swapped at the step-5 boundary without stopping; step 6 trained on v1
    assert resumed[5]["negatives_version"] == 1 and resumed[5]["negatives_staleness"] == 4
    assert resumed[5]["loss"] != straight[5]["loss"]
    assert ckpt.read_marker(ckpt.latest_complete(run / "checkpoints"))["negatives_version"] == 1


@pytest.mark.slow
def test_finetune_with_local_refresher_beats_the_untuned_model_on_scifact(
    tmp_path, shared_data, minilm_dir
):
    from retromae_ds.eval.run import evaluate_beir

    if not (shared_data / "scifact" / "qrels" / "train.tsv").is_file():
        pytest.skip("SciFact (with its train qrels) is absent from the shared data folder")
    beir = scifact_slice(shared_data / "scifact", tmp_path / "scifact", extra_docs=100)
    settings = dict(
        pooling="mean",
        normalize=True,
        max_length=64,
        measures=("ndcg@10",),
        progress=False,
        verbose=False,
    )
    before = evaluate_beir(minilm_dir, beir, "test", **settings)["metrics"]["ndcg@10"]

    run = tmp_path / "run"
    finetune(
        run,
        "--data.beir", str(beir), "--model.init", str(minilm_dir),
        "--model.pooling", "mean", "--model.normalize", "true", "--model.temperature", "0.05",
        "--data.q_max_len", "48", "--data.p_max_len", "64",
        "--micro_batch_size", "16", "--negatives.n_hard", "1", "--max_steps", "20",
        "--optim.lr", "3e-5", "--optim.warmup_steps", "3", "--log_every", "5",
        "--checkpoint.every_steps", "6", "--checkpoint.keep_last", "2",
        "--negatives.refresh_every", "2", "--refresher", "local", "--refresh.device", "cpu",
        "--refresh.poll_s", "0.5", "--refresh.batch_size", "64", "--refresh.mining.num_negatives", "4",
        "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]',
    )  # fmt: skip
    rows = metrics(run)
    assert rows[-1]["step"] == 20 and rows[-1]["loss"] < rows[0]["loss"], rows
    final = ckpt.latest_complete(run / "checkpoints")
    after = evaluate_beir(final / "encoder", beir, "test", **settings)["metrics"]["ndcg@10"]
    print(f"SciFact slice nDCG@10: un-fine-tuned {before:.4f}, fine-tuned {after:.4f}")
    assert after > before, (before, after)
    # the refresher ran beside the trainer on the trainer's own checkpoints
    log = (run / "refresher.log").read_text()
    assert "encoding" in log, log[-2000:]


def test_mine_first_trains_only_on_negatives_mined_with_the_initial_encoder(
    tmp_path, tokenizer_dir
):
    """ANCE's start (``negatives.mine_first``): a step-0 checkpoint, the local refresher mines
    from it, and the first step already uses those negatives; BM25 v0 is never trained on.
    When no refresher publishes, the trainer fails with a clear error instead of waiting
    forever (without any refresher, ``tests/test_guard_finetune.py``: refused up front)."""
    common = tiny_task(tmp_path, tokenizer_dir, micro_batch=4, n_hard=1, steps=4, zero=0)
    common += ["--negatives.mine_first", "true"]
    run = tmp_path / "run"
    finetune(run, *common, "--refresher", "local", "--refresh.device", "cpu",
             "--refresh.poll_s", "0.2", "--refresh.progress", "false",
             "--refresh.threads", "1")  # fmt: skip
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["negatives_version"] >= 1, rows[0]
    first = json.loads(handoff.manifest_file(run / "negatives", 1).read_text())
    assert first["source"] == "model" and first["step"] == 0, first
    log = (run / "refresher.log").read_text()
    assert "from step_00000000" in log
    assert_refresher_threads(log, 1)

    # a refresher said to run elsewhere that never publishes: a clear error, no endless wait
    with pytest.raises(AssertionError, match="no mined negatives within 2 s"):
        finetune(tmp_path / "alone", *common, "--negatives.mine_first_timeout_s", "2",
                 "--refresher", "external")  # fmt: skip
