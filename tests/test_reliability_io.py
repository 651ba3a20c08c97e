"""Reliability of the files export and evaluation touch (issue 13): an export never deletes a
run, a checkpoint or an unrelated folder; a model folder without its tokenizer is an error; a
BEIR folder that cannot give a meaningful score is an error, and qrels documents missing from
the corpus are reported."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from retromae_ds.cli import main
from retromae_ds.eval.run import evaluate_beir
from retromae_ds.export import export_encoder
from retromae_ds.retrieval.encode import HFEncoder

WORDS = ["apple", "banana", "cherry"]


def tiny_bert_config(vocab_size: int):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir) -> Path:
    """``mlm``: a tiny masked-LM BERT with its tokenizer; ``no_tokenizer``: a BERT body saved
    alone; ``wrong_tokenizer``: the tokenizer with a model of a far larger vocabulary."""
    from transformers import AutoTokenizer, BertForMaskedLM, BertModel

    root = tmp_path_factory.mktemp("models")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    torch.manual_seed(0)
    BertForMaskedLM(tiny_bert_config(len(tokenizer))).save_pretrained(root / "mlm")
    tokenizer.save_pretrained(root / "mlm")
    BertModel(tiny_bert_config(len(tokenizer))).save_pretrained(root / "no_tokenizer")
    BertModel(tiny_bert_config(4 * len(tokenizer))).save_pretrained(root / "wrong_tokenizer")
    tokenizer.save_pretrained(root / "wrong_tokenizer")
    return root


def make_run(root: Path, model_dir: Path, step: int = 2) -> Path:
    """A run folder in the real layout: metrics and one complete checkpoint."""
    import shutil

    checkpoint = root / "checkpoints" / f"step_{step:08d}"
    shutil.copytree(model_dir, checkpoint / "encoder")
    (checkpoint / "COMPLETE").write_text(json.dumps({"step": step, "world_size": 1}))
    (root / "metrics.jsonl").write_text(json.dumps({"step": step, "loss": 1.0}) + "\n")
    return root


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# --- export: what it may replace -----------------------------------------------------------------


def test_export_into_its_own_run_is_refused_and_deletes_nothing(models, tmp_path, capsys):
    run = make_run(tmp_path / "victim", models / "mlm")
    before = tree(run)
    assert main(["export", str(run), str(run)]) != 0
    assert tree(run) == before
    assert str(run) in capsys.readouterr().err
    # nor with --overwrite, nor into a folder inside it, nor into a folder holding it
    for out in (run, run / "checkpoints" / "step_00000002" / "encoder" / "x", tmp_path):
        with pytest.raises(ValueError, match="source|run or a checkpoint"):
            export_encoder(run, out, overwrite=True)
    assert tree(run) == before


def test_export_never_replaces_another_run_or_checkpoint(models, tmp_path):
    run = make_run(tmp_path / "run", models / "mlm")
    other = make_run(tmp_path / "other", models / "mlm", step=5)
    before = tree(other)
    with pytest.raises(ValueError, match=r"other.*run or a checkpoint.*checkpoints"):
        export_encoder(run, other, overwrite=True)
    metrics_only = tmp_path / "metrics_only"
    metrics_only.mkdir()
    (metrics_only / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="metrics.jsonl"):
        export_encoder(run, metrics_only, overwrite=True)
    checkpoint_inside = tmp_path / "holder" / "step_00000001"
    checkpoint_inside.mkdir(parents=True)
    (checkpoint_inside / "COMPLETE").write_text("{}")
    with pytest.raises(ValueError, match="COMPLETE"):
        export_encoder(run, tmp_path / "holder", overwrite=True)
    assert tree(other) == before and (metrics_only / "metrics.jsonl").is_file()
    assert (checkpoint_inside / "COMPLETE").is_file()


def test_a_non_empty_folder_needs_overwrite(models, tmp_path):
    run = make_run(tmp_path / "run", models / "mlm")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"out.*not empty.*notes\.txt.*--overwrite"):
        export_encoder(run, out)
    assert (out / "notes.txt").read_text() == "mine"
    assert main(["export", str(run), str(out)]) != 0
    assert (out / "notes.txt").read_text() == "mine"
    assert main(["export", str(run), str(out), "--overwrite"]) == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()


def test_a_previous_export_an_empty_folder_or_a_missing_path_is_replaced(models, tmp_path):
    run = make_run(tmp_path / "run", models / "mlm")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = export_encoder(run, empty)
    marker = json.loads((out / "export.json").read_text())
    assert marker["step"] == 2
    assert marker["source"] == str((run / "checkpoints" / "step_00000002").resolve())
    again = export_encoder(run, out, pooling="mean")  # a previous export: no --overwrite needed
    assert json.loads((again / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    fresh = export_encoder(run, tmp_path / "new" / "exported")
    assert (fresh / "tokenizer.json").is_file() and (fresh / "export.json").is_file()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # no staging folder left behind


def test_a_folder_named_like_the_staging_folder_survives(models, tmp_path):
    run = make_run(tmp_path / "run", models / "mlm")
    bystander = tmp_path / "exported.partial"
    bystander.mkdir()
    (bystander / "keep.txt").write_text("keep")
    export_encoder(run, tmp_path / "exported")
    assert (bystander / "keep.txt").read_text() == "keep"


# --- a model folder's tokenizer ------------------------------------------------------------------


def test_a_model_folder_without_tokenizer_files_is_an_error(models, tmp_path, capsys):
    folder = models / "no_tokenizer"
    with pytest.raises(ValueError, match=r"no_tokenizer.*no tokenizer files"):
        HFEncoder.from_dir(folder, device="cpu", progress=False)
    beir = write_beir(tmp_path / "ds", corpus_ids=["d0", "d1", "d2"])
    argv = ["eval", "--model", str(folder), "--beir", str(beir), "--device", "cpu"]
    assert main([*argv, "--progress", "false"]) != 0
    assert "no tokenizer files" in capsys.readouterr().err


def test_a_tokenizer_far_smaller_than_the_model_vocabulary_is_an_error(models, tokenizer_dir):
    from transformers import AutoTokenizer

    from retromae_ds.hf.util import load_tokenizer_checked

    size = len(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True))
    with pytest.raises(
        ValueError, match=rf"wrong_tokenizer.*{size} tokens.*vocab_size is {4 * size}"
    ):
        load_tokenizer_checked(models / "wrong_tokenizer")
    assert len(load_tokenizer_checked(models / "mlm")) == size


def test_fine_tuning_data_refuses_an_init_folder_without_tokenizer(models, tmp_path):
    from retromae_ds.finetuning.data import prepare

    beir = write_beir(tmp_path / "ds", corpus_ids=["d0", "d1", "d2"])
    with pytest.raises(ValueError, match=r"no_tokenizer.*no tokenizer files"):
        prepare(
            beir, "test", models / "no_tokenizer", tmp_path / "prepared", q_max_len=8, p_max_len=16
        )
    assert not (tmp_path / "prepared").exists()


# --- evaluation data that cannot score -----------------------------------------------------------


def write_beir(folder: Path, corpus_ids: list[str], qrels: list[str] | None = None) -> Path:
    """Document i of ``corpus_ids`` is about WORDS[i % 3]; query qi asks about WORDS[i]."""
    (folder / "qrels").mkdir(parents=True)
    corpus = [{"_id": d, "text": WORDS[i % 3]} for i, d in enumerate(corpus_ids)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    queries = [{"_id": f"q{i}", "text": w} for i, w in enumerate(WORDS)]
    (folder / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
    qrels = ["q0\td0\t1", "q1\td1\t1", "q2\td2\t1"] if qrels is None else qrels
    (folder / "qrels" / "test.tsv").write_text("\n".join(["query-id\tcorpus-id\tscore", *qrels]))
    return folder


def bag_of_words(texts: list[str]) -> np.ndarray:
    counts = np.array([[t.split().count(w) for w in WORDS] for t in texts], np.float32)
    return counts / np.maximum(np.linalg.norm(counts, axis=1, keepdims=True), 1e-9)


def test_an_empty_corpus_is_an_error_naming_the_file(models, tmp_path, capsys):
    folder = write_beir(tmp_path / "ds", corpus_ids=[])
    with pytest.raises(ValueError, match=r"corpus\.jsonl.*no documents"):
        evaluate_beir(bag_of_words, folder, verbose=False, progress=False)
    argv = ["eval", "--model", str(models / "mlm"), "--beir", str(folder), "--device", "cpu"]
    assert main([*argv, "--progress", "false"]) != 0
    assert "corpus.jsonl" in capsys.readouterr().err


def test_no_judged_queries_is_an_error_naming_the_qrels(tmp_path):
    folder = write_beir(tmp_path / "ds", corpus_ids=["d0", "d1", "d2"], qrels=[])
    with pytest.raises(ValueError, match=r"test\.tsv.*no queries with qrels"):
        evaluate_beir(bag_of_words, folder, verbose=False, progress=False)


def test_judged_documents_missing_from_the_corpus_are_reported(tmp_path, capsys):
    folder = write_beir(tmp_path / "ds", corpus_ids=["d0", "d1", "x2"])  # d2 is judged, absent
    out = tmp_path / "result.json"
    result = evaluate_beir(bag_of_words, folder, verbose=False, progress=False, out_json=out)
    assert result["qrels_docs_missing"] == 1
    assert json.loads(out.read_text())["qrels_docs_missing"] == 1
    assert result["metrics"]["recall@100"] == pytest.approx(2 / 3)  # still scored as a miss
    err = capsys.readouterr().err
    assert "warning" in err and "1 judged document" in err and "d2" in err

    complete = write_beir(tmp_path / "ok", corpus_ids=["d0", "d1", "d2"])
    assert evaluate_beir(bag_of_words, complete, verbose=False)["qrels_docs_missing"] == 0
    assert "warning" not in capsys.readouterr().err


def test_all_judged_documents_missing_is_an_error(tmp_path):
    folder = write_beir(tmp_path / "ds", corpus_ids=["x0", "x1", "x2"])
    with pytest.raises(ValueError, match=r"test\.tsv.*none of the 3 judged documents"):
        evaluate_beir(bag_of_words, folder, verbose=False, progress=False)
