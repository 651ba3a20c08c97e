"""Does a larger contrastive batch help? (issue 57). all-MiniLM-L6-v2 fine-tuned on an
inverse-cloze task from WikiText at several global batches, the same number of epochs each,
several seeds; nDCG@10 on the task's test articles.

``python scripts/batch_effect.py --wikitext ../shared/data/wikitext2 [--out runs/batch_effect]``

1. The task (``retromae_ds.data.ict_task``): sentences taken out of WikiText paragraphs as
   queries, the rest of each paragraph their one positive, split by article into train, dev
   and test (``out/data``, built once; ``ict_task.json`` holds its sizes).
2. Per seed and batch, ``retromae-ds finetune`` from the init on BM25 negatives
   (``--refresher none``, ``n_hard`` of them per query from BM25's top ``top_k``), ``epochs``
   passes over the train queries: a batch of B takes ``floor(train / B)`` steps an epoch, so a
   larger batch makes fewer, larger steps. The learning rate follows ``lr_rule``: ``sqrt``
   (default) scales ``lr`` (given for ``lr_batch`` queries) by ``sqrt(B / lr_batch)``, the
   square-root rule for Adam (Malladi et al. 2022); ``same`` keeps it. A batch above
   ``chunk`` queries trains with GradCache in chunks of ``chunk`` queries and passages, so
   memory stays that of a chunk (the gradients are the whole batch's). Pooling, normalisation
   and temperature are the init's own (MiniLM: mean, normalised, cosine / 0.05), as in the
   SciFact recipe, whose lr (3e-5) this takes; none was tuned on this task.
3. Each fine-tuned encoder, the init and BM25 on test (and the encoders on dev), at the
   encoder's own length; ``batch_effect.md`` (mean ± std per batch, the verdicts of
   ``report_rows.compare``, the command, wall time per run), ``batch_effect.png`` and
   ``batch_effect_results.json`` in ``out``.

Runs resume: a finished run or evaluation is kept and skipped on a rerun.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retromae_ds.base.config import flag, to_dict
from retromae_ds.base.fsutil import atomic_write_text
from retromae_ds.base.options import run_command
from retromae_ds.components.engine import DeepSpeedSettings
from retromae_ds.components.layout import RunLayout
from retromae_ds.data import ict_task
from retromae_ds.finetune import (
    DualModelConfig,
    FinetuneConfig,
    FinetuneDataConfig,
    NegativesConfig,
)
from retromae_ds.finetuning.grad_cache import GradCacheConfig
from retromae_ds.refresher.config import MiningConfig, RefreshConfig
from retromae_ds.training.config import CheckpointConfig, OptimConfig
from retromae_recipes.common import (
    evaluate_cached,
    minilm_dir,
    pyplot,
    run_finetune,
    save_figure,
    write_json,
)
from retromae_recipes.report_rows import MEASURES, compare


@dataclass(kw_only=True)
class EffectOptions:
    """``python scripts/batch_effect.py``: the batch-size experiment's settings."""

    wikitext: str = "../shared/data/wikitext2"
    """WikiText folder: its wiki.train.raw, wiki.valid.raw and wiki.test.raw that exist."""
    out: str = "runs/batch_effect"
    """Output folder: the task, the runs, the evaluations, the report."""
    init: str = ""
    """The encoder folder to fine-tune (empty: all-MiniLM-L6-v2)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of every batch."""
    batches: list[int] = field(default_factory=lambda: [32, 256, 1024])
    """Global batches (queries per step, one process)."""
    epochs: float = 2.0
    """Passes over the train queries, the same for every batch."""
    lr: float = 3e-5
    """Peak learning rate at ``lr_batch`` (the SciFact recipe's)."""
    lr_batch: int = 32
    """The batch ``lr`` is given for."""
    lr_rule: str = flag("sqrt", choices=("sqrt", "same"))
    """sqrt: lr * sqrt(batch / lr_batch); same: lr at every batch."""
    warmup_ratio: float = 0.1
    """Linear warm-up over this share of each run's steps."""
    chunk: int = 64
    """GradCache for batches above it, in chunks of this many queries and passages."""
    n_hard: int = 1
    """BM25 negatives per query per step."""
    top_k: int = 30
    """The negatives are drawn from BM25's top K."""
    num_negatives: int = 8
    """Negatives mined per query (n_hard drawn from them per step)."""
    q_max_len: int = 64
    """Query tokens in training."""
    p_max_len: int = 128
    """Passage tokens in training (evaluation uses the encoder's own length)."""
    precision: str = flag("bf16", choices=("bf16", "fp32"))
    """Training precision (ds_configs/PRECISION.json)."""
    eval_bf16: bool = True
    """Encode for evaluation under bf16 autocast."""
    dev: bool = True
    """Also evaluate every fine-tuned encoder on the dev articles."""
    min_words: int = 40
    """Shortest paragraph that becomes a passage."""
    per_paragraph: int = 0
    """Queries per paragraph at most (0: as many as keep half its words)."""
    dev_fraction: float = 0.1
    """Share of the queries (whole articles) held out for validation."""
    test_fraction: float = 0.1
    """Share of the queries (whole articles) the figures are measured on."""

    def __post_init__(self) -> None:
        if not self.seeds or not self.batches or min(self.batches) < 1:
            raise ValueError(
                f"--seeds and --batches need a value each, batches >= 1, not {self.batches}"
            )
        if self.epochs <= 0 or self.chunk < 1 or self.lr_batch < 1:
            raise ValueError(
                f"--epochs must be > 0 (not {self.epochs}), --chunk and --lr_batch >= 1 (not "
                f"{self.chunk}, {self.lr_batch})"
            )


def lr_for(opts: EffectOptions, batch: int) -> float:
    """The peak learning rate of a run at ``batch`` (``lr_rule``)."""
    if opts.lr_rule == "same":
        return opts.lr
    return opts.lr * math.sqrt(batch / opts.lr_batch)


class Experiment:
    def __init__(self, opts: EffectOptions) -> None:
        self.opts = opts
        self.out = Path(opts.out)
        self.init = Path(opts.init) if opts.init else minilm_dir()
        self.task = ict_task.build(
            ict_task.wikitext_raws(opts.wikitext),
            self.out / "data",
            min_words=opts.min_words,
            per_paragraph=opts.per_paragraph,
            dev_fraction=opts.dev_fraction,
            test_fraction=opts.test_fraction,
        )
        self.sizes = json.loads((self.task / "ict_task.json").read_text())
        self._loaded: dict[tuple[str, str], Any] = {}

    def run_dir(self, batch: int, seed: int) -> Path:
        return self.out / "runs" / f"b{batch}_s{seed}"

    def config(self, batch: int, seed: int) -> FinetuneConfig:
        o, run = self.opts, self.run_dir(batch, seed)
        cache = (
            GradCacheConfig(query_chunk=o.chunk, passage_chunk=o.chunk)
            if batch > o.chunk
            else GradCacheConfig()
        )
        return FinetuneConfig(
            run_dir=str(run),
            seed=seed,
            epochs=o.epochs,
            micro_batch_size=batch,
            log_every=1,
            progress=False,
            refresher="none",
            data=FinetuneDataConfig(
                beir=str(self.task),
                split="train",
                q_max_len=o.q_max_len,
                p_max_len=o.p_max_len,
                prepared=str(self.out / "prepared"),  # tokenized once for every run
            ),
            model=DualModelConfig(init=str(self.init)),  # pooling etc.: the init's own
            negatives=NegativesConfig(n_hard=o.n_hard),
            grad_cache=cache,
            refresh=RefreshConfig(
                run_dir=str(run),
                mining=MiningConfig(top_k=o.top_k, num_negatives=o.num_negatives, seed=seed),
                progress=False,
            ),
            optim=OptimConfig(lr=lr_for(o, batch), warmup_ratio=o.warmup_ratio),
            checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
            deepspeed=DeepSpeedSettings(
                config=["ds_configs/zero2.json", f"ds_configs/{o.precision}.json"]
            ),
        )

    def finetuned(self, batch: int, seed: int) -> Path:
        """The run folder of (batch, seed), trained (or resumed) to its last step."""
        return run_finetune(self.config(batch, seed))

    def evaluate(self, name: str, model: Path, split: str) -> dict[str, Any]:
        """MEASURES of ``model`` on ``split`` at its own pooling and length, cached as
        ``out/eval/NAME.json``."""
        path = self.out / "eval" / f"{name}.json"
        return evaluate_cached(
            path, model, self.task, split, self._loaded, bf16=self.opts.eval_bf16
        )

    def bm25(self) -> dict[str, Any]:
        path = self.out / "eval" / "bm25.json"
        if not path.is_file():
            from retromae_ds.retrieval.lexical import evaluate_bm25

            result = evaluate_bm25(self.task, "test", MEASURES)
            write_json({"split": "test", "metrics": result["metrics"]}, path)
        return json.loads(path.read_text())

    def one(self, batch: int, seed: int) -> dict[str, Any]:
        """The row of one run: its test (and dev) measures, steps, lr and wall time."""
        run = self.finetuned(batch, seed)
        row: dict[str, Any] = {
            "batch": batch,
            "seed": seed,
            "lr": lr_for(self.opts, batch),
            "grad_cache_chunk": self.opts.chunk if batch > self.opts.chunk else 0,
            "steps": _last_step(RunLayout(run).metrics),
            "train_seconds": _seconds(run),
            "metrics": self.evaluate(f"b{batch}_s{seed}", run, "test")["metrics"],
        }
        if self.opts.dev:
            row["dev"] = self.evaluate(f"dev_b{batch}_s{seed}", run, "dev")["metrics"]
        return row

    def run(self, command: str = "") -> str:
        t0 = time.perf_counter()
        rows = [self.one(batch, seed) for seed in self.opts.seeds for batch in self.opts.batches]
        results = {
            "options": to_dict(self.opts),
            "task": self.sizes,
            "init": self.evaluate("init", self.init, "test")["metrics"],
            "bm25": self.bm25()["metrics"],
            "rows": rows,
            "seconds": time.perf_counter() - t0,
        }
        write_json(results, self.out / "batch_effect_results.json")
        return write_report(results, self.out, command)


def _last_step(metrics: Path) -> int:
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()]
    return int(max(steps, default=0))


def _seconds(run: Path) -> float | None:
    timing = run / "recipe_timing.json"
    return json.loads(timing.read_text())["seconds"] if timing.is_file() else None


def aggregate(rows: list[dict[str, Any]], key: str = "metrics") -> dict[int, dict[str, Any]]:
    """Per batch: mean and sample std over seeds of each measure (``report_rows.compare``'s
    shape), with the steps, lr and mean wall time."""
    out: dict[int, dict[str, Any]] = {}
    for batch in dict.fromkeys(r["batch"] for r in rows):
        rs = [r for r in rows if r["batch"] == batch and key in r]
        if not rs:
            continue
        agg: dict[str, Any] = {"n": len(rs), "steps": rs[0]["steps"], "lr": rs[0]["lr"]}
        for m in MEASURES:
            xs = [r[key][m] for r in rs]
            agg[m] = statistics.fmean(xs)
            agg[m + "_std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        secs = [r["train_seconds"] for r in rs if r["train_seconds"] is not None]
        agg["train_seconds"] = statistics.fmean(secs) if secs else None
        out[batch] = agg
    return out


def _table(agg: dict[int, dict[str, Any]]) -> list[str]:
    head = "| batch | steps | peak lr | seeds | " + " | ".join(MEASURES) + " | train min/run |"
    lines = [head, "|---:|---:|---:|---:|" + "---|" * len(MEASURES) + "---:|"]
    for batch, a in agg.items():
        cells = [f"{a[m]:.4f} ± {a[m + '_std']:.4f}" for m in MEASURES]
        secs = f"{a['train_seconds'] / 60:.1f}" if a["train_seconds"] is not None else "-"
        lines.append(
            f"| {batch} | {a['steps']} | {a['lr']:.2e} | {a['n']} | "
            + " | ".join(cells)
            + f" | {secs} |"
        )
    return lines


def write_report(results: dict[str, Any], out: Path, command: str) -> str:
    opts, task = results["options"], results["task"]
    agg = aggregate(results["rows"])
    q = task["queries"]
    text = [
        "# Does a larger contrastive batch help? (issue 57)",
        "",
        f"Command: `{command}`",
        "",
        f"Task: inverse cloze on WikiText ({', '.join(Path(s).name for s in task['sources'])}): "
        f"{task['passages']:,} passages; {q['train']:,} train, {q['dev']:,} dev and {q['test']:,} "
        "test queries, split by article (`retromae_ds/data/ict_task.py`).",
        "",
        f"Every run: {opts['epochs']} epochs over the train queries, BM25 negatives "
        f"({opts['n_hard']} per query from the top {opts['top_k']}), the init's pooling and "
        f"temperature. Equal epochs: a batch of B makes floor({q['train']} / B) steps an epoch, "
        "so a larger batch takes fewer, larger steps. Learning rate: "
        + (
            f"{opts['lr']:.1e} × sqrt(B / {opts['lr_batch']}) (square-root rule)"
            if opts["lr_rule"] == "sqrt"
            else f"{opts['lr']:.1e} at every batch"
        )
        + f"; GradCache in chunks of {opts['chunk']} above {opts['chunk']} queries.",
        "",
        f"Test (BM25: nDCG@10 {results['bm25']['ndcg@10']:.4f}; the init: "
        f"{results['init']['ndcg@10']:.4f}):",
        "",
        *_table(agg),
        "",
    ]
    batches = list(agg)
    for i, a in enumerate(batches):
        for b in batches[i + 1 :]:
            text.append(
                f"- nDCG@10 at batch {b} vs {a}: {agg[b]['ndcg@10']:.4f} vs {agg[a]['ndcg@10']:.4f}: "
                f"{compare(agg[b], agg[a])}"
            )
    dev = aggregate(results["rows"], "dev")
    if dev:
        text += ["", "Dev (validation articles):", "", *_table(dev)]
    text += [
        "",
        "Verdicts: `report_rows.compare` (a difference of more than two standard errors of the "
        "two means, from the seeds' spread).",
        "",
        f"Wall time of this invocation: {results['seconds'] / 60:.1f} min.",
    ]
    png = plot(results, agg, dev, out / "batch_effect.png")
    if png:
        text += ["", f"![nDCG@10 per batch]({png.name})"]
    body = "\n".join(text) + "\n"
    atomic_write_text(out / "batch_effect.md", body)
    return body


def plot(results: dict[str, Any], agg, dev, path: Path) -> Path | None:
    """nDCG@10 against the batch (log scale), mean ± std over seeds, BM25 and the init drawn
    as lines."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, a in (("test", agg), ("dev", dev)):
        if a:
            xs = list(a)
            ax.errorbar(
                xs,
                [a[b]["ndcg@10"] for b in xs],
                [a[b]["ndcg@10_std"] for b in xs],
                marker="o",
                capsize=3,
                label=name,
            )
    ax.axhline(results["bm25"]["ndcg@10"], ls="--", c="grey", label="BM25 (test)")
    ax.axhline(results["init"]["ndcg@10"], ls=":", c="black", label="init (test)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (queries per step), equal epochs")
    ax.set_ylabel("nDCG@10")
    ax.set_title("inverse-cloze WikiText task: batch size")
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


PROG = "scripts/batch_effect.py"


def main(argv: list[str] | None = None) -> int:
    """``python scripts/batch_effect.py``: options are ``EffectOptions``' fields, parsed like
    every ``retromae-ds`` command (``base.options``); a bad option is one line naming it."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def run(opts: EffectOptions) -> int:
        print(Experiment(opts).run(" ".join([f"python {PROG}", *argv])))
        return 0

    return run_command(
        EffectOptions, run, argv, prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split())
    )
