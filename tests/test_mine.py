"""``retromae-ds mine`` (``retromae_ds.mine``, ``refresher.filters``, ``refresher.offline``):
the id-level jsonl and its manifest from a BEIR folder and from a pairs file (real tiny
encoder, real FAISS), negatives never a positive, shortfalls counted and never padded; each
filter held to a plain-Python oracle on the same scores; ``sampling_strategy top`` against
sentence-transformers' own ``mine_hard_negatives`` on the same embeddings (our encoder
exported as a sentence-transformers folder); the ST triplet export loaded with ``datasets``
and trained one step in sentence-transformers; bad input in one line naming file and line;
``--holdout_positive``'s counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from retromae_ds.cli import main
from retromae_ds.refresher.filters import FilterSettings, select

from helpers_ance import write_tiny_encoder
from synthetic import synthetic_texts


# --------------------------------------------------------------------------- fixtures
def _write_beir(folder: Path, num_docs: int = 240, num_queries: int = 80) -> Path:
    """Distinct documents (none empty); query i has positives d{3i} and d{3i+1} (and d{3i+2}
    judged 0), its text the first words of d{3i} and a word of its own."""
    (folder / "qrels").mkdir(parents=True)
    texts = [f"{t} item{i}".strip() for i, t in enumerate(synthetic_texts(num_docs, 7, 20))]
    with open(folder / "corpus.jsonl", "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n")
    lines = ["query-id\tcorpus-id\tscore"]
    with open(folder / "queries.jsonl", "w") as f:
        for q in range(num_queries):
            words = texts[3 * q].split()[:4]
            f.write(json.dumps({"_id": f"q{q}", "text": " ".join(words) + " question"}) + "\n")
            lines += [f"q{q}\td{3 * q}\t2", f"q{q}\td{3 * q + 1}\t1", f"q{q}\td{3 * q + 2}\t0"]
    (folder / "qrels" / "train.tsv").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer_dir):
    """(a BEIR folder, our tiny encoder as a sentence-transformers folder: mean pooling,
    normalised, 64 tokens)."""
    from retromae_ds.hf import sbert

    root = tmp_path_factory.mktemp("mine")
    beir = _write_beir(root / "beir")
    model = write_tiny_encoder(root / "model", tokenizer_dir, seed=3)
    sbert.write_files(model, 32, "mean", 64, normalize=True)
    return beir, model


def _mine(tmp: Path, model: Path, *args: str) -> tuple[dict, list[dict]]:
    out = tmp / "negatives.jsonl"
    argv = ["mine", "--model", str(model), "--out", str(out), "--device", "cpu"]
    assert main([*argv, "--progress", "false", *args]) == 0
    manifest = json.loads((tmp / "negatives.manifest.json").read_text())
    return manifest, [json.loads(line) for line in out.read_text().splitlines()]


def _qrels(beir: Path) -> dict[str, set[str]]:
    pos: dict[str, set[str]] = {}
    for line in (beir / "qrels" / "train.tsv").read_text().splitlines()[1:]:
        q, d, rel = line.split("\t")
        if int(rel) > 0:
            pos.setdefault(q, set()).add(d)
    return pos


# --------------------------------------------------------------------------- the command
def test_mine_on_a_beir_folder_writes_the_file_and_its_manifest(setup, tmp_path, capsys):
    """Every query with a positive gets its positives (scored) and at most n negatives, never
    a positive; a query short of negatives (range_max keeps few) is counted in the manifest
    and on stdout, not padded; the manifest records hashes, settings and counts."""
    beir, model = setup
    manifest, rows = _mine(
        tmp_path, model, "--beir", str(beir), "--num_negatives", "4", "--range_min", "1",
        "--range_max", "4", "--max_score", "0.9999",
    )  # fmt: skip
    said = capsys.readouterr().out
    qrels = _qrels(beir)
    assert [r["query_id"] for r in rows] == [f"q{q}" for q in range(80)]
    for r in rows:
        assert {p["id"] for p in r["positives"]} == qrels[r["query_id"]]
        negatives = [n["id"] for n in r["negatives"]]
        assert not set(negatives) & qrels[r["query_id"]]
        assert len(negatives) <= 3 == len(set(negatives))  # range 1..4 leaves 3 at most
        ranks = [n["rank"] for n in r["negatives"]]
        scores = [n["score"] for n in r["negatives"]]
        assert ranks == sorted(ranks) and scores == sorted(scores, reverse=True)
        assert all(s <= 0.9999 for s in scores)
    short = sum(len(r["negatives"]) < 4 for r in rows)
    assert short == 80 == manifest["shortfall"]["queries"]  # never padded to 4
    assert manifest["negatives"] == sum(len(r["negatives"]) for r in rows)
    assert f"shortfall {short} queries" in said
    assert manifest["model"]["pooling"] == "mean" and manifest["model"]["normalize"] is True
    assert len(manifest["model"]["sha256"]) == 64 and manifest["corpus"]["passages"] == 240
    assert set(manifest["corpus"]["files_sha256"]) == {
        "corpus.jsonl", "queries.jsonl", "qrels/train.tsv"
    }  # fmt: skip
    assert manifest["settings"]["range_max"] == 4 and manifest["queries"] == 80
    assert manifest["removed"]["positive"] > 0 and manifest["removed"]["range"] > 0
    assert manifest["scores"]["positive"]["count"] == 160
    assert not list(tmp_path.glob(".negatives.work/.work/*"))  # shards removed once ranked


def test_the_triplet_export_trains_one_step_in_sentence_transformers(setup, tmp_path, monkeypatch):
    """``--format st-triplet``: the texts behind the mined ids, loaded with ``datasets`` and
    trained one step by sentence-transformers (as tests/test_pairs_formats.py does)."""
    pytest.importorskip("sentence_transformers")
    from test_pairs_formats import _load_table, _train_one_step

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    beir, model = setup
    manifest, rows = _mine(
        tmp_path, model, "--beir", str(beir), "--format", "st-triplet", "flagembedding"
    )
    triplets = tmp_path / "negatives.st-triplet.jsonl"
    assert manifest["exports"]["st-triplet"]["rows"] == sum(
        len(r["positives"]) * len(r["negatives"]) for r in rows
    )
    data = _load_table(triplets, tmp_path / "cache")
    assert data.column_names == ["anchor", "positive", "negative"]
    fe = [json.loads(line) for line in (tmp_path / "negatives.flagembedding.jsonl").open()]
    assert len(fe) == 80 and all(len(r["neg"]) == 3 for r in fe)
    trained = _train_one_step("st-triplet", data, model, tmp_path / "out")
    assert np.isfinite(trained["loss"]) and trained["changed"]


def test_holdout_positive_counts_how_often_it_comes_back(setup, tmp_path):
    """``--holdout_positive``: each query has two positives, one hidden; the manifest follows
    every hidden one (retrieved, removed by a step, mined), and the file never lists it as a
    negative."""
    beir, model = setup
    manifest, rows = _mine(
        tmp_path, model, "--beir", str(beir), "--holdout_positive", "--num_negatives", "20"
    )
    h = manifest["holdout"]
    assert h["queries"] == 80 and h["retrieved"] >= h["mined"] > 0
    assert h["removed_by_positive"] == 0  # hidden: no longer removed as a positive
    assert h["kept_out_of_the_file"] == h["mined"]
    # the manifest's shortfall and count are the file's, the held-out ones kept out included
    assert manifest["shortfall"]["queries"] == sum(len(r["negatives"]) < 20 for r in rows) > 0
    assert manifest["negatives"] == sum(len(r["negatives"]) for r in rows)
    qrels = _qrels(beir)
    assert all(len(r["positives"]) == 1 for r in rows)
    assert all(not {n["id"] for n in r["negatives"]} & qrels[r["query_id"]] for r in rows)


def test_mine_reads_a_pairs_file_with_an_extra_corpus(setup, tmp_path):
    """An FE jsonl (texts) with the BEIR corpus as extra corpus: a positive whose text is a
    corpus document takes its id, and no negative is a positive."""
    beir, model = setup
    corpus = [json.loads(line) for line in (beir / "corpus.jsonl").open()]
    pairs = tmp_path / "fe.jsonl"
    with open(pairs, "w") as f:
        for q in range(5):
            doc = corpus[3 * q]["text"]
            f.write(
                json.dumps({"query": f"about {doc.split()[0]}", "pos": [doc], "neg": []}) + "\n"
            )
    manifest, rows = _mine(tmp_path, model, "--pairs", str(pairs), "--corpus", str(beir))
    assert [r["positives"][0]["id"] for r in rows] == [f"d{3 * q}" for q in range(5)]
    assert manifest["inputs"]["passages_from_pairs"] == 0
    assert all(len(r["negatives"]) == 3 for r in rows)
    assert all(r["positives"][0]["id"] not in {n["id"] for n in r["negatives"]} for r in rows)


@pytest.mark.parametrize(
    "make, status, says",
    [
        (lambda t: t / "absent.jsonl", 1, "absent.jsonl: no such file"),
        (lambda t: _file(t, '{"query": "a", "pos": ["b"]}\n{"query": "c"}\n'), 2, "bad.jsonl:2"),
        (
            lambda t: _file(t, '{"query_id": "q1", "positives": [{"id": "nope"}]}\n'),
            2,
            "bad.jsonl:1: field 'positives[0].id': id 'nope' is not in",
        ),
    ],
    ids=["missing-file", "missing-field", "unknown-id"],
)
def test_bad_input_is_one_line_naming_file_and_line(setup, tmp_path, capsys, make, status, says):
    """One line ``retromae-ds mine: error: FILE:LINE: ...``, exit 2 for bad input and 1 for
    a missing file (``errors.report``), and nothing written."""
    beir, model = setup
    argv = ["mine", "--model", str(model), "--out", str(tmp_path / "o.jsonl"), "--pairs"]
    rc = main([*argv, str(make(tmp_path)), "--corpus", str(beir), "--progress", "false"])
    err = capsys.readouterr().err.strip()
    assert rc == status and says in err and len(err.splitlines()) == 1, err
    assert err.startswith("retromae-ds mine: error: ")
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.manifest.json").exists()


def _file(tmp: Path, text: str) -> Path:
    (tmp / "bad.jsonl").write_text(text)
    return tmp / "bad.jsonl"


# --------------------------------------------------------------------------- the filters
def _oracle(ids, scores, positives, s: FilterSettings, pmin, excluded):
    """Plain Python, one query at a time, as sentence-transformers' documentation reads."""
    out = []
    max_pos = max(len(p) for p in positives)
    raw = s.raw_range()
    for q in range(len(ids)):
        lo, hi = raw if raw else (0, s.depth(max_pos))
        left = []
        for k in range(lo, min(hi, ids.shape[1])):
            d, sc = int(ids[q, k]), float(scores[q, k])
            if d < 0 or d == excluded[q] or d in set(positives[q].tolist()):
                continue
            if s.absolute_margin is not None and sc + s.absolute_margin > pmin[q]:
                continue
            if s.relative_margin is not None and sc > pmin[q] - abs(pmin[q]) * s.relative_margin:
                continue
            if s.max_score is not None and sc > s.max_score:
                continue
            if s.min_score is not None and sc < s.min_score:
                continue
            left.append(d)
        if not raw:
            left = left[: s.resolved_range_max(max_pos)][s.range_min :]
        out.append(left[: s.num_negatives])
    return out


SETTINGS = [
    {},
    {"range_min": 3, "range_max": 9},
    {"absolute_margin": 0.0},
    {"absolute_margin": 0.1, "range_min": 1},
    {"relative_margin": 0.05},
    {"max_score": 0.3},
    {"min_score": 0.2, "num_negatives": 6},
    {"max_score": 0.5, "min_score": -0.2, "relative_margin": 0.1, "range_max": 30},
    {"range_for_sampling": "2-12"},
    {"range_for_sampling": "5-40", "absolute_margin": 0.05},
]


@pytest.mark.parametrize("options", SETTINGS, ids=[json.dumps(o) for o in SETTINGS])
def test_each_filter_does_what_st_documents_against_an_oracle(options):
    """``select`` with strategy top keeps exactly what the plain-Python reading of each
    option keeps, on random rankings with repeated passages, empty slots, own documents
    and positives of both signs of score."""
    rng = np.random.default_rng(5)
    q, k, n = 60, 60, 400
    scores = np.sort(rng.uniform(-1, 1, (q, k)).astype(np.float32), axis=1)[:, ::-1].copy()
    ids = np.stack([rng.choice(n, k, replace=False) for _ in range(q)]).astype(np.int64)
    ids[rng.random((q, k)) < 0.05] = -1
    positives = [
        np.unique(rng.choice(ids[i][ids[i] >= 0][:20], rng.integers(1, 4))) for i in range(q)
    ]
    pmin = np.asarray([rng.uniform(-0.5, 0.9) for _ in range(q)])
    excluded = np.where(rng.random(q) < 0.3, ids[:, 1], -1)
    s = FilterSettings(num_negatives=options.pop("num_negatives", 4), **options)
    sel = select(ids, scores, positives, s, positive_min_Q=pmin, excluded_Q=excluded)
    expected = _oracle(ids, scores, positives, s, pmin, excluded)
    assert [x.tolist() for x in sel.negatives] == expected
    assert sel.shortfall == sum(len(e) < s.num_negatives for e in expected)
    for i, (neg, sc) in enumerate(zip(sel.negatives, sel.scores, strict=True)):
        assert not set(neg.tolist()) & set(positives[i].tolist())
        np.testing.assert_array_equal(sc, scores[i][[list(ids[i]).index(d) for d in neg]])


def test_random_sampling_draws_from_what_the_filters_leave():
    """``sampling_strategy random``: n distinct from the candidates ``top`` with a wide n would
    keep, in rank order, the same for the same seed and not for every seed."""
    rng = np.random.default_rng(1)
    scores = np.sort(rng.uniform(0, 1, (20, 50)).astype(np.float32), axis=1)[:, ::-1].copy()
    ids = np.tile(np.arange(50), (20, 1))
    positives = [np.asarray([i]) for i in range(20)]
    wide = select(
        ids, scores, positives, FilterSettings(num_negatives=30, max_score=0.8, range_max=30)
    )
    draws = [
        select(
            ids,
            scores,
            positives,
            FilterSettings(
                num_negatives=4, max_score=0.8, range_max=30, sampling_strategy="random", seed=seed
            ),
        )  # fmt: skip
        for seed in (0, 0, 1)
    ]
    for q in range(20):
        got = draws[0].negatives[q].tolist()
        assert len(set(got)) == len(got) == 4 and set(got) <= set(wide.negatives[q].tolist())
        assert got == sorted(got, key=list(ids[q]).index)
        assert got == draws[1].negatives[q].tolist()
    assert any(draws[0].negatives[q].tolist() != draws[2].negatives[q].tolist() for q in range(20))


def test_include_positives_keeps_their_slots_but_never_writes_them():
    """``include_positives``: a positive keeps its rank and takes a slot among the n (as in
    ST), is counted, and is never written as a negative."""
    ids = np.asarray([[7, 3, 9, 4, 5, 6]])
    scores = np.asarray([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]], dtype=np.float32)
    positives = [np.asarray([3])]
    plain = select(ids, scores, positives, FilterSettings(num_negatives=3))
    kept = select(ids, scores, positives, FilterSettings(num_negatives=3, include_positives=True))
    assert plain.negatives[0].tolist() == [7, 9, 4] and plain.ranks[0].tolist() == [1, 3, 4]
    assert kept.negatives[0].tolist() == [7, 9] and kept.positives_selected == 1
    assert kept.shortfall == 1 and plain.shortfall == 0


def test_bad_filter_settings_name_the_option():
    for kwargs, says in [
        ({"range_min": 5, "range_max": 5}, "--range_max 5 must be above --range_min 5"),
        ({"range_for_sampling": "10-2"}, "--range_for_sampling must be A-B"),
        ({"range_for_sampling": "2-10", "range_min": 1}, "replaces --range_min"),
        ({"sampling_strategy": "best"}, "--sampling_strategy must be one of"),
    ]:
        with pytest.raises(ValueError, match=says):
            FilterSettings(**kwargs)


# --------------------------------------------------------------------------- parity with ST
def test_top_picks_the_negatives_of_sentence_transformers(setup, tmp_path):
    """The same embeddings (our tiny encoder as a sentence-transformers folder, loaded by
    ST) and options: ``mine_hard_negatives(sampling_strategy="top")`` picks the same
    negatives for >= 99 % of queries, with and without a relative margin (ties aside:
    a differing pick scoring within 1e-5 of ours)."""
    st = pytest.importorskip("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    beir, model = setup
    text = {}
    for line in (beir / "corpus.jsonl").open():
        doc = json.loads(line)
        text[doc["_id"]] = doc["text"]
    queries = {json.loads(x)["_id"]: json.loads(x)["text"] for x in (beir / "queries.jsonl").open()}
    qrels = _qrels(beir)
    pairs = [(queries[q], text[d]) for q in qrels for d in sorted(qrels[q])]
    encoder = st.SentenceTransformer(str(model), device="cpu")
    for extra in ([], ["--relative_margin", "0.001"]):
        manifest, rows = _mine(tmp_path, model, "--beir", str(beir), "--num_negatives", "3", *extra)
        theirs = mine_hard_negatives(
            Dataset.from_dict({"anchor": [a for a, _ in pairs], "positive": [p for _, p in pairs]}),
            encoder, corpus=list(text.values()), num_negatives=3, sampling_strategy="top",
            output_format="labeled-list", output_scores=True, verbose=False,
            relative_margin=0.001 if extra else None,
        )  # fmt: skip
        st_neg: dict[str, list[tuple[str, float]]] = {}
        for row in theirs:
            st_neg[row["anchor"]] = list(zip(row["positive"][1:], row["scores"][1:], strict=True))
        same = 0
        for r in rows:
            ours = [(text[n["id"]], n["score"]) for n in r["negatives"]]
            them = st_neg.get(queries[r["query_id"]], [])
            tie = ours and them and abs(ours[-1][1] - them[-1][1]) < 1e-5
            strict = {t for t, _ in ours} == {t for t, _ in them}
            same += strict or bool(tie)
        assert same >= 0.99 * len(rows), (same, len(rows), extra)
        assert manifest["removed"]["relative_margin"] > 0 if extra else True


# --------------------------------------------------------------------------- the refresher
FILTERED = [
    ("top", {"max_score_ratio": 0.99}, ["--relative_margin", "0.01"]),
    ("random", {"max_score_ratio": 0.99}, ["--relative_margin", "0.01"]),
    (
        "top",
        {"absolute_margin": 0.0, "min_score": 0.5},
        ["--absolute_margin", "0", "--min_score", "0.5"],
    ),
    ("random", {"max_score": 0.95}, ["--max_score", "0.95"]),
]


@pytest.mark.parametrize(
    "strategy, filters, options", FILTERED, ids=[f"{s}-{'-'.join(f)}" for s, f, _ in FILTERED]
)
def test_mine_gives_the_refreshers_negatives_from_the_same_checkpoint(
    setup, tmp_path, strategy, filters, options
):
    """The refresher's version 1 from a checkpoint (``refresh_once``: top-120, n 3, seed
    0 + 1, its false-negative filter ``max_score_ratio`` or the score filters it shares with
    ``mine``) and ``mine`` on the same encoder with the same options in ST's and FE's names
    (``range_for_sampling 0-120``, ``relative_margin`` 1 - ratio, the same score filters,
    seed 1), its file read back with ``data.pairs``: the same negatives for every query the
    refresher did not top up with random passages, and a subset where it did (``mine`` counts
    those as shortfalls)."""
    from retromae_ds.data.pairs import read_examples
    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.finetuning import handoff
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig
    from retromae_ds.refresher.process import refresh_once
    from retromae_ds.refresher.stages import Group

    from helpers_ance import fake_checkpoint

    beir, model = setup
    run = tmp_path / "run"
    prepared = ance_data.prepare(
        beir, "train", model, run / "data", q_max_len=64, p_max_len=64, progress=False
    )
    ts = ance_data.load(prepared)
    mining = MiningConfig(top_k=120, num_negatives=3, strategy=strategy, **filters)
    cfg = RefreshConfig(run_dir=str(run), mining=mining, device="cpu", progress=False)
    published = refresh_once(cfg, ts, fake_checkpoint(run, 0, model), 1, Group(60))
    theirs = handoff.load_version(run / "negatives", 1)
    ids = ts.passage_ids.to_pylist()
    manifest, _ = _mine(
        tmp_path, model, "--beir", str(beir), "--sampling_strategy", strategy,
        "--range_for_sampling", "0-120", "--seed", "1", *options,
    )  # fmt: skip
    if "max_score_ratio" not in filters:  # the refresher's manifest counts what they dropped
        score_filters = published["false_negative_filter"]["score_filters"]
        assert set(score_filters) == set(filters) and sum(score_filters.values()) > 0
    mined = list(read_examples(tmp_path / "negatives.jsonl", "mined"))
    assert [ex.query_id for ex in mined] == ts.query_ids
    equal = 0
    for q, ex in enumerate(mined):
        ours = [p.id for p in ex.negatives]
        refresher = [ids[int(i)] for i in theirs.of(q)]
        if len(ours) == 3:
            equal += sorted(ours) == sorted(refresher)
        else:
            assert set(ours) < set(refresher)
    assert equal == len(mined) - manifest["shortfall"]["queries"] >= 20


@pytest.mark.slow
def test_finetune_from_the_mined_file_trains_on_its_negatives_as_v0(setup, tmp_path):
    """mine, then ``finetune --data.pairs`` on its file: the run's first version holds, per
    query, exactly the mined negatives (the refresher's own, test above), in their order."""
    from test_finetune import finetune

    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.finetuning import handoff

    beir, model = setup
    _, lines = _mine(tmp_path, model, "--beir", str(beir), "--num_negatives", "3")
    mined = {r["query_id"]: [n["id"] for n in r["negatives"]] for r in lines}
    run = tmp_path / "run"
    finetune(
        run,
        *("--data.pairs", str(tmp_path / "negatives.jsonl"), "--data.corpus", str(beir)),
        *("--model.init", str(model), "--data.q_max_len", "16", "--data.p_max_len", "32"),
        *("--micro_batch_size", "4", "--negatives.n_hard", "1", "--max_steps", "1"),
        *("--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]'),
    )
    ts = ance_data.load(run / "data")
    v0 = handoff.load_version(run / "negatives", 0)
    pid = ts.passage_ids.to_pylist()
    got = {q: [pid[i] for i in v0.of(k)] for k, q in enumerate(ts.query_ids)}
    full = {q: n for q, n in mined.items() if n}
    assert {q: got[q] for q in full} == full
    manifest = json.loads(handoff.manifest_file(run / "negatives", 0).read_text())
    assert manifest["source"] == "file"
    assert manifest["queries_from_bm25"] == len(mined) - len(full)
