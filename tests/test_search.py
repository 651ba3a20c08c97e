"""Approximate search (retromae_ds.search) against exact search on clustered vectors: recall
floors for every index type, the id/score contract ``ExactIndex`` keeps, the ``auto`` rule as
docs/ance.md states it, every error naming the setting at fault, the refresher's config with
an approximate index, and the refresher's search stage mining through one.

The vectors: unit centres with Gaussian spread, 32 dimensions (so PQ trains in well under a
second), 4,000 of them. Recall floors sit below what was measured over seeds 0-2 (ivf 1.00 /
0.97, ivfpq 0.67-0.71 / 0.89, hnsw 1.00 / 0.997 at k = 10 / 100) with room for faiss's own
variation, above what a broken index would give (an index probing the wrong lists finds
under 0.3).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from retromae_ds.components.layout import RunLayout
from retromae_ds.finetuning import data as ance_data
from retromae_ds.search.approximate import ApproximateIndex
from retromae_ds.search.build import build_index, resolve_index
from retromae_ds.search.exact import ExactIndex, rescore
from retromae_ds.search.kinds import factory_for, ivf_lists, pq_shape

from helpers_ance import load_current, write_synthetic_beir, write_tiny_encoder


@pytest.fixture(autouse=True)
def one_thread():
    """faiss's k-means over PQ's small sub-spaces spends its time in OpenMP barriers when the
    2 cores are shared (8 s instead of 0.3 s for one IVF-PQ): one thread, restored after
    (torch and faiss share the OpenMP runtime)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def clustered(n: int, q: int, dim: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((60, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)

    def draw(m: int) -> np.ndarray:
        noise = 0.5 * rng.standard_normal((m, dim)) / np.sqrt(dim)
        return (centres[rng.integers(len(centres), size=m)] + noise).astype(np.float32)

    return draw(n), draw(q)


def recall(found: np.ndarray, exact: np.ndarray, k: int) -> float:
    return float(
        np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(found, exact, strict=True)])
    )


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    corpus, queries = clustered(4000, 100)
    return corpus, queries, ExactIndex.build(corpus).search(queries, 100)[1]


FLOORS = {"flat": (1.0, 1.0), "ivf": (0.95, 0.93), "ivfpq": (0.55, 0.8), "hnsw": (0.97, 0.97)}


@pytest.mark.parametrize("kind", sorted(FLOORS))
def test_each_index_type_finds_what_exact_search_finds(kind, data):
    corpus, queries, exact_ids = data
    index = build_index(kind, dim=32, n=len(corpus))
    index.add(corpus)
    scores, ids = index.search(queries, 100)
    floor10, floor100 = FLOORS[kind]
    assert recall(ids, exact_ids, 10) >= floor10
    assert recall(ids, exact_ids, 100) >= floor100
    # the contract: float32 scores best first, int64 ids, no id twice in a row
    assert scores.dtype == np.float32 and ids.dtype == np.int64 and ids.shape == (100, 100)
    assert (np.diff(scores, axis=1) <= 1e-6).all()
    assert all(len(set(row)) == len(row) for row in ids.tolist())
    if kind != "ivfpq":  # IVF lists and HNSW graphs hold the vectors: scores are exact
        np.testing.assert_allclose(
            scores, np.einsum("qd,qkd->qk", queries, corpus[ids]), rtol=1e-4, atol=1e-4
        )


def test_rescore_gives_pq_candidates_their_exact_scores(data):
    corpus, queries, exact_ids = data
    index = build_index("ivfpq", dim=32, n=len(corpus))
    index.add(corpus)
    approx_scores, ids = index.search(queries, 100)
    ids[:, -3:] = -1  # missing slots stay last
    scores, ranked = rescore(queries, corpus, ids)
    exact = np.einsum("qd,qkd->qk", queries, corpus[np.maximum(ranked, 0)])
    np.testing.assert_allclose(scores[:, :-3], exact[:, :-3], rtol=1e-5, atol=1e-5)
    assert (np.diff(scores[:, :-3], axis=1) <= 0).all() and (ranked[:, -3:] == -1).all()
    assert np.isneginf(scores[:, -3:]).all()
    assert sorted(ranked[0, :-3]) == sorted(ids[0, :-3])  # the same candidates, reordered
    assert recall(ranked, exact_ids, 10) >= recall(ids, exact_ids, 10)
    assert not np.allclose(approx_scores[:, :10], scores[:, :10])  # PQ's were approximate


@pytest.mark.parametrize("factory", ["IVF16,Flat", "HNSW16,Flat"])
def test_approximate_index_keeps_exact_index_conventions(factory):
    corpus, queries = clustered(1000, 6, dim=16, seed=3)
    scaled = corpus * np.random.default_rng(0).uniform(0.5, 3, (1000, 1)).astype(np.float32)
    index = ApproximateIndex(16, factory, metric="cosine", nprobe=16 if "IVF" in factory else 0)
    assert index.ntotal == 0
    scores, ids = index.search(queries, 4)  # empty: all padding
    assert (ids == -1).all() and np.isneginf(scores).all()
    index.add(torch.from_numpy(scaled[:700]))  # trains on these, tensors accepted
    index.add(scaled[700:])  # ids continue from ntotal
    assert index.ntotal == 1000
    unit = corpus / np.linalg.norm(corpus, axis=1, keepdims=True)
    unit_q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    ref_ids = ExactIndex.build(unit).search(unit_q, 20)[1]
    scores, ids = index.search(queries, 20)
    assert recall(ids, ref_ids, 20) >= 0.95 and np.abs(scores).max() <= 1 + 1e-5
    scores, ids = ApproximateIndex(16, factory, nprobe=0).search(queries, 3)
    assert ids.shape == (6, 3)
    small = ApproximateIndex(16, "HNSW16,Flat")
    small.add(corpus[:5])
    scores, ids = small.search(queries, 9)  # k beyond the corpus pads
    assert (ids[:, 5:] == -1).all() and np.isneginf(scores[:, 5:]).all()
    assert sorted(ids[0, :5]) == [0, 1, 2, 3, 4]
    assert small.search(np.empty((0, 16), np.float32), 3)[1].shape == (0, 3)


def test_training_sample_is_seeded():
    corpus, queries = clustered(3000, 20, seed=4)

    def ranked(seed: int) -> np.ndarray:
        index = ApproximateIndex(32, "IVF32,Flat", nprobe=2, train_size=1500, seed=seed)
        index.add(corpus)
        return index.search(queries, 10)[1]

    np.testing.assert_array_equal(ranked(0), ranked(0))
    assert not np.array_equal(ranked(0), ranked(1))  # another sample, other lists


def test_auto_rule_is_the_documented_one():
    assert factory_for("auto", 199_999, 768) == "Flat"
    assert factory_for("auto", 200_000, 768) == "IVF2048,Flat"  # 4·√N = 1789
    assert factory_for("auto", 1_000_000, 768) == "IVF4096,Flat"
    assert factory_for("auto", 4_999_999, 768) == "IVF8192,Flat"  # 4·√N = 8944
    assert factory_for("auto", 5_000_000, 768) == "IVF32768_HNSW32,Flat"  # 16·√N = 35777
    assert factory_for("auto", 8_800_000, 768) == "IVF65536_HNSW32,Flat"  # 47465
    assert factory_for("auto", 8_800_000, 768, backend="torch") == "Flat"
    assert factory_for("flat", 10**8, 768) == "Flat"
    assert factory_for("hnsw", 10, 768) == "HNSW32,Flat"
    assert factory_for("IVF64,PQ8", 10, 768) == "IVF64,PQ8"  # a factory string as written
    assert ivf_lists(5000, 5000) == 128  # 4·√N = 283 -> 256, capped at 5000 / 39
    assert factory_for("ivf", 80, 32) == "IVF2,Flat"
    assert factory_for("ivf", 1_000_000, 768, train_size=50_000) == "IVF1024,Flat"
    assert pq_shape(384, 20_000) == (96, 8) and pq_shape(768, 20_000) == (96, 8)
    assert pq_shape(32, 20_000) == (8, 8) and pq_shape(100, 20_000) == (20, 8)
    assert pq_shape(384, 4000) == (96, 6)  # 4000 / 39 = 102 vectors: 64 codes
    assert factory_for("ivfpq", 4000, 32) == "IVF64,PQ8x6"
    choice = resolve_index("auto", n=1_000_000, dim=768)
    assert (choice.factory, choice.nprobe, choice.train_size) == ("IVF4096,Flat", 512, 262_144)
    assert resolve_index("auto", n=1000, dim=768).record() == {
        "index": "auto",
        "factory": "Flat",
        "backend": "faiss",
        "nprobe": 0,
        "ef_search": 0,
        "train_size": 0,
    }
    # auto's nprobe / ef_search on a corpus where it picks flat: ignored, not an error
    assert resolve_index("auto", n=1000, dim=8, nprobe=4, ef_search=9).exact


@pytest.mark.parametrize(
    "kind, settings, message",
    [
        ("IVF256,Flat", {}, r"refresh.index 'IVF256,Flat' needs at least 9984 training vectors "
         r"\(39 per centroid of 256 IVF lists\), the corpus has 2000"),
        ("IVF16,Flat", {"train_size": 100}, r"refresh.train_size 100 is too few for "
         r"refresh.index 'IVF16,Flat': it needs at least 624 training vectors"),
        ("IVF64,PQ16", {}, r"9984 training vectors \(39 per centroid of 256 centroids per PQ "
         r"sub-quantiser\), the corpus has 2000"),
        ("IVF8,PQ7", {}, r"refresh.index 'IVF8,PQ7': 7 PQ sub-quantisers do not divide the "
         r"dimension 32 \(pick a divisor of 32: 1, 2, 4, 8, 16, 32\)"),
        ("IVF8,Flaat", {}, r"refresh.index 'IVF8,Flaat': faiss cannot build it for dimension "
         r"32: could not parse"),
        ("ivf", {"nprobe": 99}, r"refresh.nprobe 99 exceeds the 32 lists of refresh.index "
         r"'ivf' \(IVF32,Flat\)"),
        ("hnsw", {"nprobe": 4}, r"refresh.nprobe applies to IVF indexes; refresh.index 'hnsw' "
         r"\(HNSW32,Flat\) has no lists"),
        ("ivf", {"ef_search": 4}, r"refresh.ef_search applies to HNSW indexes"),
        ("flat", {"nprobe": 4}, r"refresh.nprobe applies to approximate indexes; "
         r"refresh.index 'flat' searches exactly"),
        ("hnsw", {"ef_search": -1}, r"refresh.ef_search must be >= 0"),
        ("ivf", {"backend": "torch"}, r"refresh.index 'ivf' is approximate, and "
         r"refresh.search_backend torch searches exactly only"),
        ("torch", {}, r"refresh.index names the index type now .* --refresh.search_backend torch"),
        ("exact", {}, r"refresh.index must be auto, flat, ivf, ivfpq, hnsw or a faiss "
         r"index_factory string .* not 'exact'"),
    ],
)  # fmt: skip
def test_errors_name_the_setting_at_fault(kind, settings, message):
    """``retromae_ds.search`` names its settings bare; the trainer's refresh section, which
    read them, re-raises every error with its own option names (``refresh.``)."""
    from retromae_ds.refresher.config import RefreshConfig

    options = {("search_backend" if k == "backend" else k): v for k, v in settings.items()}
    with pytest.raises(ValueError, match=message):
        RefreshConfig(index=kind, **options).index_choice(n=2000, dim=32)


def test_too_few_vectors_at_add_time_names_the_index():
    index = build_index("IVF64,Flat", dim=8, n=10_000)  # sized for more than it gets
    with pytest.raises(ValueError, match=r"index 'IVF64,Flat' needs at least 2496 .* has 100"):
        index.add(np.ones((100, 8), np.float32))


def test_refresh_config_with_an_approximate_index_round_trips(tmp_path):
    from retromae_ds.base.config import to_dict
    from retromae_ds.base.options import build_config
    from retromae_ds.refresher.config import RefreshConfig

    cfg = RefreshConfig(index="IVF1024,PQ32", nprobe=64, train_size=100_000)
    path = tmp_path / "refresh.json"
    path.write_text(json.dumps(to_dict(cfg)))
    assert build_config(RefreshConfig, path, []) == cfg
    cli = build_config(
        RefreshConfig, None, ["--index", "hnsw", "--ef_search", "300", "--search_backend", "faiss"]
    )
    assert (cli.index, cli.ef_search, cli.search_backend) == ("hnsw", 300, "faiss")
    for bad, message in [
        ({"index": "faiss"}, "search backend 'faiss' is refresh.search_backend"),
        ({"index": "hnsw", "search_backend": "torch"}, "torch searches exactly only"),
        ({"search_backend": "annoy"}, "refresh.search_backend must be auto, faiss or torch"),
        ({"nprobe": -1}, r"refresh.nprobe must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            RefreshConfig(**bad)


def test_refresher_mines_through_an_approximate_index(tmp_path, tokenizer_dir):
    """The refresher's search stage with ``index ivf`` probing every list mines what exact
    search mines, with ``hnsw`` it publishes a version too (each manifest says what the
    index resolved to), and a setting the corpus cannot satisfy stops it, naming the setting,
    before anything is encoded."""
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    from helpers_ance import fake_checkpoint, prepared_set

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=240)
    data = prepared_set(tmp_path / "data", beir, tokenizer_dir)
    ts = ance_data.load(data)
    lists = ivf_lists(ts.num_passages, ts.num_passages)
    assert lists >= 4  # several lists: probing all of them is what makes it exact
    encoder = write_tiny_encoder(tmp_path / "enc", tokenizer_dir, seed=3)
    encoded: list[str] = []
    real_encode = stages.encode_rows

    def counting(*args, **kwargs):
        encoded.append(kwargs["desc"])
        return real_encode(*args, **kwargs)

    def mine(name: str, cache: bool = True, **index) -> tuple[dict, object]:
        run = tmp_path / name
        cfg = RefreshConfig(
            run_dir=str(run), data_dir=str(data), batch_size=16, device="cpu", progress=False,
            cache_dir=str(tmp_path / "cache") if cache else "",
            mining=MiningConfig(top_k=10, num_negatives=3, strategy="top"), **index,
        )  # fmt: skip
        publish_bm25(cfg, ts, RunLayout(run).negatives)
        checkpoint = fake_checkpoint(run, 4, encoder)
        manifest = refresher.refresh_once(cfg, ts, checkpoint, 1, stages.Group(60))
        return manifest, load_current(run / "negatives")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stages, "encode_rows", counting)
        exact_manifest, exact = mine("flat")
        ivf_manifest, ivf = mine("ivf", index="ivf", nprobe=lists)
        hnsw_manifest, hnsw = mine("hnsw", index="hnsw")
        encoded.clear()
        with pytest.raises(ValueError, match=r"refresh.index 'IVF64,Flat' needs at least 2496"):
            mine("too_many_lists", cache=False, index="IVF64,Flat")  # 2,496 > the passages
        assert encoded == []  # refused before encoding
    assert (exact_manifest["index"], exact_manifest["search_backend"]) == ("auto", "auto")
    assert exact_manifest["index_resolved"]["factory"] == "Flat"
    assert ivf_manifest["index_resolved"] == {
        "index": "ivf", "factory": f"IVF{lists},Flat", "backend": "faiss", "nprobe": lists,
        "ef_search": 0, "train_size": ts.num_passages,
    }  # fmt: skip
    assert hnsw_manifest["index_resolved"]["factory"] == "HNSW32,Flat"
    # every list probed: exact's negatives (the random encoder's exact ties between equal
    # texts may break either way: compare sets, allow a little)
    overlap = sum(
        len(set(exact.of(q).tolist()) & set(ivf.of(q).tolist())) for q in range(ts.num_queries)
    )
    assert overlap >= 0.9 * 3 * ts.num_queries, (overlap, 3 * ts.num_queries)
    for q in range(ts.num_queries):
        positives = set(ts.positives[q].tolist())
        assert len(hnsw.of(q)) == 3 and not set(hnsw.of(q).tolist()) & positives
        assert not set(ivf.of(q).tolist()) & positives


def test_bench_search_scale_corpus_and_measurement(tmp_path, monkeypatch):
    """benchmarks/bench_search_scale.py (issue 43's 100k / 1M table) at toy size. Its corpus
    keeps the SciFact abstracts intact in front and behind them joins two 24-word halves, each
    from a sentence start of one document, the two from different documents of one source;
    its measurement finds exact's ranking with flat and with IVF probing every list (recall 1,
    the same mined negatives), less with one list of 64."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(repo / "benchmarks"))
    import bench_search_scale as scale

    data = tmp_path / "data"
    (data / "scifact").mkdir(parents=True)
    (data / "wikitext2").mkdir()

    def doc(tag: str, i: int) -> str:
        return " ".join(" ".join(f"{tag}{i}x{s}x{w}" for w in range(8)) + "." for s in range(6))

    abstracts = [{"_id": str(i), "title": f"a{i}t.", "text": doc("a", i)} for i in range(30)]
    (data / "scifact" / "corpus.jsonl").write_text("\n".join(map(json.dumps, abstracts)))
    wiki = ["= Heading =", *(doc("w", i) for i in range(20))]
    (data / "wikitext2" / "wiki.test.raw").write_text("\n".join(wiki))
    builtin = [{"_id": str(i), "title": "", "text": doc("b", i)} for i in range(10)]
    monkeypatch.setattr("retromae_ds.data.builtin_corpus.iter_documents", lambda: iter(builtin))
    rows, n_real = scale.passages(data, 400)
    assert n_real == 30 and rows[:30] == [f"a{i}t. {doc('a', i)}" for i in range(30)]
    assert len(set(rows)) == 400
    sources = set()
    for words in map(str.split, rows[30:]):
        tags = [re.match(r"[abw]\d+", w).group() for w in words]
        cut = tags.index(tags[-1])  # two documents, one after the other
        assert tags[0] != tags[-1] and set(tags[:cut]) == {tags[0]}, words
        assert set(tags[cut:]) == {tags[-1]} and tags[0][0] == tags[-1][0]  # of one source
        for half in (words[:cut], words[cut:]):  # 12-24 words from a sentence start
            assert scale.MIN_HALF_WORDS <= len(half) <= scale.HALF_WORDS, words
            assert half[0].endswith(("x0", "t.")), words
        sources.add(tags[0][0])
    assert sources == {"a", "b", "w"}

    out = tmp_path / "vectors"
    (out / "chunks").mkdir(parents=True)
    corpus, queries = clustered(3000, 40)
    for i in range(3):
        np.save(scale.chunk_path(out, i), corpus[i * 1000 : (i + 1) * 1000])
    np.save(out / "queries.npy", queries)
    positives = [[q % 50, 1000 + q] for q in range(40)]
    (out / "positives.json").write_text(json.dumps(positives))
    (out / "meta.json").write_text(json.dumps({"chunk": 1000, "scifact_rows": 50}))
    result = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_search_scale.py"), "--json",
         str(tmp_path / "rows.json"), "measure", "--out", str(out), "--n", "2500", "--kinds",
         "flat", "ivf", "--nprobes", "1", "64", "--threads", "1", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [(r["kind"], r["nprobe"]) for r in rows] == [("flat", 0), ("ivf", 8), ("ivf", 1),
                                                       ("ivf", 64)]  # fmt: skip
    assert rows[1]["factory"] == "IVF64,Flat"  # 4·√2500 = 200 lists, capped at 2500 / 39
    for r in (rows[0], rows[3]):
        assert r["recall_at_200"] == r["scifact_recall_at_200"] == 1.0, r
        assert r["mined_overlap_random"] == r["mined_overlap_top"] == 1.0, r
    assert rows[2]["recall_at_200"] < 0.9 and rows[2]["mined_overlap_top"] < 1.0
    assert all(r["queries_per_s"]["1"] > 0 and r["bytes_per_vector"] > 0 for r in rows)
