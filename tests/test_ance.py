"""ANCE pieces: mining never returns a positive, the negatives hand-off under a concurrent
reader, gathered in-batch negatives against a single-process big batch (two gloo ranks), and
the refresher killed mid-encode and restarted. Shared helpers live in helpers_ance."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.base import faults
from retromae_ds.components.layout import RunLayout
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.refresher.mining import (
    drop_likely_positives,
    min_per_query,
    mine,
    positive_scores,
)

from helpers_ance import (
    ENV,
    fake_checkpoint,
    load_current,
    prepared_set,
    refresh_cmd,
    write_synthetic_beir,
    write_tiny_encoder,
)
from helpers_model import NO_DROPOUT, small_config


# --------------------------------------------------------------------------- mining
@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_passages=st.integers(2, 40),
    n=st.integers(1, 6),
    strategy=st.sampled_from(["random", "top"]),
    skip_top=st.integers(0, 5),
)
def test_mined_negatives_never_contain_a_positive(data, num_passages, n, strategy, skip_top):
    queries = data.draw(st.integers(1, 6))
    positives = [
        np.asarray(
            sorted(data.draw(st.sets(st.integers(0, num_passages - 1), min_size=1, max_size=5)))
        )
        for _ in range(queries)
    ]
    positives = [p[: num_passages - 1] for p in positives]  # at least one non-positive exists
    k = data.draw(st.integers(1, 50))
    ranked = np.asarray(
        [
            data.draw(st.lists(st.integers(-1, num_passages - 1), min_size=k, max_size=k))
            for _ in range(queries)
        ]
    )
    out = mine(
        ranked,
        positives,
        n,
        strategy=strategy,
        skip_top=skip_top,
        seed=3,
        num_passages=num_passages,
    )
    for q, neg in enumerate(out):
        assert len(neg) == n and neg.dtype == np.int32
        assert not set(neg.tolist()) & set(positives[q].tolist())
        assert ((neg >= 0) & (neg < num_passages)).all()
        non_positive = num_passages - len(positives[q])
        if non_positive >= n:
            assert len(set(neg.tolist())) == n  # distinct whenever the corpus allows
    if strategy == "top" and skip_top == 0:
        # the best-ranked non-positive comes first
        for q, neg in enumerate(out):
            first = next((r for r in ranked[q] if r >= 0 and r not in positives[q]), None)
            if first is not None:
                assert neg[0] == first


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_passages=st.integers(3, 40), ratio=st.floats(0.05, 1.0))
def test_false_negative_filter_removes_what_it_says_and_never_a_positive(data, num_passages, ratio):
    """Scores from real embeddings: every candidate above ratio x the lowest positive's score
    is dropped, nothing else; the labelled positives are untouched and never mined."""
    queries, dim = data.draw(st.integers(1, 6)), 4
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    q_emb, p_emb = rng.normal(size=(queries, dim)), rng.normal(size=(num_passages, dim))
    positives = [
        np.asarray(
            sorted(data.draw(st.sets(st.integers(0, num_passages - 1), min_size=1, max_size=3)))
        )
        for _ in range(queries)
    ]
    positives = [p[: num_passages - 1] for p in positives]
    kept_positives = [p.copy() for p in positives]
    k = data.draw(st.integers(1, num_passages))
    all_scores = q_emb @ p_emb.T
    ranked = np.argsort(-all_scores, axis=1)[:, :k]
    scores = np.take_along_axis(all_scores, ranked, axis=1)
    # the positives' scores computed in two parts of the corpus, folded as the refresher does
    cut = data.draw(st.integers(0, num_passages))
    pairs = np.fmin(
        positive_scores(q_emb, p_emb[:cut], 0, positives),
        positive_scores(q_emb, p_emb[cut:], cut, positives),
    )
    low = min_per_query(pairs, positives)
    np.testing.assert_allclose(low, [all_scores[q, p].min() for q, p in enumerate(positives)])
    filtered, dropped = drop_likely_positives(ranked, scores, low, ratio)
    for q in range(queries):
        threshold = low[q] - (1 - ratio) * abs(low[q])
        above = scores[q] > threshold
        assert (filtered[q][above] == -1).all() and (filtered[q][~above] == ranked[q][~above]).all()
        assert dropped[q] == above.sum()
    out = mine(filtered, positives, 2, seed=1, num_passages=num_passages)
    for q, neg in enumerate(out):
        assert not set(neg.tolist()) & set(positives[q].tolist())
        kept = set(filtered[q][filtered[q] >= 0].tolist()) - set(positives[q].tolist())
        if len(kept) >= 2:  # enough candidates survived: the negatives come from them
            assert set(neg.tolist()) <= kept
    for before, after in zip(kept_positives, positives, strict=True):
        assert (before == after).all()


def test_false_negative_filter_by_hand():
    ranked = np.array([[4, 2, 7, -1], [1, 3, 5, 6]])
    scores = np.array([[0.9, 0.8, 0.5, -np.inf], [2.0, 1.0, -0.5, -2.0]])
    # query 0: positive at 0.85 -> threshold 0.765 at ratio 0.9; query 1: positive at -1.0
    # -> threshold -1.1: everything above it goes, the -2.0 candidate stays
    got, dropped = drop_likely_positives(ranked, scores, np.array([0.85, -1.0]), 0.9)
    assert got.tolist() == [[-1, -1, 7, -1], [-1, -1, -1, 6]]
    assert dropped.tolist() == [2, 3]
    same, none = drop_likely_positives(ranked, scores, np.array([np.nan, np.nan]), 0.9)
    assert (same == ranked).all() and none.tolist() == [0, 0]
    with pytest.raises(ValueError, match="ratio"):
        drop_likely_positives(ranked, scores, np.array([0.1, 0.1]), 0.0)


def test_refresh_config_refuses_bad_values_by_name():
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    with pytest.raises(ValueError, match="refresh.threads must be >= 0, got -1"):
        RefreshConfig(threads=-1)
    with pytest.raises(ValueError, match="max_score_ratio must be in"):
        MiningConfig(max_score_ratio=1.5)


def test_top_strategy_skips_the_first_non_positives():
    ranked = np.array([[5, 0, 6, 7, 1, 8, 9]])
    got = mine(ranked, [np.array([0, 1])], 2, strategy="top", skip_top=1, num_passages=10)
    assert got[0].tolist() == [6, 7]


def test_bm25_version_excludes_all_positives(tmp_path, tokenizer_dir):
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    beir = write_synthetic_beir(tmp_path / "beir")
    ts = ance_data.load(prepared_set(tmp_path / "data", beir, tokenizer_dir))
    # empty documents get no passage; queries whose positives are all empty are left out
    assert ts.num_passages < 80 and all(len(p) >= 1 for p in ts.positives)
    assert max(len(p) for p in ts.positives) == 2  # relevance 0 is not a positive
    manifest = publish_bm25(
        RefreshConfig(mining=MiningConfig(num_negatives=4), progress=False),
        ts,
        tmp_path / "run" / "negatives",
    )
    assert manifest["version"] == 0 and manifest["step"] == 0 and manifest["source"] == "bm25"
    neg = load_current(tmp_path / "run" / "negatives")
    assert neg.num_queries == ts.num_queries
    for q in range(ts.num_queries):
        assert len(neg.of(q)) == 4
        assert not set(neg.of(q).tolist()) & set(ts.positives[q].tolist())
    # BM25 ranks a positive first for most queries (their text comes from it): the exclusion
    # is exercised, not vacuous
    from retromae_ds.refresher.bm25 import bm25_rankings
    from retromae_ds.retrieval.beir import load_corpus, load_queries

    ids, texts = load_corpus(beir / "corpus.jsonl")
    text_of = dict(zip(ids, texts, strict=True))
    queries = load_queries(beir / "queries.jsonl")
    ranked = bm25_rankings(
        [text_of[d] for d in ts.passage_ids.to_pylist()],
        [queries[q] for q in ts.query_ids],
        5,
        progress=False,
    )
    top_is_positive = [ranked[q, 0] in ts.positives[q] for q in range(ts.num_queries)]
    assert sum(top_is_positive) > ts.num_queries // 2


# --------------------------------------------------------------------------- hand-off
def _content(version: int, num_queries: int) -> list[np.ndarray]:
    return [
        np.arange(q, q + 1 + (version + q) % 5, dtype=np.int32) + 100 * version
        for q in range(num_queries)
    ]


def _writer(root: str, versions: int, delay: float, ready) -> None:
    ready.wait(timeout=120)  # the reader is hammering before the first publication
    for v in range(versions):
        handoff.publish(Path(root), v, _content(v, 50), step=10 * v, keep_last=3)
        time.sleep(delay)


def _reader(root: str, ready, stop, out) -> None:
    seen, checked = [], 0
    ready.set()
    while not stop.is_set():
        neg = load_current(Path(root))
        if neg is None:
            continue
        expected = _content(neg.version, 50)
        assert neg.num_queries == 50 and neg.step == 10 * neg.version
        for q in range(50):
            assert neg.of(q).tolist() == expected[q].tolist(), (neg.version, q)
        seen.append(neg.version)
        checked += 1
    out.put((seen, checked))


def test_handoff_is_atomic_under_a_concurrent_reader(tmp_path):
    root = tmp_path / "negatives"
    ctx = mp.get_context("spawn")  # fork after torch/bm25s threads may deadlock the child
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    versions = 40
    reader = ctx.Process(target=_reader, args=(str(root), ready, stop, results))
    writer = ctx.Process(target=_writer, args=(str(root), versions, 0.05, ready))
    try:
        reader.start()
        writer.start()
        writer.join(timeout=180)
        time.sleep(0.5)  # a few more reads of the last version
        stop.set()
        seen, checked = results.get(timeout=60)
        reader.join(timeout=60)
        assert writer.exitcode == 0 and reader.exitcode == 0, "a reader saw a partial version"
    finally:
        for proc in (reader, writer):
            if proc.is_alive():
                proc.kill()
    assert checked > 50 and len(set(seen)) > 3, (checked, sorted(set(seen)))
    assert seen == sorted(seen)  # never goes back to an older version
    assert handoff.published_versions(root) == [versions - 3, versions - 2, versions - 1]
    assert not list(root.glob(".*tmp"))


def test_killed_writer_leaves_the_previous_version_and_numbering_continues(tmp_path):
    root = tmp_path / "negatives"
    handoff.publish(root, 0, _content(0, 5), step=0)
    # a writer killed after writing the data file (no manifest, pointer untouched) and one
    # killed mid-write (hidden temporary file)
    (root / "v1.arrow").write_bytes(b"half a file")
    (root / ".v1.arrow.abc.tmp").write_bytes(b"partial")
    assert load_current(root).version == 0
    assert handoff.next_version(root) == 1
    handoff.publish(root, 1, _content(1, 5), step=7)
    neg = load_current(root)
    assert (neg.version, neg.step, neg.of(2).tolist()) == (1, 7, _content(1, 5)[2].tolist())
    assert not list(root.glob(".*tmp"))
    with pytest.raises(FileExistsError):
        handoff.publish(root, 1, _content(1, 5), step=7)


def test_reader_rejects_a_corrupted_version(tmp_path):
    root = tmp_path / "negatives"
    handoff.publish(root, 0, _content(0, 5), step=0)
    path = handoff.data_file(root, 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        load_current(root)


# --------------------------------------------------------------------------- gather
def _tiny_dual_encoder(seed: int):
    from transformers import BertConfig, BertModel

    from retromae_ds.finetuning.model import DualEncoder

    torch.manual_seed(seed)
    config = BertConfig(**small_config(50, 16, 1, max_position_embeddings=16), **NO_DROPOUT)
    return DualEncoder(BertModel(config, add_pooling_layer=False), temperature=0.5)


def _global_batch(world: int, per_rank: int, group: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    b, p = world * per_rank, world * per_rank * group
    p_index = torch.randint(0, 1000, (p,), generator=g)
    p_index[group] = p_index[-group]  # the same passage on both ranks
    positives = torch.full((b, 2), -1, dtype=torch.int64)
    positives[:, 0] = p_index[::group]
    positives[0, 1] = p_index[-1]  # query 0 has a second positive, held by rank 1
    return {
        "q_ids": torch.randint(1, 50, (b, 6), generator=g),
        "q_mask": torch.ones(b, 6, dtype=torch.int64),
        "p_ids": torch.randint(1, 50, (p, 9), generator=g),
        "p_mask": (torch.arange(9) < torch.randint(3, 10, (p, 1), generator=g)).long(),
        "p_index": p_index,
        "positives": positives,
    }


def _gather_rank(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    per_rank, group = 3, 3
    full = _global_batch(world, per_rank, group)
    qs, ps = (
        slice(rank * per_rank, (rank + 1) * per_rank),
        slice(rank * per_rank * group, (rank + 1) * per_rank * group),
    )
    local = {k: (v[ps] if k.startswith("p_") else v[qs]) for k, v in full.items()}
    model = _tiny_dual_encoder(0)
    loss = model(local)["loss"]
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)  # what DeepSpeed does: average the ranks' gradients
    grads /= world
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    if rank == 0:
        out.put((grads.numpy(), float(torch.stack(losses).mean())))
    # both ranks done with every collective before either tears gloo down (without it, a
    # rank tearing down while its peer's last collective completes can abort: seen once in CI)
    dist.barrier()
    dist.destroy_process_group()


def test_gathered_in_batch_negatives_match_a_single_process_big_batch():
    world = 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_gather_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    dist_grads, dist_loss = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    model = _tiny_dual_encoder(0)
    loss = model(_global_batch(world, 3, 3))["loss"]
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()]).numpy()
    assert dist_loss == pytest.approx(float(loss.detach()), rel=1e-5)
    np.testing.assert_allclose(dist_grads, grads, rtol=1e-4, atol=1e-6)
    # without the gradient through the gather the ranks' update would differ: make sure the
    # passages of the other rank matter for this batch
    assert np.abs(grads).max() > 0


# --------------------------------------------------------------------------- refresher
@pytest.mark.slow
def test_refresher_killed_mid_encode_then_restarted(tmp_path, tokenizer_dir):
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    run = tmp_path / "run"
    beir = write_synthetic_beir(tmp_path / "beir")
    ts = ance_data.load(prepared_set(run / "data", beir, tokenizer_dir))
    publish_bm25(
        RefreshConfig(mining=MiningConfig(num_negatives=3), progress=False),
        ts,
        RunLayout(run).negatives,
    )
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    fake_checkpoint(run, 5, encoder)
    root = run / "negatives"

    proc = subprocess.Popen(
        refresh_cmd(run, "--max_versions", "1"),
        env={**ENV, **faults.env(sleep_after_encode_batch_s=0.1)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        for line in proc.stderr:  # wait until it is encoding
            if "encoding" in line or time.monotonic() > deadline:
                break
        time.sleep(1.0)
        assert proc.poll() is None, "the refresher finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert handoff.published_versions(root) == [0]
    assert handoff.read_pointer(root)["version"] == 0
    assert (root / ".work" / "v1").is_dir()  # its scratch is hidden, not a version

    done = subprocess.run(
        refresh_cmd(run, "--max_versions", "1"),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    neg = load_current(root)
    assert (neg.version, neg.step, neg.manifest["source"]) == (1, 5, "model")
    assert neg.manifest["data"] == ts.fingerprint()
    # where and how it searched: auto picks exact search at this size
    assert (neg.manifest["device"], neg.manifest["index"]) == ("cpu", "auto")
    assert neg.manifest["search_backend"] == "auto"
    assert neg.manifest["index_resolved"]["factory"] == "Flat"
    for q in range(ts.num_queries):
        assert len(neg.of(q)) == 3 and not set(neg.of(q).tolist()) & set(ts.positives[q].tolist())
    assert not (root / ".work" / "v1").exists()
    metrics = [json.loads(x) for x in (run / "refresh_metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["version"] == 1 and metrics[-1]["passages_per_s"] > 0

    # a newer checkpoint: the next run continues at v2, and stops by itself when the trainer
    # says it finished
    fake_checkpoint(run, 9, encoder)
    proc = subprocess.Popen(refresh_cmd(run), env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while handoff.read_pointer(root)["version"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        (run / "FINISHED").write_text("{}")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    neg = load_current(root)
    assert (neg.version, neg.step) == (2, 9)
    assert handoff.published_versions(root) == [0, 1, 2]


@pytest.mark.slow
def test_two_refresher_ranks_each_encode_their_part_and_agree_with_one(tmp_path, tokenizer_dir):
    import shutil

    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    one, two = tmp_path / "one", tmp_path / "two"
    beir = write_synthetic_beir(tmp_path / "beir")
    ts = ance_data.load(prepared_set(one / "data", beir, tokenizer_dir))
    publish_bm25(
        RefreshConfig(mining=MiningConfig(num_negatives=3), progress=False),
        ts,
        RunLayout(one).negatives,
    )
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir, seed=3)
    fake_checkpoint(one, 4, encoder)
    shutil.copytree(one, two)
    # shards of 16 passages: both ranks encode several (the corpus has 75 passages)
    strategy = ("--mining.strategy", "top", "--max_versions", "1", "--max_score_ratio", "0.97",
                "--shard_rows", "16")  # fmt: skip
    single = subprocess.run(
        refresh_cmd(one, *strategy), env=ENV, capture_output=True, text=True, timeout=180
    )
    assert single.returncode == 0, single.stderr[-3000:]
    cmd = refresh_cmd(two, *strategy)
    cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", cmd[2]]
    double = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
    assert double.returncode == 0, double.stderr[-3000:]
    a, b = load_current(one / "negatives"), load_current(two / "negatives")
    assert (a.version, b.version, b.step) == (1, 1, 4)
    assert (a.manifest["ranks"], b.manifest["ranks"]) == (1, 2)
    # the ranks split the shards, each encoding its own (none twice, none left out)
    shards = -(-ts.num_passages // 16)
    assert b.manifest["embedding_shards"] == a.manifest["embedding_shards"] == {
        "shards": shards, "shard_rows": 16, "dim": 32, "dtype": "float32",
        "encoded": shards, "cached": 0, "resumed": 0, "redone": 0,
    }  # fmt: skip
    # the positives' scores come from both ranks' parts: the filter drops the same candidates
    fa, fb = a.manifest["false_negative_filter"], b.manifest["false_negative_filter"]
    assert fa["dropped"] > 0 and abs(fa["dropped"] - fb["dropped"]) <= 0.05 * fa["dropped"] + 1
    # the same passages mined whether one rank searched everything or two ranks searched
    # their halves and merged (the random tiny encoder makes exact ties, e.g. between equal
    # texts, which the two orders break differently: compare sets, allow a little)
    overlap = sum(len(set(a.of(q).tolist()) & set(b.of(q).tolist())) for q in range(ts.num_queries))
    assert overlap >= 0.9 * 3 * ts.num_queries, (overlap, 3 * ts.num_queries)
    for q in range(ts.num_queries):
        assert not set(b.of(q).tolist()) & set(ts.positives[q].tolist())


def test_embedding_cache_reuses_only_the_same_encoder_and_data(tmp_path, tokenizer_dir, capfd):
    """Two runs from byte-identical checkpoints: the second loads the first's embeddings
    instead of encoding and mines the same negatives; another encoder misses; a damaged
    entry is reported and recomputed, never used."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    beir = write_synthetic_beir(tmp_path / "beir")
    data = prepared_set(tmp_path / "data", beir, tokenizer_dir)
    ts = ance_data.load(data)
    cache = tmp_path / "cache"
    same = write_tiny_encoder(tmp_path / "enc_a", tokenizer_dir, seed=1)
    other = write_tiny_encoder(tmp_path / "enc_b", tokenizer_dir, seed=2)
    calls = []
    real_encode = stages.encode_rows

    def counting(*args, **kwargs):
        calls.append(kwargs["desc"])
        return real_encode(*args, **kwargs)

    def mine_from(name: str, encoder: Path, cache_dir: Path | str = cache):
        run = tmp_path / name
        cfg = RefreshConfig(
            run_dir=str(run),
            data_dir=str(data),
            mining=MiningConfig(top_k=10, num_negatives=3),
            batch_size=8,
            device="cpu",
            cache_dir=str(cache_dir),
            progress=False,
        )
        publish_bm25(cfg, ts, RunLayout(run).negatives)
        checkpoint = fake_checkpoint(run, 0, encoder)
        calls.clear()
        manifest = refresher.refresh_once(cfg, ts, checkpoint, 1, stages.Group(60))
        return manifest, load_current(run / "negatives"), list(calls)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stages, "encode_rows", counting)
        first, neg_first, enc = mine_from("a", same)
        assert first["embedding_cache"] == {"passages": "miss", "queries": "miss"}
        assert enc == ["passages r0", "queries r0"]
        entries = sorted(cache.glob("*.npy"))
        assert len(entries) == 2 and len(list(cache.glob("*.json"))) == 2

        second, neg_second, enc = mine_from("b", same)
        assert second["embedding_cache"] == {"passages": "hit", "queries": "hit"}
        assert enc == []  # nothing encoded
        for q in range(ts.num_queries):
            assert neg_second.of(q).tolist() == neg_first.of(q).tolist()

        third, _, enc = mine_from("c", other)  # other weights: other keys
        assert third["embedding_cache"] == {"passages": "miss", "queries": "miss"}
        assert enc == ["passages r0", "queries r0"] and len(list(cache.glob("*.npy"))) == 4

        # a damaged entry (here: another array's bytes) is recomputed and replaced
        np.save(entries[0], np.zeros((3, 5), np.float32))
        capfd.readouterr()
        fourth, neg_fourth, enc = mine_from("d", same)
        assert "recomputing it" in capfd.readouterr().err
        assert sorted(fourth["embedding_cache"].values()) == ["hit", "miss"] and len(enc) == 1
        for q in range(ts.num_queries):
            assert neg_fourth.of(q).tolist() == neg_first.of(q).tolist()
        assert np.load(entries[0]).shape != (3, 5)

        off, _, enc = mine_from("e", same, cache_dir="")
        assert off["embedding_cache"] == {"passages": "off", "queries": "off"} and len(enc) == 2


def test_refresher_restarted_after_its_ranking_mines_from_it_without_encoding(
    tmp_path, tokenizer_dir
):
    """The stages leave their outputs in ``.work/vN``: a refresher that fails while
    publishing (a write error, injected into ``handoff.publish``) leaves the merged ranking
    there; the next one mines and publishes from it without encoding, and the version equals
    the one an uninterrupted refresher publishes."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import publish, stages
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    beir = write_synthetic_beir(tmp_path / "beir")
    data = prepared_set(tmp_path / "data", beir, tokenizer_dir)
    ts = ance_data.load(data)
    encoder = write_tiny_encoder(tmp_path / "enc", tokenizer_dir, seed=3)
    calls: list[str] = []
    real_encode, real_publish = stages.encode_rows, handoff.publish

    def counting(*args, **kwargs):
        calls.append(kwargs["desc"])
        return real_encode(*args, **kwargs)

    def full_disk(*args, **kwargs):
        raise handoff.write_error(Path(args[0]), OSError(28, "No space left on device"), "v1")

    def setup(name: str) -> tuple[RefreshConfig, Path]:
        run = tmp_path / name
        cfg = RefreshConfig(
            run_dir=str(run), data_dir=str(data), batch_size=8, device="cpu", progress=False,
            mining=MiningConfig(top_k=10, num_negatives=3, max_score_ratio=0.99),
        )  # fmt: skip
        publish_bm25(cfg, ts, RunLayout(run).negatives)
        return cfg, fake_checkpoint(run, 4, encoder)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stages, "encode_rows", counting)
        cfg, checkpoint = setup("straight")
        straight = refresher.refresh_once(cfg, ts, checkpoint, 1, stages.Group(60))

        cfg, checkpoint = setup("broken")
        work = RunLayout(cfg.run_dir).negatives / ".work" / "v1"
        patch.setattr(publish.handoff, "publish", full_disk)
        with pytest.raises(handoff.NegativesWriteError):
            refresher.refresh_once(cfg, ts, checkpoint, 1, stages.Group(60))
        assert (work / stages.RANKING).is_file()
        assert handoff.published_versions(RunLayout(cfg.run_dir).negatives) == [0]

        patch.setattr(publish.handoff, "publish", real_publish)
        calls.clear()
        resumed = refresher.refresh_once(cfg, ts, checkpoint, 1, stages.Group(60))
    assert calls == []  # nothing encoded again
    assert resumed["embedding_cache"] == {"passages": "ranked", "queries": "ranked"}
    assert not work.exists()
    assert resumed["false_negative_filter"] == straight["false_negative_filter"]
    a = load_current(tmp_path / "straight" / "negatives")
    b = load_current(tmp_path / "broken" / "negatives")
    assert (a.version, b.version) == (1, 1)
    for q in range(ts.num_queries):
        assert a.of(q).tolist() == b.of(q).tolist()
