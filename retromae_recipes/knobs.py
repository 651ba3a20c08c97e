"""What makes RetroMAE's decoder start reading the CLS vector sooner: one knob at a time.

``python scripts/knobs.py --study DIR --out DIR [--knobs NAME ...]`` continues the MLM base of
a finished (or started) study or demo folder (``DIR/cells/bert/base/seed0/pretrain``, its
shards and its BEIR task) with RetroMAE under the reference settings and under each knob
changed alone, every run its own ``retromae-ds pretrain`` process scoring itself on the
task's **train** queries every ``--every`` steps (the study's curve: never the test split).
For each run it reports the steps, tokens and training seconds (tokens over the run's own
measured training throughput, evaluation excluded) at which the curve's CLS nDCG@10 first
reaches ``--target``, with the curve's last value and the decoder's last loss and accuracy,
as ``knobs.md`` and ``knobs.json`` in ``--out``. Runs go ``--jobs`` at a time, each on
``cpus // jobs`` threads; a finished run (its ``metrics.jsonl`` holds the last step) is
read back, not rerun.

A knob is a set of ``section.field=value`` overrides of the reference continuation (the
study's ``pretrain_config`` for objective ``retromae``) plus, for ``shard_length=N``, shards
of the same texts and tokenizer cut at N tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from retromae_ds.components.layout import RunLayout
from retromae_ds.components.metrics_log import read_rows
from retromae_recipes.common import write_json

KNOBS: dict[str, dict[str, Any]] = {
    "reference": {},
    "decoder_ratio=0.7": {"model.objective.decoder_ratio": 0.7},
    "decoder_ratio=0.9": {"model.objective.decoder_ratio": 0.9},
    "decoder_ratio=1.0": {"model.objective.decoder_ratio": 1.0},
    "encoder_ratio=0.15": {"masking.encoder_ratio": 0.15},
    "encoder_ratio=0.4": {"masking.encoder_ratio": 0.4},
    "encoder_ratio=0.5": {"masking.encoder_ratio": 0.5},
    "lr=2e-3": {"optim.lr": 2e-3},
    "lr=3e-3": {"optim.lr": 3e-3},
    "lr=5e-3": {"optim.lr": 5e-3},
    "lr=1e-2": {"optim.lr": 1e-2},
    "lr=5e-4": {"optim.lr": 5e-4},
    "warmup=0": {"optim.warmup_ratio": 0.0},
    "schedule=constant": {"optim.schedule": "constant"},
    "decoder_weight=3": {"model.objective.decoder_weight": 3.0},
    "mlm_weight=0.3": {"model.objective.mlm_weight": 0.3},
    "batch=16": {"micro_batch_size": 16, "steps_scale": 2},
    "batch=64": {"micro_batch_size": 64, "steps_scale": 0.5},
    "shard_length=64": {"shard_length": 64},
    "dropout=0": {"model.encoder.dropout": 0.0},
    "decoder_lr=5x": {"optim.decoder_lr_scale": 5.0},
    "decoder_lr=10x": {"optim.decoder_lr_scale": 10.0},
    "decoder_lr=20x": {"optim.decoder_lr_scale": 20.0},
}
"""The knobs measured (name -> overrides). ``steps_scale`` keeps the tokens of the run equal
when the batch changes."""

METRIC = "eval/{task}/cls/ndcg@10"
TEXTS: list[str] = []
"""Pre-training texts of the study (``--texts``), for knobs that re-cut its shards."""


def combined(name: str) -> dict[str, Any]:
    """The overrides of a knob or of knobs joined by ``+`` (``lr=5e-3+batch=16``)."""
    out: dict[str, Any] = {}
    for part in name.split("+"):
        out.update(KNOBS[part])
    return out


def _current(cfg: dict[str, Any]) -> dict[str, Any]:
    """A saved pre-training config with the fields renamed since under their new names."""
    from retromae_ds.base.config import apply_renamed
    from retromae_ds.pretrain import PretrainConfig

    return apply_renamed(PretrainConfig, cfg, quiet=True)


def template(study: Path) -> dict[str, Any]:
    """The reference RetroMAE continuation of ``study``: its retromae cell's config if it has
    one, else the mlm (or seed) cell's with the objective switched, else the base's own
    settings continuing the base with RetroMAE's masking (30 % / 50 %)."""
    for objective in ("retromae", "mlm", "seed"):
        for path in sorted(
            (study / "cells" / "bert" / objective).glob("seed*/pretrain_config.json")
        ):
            cfg = _current(json.loads(path.read_text(encoding="utf-8")))
            cfg["model"]["objective"]["name"] = "retromae"
            cfg["model"]["objective"]["strong_decoder"] = False
            return cfg
    base = study / "cells" / "bert" / "base" / "seed0"
    if (base / "pretrain_config.json").is_file():  # only the base so far: continue its settings
        cfg = _current(json.loads((base / "pretrain_config.json").read_text(encoding="utf-8")))
        cfg["model"]["encoder"]["name"] = str(base / "pretrain")
        cfg["model"]["objective"] = {**cfg["model"]["objective"], "name": "retromae"}
        cfg["model"]["objective"]["decoder_ratio"] = 0.5
        cfg["masking"] = {**cfg["masking"], "encoder_ratio": 0.3}
        return cfg
    raise FileNotFoundError(
        f"{study}: no cells/bert/<objective>/seed*/pretrain_config.json and no base; run the "
        "study or demo there first (its base and a continuation's config are what knobs change)"
    )


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = node[key]
    # a study's saved config predates fields added since: those of this version may be set
    if leaf not in node and dotted not in _fields():
        raise KeyError(f"knob field {dotted!r} is not in the pre-training config")
    node[leaf] = value


def _fields() -> dict[str, Any]:
    from retromae_ds.base.config import flat_defaults
    from retromae_ds.pretrain import PretrainConfig

    return flat_defaults(PretrainConfig)


def shards_at(study: Path, base_shards: Path, length: int, out: Path) -> Path:
    """The study's texts through the same tokenizer, cut at ``length`` tokens (once)."""
    from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

    folder = out / f"shards_{length}"
    if (folder / "manifest.json").exists():
        return folder
    inputs = [str(p) for p in study.glob("builtin/corpus.jsonl")] + TEXTS
    if not inputs:
        raise ValueError(f"shard_length: give the study's texts (--texts FILE ...) for {study}")
    run_preprocess(
        PreprocessConfig(
            inputs=inputs,
            out=str(folder),
            max_length=length,
            workers=2,
            tokenizer=str(base_shards / "tokenizer"),
            progress=False,
        )
    )
    return folder


def knob_config(
    base: dict[str, Any],
    name: str,
    knob: dict[str, Any],
    steps: int,
    every: int,
    out: Path,
    study: Path,
) -> dict[str, Any]:
    cfg = json.loads(json.dumps(base))
    scale = knob.get("steps_scale", 1)
    n = int(round(steps * scale))
    cfg.update(
        run_dir=str(out / "runs" / name.replace("=", "_")),
        max_steps=n,
        log_every=max(1, int(round(every * scale)) // 2),
        checkpoint={**cfg["checkpoint"], "every_steps": n, "keep_last": 1},
    )
    cfg["eval"]["every"] = max(1, int(round(every * scale)))
    for key, value in knob.items():
        if key == "steps_scale":
            continue
        if key == "shard_length":
            cfg["data"]["shards"] = str(shards_at(study, Path(base["data"]["shards"]), value, out))
            continue
        _set(cfg, key, value)
    return cfg


def run_knob(cfg: dict[str, Any], threads: int) -> float:
    run = Path(cfg["run_dir"])
    if _finished(run, cfg["max_steps"]):
        return 0.0
    run.parent.mkdir(parents=True, exist_ok=True)
    path = run.with_name(run.name + "_config.json")
    write_json(cfg, path)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu"}
    t0 = time.perf_counter()
    with open(run.with_name(run.name + ".log"), "w", encoding="utf-8") as log:
        code = subprocess.run(
            [sys.executable, "-m", "retromae_ds.pretrain", "--config", str(path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, check=False,
        ).returncode  # fmt: skip
    if code:  # reported in the table as stopped, with the curve it logged
        print(f"{run.name}: exit {code}, see {log.name}", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def shape(cfg: dict[str, Any]) -> str:
    """What a step costs depends on: the objective, the batch and the shards' row length."""
    objective = cfg["model"]["objective"]["name"]
    return f"{objective}_batch{cfg['micro_batch_size']}_{Path(cfg['data']['shards']).name}"


def measure_rate(cfg: dict[str, Any], out: Path, steps: int = 60) -> float:
    """Training tokens/s of ``cfg``'s shape, run alone on every CPU thread without
    evaluations (the knob runs share the cores, so their own rates are not comparable)."""
    run = out / "rates" / shape(cfg)
    if not _finished(run, steps):
        rate_cfg = json.loads(json.dumps(cfg))
        rate_cfg.update(run_dir=str(run), max_steps=steps, log_every=max(1, steps // 6))
        rate_cfg["checkpoint"] = {**cfg["checkpoint"], "every_steps": steps}
        rate_cfg["eval"] = {**cfg["eval"], "beir": "", "every": 0}
        run_knob(rate_cfg, os.cpu_count() or 1)
    rows = [r for r in _rows(run)[0] if "tokens_per_s" in r][1:]  # the first log holds start-up
    return sum(r["tokens_per_s"] for r in rows) / max(1, len(rows))


def _rows(run: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, evaluation rows) of a run's metrics (``metrics_log.read_rows``)."""
    return read_rows(RunLayout(run))


def _finished(run: Path, steps: int) -> bool:
    return any(r.get("step") == steps for r in _rows(run)[0])


def _tail_mean(rows: list[dict[str, Any]], key: str, n: int = 3) -> float | None:
    """Mean of ``key`` over the last ``n`` logged rows (one row is one noisy batch)."""
    values = [r[key] for r in rows[-n:] if key in r]
    return sum(values) / len(values) if values else None


def summarise(
    name: str, cfg: dict[str, Any], task: str, target: float, alone: float | None = None
) -> dict[str, Any]:
    train, evals = _rows(Path(cfg["run_dir"]))
    metric = METRIC.format(task=task)
    evals = [r for r in evals if metric in r]
    rate = sum(r["tokens_per_s"] for r in train) / max(1, len(train))
    tokens_per_step = train[-1]["tokens_seen"] / train[-1]["step"] if train else 0.0
    hit = next((r for r in evals if r[metric] >= target), None)
    last_step = train[-1]["step"] if train else 0
    out = {
        "knob": name,
        "curve": [
            (r["step"], r.get("tokens_seen", r["step"] * tokens_per_step), r[metric]) for r in evals
        ],
        "tokens_per_s": rate,
        "tokens_per_s_alone": alone,
        "steps": cfg["max_steps"],
        "stopped_at": None if last_step >= cfg["max_steps"] else last_step,
        "last": evals[-1][metric] if evals else float("nan"),
        "best": max((r[metric] for r in evals), default=float("nan")),
        "train": [
            (r["tokens_seen"], r.get("decoder_loss"), r.get("decoder_accuracy")) for r in train
        ],
        "decoder_loss": _tail_mean(train, "decoder_loss"),
        "decoder_accuracy": _tail_mean(train, "decoder_accuracy"),
        "hit_step": None,
        "hit_tokens": None,
        "hit_seconds": None,
    }
    if hit is not None:
        tokens = hit.get("tokens_seen", hit["step"] * tokens_per_step)
        out.update(hit_step=hit["step"], hit_tokens=tokens, hit_seconds=tokens / (alone or rate))
    return out


def plot(results: list[dict[str, Any]], path: Path, target: float) -> Path | None:
    """CLS nDCG@10 on the train queries, decoder loss and decoder accuracy against the tokens
    each run saw, one line per knob."""
    from retromae_recipes.common import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        line = axes[0].plot([c[1] / 1e6 for c in r["curve"]], [c[2] for c in r["curve"]],
                            marker=".", label=r["knob"])  # fmt: skip
        colour = line[0].get_color()
        rows = [t for t in r["train"] if t[1] is not None]
        for ax, k in ((axes[1], 1), (axes[2], 2)):
            ax.plot([t[0] / 1e6 for t in rows], [t[k] for t in rows], color=colour, lw=1)
    axes[0].axhline(target, color="grey", ls=":", lw=1)
    titles = ("CLS nDCG@10, train queries", "decoder loss", "decoder accuracy")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("tokens seen (M)")
    axes[0].legend(fontsize=7)
    return save_figure(plt, fig, path)


def table(results: list[dict[str, Any]], target: float) -> str:
    alone = all(r["tokens_per_s_alone"] for r in results)
    lines = [
        f"| knob | tokens/s{' alone' if alone else ' (runs sharing the cores)'} | step at CLS nDCG@10 ≥ {target} | tokens then | training seconds then "
        "| curve best | curve last | decoder loss, last 3 logs | decoder acc., last 3 logs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        hit = r["hit_step"] is not None
        lines.append(
            f"| {r['knob']}{' (stopped)' if r['stopped_at'] else ''} | {r['tokens_per_s_alone'] or r['tokens_per_s']:,.0f} | "
            + (f"{r['hit_step']} | {r['hit_tokens'] / 1e6:.2f}M | {r['hit_seconds']:.0f} | "
               if hit else f"not by {r['stopped_at'] or r['steps']} | — | — | ")
            + f"{r['best']:.4f} | {r['last']:.4f} | "
            + (f"{r['decoder_loss']:.2f} | {r['decoder_accuracy']:.3f} |"
               if r["decoder_loss"] is not None else "— | — |")
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/knobs.py", description=__doc__.splitlines()[0])
    p.add_argument("--study", required=True, help="a study or demo --out folder with its base")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--knobs", nargs="+", default=list(KNOBS), help=f"of {list(KNOBS)}, or joined by +"
    )
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--target", type=float, default=0.05, help="train-curve CLS nDCG@10")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--set", nargs="*", default=[], metavar="FIELD=VALUE",
        help="overrides applied to every run (the reference included), JSON values",
    )  # fmt: skip
    p.add_argument("--report-only", action="store_true", help="tabulate the runs there, start none")
    p.add_argument(
        "--rates",
        action="store_true",
        help="measure each batch/row-length shape's tokens/s alone (all threads, no evaluation) "
        "and convert tokens to seconds with it",
    )
    p.add_argument("--rate-steps", type=int, default=60, help="steps of each --rates run")
    p.add_argument("--texts", nargs="*", default=[], help="the study's pre-training texts")
    args = p.parse_args(argv)
    TEXTS[:] = args.texts
    study, out = Path(args.study), Path(args.out)
    unknown = [k for name in args.knobs for k in name.split("+") if k not in KNOBS]
    if unknown:
        p.error(f"unknown knobs {unknown}; known: {list(KNOBS)} (combine with +)")
    base = template(study)
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        _set(base, key, parsed)
    task = Path(base["eval"]["beir"]).name
    configs = {
        name: knob_config(base, name, combined(name), args.steps, args.every, out, study)
        for name in args.knobs
    }
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    if args.report_only:
        configs = {n: c for n, c in configs.items() if any(_rows(Path(c["run_dir"])))}
    with ThreadPoolExecutor(args.jobs if not args.report_only else 1) as pool:
        walls = dict(
            zip(
                configs,
                pool.map(
                    lambda c: 0.0 if args.report_only else run_knob(c, threads), configs.values()
                ),
                strict=True,
            )
        )
    rates: dict[str, float] = {}
    if args.rates:
        for cfg in configs.values():
            if shape(cfg) not in rates:
                rates[shape(cfg)] = measure_rate(cfg, out, args.rate_steps)
    results = [
        summarise(name, cfg, task, args.target, rates.get(shape(cfg)))
        for name, cfg in configs.items()
    ]
    for r in results:
        r["wall_s"] = walls[r["knob"]]
    (out / "knobs.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    plot(results, out / "knobs.png", args.target)
    body = table(results, args.target)
    command = "python scripts/knobs.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "knobs.md").write_text(f"```\n{command}\n```\n\n{body}\n", encoding="utf-8")
    print(body)
    return 0
