"""Retrieval evaluation: BEIR loading (and its errors), the encoder, the whole job on a synthetic
BEIR folder, and end to end on SciFact with a real model against a reference figure."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from retromae_ds.cli import main as cli_main
from retromae_ds.eval.run import evaluate_beir, retrieve
from retromae_ds.retrieval.beir import load_beir, load_corpus, load_qrels, load_queries
from retromae_ds.retrieval.encode import HFEncoder, encode_texts

from helpers_model import tiny_bert_dir
from synthetic import synthetic_texts

VOCAB = ["apple", "banana", "cherry", "grape", "lemon", "mango"]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def write_beir(folder: Path) -> Path:
    """Six documents, each about one fruit; query i asks about fruit i."""
    (folder / "qrels").mkdir(parents=True)
    corpus = [
        {"_id": "d0", "title": "Apple", "text": "apple apple apple"},
        {"_id": "d1", "title": "", "text": "apple banana"},
        {"_id": "d2", "text": "banana banana banana"},
        {"_id": "d3", "title": "Cherry", "text": "cherry", "metadata": {}},
        {"_id": "q2", "title": None, "text": "cherry cherry cherry cherry"},  # id = a query id
        {"_id": "d5", "title": "grape", "text": "lemon"},
    ]
    write_jsonl(folder / "corpus.jsonl", corpus)
    queries = [{"_id": f"q{i}", "text": word} for i, word in enumerate(VOCAB)]
    write_jsonl(folder / "queries.jsonl", queries)
    qrels = ["query-id\tcorpus-id\tscore", "q0\td0\t2", "q0\td1\t1", "q1\td2\t1", "q2\td3\t1"]
    qrels += ["q4\td5\t0"]  # no relevant document: counts as 0, as BEIR averages
    (folder / "qrels" / "test.tsv").write_text("\n".join(qrels) + "\n", encoding="utf-8")
    return folder


def bag_of_words(texts: list[str]) -> np.ndarray:
    """A real (if simple) encoder: normalised counts of the VOCAB words."""
    counts = np.array([[t.lower().split().count(w) for w in VOCAB] for t in texts], np.float32)
    return counts / np.maximum(np.linalg.norm(counts, axis=1, keepdims=True), 1e-9)


# --- loading ---------------------------------------------------------------------------------


def test_load_beir_joins_title_and_keeps_qrels_queries(tmp_path):
    data = load_beir(write_beir(tmp_path))
    assert data.corpus_ids == ["d0", "d1", "d2", "d3", "q2", "d5"]
    assert data.corpus_texts[:2] == ["Apple apple apple apple", "apple banana"]
    assert data.corpus_texts[4] == "cherry cherry cherry cherry"
    assert data.corpus_texts[5] == "grape lemon"
    assert data.query_ids == ["q0", "q1", "q2", "q4"]  # qrels order, q3/q5 dropped
    assert data.query_texts == ["apple", "banana", "cherry", "lemon"]
    assert data.qrels["q0"] == {"d0": 2, "d1": 1}
    assert data.summary() == "6 documents, 4 queries, 5 qrels"


def test_qrels_header_is_optional(tmp_path):
    path = tmp_path / "q.tsv"
    path.write_text("q1\td1\t1\nq1\td2\t0\n")
    assert load_qrels(path) == {"q1": {"d1": 1, "d2": 0}}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"_id": "x", "text": "a"', r"corpus\.jsonl:3: not valid JSON"),
        ('{"text": "a"}', r"corpus\.jsonl:3: missing field '_id'"),
        ('{"_id": "d0", "text": "a"}', r"corpus\.jsonl:3: duplicate _id 'd0' \(first on line 1\)"),
        ('{"_id": "x", "text": 5}', r"corpus\.jsonl:3: field 'text' is int"),
        ('["_id", "text"]', r"corpus\.jsonl:3: expected a JSON object"),
    ],
)
def test_malformed_corpus_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"_id": "d0", "text": "a"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_corpus(path)


def test_malformed_queries_and_qrels_name_file_and_line(tmp_path):
    queries = tmp_path / "queries.jsonl"
    queries.write_text('{"_id": "q1", "text": "a"}\n{"_id": "q1", "text": "b"}\n')
    with pytest.raises(ValueError, match=r"queries\.jsonl:2: duplicate query _id 'q1'"):
        load_queries(queries)
    qrels = tmp_path / "test.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1 d2 1\n")
    with pytest.raises(ValueError, match=r"test\.tsv:3: expected 3 tab-separated fields"):
        load_qrels(qrels)
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\thigh\n")
    with pytest.raises(ValueError, match=r"test\.tsv:3: score 'high' is not an integer"):
        load_qrels(qrels)


def test_missing_files_and_unknown_queries(tmp_path):
    folder = write_beir(tmp_path / "ds")
    with pytest.raises(FileNotFoundError, match=r"dev\.tsv.*splits available: test"):
        load_beir(folder, "dev")
    with pytest.raises(FileNotFoundError, match="no such BEIR dataset folder"):
        load_beir(tmp_path / "nowhere")
    with open(folder / "qrels" / "test.tsv", "a") as f:
        f.write("q99\td0\t1\n")
    with pytest.raises(ValueError, match=r"1 query ids have no entry in .*queries\.jsonl.*q99"):
        load_beir(folder)
    (folder / "corpus.jsonl").unlink()
    (folder / "qrels" / "test.tsv").write_text("q0\td0\t1\n")
    with pytest.raises(FileNotFoundError, match=r"corpus\.jsonl: no such file"):
        load_beir(folder)


# --- the job on synthetic data -----------------------------------------------------------------


def test_evaluate_beir_with_a_callable_encoder(tmp_path, capsys):
    folder = write_beir(tmp_path / "ds")
    out = tmp_path / "out" / "result.json"
    result = evaluate_beir(bag_of_words, folder, out_json=out, progress=False)
    # q0: d0 then d1 (ideal order), q1: d2 first, q2: d3 first once the doc named q2 is ignored
    # q4 has no relevant document and scores 0 on every measure (BEIR's mean over 4 queries)
    assert result["metrics"] == pytest.approx(
        {"ndcg@10": 0.75, "mrr@10": 0.75, "recall@100": 0.75, "recall@1000": 0.75}
    )
    assert result["num_queries"] == 4 and result["num_queries_skipped"] == 0
    assert result["num_corpus"] == 6 and result["model"] == "bag_of_words"
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    printed = capsys.readouterr().out
    assert "ndcg@10      0.7500" in printed and str(out) in printed

    # without BEIR's identical-id rule, the document named "q2" outranks d3 for query q2
    kept = evaluate_beir(bag_of_words, folder, ignore_identical_ids=False, verbose=False)
    assert kept["per_query"]["q2"]["mrr@10"] == pytest.approx(0.5)
    assert kept["per_query"]["q2"]["ndcg@10"] == pytest.approx(1 / np.log2(3))


def test_retrieve_returns_k_documents_after_dropping_identical_ids():
    emb = np.eye(3, dtype=np.float32)
    run = retrieve(emb, emb, ["a", "b", "c"], ["a", "b", "c"], 2)
    assert all(len(docs) == 2 and qid not in docs for qid, docs in run.items())
    run = retrieve(emb[:1], emb, ["a"], ["a", "b", "c"], 5, ignore_identical_ids=False)
    assert run["a"] == pytest.approx({"a": 1.0, "b": 0.0, "c": 0.0})


def test_encode_texts_checks_the_encoder():
    with pytest.raises(ValueError, match=r"shape \(1, 2\) for 2 texts"):
        encode_texts(lambda texts: np.zeros((1, 2)), ["a", "b"])
    with pytest.raises(ValueError, match="NaN"):
        encode_texts(lambda texts: np.full((2, 2), np.nan), ["a", "b"])
    out = encode_texts(lambda texts: torch.ones(len(texts), 3, dtype=torch.float64), ["a", "b"])
    assert out.dtype == np.float32 and out.shape == (2, 3)


# --- the Hugging Face encoder, on a small random BERT -------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return tiny_bert_dir(tmp_path_factory.mktemp("tiny_bert"), tokenizer_dir)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_hf_encoder_equals_one_text_at_a_time(tiny_model_dir, pooling):
    from transformers import AutoModel, AutoTokenizer

    texts = synthetic_texts(23, seed=3) + ["x"]  # lengths vary; some exceed max_length
    encoder = HFEncoder.from_dir(
        tiny_model_dir, pooling=pooling, max_length=48, batch_size=5, device="cpu", progress=False
    )
    got = encoder(texts)
    assert got.shape == (24, 32) and got.dtype == np.float32

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(tiny_model_dir, local_files_only=True).eval()
    with torch.no_grad():
        for i, text in enumerate(texts):
            batch = tokenizer(text, truncation=True, max_length=48, return_tensors="pt")
            hidden_LD = model(**batch).last_hidden_state[0]
            expected = hidden_LD[0] if pooling == "cls" else hidden_LD.mean(0)
            np.testing.assert_allclose(got[i], expected.numpy(), rtol=1e-4, atol=1e-5)


def test_hf_encoder_normalises_and_restores_training_mode(tiny_model_dir):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_model_dir, local_files_only=True).train()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    encoder = HFEncoder(model, tokenizer, normalize=True, progress=False)
    emb = encoder(synthetic_texts(9, seed=4))
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    assert model.training  # in-process use (pre-training) gets its model back as it was
    assert encoder([]).shape == (0, 32)
    with pytest.raises(ValueError, match="pooling"):
        HFEncoder(model, tokenizer, pooling="max")
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face encoder folder"):
        HFEncoder.from_dir(tiny_model_dir.parent)


def test_a_run_folder_evaluates_its_newest_checkpoint_not_its_training_config(
    tiny_model_dir, tmp_path
):
    """``eval --model RUN_DIR``: the run's config.json is a training config, not a model's."""
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run_dir": str(run), "seed": 0}))
    step = run / "checkpoints" / "step_00000002"
    shutil.copytree(tiny_model_dir, step / "encoder")
    (step / "COMPLETE").write_text(json.dumps({"step": 2, "world_size": 1}))
    texts = synthetic_texts(5, seed=9)
    direct = HFEncoder.from_dir(tiny_model_dir, device="cpu", progress=False)(texts)
    via_run = HFEncoder.from_dir(run, device="cpu", progress=False)(texts)
    np.testing.assert_array_equal(direct, via_run)


def test_cmd_eval_writes_json(tiny_model_dir, tmp_path):
    folder = write_beir(tmp_path / "ds")
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(tiny_model_dir), "--beir", str(folder), "--pooling", "mean"]
    argv += ["--normalize", "--max_length", "32", "--batch_size", "4", "--device", "cpu"]
    argv += ["--out", str(out), "--progress", "false"]
    assert cli_main(argv) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["pooling"] == "mean" and result["settings"]["dim"] == 32
    assert result["settings"]["device"] == "cpu"
    assert result["num_queries"] == 4 and set(result["metrics"]) == {
        "ndcg@10",
        "mrr@10",
        "recall@100",
        "recall@1000",
    }
    assert all(0.0 <= v <= 1.0 for v in result["metrics"].values())
    # 6 documents: every one is retrieved, so recall is 1 for the 3 queries with a relevant
    # document and 0 for q4, which has none
    assert result["metrics"]["recall@1000"] == 0.75


# --- end to end on real data --------------------------------------------------------------------

SCIFACT_NDCG10 = 0.645  # all-MiniLM-L6-v2, mean pooling, measured independently (DESIGN.md)


def cpu_autocast_dtype() -> torch.dtype | None:
    """bfloat16 where the CPU computes it natively (1.5-2x faster here), else float32.

    Both land on the reference: nDCG@10 0.6451 in float32, 0.6457 under bfloat16 autocast.
    """
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return torch.bfloat16 if native else None


@pytest.mark.gpu
def test_scifact_ndcg_matches_reference(shared_data, minilm_dir, tmp_path):
    """The whole SciFact test split (5,183 documents) lands on the published figure. On a GPU
    only: on 2 CPU cores it is ~6 minutes of MiniLM encoding; the CPU suite checks the same
    pipeline against an independent one on a sub-collection (next test)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (on CPU: the sub-collection test below)")
    scifact = shared_data / "scifact"
    if not (scifact / "corpus.jsonl").is_file():
        pytest.skip(f"{scifact} is absent")
    result = evaluate_beir(
        minilm_dir,
        scifact,
        "test",
        pooling="mean",
        normalize=True,
        max_length=256,
        batch_size=64,
        device="cuda",
        out_json=tmp_path / "scifact.json",
        progress=False,
    )
    assert result["num_queries"] == 300 and result["num_corpus"] == 5183
    assert result["metrics"]["ndcg@10"] == pytest.approx(SCIFACT_NDCG10, abs=0.01)
    assert 0 < result["metrics"]["mrr@10"] <= 1
    assert result["metrics"]["recall@100"] <= result["metrics"]["recall@1000"] <= 1


@pytest.mark.slow
def test_scifact_metrics_equal_an_independent_pipeline(shared_data, minilm_dir, tmp_path):
    """A SciFact sub-collection (60 test queries; the 60+ documents they judge and 200
    others): ``evaluate_beir`` with all-MiniLM-L6-v2 gives the figures that sentence-
    transformers' own encoding, exact numpy search and trec_eval (ir-measures) give, both in
    float32; under bfloat16 autocast within 0.01 (nDCG@10 came 0.0029 off with transformers
    5.25 on this machine's CPU, over the 2e-3 this test once allowed it)."""
    scifact = shared_data / "scifact"
    if not (scifact / "corpus.jsonl").is_file():
        pytest.skip(f"{scifact} is absent")
    from helpers_ance import scifact_slice

    ir_measures = pytest.importorskip("ir_measures", reason="ir-measures (dev extra)")
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (dev extra)")
    sub = scifact_slice(scifact, tmp_path / "sub", extra_docs=200, test_queries=60)

    def ours(amp_dtype):
        return evaluate_beir(
            minilm_dir,
            sub,
            "test",
            pooling="mean",
            normalize=True,
            max_length=256,
            batch_size=32,
            device="cpu",
            amp_dtype=amp_dtype,
            progress=False,
            verbose=False,
        )

    result = ours(None)  # float32, as the independent pipeline encodes
    assert result["num_queries"] == 60

    # the independent pipeline: BEIR's text, sentence-transformers, numpy, trec_eval
    corpus = [json.loads(line) for line in (sub / "corpus.jsonl").read_text().splitlines()]
    assert result["num_corpus"] == len(corpus) >= 260
    qrels = [row.split("\t") for row in (sub / "qrels" / "test.tsv").read_text().split("\n")[1:-1]]
    qids = list(dict.fromkeys(q for q, _, _ in qrels))
    by_id = {}
    for line in (sub / "queries.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_id[record["_id"]] = record["text"]
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    model.max_seq_length = 256
    docs = model.encode(
        [f"{d.get('title') or ''} {d['text']}".strip() for d in corpus],
        batch_size=32,
        normalize_embeddings=True,
    )
    queries = model.encode([by_id[q] for q in qids], batch_size=32, normalize_embeddings=True)
    scores = queries @ docs.T
    run = []
    for qi, qid in enumerate(qids):
        top = np.argsort(-scores[qi], kind="stable")[:1000]
        run += [
            ir_measures.ScoredDoc(qid, corpus[j]["_id"], float(scores[qi, j]))
            for j in top
            if corpus[j]["_id"] != qid  # BEIR ignores a document whose id is the query's
        ]
    judged = [ir_measures.Qrel(q, d, int(r)) for q, d, r in qrels]
    measures = {
        "ndcg@10": ir_measures.nDCG @ 10,
        "mrr@10": ir_measures.RR @ 10,
        "recall@100": ir_measures.R @ 100,
    }
    reference = ir_measures.calc_aggregate(list(measures.values()), judged, run)
    for name, measure in measures.items():
        assert result["metrics"][name] == pytest.approx(reference[measure], abs=2e-3), name
    assert 0.4 < result["metrics"]["ndcg@10"] < 0.95  # a real retriever, not a degenerate run
    # bfloat16 autocast where the CPU has it natively: rankings move by a few swaps (one swap
    # in one of 60 queries moves the mean nDCG@10 by up to ~0.006), not more
    if cpu_autocast_dtype() is not None:
        fast = ours(cpu_autocast_dtype())
        for name, measure in measures.items():
            assert fast["metrics"][name] == pytest.approx(reference[measure], abs=0.01), name
