"""``eval`` and ``export`` of what fine-tuning writes (issue 46, third hostile pass; each test
failed on the code before its fix):

- item 1: a run with separate towers (``--model.shared false``) is evaluated with its query
  tower for the queries, and its export keeps both towers (a sentence-transformers ``Router``)
  and evaluates the same as the run;
- item 9: ``eval --model RUN`` whose newest checkpoint the live run prunes between resolving
  and loading it goes on with the run's newest (a named checkpoint says it was removed);
- item 10: ``eval --out`` never writes inside the model or the BEIR folder, nor over a file
  that is not an earlier result;
- item 12: BEIR's ``ignore_identical_ids`` is a flag, said in one line with its counts
  whenever it drops anything, and recorded in the result.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from retromae_ds.cli import main
from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import step_tag
from retromae_ds.hf import sbert

from helpers_ance import ENV, REPO, write_synthetic_beir, write_tiny_encoder


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if line.strip()]


def make_checkpoint(run: Path, model_dir: Path, step: int) -> Path:
    """A complete checkpoint in the real layout, its record listing every file's hash."""
    checkpoint = run / "checkpoints" / step_tag(step)
    shutil.copytree(model_dir, checkpoint / "encoder")
    record = {"step": step, "world_size": 1, "files": ckpt.file_records(checkpoint)}
    (checkpoint / "COMPLETE").write_text(json.dumps(record))
    return checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_dir) -> Path:
    return write_tiny_encoder(tmp_path_factory.mktemp("tiny") / "model", tokenizer_dir)


@pytest.fixture(scope="module")
def beir(tmp_path_factory) -> Path:
    folder = write_synthetic_beir(tmp_path_factory.mktemp("beir") / "beir", 30, 8)
    shutil.copy(folder / "qrels" / "train.tsv", folder / "qrels" / "test.tsv")
    return folder


EVAL = ["--split", "test", "--progress", "false", "--device", "cpu"]


# --- item 1: separate towers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def towers_run(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    """A real fine-tuning run with ``--model.shared false`` (4 steps, a checkpoint every 2)."""
    root = tmp_path_factory.mktemp("towers")
    beir = write_synthetic_beir(root / "beir", num_docs=60, num_queries=16)
    shutil.copy(beir / "qrels" / "train.tsv", beir / "qrels" / "test.tsv")
    init = write_tiny_encoder(root / "init", tokenizer_dir)
    run = root / "run"
    args = [
        "--run_dir", str(run), "--progress", "false", "--data.beir", str(beir),
        "--model.init", str(init), "--model.shared", "false",
        "--data.q_max_len", "16", "--data.p_max_len", "32",
        "--micro_batch_size", "4", "--negatives.n_hard", "1", "--refresh.mining.num_negatives", "3",
        "--max_steps", "4", "--checkpoint.every_steps", "2", "--log_every", "1",
        "--optim.lr", "3e-3", "--optim.warmup_steps", "1",
        "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]',
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "retromae_ds.finetune", *args],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return run, beir


def _eval(model: Path, beir: Path, out: Path, capsys) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--beir", str(beir), *EVAL, "--out", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().err


def test_separate_towers_are_evaluated_and_exported_as_two(towers_run, tmp_path, capsys):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from retromae_ds.eval.run import evaluate_embeddings
    from retromae_ds.export import export_encoder
    from retromae_ds.retrieval.beir import load_beir
    from retromae_ds.retrieval.encode import HFEncoder

    run, beir = towers_run
    step = ckpt.latest_complete(run / "checkpoints")
    assert (step / "query_encoder" / "config.json").is_file()

    via_run, _ = _eval(run, beir, tmp_path / "run.json", capsys)
    via_step, _ = _eval(step, beir, tmp_path / "step.json", capsys)
    alone, err = _eval(step / "encoder", beir, tmp_path / "alone.json", capsys)
    assert via_run["encoder_dir"] == str(step / "encoder")
    assert via_run["query_encoder_dir"] == str(step / "query_encoder")
    assert via_step["metrics"] == via_run["metrics"]
    assert via_step["per_query"] == via_run["per_query"]
    # the passage tower named alone encodes both sides, and says what it leaves out
    assert alone["query_encoder_dir"] is None
    assert "query_encoder" in err and "not used" in err, err
    assert alone["metrics"]["ndcg@10"] != via_run["metrics"]["ndcg@10"]

    # the oracle: each tower loaded by hand, queries through the query tower
    data = load_beir(beir, "test")
    spec = sbert.read_spec(step / "encoder")
    assert spec.max_length == 32  # the passages trained at
    own = dict(pooling=spec.pooling, normalize=spec.normalize, max_length=spec.max_length)
    passages = HFEncoder.from_dir(step / "encoder", progress=False, device="cpu", **own)
    queries = HFEncoder.from_dir(step / "query_encoder", progress=False, device="cpu", **own)
    mean, _ = evaluate_embeddings(data, queries(data.query_texts), passages(data.corpus_texts))
    assert mean == pytest.approx(via_run["metrics"], abs=1e-6)

    # the export keeps both towers, said in one line, and evaluates as the run does
    capsys.readouterr()
    out = export_encoder(run, tmp_path / "exported")
    err = capsys.readouterr().err
    assert "query tower" in err and str(out / "query_encoder") in err, err
    assert (out / "query_encoder" / "model.safetensors").is_file()
    assert json.loads((out / "export.json").read_text())["query_encoder"] == "query_encoder"
    exported, _ = _eval(out, beir, tmp_path / "export.json", capsys)
    assert exported["query_encoder_dir"] == str(out / "query_encoder")
    assert exported["metrics"] == via_run["metrics"]
    assert exported["per_query"] == via_run["per_query"]

    # sentence-transformers routes queries and documents to the towers; AutoModel loads the
    # passage tower
    texts = ["claims about proteins", "a much longer passage " * 10, "x"]
    st = SentenceTransformer(str(out), device="cpu")
    np.testing.assert_allclose(st.encode_query(texts), queries(texts), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st.encode_document(texts), passages(texts), rtol=1e-5, atol=1e-5)
    assert not np.allclose(queries(texts), passages(texts), atol=1e-4)
    body = AutoModel.from_pretrained(str(out))
    want = AutoModel.from_pretrained(str(step / "encoder"))
    for (name, a), b in zip(body.named_parameters(), want.parameters(), strict=False):
        if not name.startswith("pooler."):
            torch.testing.assert_close(a, b)


def test_a_router_is_read_only_with_one_transformer_per_route(tmp_path):
    """What ``eval`` reads of a Router: each route one Transformer, both routes there; any
    other module in a route is named, never silently dropped."""
    st = "sentence_transformers.models."
    folder = tmp_path / "model"
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Router"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    router = {
        "types": {"q": st + "Transformer", "d": st + "Transformer", "x": st + "Dense"},
        "structure": {"query": ["q"], "document": ["d"]},
    }
    (folder / "router_config.json").write_text(json.dumps(router))
    assert sbert.routed_towers(folder) == (folder / "d", folder / "q")
    assert sbert.read_spec(folder).pooling == "cls"
    router["structure"]["query"] = ["q", "x"]
    (folder / "router_config.json").write_text(json.dumps(router))
    with pytest.raises(ValueError, match=r"router_config\.json: route 'query' .*Dense"):
        sbert.routed_towers(folder)
    router["structure"] = {"document": ["d"]}
    (folder / "router_config.json").write_text(json.dumps(router))
    with pytest.raises(ValueError, match="without both a 'query' and a 'document' route"):
        sbert.routed_towers(folder)


# --- item 9: eval of a run that prunes its checkpoint ------------------------------------------


def _prune_after_resolving(monkeypatch, run: Path) -> list[str]:
    """The run publishes step 6 and prunes (keep_last 1) right after ``eval`` resolved its
    newest checkpoint, before a file of it is read: the race, every time."""
    real = ckpt.resolve_checkpoint
    resolved: list[str] = []

    def resolve_then_prune(path, *args, **kwargs):
        found = real(path, *args, **kwargs)
        resolved.append(found.name)
        if len(resolved) == 1:
            root = run / "checkpoints"
            step6 = root / step_tag(6)
            shutil.copytree(found, step6)
            record = {**ckpt.read_marker(step6), "step": 6}
            (step6 / "COMPLETE").write_text(json.dumps(record))
            ckpt.prune(root, 1)
        return found

    monkeypatch.setattr(ckpt, "resolve_checkpoint", resolve_then_prune)
    return resolved


def test_eval_of_a_run_goes_on_with_the_newest_when_the_run_prunes_its_checkpoint(
    tiny, beir, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    make_checkpoint(run, tiny, 2)
    make_checkpoint(run, tiny, 4)
    resolved = _prune_after_resolving(monkeypatch, run)
    out = tmp_path / "result.json"
    code = main(["eval", "--model", str(run), "--beir", str(beir), *EVAL, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert resolved[:2] == [step_tag(4), step_tag(6)], resolved
    result = json.loads(out.read_text())
    assert result["encoder_dir"] == str(run / "checkpoints" / step_tag(6) / "encoder")
    said = [line for line in err.splitlines() if "removed" in line]
    assert len(said) == 1 and step_tag(4) in said[0] and step_tag(6) in said[0], err


def test_eval_of_a_named_checkpoint_that_is_pruned_says_so(
    tiny, beir, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    make_checkpoint(run, tiny, 2)
    step4 = make_checkpoint(run, tiny, 4)
    _prune_after_resolving(monkeypatch, run)
    assert main(["eval", "--model", str(step4), "--beir", str(beir), *EVAL]) == 1
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1, err
    assert err.startswith(f"retromae-ds eval: error: {step4}") and "removed" in err, err
    assert "neither a Hugging Face" not in err, err


# --- item 10: eval --out never overwrites its inputs ----------------------------------------


def test_eval_out_is_never_inside_its_inputs_nor_over_another_file(tiny, beir, tmp_path, capsys):
    model = Path(shutil.copytree(tiny, tmp_path / "model"))
    run = tmp_path / "run"
    step2 = make_checkpoint(run, tiny, 2)
    data = Path(shutil.copytree(beir, tmp_path / "beir"))
    before = {p: tree(p) for p in (model, run, data)}
    refused = [
        (model, model / "config.json", "model folder"),
        (model, model / "results" / "eval.json", "model folder"),
        (run, step2 / "encoder" / "config.json", "model folder"),
        (run, run / "eval.json", "model folder"),
        (model, data / "qrels" / "test.tsv", "BEIR folder"),
        (model, data / "eval.json", "BEIR folder"),
    ]
    for named, out, where in refused:
        code = main(["eval", "--model", str(named), "--beir", str(data), *EVAL, "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2, (out, err)
        assert len(error_lines(err)) == 1 and str(out) in err and where in err, err
    assert {p: tree(p) for p in (model, run, data)} == before
    assert not (model / "results").exists()

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    code = main(["eval", "--model", str(model), "--beir", str(data), *EVAL, "--out", str(notes)])
    err = capsys.readouterr().err
    assert code == 2 and "not an earlier eval result" in err and str(notes) in err, err
    assert notes.read_text() == "my notes\n"
    code = main(["eval", "--model", str(model), "--beir", str(data), *EVAL, "--out", str(tmp_path)])
    assert code == 2 and "folder" in capsys.readouterr().err

    # an earlier result is replaced (the usual rerun)
    out = tmp_path / "results" / "eval.json"
    args = ["eval", "--model", str(model), "--beir", str(data), *EVAL, "--out", str(out)]
    for _ in range(2):
        assert main(args) == 0
    assert json.loads(out.read_text())["num_queries"] == 8


# --- item 12: ignore_identical_ids -------------------------------------------------------------


def test_identical_ids_are_a_flag_said_with_their_count_and_recorded(tiny, tmp_path, capsys):
    """Three documents share a query's id: one is that query's relevant document (a pair BEIR
    can never count), two are not judged. Every document is retrieved (6 < the search depth
    1000), so each of the three is dropped for its query."""
    data = tmp_path / "beir"
    (data / "qrels").mkdir(parents=True)
    docs = ["d0", "d1", "q0", "q1", "q3", "d5"]
    write_jsonl(data / "corpus.jsonl", [{"_id": d, "text": f"text {d}"} for d in docs])
    write_jsonl(data / "queries.jsonl", [{"_id": f"q{i}", "text": f"query {i}"} for i in range(4)])
    qrels = ["query-id\tcorpus-id\tscore", "q0\tq0\t1", "q0\td0\t1", "q1\td1\t1", "q3\td5\t1"]
    (data / "qrels" / "test.tsv").write_text("\n".join(qrels) + "\n")
    args = ["eval", "--model", str(tiny), "--beir", str(data), *EVAL]

    out = tmp_path / "default.json"
    assert main([*args, "--out", str(out)]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "identical" in line]
    assert len(said) == 1, said
    assert "3 retrieved" in said[0] and "1 judged relevant" in said[0], said
    assert "--ignore_identical_ids false" in said[0], said
    result = json.loads(out.read_text())
    assert result["settings"]["ignore_identical_ids"] is True
    assert result["identical_ids"] == {"dropped": 3, "judged_relevant": 1}
    assert result["per_query"]["q0"]["recall@1000"] == 0.5  # its pair (q0, q0) is a miss

    out = tmp_path / "kept.json"
    assert main([*args, "--ignore_identical_ids", "false", "--out", str(out)]) == 0
    assert "identical" not in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["settings"]["ignore_identical_ids"] is False
    assert result["identical_ids"] == {"dropped": 0, "judged_relevant": 1}
    assert result["per_query"]["q0"]["recall@1000"] == 1.0

    # nothing to drop: no line
    (data / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": f"d{i}", "text": f"text {i}"}) + "\n" for i in range(6))
    )
    (data / "qrels" / "test.tsv").write_text("q0\td0\t1\nq1\td1\t1\n")
    assert main([*args]) == 0
    assert "identical" not in capsys.readouterr().err


# --- item 13: a damaged weights file, an all-zero qrels file -----------------------------------


def test_a_truncated_safetensors_file_is_one_line_naming_it(tiny, beir, tmp_path, capsys):
    model = Path(shutil.copytree(tiny, tmp_path / "model"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code = main(["eval", "--model", str(model), "--beir", str(beir), *EVAL])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(error_lines(err)) == 1 and str(weights) in err and "truncated" in err, err


def test_qrels_judging_nothing_relevant_are_warned_about(tiny, beir, tmp_path, capsys):
    data = Path(shutil.copytree(beir, tmp_path / "beir"))
    qrels = data / "qrels" / "test.tsv"
    lines = qrels.read_text().splitlines()
    zeroed = [lines[0]] + ["\t".join(line.split("\t")[:2] + ["0"]) for line in lines[1:]]
    qrels.write_text("\n".join(zeroed) + "\n")
    code = main(["eval", "--model", str(tiny), "--beir", str(data), *EVAL])
    err = capsys.readouterr().err
    assert code == 0, err
    warned = [line for line in err.splitlines() if "no judgement above 0" in line]
    assert len(warned) == 1 and str(qrels) in warned[0], err
    # a qrels file with one relevant judgement says nothing
    qrels.write_text("\n".join(lines) + "\n")
    main(["eval", "--model", str(tiny), "--beir", str(data), *EVAL])
    assert "no judgement above 0" not in capsys.readouterr().err


# --- item 13: a full disk under --out -----------------------------------------------------------


def test_a_full_disk_under_eval_out_names_the_file_and_the_free_space(tiny, beir, tmp_path):
    """``eval --out`` on a full filesystem: one line naming the result file and the free
    space, exit 1, and an earlier result there left whole."""
    from helpers_disk import fill, small_disk

    with small_disk("4m") as disk:
        out = disk / "results" / "eval.json"
        args = ["eval", "--model", str(tiny), "--beir", str(beir), *EVAL, "--out", str(out)]
        run = [sys.executable, "-m", "retromae_ds.cli", *args]
        first = subprocess.run(run, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr[-3000:]
        earlier = out.read_bytes()
        ballast = fill(disk, leave=0)
        full = subprocess.run(run, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        assert full.returncode == 1, full.stderr[-3000:]
        assert "Traceback" not in full.stderr, full.stderr[-3000:]
        (line,) = [x for x in error_lines(full.stderr) if x.startswith("retromae-ds eval: error:")]
        assert str(out) in line and "no space left" in line and "free" in line, line
        assert out.read_bytes() == earlier
        assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temp left
        ballast.unlink()
