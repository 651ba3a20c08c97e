"""A cross-encoder teacher, measured (issue 58, item 5): trained here, as a reranker, as a
denoiser of mined negatives, and distilled into the bi-encoder offline and online.

``python scripts/teacher_study.py --data ../shared/data/scifact --wikitext ../shared/data/wikitext2 [--out runs/teacher] [--retromae_init DIR]``

Two collections: SciFact (its train queries split once into train and ``holdout`` validation
queries, as the SciFact fine-tuning recipe ``retromae_recipes.finetune`` does; test untouched)
and the WikiText inverse-cloze task (``retromae_ds.data.ict_task``, split by article). Per
collection and seed:

1. **Cross-encoders.** ``finetune --model.kind cross_encoder`` from all-MiniLM-L6-v2 on BM25
   negatives (``--refresher none``), and from ``--retromae_init`` when given (does
   retrieval-oriented pre-training help the reranker too?).
2. **Bi-encoders** (the SciFact recipe's settings: ``RecipeConfig``'s steps, batch, lengths,
   lr, top 30, refresh every 50 steps): ``ance`` (its ANCE arm); ``mined`` and ``denoised``:
   the init's own negatives written by ``retromae-ds mine`` (8 drawn from its top 30, as the
   ANCE arm's first version), trained as ``--data.pairs`` (static by default, RocketQA's
   protocol; ``--file_refresher local`` refreshes them as ANCE does), the second with the
   cross-encoder's false negatives dropped (``--denoise margin`` at the margin fitted with
   ``--holdout_positive --denoise_fit`` on the train queries with two or more positives: its
   precision and recall are reported); ``distill_offline``: the ``mined`` negatives with the
   teacher's scores of the same ``mine`` (``--distill.scores NAME.teacher.tsv``);
   ``distill_online``: the ANCE arm with ``--distill.teacher CE``, the refresher scoring every
   version as it publishes it.
3. **Evaluation** on test: BM25, BM25 + CE, the ANCE bi-encoder, ANCE + CE (each CE; the
   top ``rerank_depth``), every bi-encoder arm; nDCG@10, MRR@10, Recall@100, the CE's pairs/s.
4. ``teacher.md`` (``retromae_recipes.teacher_report``: mean ± std over seeds, ``compare``
   verdicts, detection figures, the costs), ``teacher_results.json``.

Every stage is cached: a finished run, mine or evaluation is kept and skipped on a rerun.

**Cost on 2 CPU cores** (measured on SciFact seed 0, docs/results.md): the CE trains at
~3.8 s a step (8 groups of 4 pairs at 287 tokens; ~2.4 s at 159), 600 steps ~38 min; its
curve reranks BM25's top 30 of the 150 validation queries at each kept checkpoint (~2.5 min
each); CE scoring under bf16 autocast runs at ~30 pairs/s at 287 tokens (55-60 at 159, ~19
at 512): a top-30 reranking of the 300 test queries ~5 min, a ``mine`` ~4 min of scoring;
each bi-encoder run 6 min static, 9 with ANCE's refresher, ~12 with the online teacher (at
159 tokens; more at 287); evaluations ~2 min. A SciFact seed after the teacher ~1 h. On one
GPU the CE's scoring goes at thousands of pairs per second (not measured).

**Defaults, chosen by the validation curves** (docs/results.md, "What the teacher reads"):
pairs of 287 tokens (``ce_q_max_len`` 32 + ``ce_p_max_len`` 256 - 1). SciFact abstracts
run to 316 tokens at the median: cut at 159 the CE reads half of each and ranks below BM25
(best 0.713 nDCG@10 against BM25's 0.724), at 287 it ranks above (0.749); scoring a CE
at more tokens than it trained on loses (0.749 -> 0.691 at 512; 0.713 -> 0.606 for the
159-token CE at 287), so ``ce_max_length`` stays the trained length. 600 CE steps (the
287-token curve peaks at step 400 of 600; ``--ce_pick best`` takes it). Rerank depth 30
(the BEIR paper reranks BM25's top 100: ``--rerank_depth 100`` costs 3.3x the reranking).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retromae_ds.base.config import flag, to_dict
from retromae_ds.base.options import run_command
from retromae_ds.components.engine import DeepSpeedSettings
from retromae_ds.finetune import DualModelConfig, FinetuneConfig, FinetuneDataConfig
from retromae_ds.finetuning.distill import LOSSES, DistillConfig
from retromae_ds.finetuning.feed import NegativesConfig
from retromae_ds.refresher.config import MiningConfig, RefreshConfig
from retromae_ds.training.config import CheckpointConfig, OptimConfig
from retromae_recipes.common import (
    check_settings,
    evaluate_cached,
    minilm_dir,
    run_finetune,
    write_json,
)
from retromae_recipes.finetune import RecipeConfig, split_train
from retromae_recipes.report_rows import MEASURES

TASKS = ("scifact", "ict")
ARMS = ("ance", "mined", "denoised", "distill_offline", "distill_online")
"""The bi-encoder arms (module doc, step 2)."""
FREE = (
    "tasks",
    "seeds",
    "arms",
    "stages",
    "out",
    "refresh_threads",
    "ce_batch_size",
    "ce_max_length",
)
"""Options a rerun into the same ``--out`` may change: they add rows, or change only speed,
or (``ce_max_length``) name their results apart; any other change is refused
(``common.check_settings``), since the cached results were made with the old value."""
STARTS = ("minilm", "retromae")
"""The cross-encoders' inits: all-MiniLM-L6-v2 (``init``) and ``retromae_init``."""


@dataclass(kw_only=True)
class TeacherOptions:
    """``python scripts/teacher_study.py``: the teacher study's settings (the bi-encoder's are
    the SciFact recipe's, ``retromae_recipes.finetune.RecipeConfig``)."""

    data: str = "../shared/data/scifact"
    """SciFact as a BEIR folder (corpus, queries, qrels/train.tsv and test.tsv)."""
    wikitext: str = "../shared/data/wikitext2"
    """WikiText folder for the inverse-cloze task (its wiki.*.raw files)."""
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """Collections: scifact, ict (the WikiText inverse-cloze task)."""
    out: str = "runs/teacher"
    """Output folder: the data, the runs, the mines, the evaluations, the report."""
    init: str = ""
    """The bi-encoder's init and the first cross-encoder's (empty: all-MiniLM-L6-v2)."""
    retromae_init: str = ""
    """A RetroMAE checkpoint (an encoder folder) a second cross-encoder starts from (empty:
    none)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of every run."""
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    """Bi-encoder arms: ance, mined, denoised, distill_offline, distill_online."""
    steps: int = RecipeConfig.steps
    """Steps of every bi-encoder run."""
    batch: int = RecipeConfig.batch
    """Queries per bi-encoder step."""
    n_hard: int = RecipeConfig.n_hard
    """Hard negatives per query per step (bi-encoder and cross-encoder)."""
    num_negatives: int = RecipeConfig.num_negatives
    """Negatives mined per query (by BM25, the refresher or ``mine``)."""
    top_k: int = RecipeConfig.top_k
    """Candidates the negatives are drawn from."""
    q_max_len: int = RecipeConfig.q_max_len
    """Bi-encoder query tokens in training."""
    p_max_len: int = RecipeConfig.p_max_len
    """Bi-encoder passage tokens in training."""
    lr: float = RecipeConfig.lr
    """Peak learning rate of the bi-encoder runs."""
    checkpoint_every: int = RecipeConfig.checkpoint_every
    """The ANCE arms refresh from each such checkpoint."""
    refresh_threads: int = RecipeConfig.refresh_threads
    """Torch threads of the local refresher (and its online teacher)."""
    file_refresher: str = flag("none", choices=("none", "local"))
    """The mined and denoised arms: none (the file's negatives throughout, RocketQA's
    protocol) or local (the file is the first version, then ANCE's refreshes)."""
    holdout: int = RecipeConfig.holdout
    """SciFact train queries held out for validation."""
    ict_per_paragraph: int = 1
    """Queries per WikiText paragraph (1: ~1,300 train queries; 0: as many as fit)."""
    mine_max_length: int | None = None
    """Tokens per text when ``mine`` encodes (none: the encoder's own, 256 for MiniLM)."""
    ce_steps: int = 600
    """Cross-encoder training steps (chosen by the curve: ``ce_curve_every``)."""
    ce_seed: int | None = 0
    """The one seed every cross-encoder trains with: one teacher per collection and start,
    shared by the bi-encoder seeds (none: a teacher per seed)."""
    ce_curve_every: int = 200
    """Keep the cross-encoder's checkpoint every this many steps and rerank BM25's top
    ``rerank_depth`` on the validation split with each: the teacher's budget curve (0: no
    curve, the last checkpoint is the teacher)."""
    ce_pick: str = flag("best", choices=("best", "last"))
    """The teacher: the curve's checkpoint with the best validation nDCG@10 (the earliest
    of a tie: early stopping on held-out queries; the test split is never looked at), or
    the last."""
    ce_batch: int = 8
    """Queries per cross-encoder step, each with its positive and n_hard negatives."""
    ce_lr: float = 3e-5
    """Peak learning rate of the cross-encoders."""
    ce_q_max_len: int = 32
    """Cross-encoder query tokens (a pair is cut at ce_q_max_len + ce_p_max_len - 1)."""
    ce_p_max_len: int = 256
    """Cross-encoder passage tokens (the bi-encoder's are ``p_max_len``; the teacher reads
    more of each passage: the module doc)."""
    ce_batch_size: int = 32
    """Pairs per cross-encoder forward pass when scoring."""
    ce_max_length: int | None = None
    """Tokens per pair whenever a cross-encoder scores (its curve, the reranking, ``mine``,
    the online teacher); none: the longest pair it trained on (ce_q_max_len + ce_p_max_len -
    1). Measured: scoring past the trained length loses (module doc), so leave it none
    unless that is what is being measured."""
    stages: str = flag("all", choices=("curve", "all"))
    """curve: the cross-encoders and their validation curves only (choosing the teacher's
    settings on held-out queries; no bi-encoder, nothing on test); all: the whole study."""
    rerank_depth: int = 30
    """First-stage documents per test query the cross-encoder reranks (BEIR's: 100)."""
    denoise: str = flag("margin", choices=("margin", "relative_margin", "threshold"))
    """The false-negative rule of the denoised arm (fitted on held-out positives)."""
    distill_loss: str = flag("kl_ce", choices=LOSSES[1:])
    """The distillation loss of both distilled arms."""
    teacher_temperature: float = 1.0
    """The teacher's temperature (distill.teacher_temperature)."""
    student_temperature: float | None = None
    """The student's temperature (none: the run's contrastive one)."""
    precision: str = flag("bf16", choices=("bf16", "fp32"))
    """Training precision (ds_configs/PRECISION.json)."""
    eval_bf16: bool = True
    """Encode for evaluation and mining, and score with the cross-encoders, under bf16
    autocast."""

    def __post_init__(self) -> None:
        for name, allowed in (("tasks", TASKS), ("arms", ARMS)):
            bad = [x for x in getattr(self, name) if x not in allowed]
            if bad or not getattr(self, name):
                raise ValueError(f"--{name}: give some of {', '.join(allowed)}, not {bad}")
        if not self.seeds or min(self.steps, self.ce_steps, self.rerank_depth, self.n_hard) < 1:
            raise ValueError("--seeds, and --steps, --ce_steps, --rerank_depth, --n_hard >= 1")
        if self.ce_max_length is not None and self.ce_max_length < 3:
            raise ValueError(f"--ce_max_length must be >= 3, not {self.ce_max_length}")
        if self.stages == "curve" and not self.ce_curve_every:
            raise ValueError("--stages curve needs --ce_curve_every > 0 (the curve is the stage)")


@dataclass
class Task:
    name: str
    beir: Path
    """Splits train and test (and dev)."""
    multi: Path | None
    """The train queries with two or more positives (the denoising fit's), or None."""


class TeacherStudy:
    def __init__(self, opts: TeacherOptions) -> None:
        self.opts = opts
        self.out = Path(opts.out)
        self.init = Path(opts.init) if opts.init else minilm_dir()
        self.starts = {"minilm": self.init}
        if opts.retromae_init:
            self.starts["retromae"] = Path(opts.retromae_init)
        self._loaded: dict[tuple[str, str], Any] = {}
        self._curves: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        self.tasks = [self._task(name) for name in opts.tasks]

    def _task(self, name: str) -> Task:
        o, root = self.opts, self.out / name
        if name == "scifact":
            beir = split_train(Path(o.data), root / "data", o.holdout, 0)
        else:
            from retromae_ds.data import ict_task

            beir = ict_task.build(
                ict_task.wikitext_raws(o.wikitext), root / "data", per_paragraph=o.ict_per_paragraph
            )
        return Task(name, beir, multi_positive(beir, root / "data_multi"))

    # -- configs ------------------------------------------------------------------------
    def _base(self, task: Task, run: Path, seed: int) -> FinetuneConfig:
        o = self.opts
        return FinetuneConfig(
            run_dir=str(run), seed=seed, max_steps=o.steps, micro_batch_size=o.batch,
            log_every=max(1, min(10, o.steps // 5)), progress=False, refresher="none",
            data=FinetuneDataConfig(beir=str(task.beir), split="train", q_max_len=o.q_max_len,
                                    p_max_len=o.p_max_len,
                                    prepared=str(self.out / task.name / "prepared")),
            model=DualModelConfig(init=str(self.init)),
            negatives=NegativesConfig(n_hard=o.n_hard, refresh_every=5),
            refresh=RefreshConfig(
                run_dir=str(run), device="cpu",
                mining=MiningConfig(top_k=o.top_k, num_negatives=o.num_negatives, seed=seed),
                threads=o.refresh_threads, cache_dir=str(self.out / task.name / "embedding_cache"),
                bf16=o.eval_bf16, bf16_cpu=o.eval_bf16, progress=False,
                teacher_bf16=o.eval_bf16,
            ),
            optim=OptimConfig(lr=o.lr, warmup_ratio=RecipeConfig.warmup_ratio),
            checkpoint=CheckpointConfig(every_steps=o.steps, keep_last=1),
            deepspeed=DeepSpeedSettings(
                config=["ds_configs/zero2.json", f"ds_configs/{o.precision}.json"]
            ),
        )  # fmt: skip

    def _refreshing(self, cfg: FinetuneConfig, *, mine_first: bool) -> FinetuneConfig:
        every = min(self.opts.steps, self.opts.checkpoint_every)
        return replace(
            cfg, refresher="local",
            negatives=replace(cfg.negatives, mine_first=mine_first),
            checkpoint=CheckpointConfig(every_steps=every, keep_last=1),
        )  # fmt: skip

    @property
    def length_tag(self) -> str:
        """Part of the cached names of whatever a cross-encoder scored: a scoring length other
        than the trained one is another result, never read back as this one."""
        n = self.opts.ce_max_length
        return f"_len{n}" if n else ""

    def ce_seed(self, seed: int) -> int:
        return seed if self.opts.ce_seed is None else self.opts.ce_seed

    def ce_config(self, task: Task, start: str, seed: int) -> FinetuneConfig:
        seed = self.ce_seed(seed)
        o, run = self.opts, self.out / task.name / "runs" / f"ce_{start}_s{seed}"
        cfg = self._base(task, run, seed)
        every = o.ce_curve_every if 0 < o.ce_curve_every < o.ce_steps else o.ce_steps
        return replace(
            cfg, max_steps=o.ce_steps, micro_batch_size=o.ce_batch,
            log_every=max(1, min(10, o.ce_steps // 5)),
            data=replace(cfg.data, q_max_len=o.ce_q_max_len, p_max_len=o.ce_p_max_len,
                         prepared=str(self.out / task.name / f"prepared_ce_{start}")),
            model=DualModelConfig(init=str(self.starts[start]), kind="cross_encoder"),
            optim=OptimConfig(lr=o.ce_lr, warmup_ratio=RecipeConfig.warmup_ratio),
            checkpoint=CheckpointConfig(every_steps=every, keep_last=0),  # all: the curve's
        )  # fmt: skip

    def arm_config(self, task: Task, arm: str, seed: int) -> FinetuneConfig:
        tag = self.length_tag if arm in ("denoised", "distill_offline", "distill_online") else ""
        o, run = self.opts, self.out / task.name / "runs" / f"{arm}_s{seed}{tag}"
        cfg = self._base(task, run, seed)
        distill = DistillConfig(
            loss=o.distill_loss, teacher_temperature=o.teacher_temperature,
            student_temperature=o.student_temperature,
        )  # fmt: skip
        if arm == "ance":
            return self._refreshing(cfg, mine_first=True)
        if arm == "distill_online":
            teacher = str(self.teacher(task, "minilm", seed))
            cfg = self._refreshing(cfg, mine_first=True)
            refresh = replace(cfg.refresh, teacher_max_length=o.ce_max_length)
            return replace(cfg, distill=replace(distill, teacher=teacher), refresh=refresh)
        mined = self.mine(task, seed, "mined" if arm != "denoised" else "denoised")
        if arm == "distill_offline":
            scores = mined["file"].with_name(mined["manifest"]["cross_encoder"]["teacher_file"])
            return replace(cfg, distill=replace(distill, scores=str(scores)))
        data = FinetuneDataConfig(
            pairs=str(mined["file"]), pairs_format="mined", corpus=str(task.beir),
            q_max_len=o.q_max_len, p_max_len=o.p_max_len,
        )  # fmt: skip
        cfg = replace(cfg, data=data)
        return self._refreshing(cfg, mine_first=False) if o.file_refresher == "local" else cfg

    # -- stages -------------------------------------------------------------------------
    def ce(self, task: Task, start: str, seed: int) -> Path:
        """The cross-encoder of (task, start, seed), trained (or resumed) to its last step."""
        return run_finetune(self.ce_config(task, start, seed))

    def arm(self, task: Task, arm: str, seed: int) -> Path:
        return run_finetune(self.arm_config(task, arm, seed))

    def mine(self, task: Task, seed: int, kind: str) -> dict[str, Any]:
        """``retromae-ds mine`` with the init and the seed's MiniLM cross-encoder: ``holdout``
        (the multi-positive train queries, one positive hidden, the denoising rule fitted),
        ``mined`` (every train query, the CE's scores, nothing dropped) or ``denoised``
        (dropped at the fitted value). Kept once its manifest is written."""
        from retromae_ds.mine import MineConfig, run_mine

        o = self.opts
        stem = f"{kind}_s{seed}{self.length_tag}"
        out = self.out / task.name / "mine" / f"{stem}.jsonl"
        manifest_path = out.with_name(f"{stem}.manifest.json")
        if manifest_path.is_file():
            return {"file": out, "manifest": json.loads(manifest_path.read_text())}
        settings = dict(
            model=str(self.init), out=str(out), split="train", num_negatives=o.num_negatives,
            range_max=o.top_k, sampling_strategy="random", seed=seed, device="cpu",
            bf16=o.eval_bf16, max_length=o.mine_max_length, progress=False, cache_dir=str(self.out / task.name / "mine_cache"),
            cross_encoder=str(self.teacher(task, "minilm", seed)), ce_batch_size=o.ce_batch_size,
            ce_bf16=o.eval_bf16, ce_max_length=o.ce_max_length,
        )  # fmt: skip
        if kind == "holdout":
            assert task.multi is not None
            settings.update(beir=str(task.multi), holdout_positive=True, denoise=o.denoise)
            try:
                manifest = run_mine(MineConfig(**settings, denoise_fit=True))
            except ValueError as e:  # no held-out positive came back: measured at the default
                print(f"teacher: {task.name} seed {seed}: no fit ({e})", file=sys.stderr)
                manifest = run_mine(MineConfig(**settings))
        else:
            settings["beir"] = str(task.beir)
            if kind == "denoised":
                settings.update(denoise=o.denoise, denoise_value=self.denoise_value(task, seed))
            manifest = run_mine(MineConfig(**settings))
        shutil.rmtree(out.with_name(f".{stem}.work"), ignore_errors=True)
        return {"file": out, "manifest": manifest}

    def denoise_value(self, task: Task, seed: int) -> float | None:
        """The fitted value of the denoising rule (none: the rule's default, when the task
        has no query with two positives or the fit found nothing to fit)."""
        if task.multi is None:
            return None
        fitted = self.mine(task, seed, "holdout")["manifest"]["denoise"].get("fitted")
        return fitted["value"] if fitted else None

    def evaluate(self, task: Task, name: str, model: Path, split: str = "test") -> dict[str, Any]:
        path = self.out / task.name / "eval" / f"{name}.json"
        return evaluate_cached(
            path, model, task.beir, split, self._loaded, bf16=self.opts.eval_bf16
        )

    def students_on_dev(self, task: Task, ance: bool = True) -> dict[str, Any]:
        """What the teacher's curve is read against: the init and each seed's ANCE
        bi-encoder on the same validation queries (a teacher weaker than its student has
        nothing to teach it)."""
        out: dict[str, Any] = {"init": self.evaluate(task, "dev_init", self.init, "dev")["metrics"]}
        if ance and "ance" in self.opts.arms:
            out["ance"] = [
                self.evaluate(task, f"dev_ance_s{s}", self.arm(task, "ance", s), "dev")["metrics"]
                for s in self.opts.seeds
            ]  # fmt: skip
        return out

    def reranked(
        self, task: Task, name: str, first: Path | str, ce: Path, split: str = "test"
    ) -> dict[str, Any]:
        """``first`` (a bi-encoder, or ``bm25``) reranked by ``ce`` at ``rerank_depth`` on
        ``split``: ``metrics`` reranked, ``first_stage``, ``cross_encoder`` (pairs/s); cached
        (under a name that carries ``ce_max_length`` when it is set)."""
        path = self.out / task.name / "eval" / f"{name}{self.length_tag}.json"
        if path.is_file():
            return json.loads(path.read_text())
        import torch

        from retromae_ds.eval.run import evaluate_beir
        from retromae_ds.eval.two_stage import BM25, CrossEncoderStage, evaluate_bm25_beir
        from retromae_ds.retrieval.beir import load_beir

        o = self.opts
        stage = CrossEncoderStage(model=str(ce), depth=o.rerank_depth,
                                  batch_size=o.ce_batch_size, device="cpu",
                                  bf16=o.eval_bf16, max_length=o.ce_max_length)  # fmt: skip
        key = (str(task.beir), split)
        if key not in self._loaded:
            self._loaded[key] = load_beir(task.beir, split)
        if first == BM25:
            result = evaluate_bm25_beir(self._loaded[key], split, measures=MEASURES,
                                        cross_encoder=stage)  # fmt: skip
        else:
            result = evaluate_beir(
                first, self._loaded[key], split, measures=MEASURES, device="cpu",
                amp_dtype=torch.bfloat16 if o.eval_bf16 else None, progress=False,
                verbose=False, cross_encoder=stage,
            )  # fmt: skip
        row = {k: result[k] for k in ("metrics", "first_stage", "cross_encoder", "seconds")}
        write_json(row, path)
        return row

    def teacher(self, task: Task, start: str, seed: int) -> Path:
        """The cross-encoder the study uses: the run (its last checkpoint), or with
        ``ce_pick`` best the curve's best checkpoint's encoder."""
        run = self.ce(task, start, seed)
        if self.opts.ce_pick != "best" or not self.opts.ce_curve_every:
            return run
        picked = pick(self.ce_curve(task, start, seed))
        if picked is None:
            return run
        from retromae_ds.components.layout import step_tag

        return run / "checkpoints" / step_tag(picked) / "encoder"

    def ce_curve(self, task: Task, start: str, seed: int) -> list[dict[str, Any]]:
        """The teacher's budget curve: BM25's top ``rerank_depth`` on the validation split
        reranked by each kept checkpoint of the cross-encoder (step 0: BM25 alone)."""
        from retromae_ds.components.checkpoint import STEP_DIR, complete_checkpoints
        from retromae_ds.eval.two_stage import BM25

        run, seed = self.ce(task, start, seed), self.ce_seed(seed)
        key = (task.name, start, seed)
        if key in self._curves:  # teacher() asks for it at every stage that scores
            return self._curves[key]
        points: list[dict[str, Any]] = []
        for ckpt in complete_checkpoints(run / "checkpoints"):
            step = int(STEP_DIR.match(ckpt.name).group(1))
            r = self.reranked(task, f"curve_ce_{start}_s{seed}_step{step}", BM25,
                              ckpt / "encoder", split="dev")  # fmt: skip
            if not points:
                points.append({"step": 0, "metrics": r["first_stage"]["metrics"]})
            points.append({"step": step, "metrics": r["metrics"]})
        self._curves[key] = points
        return points

    def bm25(self, task: Task) -> dict[str, Any]:
        path = self.out / task.name / "eval" / "bm25.json"
        if not path.is_file():
            from retromae_ds.retrieval.lexical import evaluate_bm25

            write_json({"metrics": evaluate_bm25(task.beir, "test", MEASURES)["metrics"]}, path)
        return json.loads(path.read_text())

    # -- the study ----------------------------------------------------------------------
    def one_seed(self, task: Task, seed: int) -> list[dict[str, Any]]:
        """Every row of (task, seed): the CEs' reranking, the arms, their costs."""
        from retromae_ds.eval.two_stage import BM25
        from retromae_recipes.teacher_report import online_costs, run_seconds

        rows: list[dict[str, Any]] = []
        dense = self.arm(task, "ance", seed) if "ance" in self.opts.arms else None
        for start in self.starts:
            ce = self.teacher(task, start, seed)
            common = {"task": task.name, "seed": seed, "ce": start,
                      "train_s": run_seconds(self.ce(task, start, seed)),
                      "ce_seed": self.ce_seed(seed), "ce_model": str(ce)}  # fmt: skip
            if self.ce_seed(seed) == seed or seed == self.opts.seeds[0]:
                # BM25 + CE depends on the teacher alone: one row per teacher
                r = self.reranked(task, f"bm25_ce_{start}_s{self.ce_seed(seed)}", BM25, ce)
                rows.append({**common, "row": f"bm25+ce_{start}", **r})
            if dense is not None:
                r = self.reranked(task, f"ance_ce_{start}_s{seed}", dense, ce)
                rows.append({**common, "row": f"ance+ce_{start}", **r})
        for arm in self.opts.arms:
            run = self.arm(task, arm, seed)
            row = {"task": task.name, "seed": seed, "row": arm, "train_s": run_seconds(run),
                   **self.evaluate(task, f"{arm}_s{seed}", run)}  # fmt: skip
            if arm in ("mined", "denoised", "distill_offline"):
                kind = "denoised" if arm == "denoised" else "mined"
                row["mine"] = mine_record(self.mine(task, seed, kind)["manifest"])
            if arm == "distill_online":
                row["online"] = online_costs(run)
            rows.append(row)
        if task.multi is not None and "denoised" in self.opts.arms:
            m = self.mine(task, seed, "holdout")["manifest"]
            rows.append({"task": task.name, "seed": seed, "row": "holdout",
                         "mine": mine_record(m), "metrics": {}})  # fmt: skip
        return rows

    def run(self, command: str = "") -> str:
        from retromae_recipes.teacher_report import write_report

        t0 = time.perf_counter()
        rows, fixed, curves, dev, o = [], {}, {}, {}, self.opts
        check_settings(self.out, to_dict(o), FREE)
        whole = o.stages == "all"
        for task in self.tasks:
            if whole:
                fixed[task.name] = {"bm25": self.bm25(task)["metrics"],
                                    "init": self.evaluate(task, "init", self.init)["metrics"]}  # fmt: skip
            for seed in self.opts.seeds:
                if whole:
                    rows += self.one_seed(task, seed)
                if self.opts.ce_curve_every:
                    for start in self.starts:
                        key = f"{task.name}/{start}/s{self.ce_seed(seed)}"
                        points = self.ce_curve(task, start, seed)
                        curves.setdefault(key, {"points": points, "picked": pick(points)
                                                if o.ce_pick == "best" else None})  # fmt: skip
            if o.ce_curve_every:
                dev[task.name] = self.students_on_dev(task, ance=whole)
        results = {
            "options": to_dict(self.opts),
            "tasks": {
                t.name: {"beir": str(t.beir), "multi_positive": str(t.multi or "")}
                for t in self.tasks
            },  # fmt: skip
            "fixed": fixed,
            "rows": rows,
            "ce_curves": curves,
            "students_on_dev": dev,
            "seconds": time.perf_counter() - t0,
        }
        write_json(results, self.out / "teacher_results.json")
        return write_report(results, self.out, command)


def pick(points: list[dict[str, Any]]) -> int | None:
    """The curve's step with the best nDCG@10 past step 0 (BM25 alone), the earliest of a
    tie; None without one."""
    trained = [p for p in points if p["step"] > 0]
    if not trained:
        return None
    best = max(p["metrics"]["ndcg@10"] for p in trained)
    return min(p["step"] for p in trained if p["metrics"]["ndcg@10"] == best)


def multi_positive(beir: Path, dst: Path) -> Path | None:
    """``dst``: ``beir``'s train queries with two or more positives (corpus and queries
    linked), the only ones ``mine --holdout_positive`` can hide one of; None when there are
    none. Written whole or not at all; an existing one is kept."""
    import os

    if (dst / "qrels" / "train.tsv").is_file():
        return dst
    lines = (beir / "qrels" / "train.tsv").read_text(encoding="utf-8").splitlines()
    rows = [r for r in lines[1:] if r.strip() and float(r.split("\t")[2]) > 0]
    count: dict[str, int] = {}
    for r in rows:
        count[r.split("\t")[0]] = count.get(r.split("\t")[0], 0) + 1
    kept = [r for r in rows if count[r.split("\t")[0]] >= 2]
    if not kept:
        return None
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "qrels").mkdir(parents=True)
    for name in ("corpus.jsonl", "queries.jsonl"):
        os.symlink((beir / name).resolve(), staging / name)
    (staging / "qrels" / "train.tsv").write_text("\n".join([lines[0], *kept]) + "\n")
    os.replace(staging, dst)
    return dst


def mine_record(m: dict[str, Any]) -> dict[str, Any]:
    """What the report reads of a mine's manifest: counts, the CE's pairs/s, denoising."""
    ce = m.get("cross_encoder") or {}
    return {
        "queries": m["queries"], "negatives": m["negatives"],
        "ce_pairs": ce.get("pairs"), "ce_pairs_per_s": ce.get("pairs_per_s"),
        "denoise": m.get("denoise"), "total_s": m["timings"].get("total_s"),
    }  # fmt: skip


PROG = "scripts/teacher_study.py"


def main(argv: list[str] | None = None) -> int:
    """``python scripts/teacher_study.py``: options are ``TeacherOptions``' fields, parsed
    like every ``retromae-ds`` command (``base.options``); a bad option is one line naming it."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def run(opts: TeacherOptions) -> int:
        print(TeacherStudy(opts).run(" ".join([f"python {PROG}", *argv])))
        return 0

    return run_command(
        TeacherOptions, run, argv, prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split())
    )
