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

A knob (``Knob``) is a set of typed changes of the reference continuation's
``PretrainConfig`` (the study's ``pretrain_config`` for objective ``retromae``), a step scale,
and for ``shard_length=N`` shards of the same texts and tokenizer cut at N tokens. The options
are ``KnobsOptions``' fields (``--help``), parsed like every ``retromae-ds`` command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retromae_ds.base.options import run_command
from retromae_ds.components.layout import RunLayout
from retromae_ds.components.metrics_log import read_rows
from retromae_recipes.common import write_json

if TYPE_CHECKING:  # the library's training side (torch): imported when a knob is built
    from retromae_ds.pretrain import PretrainConfig

Change = Callable[["PretrainConfig"], "PretrainConfig"]
"""One typed edit of a pre-training config (``dataclasses.replace`` on its sections)."""


def _top(**values: Any) -> Change:
    """Set fields of the run itself (``micro_batch_size``, ...)."""
    return lambda c: replace(c, **values)


def _optim(**values: Any) -> Change:
    """Set fields of ``optim``."""
    return lambda c: replace(c, optim=replace(c.optim, **values))


def _masking(**values: Any) -> Change:
    """Set fields of ``masking``."""
    return lambda c: replace(c, masking=replace(c.masking, **values))


def _objective(**values: Any) -> Change:
    """Set fields of ``model.objective``."""
    return lambda c: replace(
        c, model=replace(c.model, objective=replace(c.model.objective, **values))
    )


def _encoder(**values: Any) -> Change:
    """Set fields of ``model.encoder``."""
    return lambda c: replace(c, model=replace(c.model, encoder=replace(c.model.encoder, **values)))


@dataclass(frozen=True)
class Knob:
    """One change of the reference continuation: typed edits of its ``PretrainConfig``, a step
    scale, and shards cut at another length."""

    changes: tuple[Change, ...] = ()
    """Applied in order to the run's config."""
    steps_scale: float | None = None
    """The run's steps (and evaluation interval) times this: a batch knob keeps the tokens of
    the run equal. None: unchanged."""
    shard_length: int | None = None
    """Shards of the study's texts through the same tokenizer, cut at this many tokens. None:
    the study's shards."""

    def __add__(self, other: Knob) -> Knob:
        """Both knobs, ``other``'s changes after this one's (a setting both change: ``other``'s)."""
        return Knob(
            self.changes + other.changes,
            other.steps_scale if other.steps_scale is not None else self.steps_scale,
            other.shard_length if other.shard_length is not None else self.shard_length,
        )


KNOBS: dict[str, Knob] = {
    "reference": Knob(),
    "decoder_ratio=0.7": Knob((_objective(decoder_ratio=0.7),)),
    "decoder_ratio=0.9": Knob((_objective(decoder_ratio=0.9),)),
    "decoder_ratio=1.0": Knob((_objective(decoder_ratio=1.0),)),
    "encoder_ratio=0.15": Knob((_masking(encoder_ratio=0.15),)),
    "encoder_ratio=0.4": Knob((_masking(encoder_ratio=0.4),)),
    "encoder_ratio=0.5": Knob((_masking(encoder_ratio=0.5),)),
    "lr=2e-3": Knob((_optim(lr=2e-3),)),
    "lr=3e-3": Knob((_optim(lr=3e-3),)),
    "lr=5e-3": Knob((_optim(lr=5e-3),)),
    "lr=1e-2": Knob((_optim(lr=1e-2),)),
    "lr=5e-4": Knob((_optim(lr=5e-4),)),
    "warmup=0": Knob((_optim(warmup_ratio=0.0),)),
    "schedule=constant": Knob((_optim(schedule="constant"),)),
    "decoder_weight=3": Knob((_objective(decoder_weight=3.0),)),
    "mlm_weight=0.3": Knob((_objective(mlm_weight=0.3),)),
    "batch=16": Knob((_top(micro_batch_size=16),), steps_scale=2),
    "batch=64": Knob((_top(micro_batch_size=64),), steps_scale=0.5),
    "shard_length=64": Knob(shard_length=64),
    "dropout=0": Knob((_encoder(dropout=0.0),)),
    "decoder_lr=5x": Knob((_optim(decoder_lr_scale=5.0),)),
    "decoder_lr=10x": Knob((_optim(decoder_lr_scale=10.0),)),
    "decoder_lr=20x": Knob((_optim(decoder_lr_scale=20.0),)),
}
"""The knobs measured, by the name ``--knobs`` gives."""

METRIC = "eval/{task}/cls/ndcg@10"
TEXTS: list[str] = []
"""Pre-training texts of the study (``--texts``), for knobs that re-cut its shards."""


def combined(name: str) -> Knob:
    """The knob of that name, or of knobs joined by ``+`` (``lr=5e-3+batch=16``)."""
    out = Knob()
    for part in name.split("+"):
        out = out + KNOBS[part]
    return out


def _saved(path: Path) -> PretrainConfig:
    """A pre-training config a study saved, the fields renamed since under their new names."""
    from retromae_ds.base.config import apply_renamed, from_dict
    from retromae_ds.pretrain import PretrainConfig

    data = json.loads(path.read_text(encoding="utf-8"))
    try:
        return from_dict(PretrainConfig, apply_renamed(PretrainConfig, data, quiet=True))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def template(study: Path) -> PretrainConfig:
    """The reference RetroMAE continuation of ``study``: its retromae cell's config if it has
    one, else the mlm (or seed) cell's with the objective switched, else the base's own
    settings continuing the base with RetroMAE's masking (30 % / 50 %)."""
    for objective in ("retromae", "mlm", "seed"):
        for path in sorted(
            (study / "cells" / "bert" / objective).glob("seed*/pretrain_config.json")
        ):
            return _objective(name="retromae", strong_decoder=False)(_saved(path))
    base = study / "cells" / "bert" / "base" / "seed0"
    if (base / "pretrain_config.json").is_file():  # only the base so far: continue its settings
        cfg = _saved(base / "pretrain_config.json")
        cfg = _encoder(name=str(base / "pretrain"))(cfg)
        cfg = _objective(name="retromae", decoder_ratio=0.5)(cfg)
        return _masking(encoder_ratio=0.3)(cfg)
    raise FileNotFoundError(
        f"{study}: no cells/bert/<objective>/seed*/pretrain_config.json and no base; run the "
        "study or demo there first (its base and a continuation's config are what knobs change)"
    )


def with_settings(cfg: PretrainConfig, settings: list[str]) -> PretrainConfig:
    """``cfg`` with ``--set`` overrides: ``section.field=VALUE``, the value read as JSON
    (else as text); a field the config does not have is a ValueError naming it."""
    from retromae_ds.base.config import from_dict, merge_dotted, to_dict
    from retromae_ds.pretrain import PretrainConfig

    overrides: dict[str, Any] = {}
    for item in settings:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: give section.field=VALUE")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    try:
        return from_dict(PretrainConfig, merge_dotted(to_dict(cfg), overrides))
    except ValueError as exc:
        raise ValueError(f"--set: {exc} (retromae-ds pretrain --help lists the fields)") from None


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
    base: PretrainConfig,
    name: str,
    knob: Knob,
    steps: int,
    every: int,
    out: Path,
    study: Path,
) -> PretrainConfig:
    """The run of ``knob`` (named ``name``): ``base`` for ``steps`` steps evaluated every
    ``every`` (both times the knob's ``steps_scale``), its own run folder under ``out``, then
    the knob's changes."""
    scale = knob.steps_scale if knob.steps_scale is not None else 1
    n = int(round(steps * scale))
    cfg = replace(
        base,
        run_dir=str(out / "runs" / name.replace("=", "_")),
        max_steps=n,
        log_every=max(1, int(round(every * scale)) // 2),
        checkpoint=replace(base.checkpoint, every_steps=n, keep_last=1),
        eval=replace(base.eval, every=max(1, int(round(every * scale)))),
    )
    for change in knob.changes:
        cfg = change(cfg)
    if knob.shard_length is not None:
        shards = shards_at(study, Path(base.data.shards), knob.shard_length, out)
        cfg = replace(cfg, data=replace(cfg.data, shards=str(shards)))
    return cfg


def run_knob(cfg: PretrainConfig, threads: int) -> float:
    """Run ``cfg`` as its own ``retromae_ds.pretrain`` process on ``threads`` threads (unless
    it finished before); its wall seconds."""
    from retromae_ds.base.config import to_dict

    run = Path(cfg.run_dir)
    if _finished(run, cfg.max_steps):
        return 0.0
    run.parent.mkdir(parents=True, exist_ok=True)
    path = run.with_name(run.name + "_config.json")
    write_json(to_dict(cfg), path)
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


def shape(cfg: PretrainConfig) -> str:
    """What a step costs depends on: the objective, the batch and the shards' row length."""
    objective = cfg.model.objective.name
    return f"{objective}_batch{cfg.micro_batch_size}_{Path(cfg.data.shards).name}"


def measure_rate(cfg: PretrainConfig, out: Path, steps: int = 60) -> float:
    """Training tokens/s of ``cfg``'s shape, run alone on every CPU thread without
    evaluations (the knob runs share the cores, so their own rates are not comparable)."""
    run = out / "rates" / shape(cfg)
    if not _finished(run, steps):
        rate_cfg = replace(
            cfg,
            run_dir=str(run),
            max_steps=steps,
            log_every=max(1, steps // 6),
            checkpoint=replace(cfg.checkpoint, every_steps=steps),
            eval=replace(cfg.eval, beir="", every=0),
        )
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
    name: str, cfg: PretrainConfig, task: str, target: float, alone: float | None = None
) -> dict[str, Any]:
    """One row of the table: the run's curve, rates, the first point at ``target`` and its
    decoder's last loss and accuracy."""
    train, evals = _rows(Path(cfg.run_dir))
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
        "steps": cfg.max_steps,
        "stopped_at": None if last_step >= cfg.max_steps else last_step,
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


@dataclass(kw_only=True)
class KnobsOptions:
    """``python scripts/knobs.py``: which knobs to run on which study, how long, and what to
    report."""

    study: str
    """A study or demo --out folder with its MLM base (``cells/bert/base/seed0``)."""
    out: str
    """Output folder: the runs, knobs.md, knobs.json and knobs.png."""
    knobs: list[str] = field(default_factory=lambda: list(KNOBS))
    """Knobs run, each a name of ``KNOBS`` (the default lists them) or names joined by +
    (lr=5e-3+batch=16)."""
    steps: int = 600
    """Steps of each run (a batch knob scales them: the same tokens)."""
    every: int = 50
    """Steps between two points of the train-query curve (scaled like the steps)."""
    target: float = 0.05
    """The train-curve CLS nDCG@10 each run is timed to."""
    jobs: int = 2
    """Runs at a time, each on cpus // jobs threads."""
    set: list[str] = field(default_factory=list)
    """Overrides applied to every run (the reference included): section.field=VALUE, JSON
    values."""
    report_only: bool = False
    """Tabulate the runs there; start none."""
    rates: bool = False
    """Measure each batch/row-length shape's tokens/s alone (all threads, no evaluation) and
    convert tokens to seconds with it."""
    rate_steps: int = 60
    """Steps of each --rates run."""
    texts: list[str] = field(default_factory=list)
    """The study's pre-training texts (for shard_length knobs; a demo folder's are found)."""

    def __post_init__(self) -> None:
        unknown = [k for name in self.knobs for k in name.split("+") if k not in KNOBS]
        if unknown:
            raise ValueError(f"--knobs: unknown {unknown}; known: {list(KNOBS)} (combine with +)")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, not {self.jobs}")


def _run_all(configs: dict[str, PretrainConfig], opts: KnobsOptions) -> dict[str, float]:
    """Every run's wall seconds, ``opts.jobs`` runs at a time (none run with
    ``--report_only``)."""
    if opts.report_only:
        return dict.fromkeys(configs, 0.0)
    threads = max(1, (os.cpu_count() or 1) // opts.jobs)
    with ThreadPoolExecutor(opts.jobs) as pool:
        walls = pool.map(lambda c: run_knob(c, threads), configs.values())
        return dict(zip(configs, walls, strict=True))


def run_knobs(opts: KnobsOptions, argv: list[str]) -> int:
    """Run (or only read back) the knobs ``opts`` name and write their table, JSON and plot;
    ``argv`` is the command line, quoted in ``knobs.md``."""
    TEXTS[:] = opts.texts
    study, out = Path(opts.study), Path(opts.out)
    base = with_settings(template(study), opts.set)
    task = Path(base.eval.beir).name
    configs = {
        name: knob_config(base, name, combined(name), opts.steps, opts.every, out, study)
        for name in opts.knobs
    }
    if opts.report_only:
        configs = {n: c for n, c in configs.items() if any(_rows(Path(c.run_dir)))}
    walls = _run_all(configs, opts)
    rates: dict[str, float] = {}
    if opts.rates:
        for cfg in configs.values():
            if shape(cfg) not in rates:
                rates[shape(cfg)] = measure_rate(cfg, out, opts.rate_steps)
    results = [
        summarise(name, cfg, task, opts.target, rates.get(shape(cfg)))
        for name, cfg in configs.items()
    ]
    for r in results:
        r["wall_s"] = walls[r["knob"]]
    (out / "knobs.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    plot(results, out / "knobs.png", opts.target)
    body = table(results, opts.target)
    command = "python scripts/knobs.py " + " ".join(argv)
    (out / "knobs.md").write_text(f"```\n{command}\n```\n\n{body}\n", encoding="utf-8")
    print(body)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python scripts/knobs.py``: its options are ``KnobsOptions``' fields, parsed like every
    ``retromae-ds`` command (``base.options``); a bad option or value is one line naming it,
    exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(
        KnobsOptions,
        lambda opts: run_knobs(opts, argv),
        argv,
        prog="scripts/knobs.py",
        description=" ".join(__doc__.split("\n\n")[0].split()),
    )
