"""Mining and the refresher's settings (issue 55, item 4 and the "Refresher settings" items): a
query's own document is never mined as its negative (eval's ``ignore_identical_ids``, under the
same name, counted in the manifest); settings that cannot work are refused up front; an HNSW
manifest records the ``ef_search`` used; ``refresh`` names its options as it reads them; a
read-only negatives folder is said to be read-only; the refresher's folders can be written
absolute."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers_disk import small_disk

from retromae_ds.components.layout import RunLayout
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff

from helpers_ance import (
    fake_checkpoint,
    load_current,
    prepared_set,
    write_synthetic_beir,
    write_tiny_encoder,
)

OWN = 12
"""Training queries q0 .. q11 also sit in the corpus under their own id, holding their text."""


def _add_own_documents(beir: Path, count: int) -> list[str]:
    """Append to ``beir``'s corpus a document per query q0 .. q{count-1}, under the query's
    id and with its text (ArguAna's and Quora's shape); returns those ids."""
    queries = [json.loads(line) for line in (beir / "queries.jsonl").read_text().splitlines()]
    own = queries[:count]
    with open(beir / "corpus.jsonl", "a") as f:
        for q in own:
            f.write(json.dumps({"_id": q["_id"], "title": "", "text": q["text"]}) + "\n")
    return [q["_id"] for q in own]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("own_id_assets")
    beir = write_synthetic_beir(base / "beir")
    own_ids = _add_own_documents(beir, OWN)
    data = prepared_set(base / "data", beir, tokenizer_dir)
    ts = ance_data.load(data)
    passage_of = {pid: p for p, pid in enumerate(ts.passage_ids.to_pylist())}
    own = {q: passage_of[qid] for q, qid in enumerate(ts.query_ids) if qid in passage_of}
    assert sorted(ts.query_ids[q] for q in own) == sorted(own_ids)  # the setting's premise
    return SimpleNamespace(
        base=base,
        data=data,
        ts=ts,
        own=own,
        encoder=write_tiny_encoder(base / "encoder", tokenizer_dir, seed=3),
    )


def _config(assets: SimpleNamespace, run: Path, ignore: bool, **kwargs):
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    mining = MiningConfig(top_k=10, num_negatives=3, strategy="top", ignore_identical_ids=ignore)
    return RefreshConfig(
        run_dir=str(run), data_dir=str(assets.data), batch_size=16, device="cpu",
        progress=False, mining=mining, **kwargs,
    )  # fmt: skip


def _mine_v0_and_v1(assets: SimpleNamespace, run: Path, ignore: bool, **kwargs):
    """BM25's v0 as the trainer publishes it, then one model-mined v1 by the refresher's
    ``refresh_once``: [(manifest, negatives per query)] of both."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages
    from retromae_ds.refresher.bm25 import publish_bm25

    cfg = _config(assets, run, ignore, **kwargs)
    root = RunLayout(run).negatives
    publish_bm25(cfg, assets.ts, root)
    v0 = load_current(root)
    refresher.refresh_once(
        cfg, assets.ts, fake_checkpoint(run, 4, assets.encoder), 1, stages.Group(60)
    )
    v1 = load_current(root)
    assert (v0.version, v1.version) == (0, 1)
    return [(v.manifest, [v.of(q).tolist() for q in range(v.num_queries)]) for v in (v0, v1)]


def _own_as_negative(assets: SimpleNamespace, negatives: list[list[int]]) -> list[int]:
    """The queries whose own document is among their negatives."""
    return [q for q, p in assets.own.items() if p in negatives[q]]


# --------------------------------------------------------------------------- item 4
def test_a_querys_own_document_is_never_its_mined_negative(assets, tmp_path):
    """Twelve training queries sit in the corpus under their own id. BM25's v0 and a
    model-mined v1 (flat, and HNSW) never hold a query's own passage among its negatives, and
    each manifest counts the drops; with ``mining.ignore_identical_ids false`` the old
    behaviour: BM25 ranks the own document first, and mining ``top`` takes it."""
    for index in ("auto", "hnsw"):
        versions = _mine_v0_and_v1(assets, tmp_path / index, True, index=index)
        for manifest, negatives in versions:
            assert _own_as_negative(assets, negatives) == [], (index, manifest["version"])
            counts = manifest["identical_ids"]
            assert counts["ignore_identical_ids"] is True
            assert counts["queries_in_corpus"] == OWN, counts
            assert manifest["settings"]["ignore_identical_ids"] is True
            for q, p in assets.own.items():  # every query still gets its n negatives
                assert len(negatives[q]) == 3 and p not in assets.ts.positives[q]
        # BM25 ranks each query's own text first: every one was dropped from its ranking
        assert versions[0][0]["identical_ids"]["dropped"] == OWN
        assert 0 < versions[1][0]["identical_ids"]["dropped"] <= OWN

    kept = _mine_v0_and_v1(assets, tmp_path / "kept", False)
    (v0_manifest, v0), (v1_manifest, v1) = kept
    assert sorted(_own_as_negative(assets, v0)) == sorted(assets.own)
    assert _own_as_negative(assets, v1), "the model ranks no own document in its top 3"
    for manifest in (v0_manifest, v1_manifest):
        assert manifest["identical_ids"] == {"ignore_identical_ids": False}


def test_the_own_document_is_never_a_random_top_up_either():
    """A query whose ranking is too short is topped up with random passages: never its own
    document, and never a positive, however many draws it takes."""
    from retromae_ds.refresher.mining import drop_identical, identical_passages, mine

    own = identical_passages(["q0", "q1", "x"], ["d0", "q1", "d2", "q0"])
    assert own.tolist() == [3, 1, -1]
    ranked = np.array([[3, 0, -1], [1, 1, 2], [0, 1, 2]])
    kept, dropped = drop_identical(ranked, own)
    assert kept.tolist() == [[-1, 0, -1], [-1, -1, 2], [0, 1, 2]] and dropped == 2
    for seed in range(20):
        got = mine(
            kept, [np.array([0]), np.array([2]), np.array([0])], 2,
            seed=seed, num_passages=4, excluded=own,
        )  # fmt: skip
        assert 3 not in got[0] and 0 not in got[0], got
        assert 1 not in got[1] and 2 not in got[1], got


def test_the_trainer_mines_its_bm25_version_under_the_same_setting():
    """``finetune --refresh.mining.ignore_identical_ids false`` reaches the section the
    trainer mines BM25's v0 with (``publish_bm25(cfg.refresh, ...)``); on by default."""
    from retromae_ds.base.options import parse_command
    from retromae_ds.finetune import FinetuneConfig

    base = ["--run_dir", "r", "--data.beir", "b", "--model.init", "m"]
    assert parse_command(FinetuneConfig, base).refresh.mining.ignore_identical_ids is True
    off = parse_command(FinetuneConfig, [*base, "--refresh.mining.ignore_identical_ids", "false"])
    assert off.refresh.mining.ignore_identical_ids is False


# --------------------------------------------------------------------------- settings
def _refresh_error(capsys, *argv: str) -> str:
    """``retromae-ds refresh ARGV`` in this process: its one error line (exit 2)."""
    from retromae_ds.cli import main

    assert main(["refresh", "--run_dir", "no_such_run", *argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("retromae-ds refresh: error: "), lines
    return lines[0]


def test_skip_top_that_skips_the_whole_ranking_is_refused_naming_both(capsys):
    """``skip_top >= top_k`` would make every negative random: refused, naming both settings
    as each command spells them."""
    from retromae_ds.refresher.config import MiningConfig

    line = _refresh_error(capsys, "--mining.top_k", "20", "--mining.skip_top", "20")
    assert "mining.skip_top 20" in line and "mining.top_k 20" in line, line
    assert "refresh." not in line, line
    with pytest.raises(ValueError, match=r"refresh\.mining\.skip_top 200 .*refresh\.mining\.top_k"):
        MiningConfig(skip_top=200)
    MiningConfig(skip_top=199)  # one ranked passage left: allowed


def test_a_batch_size_below_one_is_refused_before_anything_runs(capsys):
    line = _refresh_error(capsys, "--batch_size", "0")
    assert "batch_size must be >= 1, got 0" in line and "refresh." not in line, line


def test_refresh_names_its_options_as_it_reads_them(capsys):
    """``retromae-ds refresh`` reads ``--search_backend``, not the trainer's
    ``--refresh.search_backend``: its errors say so, at parse time and when the index is
    resolved; the trainer's section keeps the ``refresh.`` prefix."""
    from retromae_ds.base.options import parse_command
    from retromae_ds.finetune import FinetuneConfig
    from retromae_ds.refresher import stages
    from retromae_ds.refresher.config import RefreshConfig, RefresherConfig

    line = _refresh_error(capsys, "--index", "faiss")
    assert "--search_backend faiss" in line and "refresh." not in line, line
    line = _refresh_error(capsys, "--mining.strategy", "best")
    assert "mining.strategy must be one of" in line and "refresh." not in line, line
    cfg = RefresherConfig(run_dir="r", index="IVF64,Flat")
    with pytest.raises(ValueError, match=r"^index 'IVF64,Flat' needs at least 2496"):
        stages.index_choice(cfg, 100, 8)
    with pytest.raises(ValueError, match=r"^refresh\.index 'IVF64,Flat' needs at least 2496"):
        stages.index_choice(RefreshConfig(run_dir="r", index="IVF64,Flat"), 100, 8)
    base = ["--run_dir", "r", "--data.beir", "b", "--model.init", "m"]
    with pytest.raises(ValueError, match=r"--refresh\.search_backend faiss"):
        parse_command(FinetuneConfig, [*base, "--refresh.index", "faiss"])


def test_an_hnsw_record_names_the_ef_search_its_searches_use():
    """``ef_search 0`` (auto) is recorded as the candidate list the searches set (4·k, at
    least 64), the value faiss's index holds after a search; a given value as given."""
    import faiss

    from retromae_ds.search.build import build_index, resolve_index

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((300, 8)).astype(np.float32)
    for k, ef in ((10, 64), (50, 200)):
        choice = resolve_index("hnsw", n=len(vectors), dim=8, k=k)
        index = build_index("hnsw", n=len(vectors), dim=8, backend="faiss")
        index.add(vectors)
        index.search(vectors[:3], k)
        used = faiss.downcast_index(index._index).hnsw.efSearch
        assert choice.ef_search == used == ef, (k, choice, used)
    assert resolve_index("hnsw", n=300, dim=8, k=10, ef_search=9).ef_search == 9
    assert resolve_index("hnsw", n=300, dim=8).ef_search == 0  # k unknown: auto per search


def test_the_refreshers_folders_are_written_absolute(tmp_path, monkeypatch):
    """``with_absolute_paths``: the folders of a refresh section, made absolute against the
    directory the trainer runs in, so a refresher started elsewhere finds them."""
    from retromae_ds.base.config import to_dict
    from retromae_ds.refresher.config import RefreshConfig, with_absolute_paths

    monkeypatch.chdir(tmp_path)
    settings = to_dict(RefreshConfig(run_dir="runs/a", data_dir="runs/a/../d", cache_dir=""))
    out = with_absolute_paths(settings)
    assert out["run_dir"] == str(tmp_path / "runs" / "a")
    assert out["data_dir"] == str(tmp_path / "runs" / "d")
    assert out["cache_dir"] == ""  # unset stays unset
    assert {k: v for k, v in out.items() if k not in ("run_dir", "data_dir")} == {
        k: v for k, v in settings.items() if k not in ("run_dir", "data_dir")
    }
    RefreshConfig(**{**out, "mining": RefreshConfig().mining})  # still a valid section


def test_the_trainer_writes_the_refreshers_folders_absolute(tmp_path, monkeypatch):
    """The file a refresher started anywhere reads (a Slurm step, ``refresh --config``) names
    the run, its data and the cache as absolute paths, though the trainer was given relative
    ones (they were stored relative to where the trainer ran)."""
    import json

    from retromae_ds.components.layout import RunLayout
    from retromae_ds.finetune import (
        DualModelConfig,
        FinetuneConfig,
        FinetuneDataConfig,
        _write_refresh_config,
    )

    monkeypatch.chdir(tmp_path)
    cfg = FinetuneConfig(
        run_dir="runs/ft",
        max_steps=1,
        data=FinetuneDataConfig(beir="beir", prepared="prep"),
        model=DualModelConfig(init="init"),
    )
    cfg.refresh.cache_dir = "cache"
    layout = RunLayout(cfg.run_dir)
    layout.root.mkdir(parents=True)
    saved = json.loads(_write_refresh_config(cfg, layout).read_text())
    assert saved["run_dir"] == str(tmp_path / "runs" / "ft")
    assert saved["data_dir"] == str(tmp_path / "prep")
    assert saved["cache_dir"] == str(tmp_path / "cache")


# --------------------------------------------------------------------------- read-only
def test_a_read_only_negatives_folder_is_said_to_be_read_only(assets, tmp_path, capsys):
    """``negatives/`` on a file system mounted read-only after the trainer published v0:
    the refresher's one line names the folder as not writable (read-only) and says to make
    it writable, not to free space."""
    from retromae_ds.cli import main
    from retromae_ds.refresher.bm25 import publish_bm25

    with small_disk("16m") as disk:
        run = tmp_path / "run"
        run.mkdir()
        (run / "negatives").symlink_to(disk)
        publish_bm25(_config(assets, run, True), assets.ts, RunLayout(run).negatives)
        fake_checkpoint(run, 4, assets.encoder)
        remount = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remount.stderr!r}")
        argv = ["refresh", "--run_dir", str(run), "--data_dir", str(assets.data)]
        status = main([*argv, "--device", "cpu", "--progress", "false", "--max_versions", "1"])
        lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert status != 0 and len(lines) == 1, lines
        line = lines[0]
        assert "read-only" in line.lower() and "not writable" in line, line
        assert f"make {run / 'negatives'} writable" in line, line
        assert "free space" not in line and "No space" not in line, line
        assert handoff.published_versions(disk) == [0]
