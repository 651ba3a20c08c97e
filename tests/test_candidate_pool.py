"""The candidate-pool refresh (``refresh.mode pool``, issue 43 item 5): a version that
re-scores each training query's previous top-K' with the newest checkpoint instead of
encoding the corpus. Real tiny encoders (two towers, mean pooling, normalised), real Arrow
data, the refresher in process and as real processes:

- its ranking is an exact search restricted to the pool's candidates (an oracle that encodes
  every text one at a time with ``transformers`` and scores them all);
- it encodes the pool's union, not the corpus;
- killed anywhere in a pool version, it publishes nothing and resumes to the same version;
- a missing or damaged pool falls back to a full refresh, saying so in one line;
- the pool survives ``keep_last``; ``pool_full_every`` refreshes it; a full refresh of pool
  mode mines what the default mode mines (the default itself: the other refresher tests);
- two refresher ranks split the pool's passages and agree with one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from retromae_ds.components.layout import QUERY_ENCODER, RunLayout
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.hf import sbert

from helpers_ance import (
    ENV,
    REPO,
    fake_checkpoint,
    load_current,
    prepared_set,
    refresh_cmd,
    run_killed,
    write_synthetic_beir,
    write_tiny_encoder,
)

TOP_K, POOL_K, SHARD_ROWS = 8, 12, 16


# --------------------------------------------------------------------------- assets
def _tower(folder: Path, tokenizer_dir: Path, seed: int) -> Path:
    """A tiny encoder that pools by the mean and normalises (its dual_encoder.json)."""
    write_tiny_encoder(folder, tokenizer_dir, seed=seed)
    settings = {"pooling": "mean", "normalize": True, "temperature": 0.05, "shared": False}
    (folder / sbert.DUAL_ENCODER_FILE).write_text(json.dumps(settings))
    return folder


def _checkpoint(run: Path, step: int, towers: tuple[Path, Path]) -> Path:
    """A complete checkpoint with a passage and a query tower."""
    folder = fake_checkpoint(run, step, towers[0])
    shutil.copytree(towers[1], folder / QUERY_ENCODER)
    return folder


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("pool_assets")
    beir = write_synthetic_beir(base / "beir", num_docs=240, num_queries=24)
    data = prepared_set(base / "data", beir, tokenizer_dir)
    old = (_tower(base / "old_p", tokenizer_dir, 1), _tower(base / "old_q", tokenizer_dir, 2))
    new = (_tower(base / "new_p", tokenizer_dir, 3), _tower(base / "new_q", tokenizer_dir, 4))
    return SimpleNamespace(base=base, data=data, ts=ance_data.load(data), old=old, new=new)


def _config(assets: SimpleNamespace, run: Path, **kwargs):
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    settings = dict(
        run_dir=str(run), data_dir=str(assets.data), batch_size=8, device="cpu", progress=False,
        shard_rows=SHARD_ROWS, mode="pool", pool_k=POOL_K,
        mining=MiningConfig(top_k=TOP_K, num_negatives=4, strategy="top"),
    )  # fmt: skip
    return RefreshConfig(**{**settings, **kwargs})


def _refresh(cfg, assets: SimpleNamespace, checkpoint: Path, version: int) -> dict:
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    return refresher.refresh_once(cfg, assets.ts, checkpoint, version, stages.Group(60))


def _run_with_full_v1(assets: SimpleNamespace, run: Path, **kwargs):
    """BM25's v0 (its pool kept), v1 mined in full from the old towers (step 2), the new
    towers' checkpoint (step 4) waiting: (config, new checkpoint)."""
    from retromae_ds.refresher.bm25 import publish_bm25

    cfg = _config(assets, run, **kwargs)
    publish_bm25(cfg, assets.ts, RunLayout(run).negatives)
    _refresh(cfg, assets, _checkpoint(run, 2, assets.old), 1)
    return cfg, _checkpoint(run, 4, assets.new)


def _negatives(run: Path) -> list[list[int]]:
    neg = load_current(run / "negatives")
    return [neg.of(q).tolist() for q in range(neg.num_queries)]


def _recording(patch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Counts the passage rows encoded and keeps the ranking each version is mined from."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    seen = SimpleNamespace(rows=[], rankings=[])
    real_encode, real_mine = stages.encode_rows, refresher.mine_and_publish

    def encode(model, ds, rows, *args, **kwargs):
        if kwargs["desc"].startswith("passages"):
            seen.rows.append(np.asarray(rows).copy())
        return real_encode(model, ds, rows, *args, **kwargs)

    def mine(root, version, ranking, *args, **kwargs):
        seen.rankings.append(ranking)
        return real_mine(root, version, ranking, *args, **kwargs)

    patch.setattr(stages, "encode_rows", encode)
    patch.setattr(refresher, "mine_and_publish", mine)
    return seen


def _oracle_embeddings(folder: Path, ds, rows: np.ndarray, special) -> np.ndarray:
    """Each text alone through ``transformers`` (no padding, no batching), mean-pooled and
    normalised as its dual_encoder.json says: float64 ``[len(rows), D]``."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder)).eval()
    out = []
    with torch.inference_mode():
        for row in rows:
            ids = [special.cls, *ds.get_batch(np.array([row])).input_ids.tolist(), special.sep]
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1).double().numpy())
    return np.stack(out)


# --------------------------------------------------------------------------- in process
def test_a_pool_version_ranks_as_an_exact_search_restricted_to_its_pool(tmp_path, assets):
    """v2 (new towers) re-scores v1's pool: its ranking equals the oracle's (every passage
    and query encoded alone, every score computed) restricted to each query's K' pool
    candidates, and it encodes exactly the pool's passages, never the corpus."""
    ts = assets.ts
    cfg, checkpoint = _run_with_full_v1(assets, tmp_path / "run")
    root = RunLayout(tmp_path / "run").negatives
    pool = np.load(root / "pools" / "v1.npy")
    assert pool.shape == (ts.num_queries, POOL_K) and pool.dtype == np.int32
    assert sorted(p.name for p in (root / "pools").iterdir()) == ["v1.json", "v1.npy"]  # v0's gone
    with pytest.MonkeyPatch.context() as patch:
        seen = _recording(patch)
        manifest = _refresh(cfg, assets, checkpoint, 2)
    union = np.unique(pool)
    assert len(union) < ts.num_passages  # else the cost check below proves nothing
    encoded = np.sort(np.concatenate(seen.rows))
    np.testing.assert_array_equal(encoded, np.sort(ts.passage_rows[union]))
    record = manifest["candidate_pool"]
    assert (record["mode"], record["k"], record["pool_version"], record["age"]) == (
        "pool", POOL_K, 1, 1
    )  # fmt: skip
    assert record["passages_encoded"] == len(union) and record["pool_source"] == "model"
    assert manifest["embedding_shards"]["shards"] == -(-len(union) // SHARD_ROWS)

    # the oracle: the new towers on every text, all scores, restricted to the pool
    passages = _oracle_embeddings(checkpoint / "encoder", ts.corpus, ts.passage_rows, ts.special)
    queries = _oracle_embeddings(checkpoint / QUERY_ENCODER, ts.queries, ts.query_rows, ts.special)
    scores_QN = queries @ passages.T
    ranking = seen.rankings[-1]
    assert ranking.ids.shape == (ts.num_queries, TOP_K)
    for q in range(ts.num_queries):
        cand = pool[q][pool[q] >= 0].astype(np.int64)
        order = np.lexsort((cand, -scores_QN[q, cand]))[:TOP_K]
        want_ids, want_scores = cand[order], scores_QN[q, cand[order]]
        got = ranking.ids[q]
        assert set(got.tolist()) <= set(cand.tolist())
        np.testing.assert_allclose(ranking.scores[q], want_scores, atol=2e-5)
        # the same passages in the same order, up to exact ties of the oracle's scores
        swapped = got != want_ids
        assert np.all(np.abs(scores_QN[q, got[swapped]] - want_scores[swapped]) < 2e-5), q
    # and the new towers' full search differs: the pool is what was re-scored
    full_top = np.argsort(-scores_QN, axis=1)[:, :TOP_K]
    assert any(set(full_top[q]) - set(pool[q].tolist()) for q in range(ts.num_queries))


def test_a_full_refresh_of_pool_mode_mines_what_the_default_mode_mines(tmp_path, assets):
    """A full refresh that keeps a deeper pool (K' > top_k) hands mining the same top_k;
    the default mode writes no pool and no ``candidate_pool``."""
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig

    negatives, manifests = {}, {}
    for mode in ("full", "pool"):
        run = tmp_path / mode
        # random draws from the whole ranking: a ranking deeper than top_k would show
        mining = MiningConfig(top_k=TOP_K, num_negatives=4, strategy="random", seed=3)
        cfg = _config(assets, run, mode=mode, mining=mining)
        publish_bm25(cfg, assets.ts, RunLayout(run).negatives)
        manifests[mode] = _refresh(cfg, assets, _checkpoint(run, 2, assets.old), 1)
        negatives[mode] = _negatives(run)
        assert (RunLayout(run).negatives / "pools").exists() == (mode == "pool")
    assert negatives["full"] == negatives["pool"]
    assert "candidate_pool" not in manifests["full"]
    assert manifests["pool"]["candidate_pool"]["mode"] == "full"
    assert "BM25" in manifests["pool"]["candidate_pool"]["why"]  # pool_from_bm25 is off


@pytest.mark.parametrize("damage", ["missing", "flipped", "other_k"])
def test_a_missing_or_damaged_pool_falls_back_to_a_full_refresh_saying_so(
    tmp_path, assets, capfd, damage
):
    cfg, checkpoint = _run_with_full_v1(assets, tmp_path / "run")
    root = RunLayout(tmp_path / "run").negatives
    npy = root / "pools" / "v1.npy"
    if damage == "missing":
        npy.unlink()
    elif damage == "flipped":
        data = bytearray(npy.read_bytes())
        data[-5] ^= 0x01
        npy.write_bytes(bytes(data))
    else:  # the run asks for a wider pool than v1 kept
        cfg = _config(assets, tmp_path / "run", pool_k=POOL_K + 4)
    capfd.readouterr()
    manifest = _refresh(cfg, assets, checkpoint, 2)
    lines = [x for x in capfd.readouterr().err.splitlines() if "mined in full" in x]
    assert len(lines) == 1, lines
    expected = {"missing": "missing", "flipped": "fails its checksum", "other_k": "needs"}
    assert expected[damage] in lines[0] and "v2" in lines[0] and "falling back" in lines[0]
    record = manifest["candidate_pool"]
    assert record["mode"] == "full" and record["passages_encoded"] == assets.ts.num_passages
    assert expected[damage] in record["why"]
    # the fallback kept a new pool, which the next version re-scores
    assert sorted(p.name for p in (root / "pools").iterdir()) == ["v2.json", "v2.npy"]
    nxt = _refresh(cfg, assets, _checkpoint(tmp_path / "run", 6, assets.old), 3)
    assert (nxt["candidate_pool"]["mode"], nxt["candidate_pool"]["pool_version"]) == ("pool", 2)


def test_the_pool_survives_keep_last_and_is_refreshed_every_n_versions(tmp_path, assets):
    """keep_last 1 deletes v1 while v2 and v3 still re-score v1's pool; pool_full_every 3
    mines v4 in full, which keeps its own pool and drops v1's."""
    run = tmp_path / "run"
    cfg, _ = _run_with_full_v1(assets, run, keep_last=1, pool_full_every=3)
    root = RunLayout(run).negatives
    modes = []
    for version, step in ((2, 6), (3, 8), (4, 10)):
        towers = assets.new if version % 2 == 0 else assets.old
        manifest = _refresh(cfg, assets, _checkpoint(run, step, towers), version)
        modes.append(
            (manifest["candidate_pool"]["mode"], manifest["candidate_pool"]["pool_version"])
        )
        assert handoff.published_versions(root) == [version]  # keep_last 1
        kept = manifest["candidate_pool"]["pool_version"]
        assert sorted(p.name for p in (root / "pools").iterdir()) == [
            f"v{kept}.json",
            f"v{kept}.npy",
        ]
    assert modes == [("pool", 1), ("pool", 1), ("full", 4)]
    assert "pool_full_every 3" in manifest["candidate_pool"]["why"]


def test_bm25s_pool_is_rescored_only_when_asked(tmp_path, assets):
    from retromae_ds.refresher.bm25 import publish_bm25

    run = tmp_path / "run"
    cfg = _config(assets, run, pool_from_bm25=True)
    v0 = publish_bm25(cfg, assets.ts, RunLayout(run).negatives)
    assert v0["candidate_pool"]["mode"] == "bm25" and v0["candidate_pool"]["k"] == POOL_K
    manifest = _refresh(cfg, assets, _checkpoint(run, 2, assets.old), 1)
    assert manifest["candidate_pool"]["pool_source"] == "bm25"
    assert manifest["candidate_pool"]["mode"] == "pool"


# --------------------------------------------------------------------------- processes
def _cli(assets: SimpleNamespace, run: Path, *extra: str) -> list[str]:
    """A run with v0 and a full v1 and the new towers' checkpoint, and the command-line
    refresher that mines v2 from it in pool mode."""
    _run_with_full_v1(assets, run)
    return refresh_cmd(
        run, "--mining.top_k", str(TOP_K), "--mining.strategy", "top", "--max_versions", "1",
        "--data_dir", str(assets.data), "--shard_rows", str(SHARD_ROWS), "--mode", "pool",
        "--pool_k", str(POOL_K), *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def clean_cli(assets) -> list[list[int]]:
    run = assets.base / "clean_cli"
    done = subprocess.run(_cli(assets, run), env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert load_current(run / "negatives").manifest["candidate_pool"]["mode"] == "pool"
    return _negatives(run)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "at"),
    [
        ("crash_after_embedding_shard", 1),
        ("crash_in_refresh_at", "rescore"),
        ("crash_in_refresh_at", "merge"),
        ("crash_in_refresh_at", "publish"),
    ],
)
def test_a_pool_refresh_killed_anywhere_publishes_nothing_and_resumes(
    tmp_path, assets, clean_cli, point, at
):
    run = tmp_path / "run"
    cmd = _cli(assets, run)
    root = RunLayout(run).negatives
    run_killed(cmd, point, at)
    assert handoff.published_versions(root) == [0, 1]
    assert handoff.read_pointer(root)["version"] == 1
    assert not [p.name for p in root.iterdir() if p.name.startswith("v2")]
    assert sorted(p.name for p in (root / "pools").iterdir()) == ["v1.json", "v1.npy"]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    neg = load_current(root)
    assert (neg.version, neg.step, neg.manifest["candidate_pool"]["mode"]) == (2, 4, "pool")
    if point == "crash_after_embedding_shard":
        assert neg.manifest["embedding_shards"]["resumed"] == 2
    assert _negatives(run) == clean_cli
    assert not (root / ".work").exists() or not list((root / ".work").iterdir())


@pytest.mark.slow
def test_two_refresher_ranks_split_the_pool_and_agree_with_one(tmp_path, assets, clean_cli):
    run = tmp_path / "run"
    cmd = _cli(assets, run)
    cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", cmd[2]]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    neg = load_current(run / "negatives")
    assert neg.manifest["ranks"] == 2 and neg.manifest["candidate_pool"]["mode"] == "pool"
    pool = np.load(RunLayout(run).negatives / "pools" / "v1.npy")
    shards = -(-len(np.unique(pool)) // SHARD_ROWS)
    assert shards >= 2  # both ranks encode a part
    summary = neg.manifest["embedding_shards"]
    assert (summary["shards"], summary["encoded"]) == (shards, shards)
    # each query re-scored on one rank, ordered by score then index: the same negatives
    # (queries are encoded in other batches on two ranks: allow a near-tie to swap)
    got = _negatives(run)
    same = sum(len(set(a) & set(b)) for a, b in zip(got, clean_cli, strict=True))
    assert same >= 0.95 * sum(len(a) for a in clean_cli), (same, got, clean_cli)


@pytest.mark.slow
def test_bench_candidate_pool_smoke(tmp_path, assets):
    """``benchmarks/bench_candidate_pool.py`` at toy size: one round, one K'."""
    out = tmp_path / "out.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "bench_candidate_pool.py"),
        "--data", str(assets.base / "beir"), "--old", str(assets.old[0]),
        "--new", str(assets.new[0]), "--pool-k", str(POOL_K), "--top-k", str(TOP_K),
        "--num-negatives", "3", "--rounds", "1", "--bf16-cpu", "false",
        "--work", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["full"]["passages_encoded"] == assets.ts.num_passages
    assert summary["full"]["recall_at_k_vs_full"] == 1.0
    pool = summary[f"pool {POOL_K}"]
    assert pool["passages_encoded"] < assets.ts.num_passages
    assert 0 <= pool["recall_at_k_vs_full"] <= pool["pool_holds_full_top_k"] + 1e-9
