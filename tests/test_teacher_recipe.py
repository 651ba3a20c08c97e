"""The teacher study (retromae_recipes/teacher.py) end to end at toy size: a synthetic BEIR
folder standing in for SciFact and a tiny WikiText for the inverse-cloze task, tiny encoders
as MiniLM and as the RetroMAE start; every row of the report, arms that really differ in
what they ran (teacher scores in the distilled runs' negatives, a denoised file that dropped
negatives), and a rerun that trains, mines and evaluates nothing. The real study is in
docs/results.md, not a test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_batch_effect import _wikitext

from retromae_ds.finetune import FinetuneConfig
from retromae_recipes.teacher import ARMS, TeacherOptions, TeacherStudy, main
from retromae_recipes.teacher_report import ROWS

from helpers_ance import write_synthetic_beir, write_tiny_encoder


def _beir(folder: Path) -> Path:
    """The synthetic set with its last 6 queries as test (every query has two positives)."""
    write_synthetic_beir(folder, num_docs=72, num_queries=24)
    rows = (folder / "qrels" / "train.tsv").read_text().splitlines()
    test = {f"q{q}" for q in range(18, 24)}
    (folder / "qrels" / "train.tsv").write_text(
        "\n".join([rows[0], *(r for r in rows[1:] if r.split("\t")[0] not in test)]) + "\n"
    )
    (folder / "qrels" / "test.tsv").write_text(
        "\n".join([rows[0], *(r for r in rows[1:] if r.split("\t")[0] in test)]) + "\n"
    )
    return folder


@pytest.mark.slow
def test_the_whole_study_at_toy_size_and_a_rerun_runs_nothing(tmp_path, tokenizer_dir):
    beir = _beir(tmp_path / "beir")
    wikitext = _wikitext(tmp_path / "wikitext")
    init = write_tiny_encoder(tmp_path / "init", tokenizer_dir)
    retromae = write_tiny_encoder(tmp_path / "retromae", tokenizer_dir, seed=1)
    out = tmp_path / "out"
    argv = [
        *("--data", str(beir), "--wikitext", str(wikitext), "--out", str(out)),
        *("--init", str(init), "--retromae_init", str(retromae), "--seeds", "0"),
        *("--holdout", "3", "--steps", "2", "--batch", "4", "--n_hard", "2", "--top_k", "8"),
        *("--num_negatives", "3", "--q_max_len", "16", "--p_max_len", "32", "--lr", "1e-3"),
        *("--checkpoint_every", "1", "--ce_steps", "2", "--ce_batch", "4", "--ce_lr", "1e-3"),
        *("--ce_q_max_len", "16", "--ce_p_max_len", "32", "--rerank_depth", "5"),
        *("--precision", "fp32", "--eval_bf16", "false", "--ict_per_paragraph", "1"),
        *("--mine_max_length", "64", "--tasks", "scifact", "--ce_curve_every", "1"),
    ]
    assert main(argv) == 0
    results = json.loads((out / "teacher_results.json").read_text())
    report = (out / "teacher.md").read_text()
    assert "python scripts/teacher_study.py" in report
    for task in ("scifact",):
        assert f"## {task}" in report
        rows = {r["row"]: r for r in results["rows"] if r["task"] == task}
        assert set(rows) >= set(ROWS), sorted(rows)
        for name, label in ROWS.items():
            assert f"| {label} | 1 |" in report, label
            assert set(rows[name]["metrics"]) == {"ndcg@10", "mrr@10", "recall@100"}
        for name in ("bm25+ce_minilm", "ance+ce_retromae"):
            ce = rows[name]["cross_encoder"]
            assert ce["depth"] == 5 and ce["pairs"] > 0 and ce["pairs_per_s"] > 0
            assert rows[name]["first_stage"]["metrics"].keys() == rows[name]["metrics"].keys()
        assert rows["bm25+ce_minilm"]["train_s"] > 0
        # the arms ran what they say: the online run's versions carry the teacher's scoring
        online = rows["distill_online"]["online"]["versions"]
        assert online and all(v.get("teacher_s") is not None for v in online.values()), online
        runs = out / task / "runs"
        for arm in ARMS:
            config = json.loads((runs / f"{arm}_s0_config.json").read_text())
            assert config["distill"]["loss"] == ("kl_ce" if arm.startswith("distill") else "none")
            assert bool(config["distill"]["teacher"]) == (arm == "distill_online")
            assert bool(config["distill"]["scores"]) == (arm == "distill_offline")
            assert config["refresher"] == ("local" if arm in ("ance", "distill_online") else "none")
        assert (
            "denoised"
            in json.loads((runs / "denoised_s0_config.json").read_text())["data"]["pairs"]
        )
        ce_config = json.loads((runs / "ce_retromae_s0_config.json").read_text())
        assert ce_config["model"]["kind"] == "cross_encoder"
        assert ce_config["model"]["init"] == str(retromae)
        from retromae_ds.finetuning import handoff

        v0 = json.loads(
            handoff.manifest_file(runs / "distill_offline_s0" / "negatives", 0).read_text()
        )
        assert v0["source"] == "teacher_scores" and v0["teacher_scores"] is True
        mined, denoised = rows["mined"]["mine"], rows["denoised"]["mine"]
        assert denoised["denoise"]["denoised"] > 0
        assert denoised["negatives"] == mined["negatives"] - denoised["denoise"]["denoised"]
    held = [r for r in results["rows"] if r["row"] == "holdout"]
    assert [r["task"] for r in held] == ["scifact"]
    found = held[0]["mine"]["denoise"]["holdout_detection"]
    assert found["candidates"] > 0 and {"precision", "recall"} <= set(found)
    assert "Denoising (held-out positives" in report
    # the teachers' budget curves: BM25 on the validation split, then each kept checkpoint
    curves = results["ce_curves"]
    assert set(curves) == {"scifact/minilm/s0", "scifact/retromae/s0"}
    for curve in curves.values():
        points = curve["points"]
        assert [p["step"] for p in points] == [0, 1, 2]
        best = max(p["metrics"]["ndcg@10"] for p in points[1:])
        assert curve["picked"] == min(p["step"] for p in points[1:]
                                      if p["metrics"]["ndcg@10"] == best)  # fmt: skip
        assert all(set(p["metrics"]) == {"ndcg@10", "mrr@10", "recall@100"} for p in points)
    dev_bm25 = json.loads((out / "scifact" / "eval" / "curve_ce_minilm_s0_step2.json").read_text())
    assert dev_bm25["first_stage"]["metrics"] == curves["scifact/minilm/s0"]["points"][0]["metrics"]
    # the picked checkpoint is the teacher every stage used
    picked = curves["scifact/minilm/s0"]["picked"]
    ce_model = rows["bm25+ce_minilm"]["ce_model"]
    assert ce_model.endswith(f"step_{picked:08d}/encoder"), ce_model
    online_cfg = json.loads((runs / "distill_online_s0_config.json").read_text())
    assert online_cfg["distill"]["teacher"] == ce_model
    assert "budget curve: scifact, CE from minilm, seed 0" in report
    students = results["students_on_dev"]["scifact"]
    assert len(students["ance"]) == 1 and set(students["init"]) == set(students["ance"][0])
    assert "The students on the same queries, nDCG@10: the init " in report
    assert "| 2 | " in report

    logs = {p: p.stat().st_mtime_ns for p in out.rglob("*.log")}
    evals = {p: p.stat().st_mtime_ns for p in out.rglob("eval/*.json")}
    mines = {p: p.stat().st_mtime_ns for p in out.rglob("mine/*.manifest.json")}
    TeacherStudy(TeacherOptions(**results["options"])).run("rerun")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.log")} == logs
    assert {p: p.stat().st_mtime_ns for p in out.rglob("eval/*.json")} == evals
    assert {p: p.stat().st_mtime_ns for p in out.rglob("mine/*.manifest.json")} == mines
    assert json.loads((out / "teacher_results.json").read_text())["rows"] == results["rows"]


def test_the_inverse_cloze_task_is_built_and_has_no_holdout(tmp_path, tokenizer_dir):
    """The second collection: the WikiText task built under OUT/ict, one positive a query,
    so no fit of the denoising rule (the report says so); its runs' configs are the same
    recipe's (built, not run: the pipeline itself is the test above)."""
    init = write_tiny_encoder(tmp_path / "init", tokenizer_dir)
    opts = TeacherOptions(wikitext=str(_wikitext(tmp_path / "wikitext")), out=str(tmp_path / "o"),
                          init=str(init), tasks=["ict"], ce_steps=3)  # fmt: skip
    study = TeacherStudy(opts)
    (task,) = study.tasks
    assert task.name == "ict" and task.multi is None and study.denoise_value(task, 0) is None
    assert (task.beir / "qrels" / "test.tsv").is_file()
    ce = study.ce_config(task, "minilm", 0)
    ance = study.arm_config(task, "ance", 0)
    assert isinstance(ce, FinetuneConfig) and ce.model.kind == "cross_encoder"
    assert ce.max_steps == 3 and ce.data.beir == ance.data.beir == str(task.beir)
    assert ance.refresher == "local" and ance.negatives.mine_first


def test_the_curve_stage_trains_and_scores_the_teacher_only_at_the_length_asked(
    tmp_path, tokenizer_dir, capsys
):
    """``--stages curve``: the cross-encoder and its validation curve, no bi-encoder and
    nothing on test; ``--ce_max_length``: the curve is scored at that length, cached under
    its own names, and a rerun at the trained length scores the same checkpoints anew; a
    rerun that would train the teacher otherwise into the same folder is refused."""
    beir = _beir(tmp_path / "beir")
    init = write_tiny_encoder(tmp_path / "init", tokenizer_dir)
    out = tmp_path / "out"
    argv = [
        *("--data", str(beir), "--out", str(out), "--init", str(init), "--seeds", "0"),
        *("--holdout", "3", "--n_hard", "2", "--top_k", "8", "--num_negatives", "3"),
        *("--ce_steps", "2", "--ce_batch", "4", "--ce_lr", "1e-3", "--ce_curve_every", "1"),
        *("--ce_q_max_len", "16", "--ce_p_max_len", "16", "--rerank_depth", "5"),
        *("--precision", "fp32", "--eval_bf16", "false", "--tasks", "scifact"),
    ]
    assert main([*argv, "--stages", "curve", "--ce_max_length", "40"]) == 0
    runs = sorted(p.name for p in (out / "scifact" / "runs").iterdir() if p.is_dir())
    assert runs == ["ce_minilm_s0"], runs
    evals = sorted(p.name for p in (out / "scifact" / "eval").iterdir())
    assert evals == [f"{n}.json" for n in ("curve_ce_minilm_s0_step1_len40",
                                          "curve_ce_minilm_s0_step2_len40", "dev_init")], evals  # fmt: skip
    long = json.loads((out / "scifact" / "eval" / evals[0]).read_text())
    assert long["cross_encoder"]["max_length"] == 40
    results = json.loads((out / "teacher_results.json").read_text())
    assert results["rows"] == [] and results["fixed"] == {}
    assert [p["step"] for p in results["ce_curves"]["scifact/minilm/s0"]["points"]] == [0, 1, 2]
    assert "ance" not in results["students_on_dev"]["scifact"]
    report = (out / "teacher.md").read_text()
    assert "scored at 40" in report and "## scifact" not in report
    assert "budget curve: scifact, CE from minilm, seed 0" in report
    assert main([*argv, "--stages", "curve"]) == 0  # the trained length: 31 tokens
    short = json.loads((out / "scifact" / "eval" / "curve_ce_minilm_s0_step1.json").read_text())
    assert short["cross_encoder"]["max_length"] == 31
    assert short["cross_encoder"]["model"] == long["cross_encoder"]["model"]

    # The same --out with a teacher trained otherwise: refused, naming the field, since the
    # cached teacher, curve and rows are the old settings' (the study once read them back).
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main([*argv, "--stages", "curve", "--ce_p_max_len", "24"]) == 2
    err = capsys.readouterr().err
    assert "ce_p_max_len: 16 -> 24" in err and "recipe_settings.json" in err, err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.parametrize(
    "argv, named",
    [(["--tasks", "msmarco"], "--tasks"), (["--arms", "bm25"], "--arms"),
     (["--denoise", "maybe"], "--denoise"), (["--rerank_depth", "0"], "--rerank_depth"),
     (["--ce_max_length", "2"], "--ce_max_length"),
     (["--stages", "curve", "--ce_curve_every", "0"], "--stages")],
)  # fmt: skip
def test_a_bad_option_is_one_line_naming_it(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
