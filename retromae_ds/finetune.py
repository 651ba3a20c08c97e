"""Dense-retrieval fine-tuning (ANCE): ``retromae-ds finetune --config FILE [--a.b VALUE ...]``.

Also ``python -m retromae_ds.finetune``; one process, ``torchrun``, the ``deepspeed`` launcher
or ``srun`` (``slurm/finetune.sh`` runs it beside the refresher). A dual encoder (shared
weights by default), initialised from a pre-training checkpoint or any local Hugging Face
encoder, is trained contrastively on a BEIR split: per query its positive, ``n_hard`` hard
negatives and every other passage of the global batch (gathered from all ranks, gradients
flowing through the gather), with a temperature. The loop, checkpoints, exact resume and the
stop/requeue protocol are pre-training's (``retromae_ds.training``).

Negatives: before the first step rank 0 publishes version 0 from BM25 (``bm25s``, all
positives removed) unless a version exists. Every ``negatives.refresh_every`` steps rank 0
reads the ``CURRENT`` pointer and, when the refresher published a newer version, all ranks
swap to it at that step boundary; the version in use and its staleness (steps since the
checkpoint it was mined from) are logged. If the refresher dies, training goes on with the
last version, and the trainer says so once: a local refresher that exited is reported at the
next look (with the last line of its log), and with ``negatives.stale_after`` N a version in
use for N × ``refresh_every`` steps without a newer one is (any refresher: a Slurm step, one
on another machine). ``negatives.on_stale stop`` turns either into a stop: a checkpoint of
that step is saved, then the run fails in one line (resume once a refresher runs).
``--refresher local`` starts ``retromae-ds refresh`` as a subprocess that dies with the
trainer (Linux's parent-death signal, and ``--parent_pid`` polled by the refresher);
``--refresher external`` says one runs elsewhere (a Slurm step: ``slurm/finetune.sh``, another
machine). ``--negatives.mine_first`` waits for the first version a refresher mines, so it needs
one of the two (refused up front with ``none``); the wait says what it waits for every
``negatives.wait_report_s`` and ends on a stop signal as training does (the step-0 checkpoint
is complete: exit 85, resume with ``--checkpoint.resume auto``).

The BEIR files the run tokenizes are fingerprinted (sha256) in ``RUN/data/READY``; a resume
(or a run reusing ``data.prepared``) against a folder whose files changed since is refused
naming them, and every start checks the tokenized shards against their manifest before
anything reads them (``retromae_ds.finetuning.data``). The init and its pooling are checked (the
model is built) before anything is tokenized, and a pre-training run folder as ``--run_dir``
is refused before anything is written into it.

``--model.kind cross_encoder`` trains a reranker instead, through the same loop, checkpoints
and negatives (``retromae_ds.finetuning.cross_encoder``: listwise over each query's positive
and hard negatives; no refresher). A kind is looked up once (``MODEL_KINDS``) for its model,
batches, folders and refusals.

Checkpoints hold ``encoder/`` (and ``query_encoder/``) as Hugging Face folders; the per-rank
state adds the negatives version in use, so a resumed run builds the same batches as an
uninterrupted one.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from retromae_ds.base.commands import DESCRIPTIONS
from retromae_ds.base.config import resumable, to_dict
from retromae_ds.base.fsutil import atomic_write_text
from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.components import engine as eng
from retromae_ds.components.checkpoint import pretraining_evidence, resolve_encoder
from retromae_ds.components.layout import RunLayout
from retromae_ds.components.signals import StopSignals
from retromae_ds.data.pairs import READ_FORMATS
from retromae_ds.data.sampler import ResumableDistributedSampler
from retromae_ds.finetuning import cross_encoder, handoff, pairs_data
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning.batches import BatchBuilder, batch_stream
from retromae_ds.finetuning.distill import DistillConfig
from retromae_ds.finetuning.feed import NegativesConfig, NegativesFeed
from retromae_ds.finetuning.grad_cache import GradCache, GradCacheConfig
from retromae_ds.finetuning.kind import ModelKind, ModelPieces
from retromae_ds.finetuning.model import DualEncoder, load_tower, save_encoders
from retromae_ds.hf import sbert
from retromae_ds.hf.pooling import check_pooling, get_pooling
from retromae_ds.refresher.bm25 import publish_bm25
from retromae_ds.refresher.config import RefreshConfig, with_absolute_paths
from retromae_ds.refresher.given import publish_given, publish_scored
from retromae_ds.training.config import OptimConfig, RunConfig
from retromae_ds.training.loop import Hooks, Trainer, job_main, run_guarded, run_job, steps_for


@dataclass(kw_only=True)
class FinetuneDataConfig:
    beir: str = ""
    """BEIR folder (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv)."""
    split: str = "train"
    """Qrels split to train on."""
    pairs: str = ""
    """Instead of ``beir``: training pairs in an anchor's format (FlagEmbedding jsonl, a
    sentence-transformers table: jsonl, parquet or a datasets folder, Tevatron jsonl, or
    ``retromae-ds mine``'s file). Staged once as a BEIR folder beside the tokenized data; its
    negatives are the run's first version (BM25's for a query it gives none)."""
    pairs_format: str = "auto"
    """auto, flagembedding, st, tevatron or mined."""
    corpus: str = ""
    """With ``pairs``: a BEIR folder (or its corpus.jsonl) whose ids the file's ids name, and
    whose other passages a refresher mines from."""
    by_id: bool = False
    """With ``pairs``: FlagEmbedding's and sentence-transformers' strings are query and
    passage ids into ``corpus``."""
    q_max_len: int = 64
    """Query tokens including special tokens."""
    p_max_len: int = 256
    """Passage tokens including special tokens (longer documents are truncated)."""
    prepared: str = ""
    """Tokenized data folder (default RUN/data; tokenized once, reused on resume)."""
    workers: int = resumable(1)
    """Tokenization worker processes."""


@dataclass(kw_only=True)
class DualModelConfig:
    init: str = ""
    """A local Hugging Face encoder folder, a complete checkpoint, or a run folder."""
    kind: str = "dual_encoder"
    """dual_encoder (a retriever: the settings below) or cross_encoder (a reranker reading
    query and passage together, trained listwise on each query's positive and hard negatives:
    retromae_ds.finetuning.cross_encoder; pooling, normalize, temperature, shared, GradCache
    and a refresher are refused)."""
    pooling: str = "auto"
    """auto (the init's own: its sentence-transformers files, else cls) or a registered
    pooling (retromae_ds.hf.pooling, an installed package's included): cls (RetroMAE's
    sentence embedding), mean, dupmae_bow (DupMAE's ordinary-token vector, through the MLM
    head: the init must keep it) or dupmae ([CLS] and that vector concatenated). The refresher
    mines with the same pooling (DupMAE's vectors are vocabulary-sized: shards hold fewer
    passages, and search costs |V| / H times CLS's)."""
    bow_topk: int | None = None
    """DupMAE poolings: entries of the bag-of-words vector kept (none: the init's own, else
    256; 0 keeps all)."""
    normalize: bool | None = None
    """L2-normalise embeddings (cosine similarity); none: the init's own (else false)."""
    temperature: float | None = None
    """Scores are divided by it; none: 0.05 with normalised embeddings, else 1."""
    shared: bool = True
    """One encoder for queries and passages; false trains a separate query tower."""
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(
                f"model.kind must be one of {', '.join(MODEL_KINDS)}, not {self.kind!r}"
            )
        self.pooling = check_pooling(self.pooling, "model.pooling")
        if self.bow_topk is not None and self.bow_topk < 0:
            raise ValueError(f"model.bow_topk must be >= 0, not {self.bow_topk}")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError("model.temperature must be > 0")

    def resolve(self, init_dir: Path) -> tuple[sbert.EmbeddingSpec, float]:
        """(the embedding settings to train with, the temperature): explicit settings over
        the init's own (``retromae_ds.hf.sbert``)."""
        spec = sbert.resolve(init_dir, self.pooling, self.normalize, self.bow_topk)
        temperature = self.temperature or (NORMALIZED_TEMPERATURE if spec.normalize else 1.0)
        return spec, temperature


REFRESHERS = ("none", "local", "external")
"""Who renews the negatives: nobody this trainer knows of, its own subprocess, one elsewhere."""

NORMALIZED_TEMPERATURE = 0.05
"""Contrastive temperature for cosine scores (sentence-transformers' scale 20, SimCSE, E5)."""


@dataclass(kw_only=True)
class FinetuneConfig(RunConfig):
    run_dir: str = resumable("runs/finetune")
    """Where checkpoints, metrics, negatives and resolved configs go."""
    micro_batch_size: int = 16
    """Queries per rank per forward pass (each with 1 + n_hard passages)."""
    RENAMED: ClassVar[dict[str, str]] = {
        "refresher_device": "refresh.device",
        "resume": "checkpoint.resume",
    }
    """``refresher_device`` overrode ``refresh.device``; the section's field is the one."""

    refresher: str = resumable("none")
    """none (the trainer renews no negatives itself; a refresher may run elsewhere), local
    (start it as a subprocess; ``refresh.device cpu`` keeps a single GPU for the trainer) or
    external (one runs elsewhere: a Slurm step, another machine; what
    ``negatives.mine_first`` needs when it is not local)."""
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    model: DualModelConfig = field(default_factory=DualModelConfig)
    negatives: NegativesConfig = field(default_factory=NegativesConfig)
    grad_cache: GradCacheConfig = field(default_factory=GradCacheConfig)
    """GradCache (``retromae_ds.finetuning.grad_cache``): embed a micro-batch in chunks of
    ``query_chunk`` queries and ``passage_chunk`` passages, without a graph, then re-embed each
    chunk with its cached loss gradient; the gradients equal one pass over the whole batch,
    at the memory of a chunk. 0 and 0: off."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """Distillation of a teacher's scores (``retromae_ds.finetuning.distill``): the loss, the
    temperatures and weights, the offline scores. The run's first negatives version is then
    the teacher-scored passages of each query, with their scores."""
    refresh: RefreshConfig = field(default_factory=RefreshConfig)
    """The refresher's settings, written to RUN/refresh_config.json for any refresher of this
    run (a local one, a Slurm step), and ``refresh.mining``, with which the trainer mines the
    BM25 version too. ``run_dir`` and ``parent_pid`` are the trainer's to fill in."""
    epochs: float = resumable(2.5)
    """Passes over the training queries when max_steps is 0 (the SciFact recipe's 100 steps
    of 16 queries are 2.4 passes over its 659)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-5, warmup_ratio=0.1))

    def __post_init__(self) -> None:
        if bool(self.data.beir) == bool(self.data.pairs) or not self.model.init:
            raise ValueError(
                "give model.init and one of data.beir (a BEIR folder) or data.pairs (a "
                "training pairs file)"
            )
        if self.data.pairs and self.data.split != "train":
            raise ValueError("data.split is a BEIR folder's: data.pairs trains on its whole file")
        if self.data.pairs_format not in ("auto", *READ_FORMATS):
            raise ValueError(
                f"data.pairs_format must be auto or one of {', '.join(READ_FORMATS)}, "
                f"not {self.data.pairs_format!r}"
            )
        super().__post_init__()
        if self.negatives.n_hard < 0:
            raise ValueError("negatives.n_hard must be >= 0")
        if self.negatives.refresh_every < 1:
            raise ValueError("negatives.refresh_every must be >= 1")
        if self.refresher not in REFRESHERS:
            raise ValueError(
                f"refresher must be one of {', '.join(REFRESHERS)}, not {self.refresher!r}"
            )
        if self.negatives.mine_first and self.refresher == "none":
            raise ValueError(
                "negatives.mine_first waits for the negatives a refresher mines from the "
                "step-0 checkpoint, and refresher is none: nothing would ever publish them; "
                "use --refresher local (a subprocess of this trainer), --refresher external "
                "when one runs elsewhere (a Slurm step, another machine), or leave "
                "mine_first out to start on BM25 negatives"
            )
        if (
            self.refresh.run_dir
            and Path(self.refresh.run_dir).resolve() != Path(self.run_dir).resolve()
        ):
            raise ValueError(
                f"refresh.run_dir {self.refresh.run_dir!r} is not this run's folder "
                f"{self.run_dir!r}: the refresher serves this run; leave refresh.run_dir out"
            )
        if self.refresh.parent_pid:
            raise ValueError("refresh.parent_pid is the trainer's to set: leave it out")
        self._check_distill()
        MODEL_KINDS[self.model.kind].check(self)

    def _check_distill(self) -> None:
        d = self.distill
        if not d.enabled:
            return
        if not (d.scores or d.teacher or self.data.pairs):
            raise ValueError(
                f"distill.loss {d.loss} needs teacher scores: --distill.teacher CE (a "
                "cross-encoder scoring every negatives version), --distill.scores FILE (an "
                "anchor's score file naming the training ids), or --data.pairs with a file "
                "that scores its passages (FlagEmbedding pos_scores/neg_scores, an ST scores "
                "column, Tevatron's score)"
            )
        if d.teacher:
            if self.refresh.teacher and self.refresh.teacher != d.teacher:
                raise ValueError(
                    f"refresh.teacher {self.refresh.teacher!r} and distill.teacher "
                    f"{d.teacher!r} differ: give distill.teacher alone"
                )
            self.refresh.teacher = d.teacher  # every version, the refresher's included
        elif self.refresher != "none":
            raise ValueError(
                f"distill.loss {d.loss} with --refresher {self.refresher}: the refresher's "
                "versions carry teacher scores only from an online teacher: add "
                "--distill.teacher CE, or use --refresher none"
            )
        if self.negatives.n_hard < 1:
            raise ValueError("distillation needs negatives.n_hard >= 1 scored negatives a query")
        if self.model.kind != "dual_encoder":
            raise ValueError(
                f"distill.loss {d.loss}: distillation trains a dual encoder, not model.kind "
                f"{self.model.kind} (a cross-encoder is the teacher)"
            )


def _write_refresh_config(cfg: FinetuneConfig, layout: RunLayout) -> Path:
    """The refresher's settings (the ``refresh`` section) for any refresher of this run: the
    local subprocess, or a Slurm job step that waits for this file (slurm/finetune.sh)."""
    refresh = {
        **to_dict(cfg.refresh),
        "run_dir": str(layout.root),
        # the data this trainer prepared (``data.prepared``, else RUN/data)
        "data_dir": cfg.refresh.data_dir or str(Path(cfg.data.prepared or layout.data)),
        # --progress false: no bars anywhere in the run (a refresher's log is a file too)
        "progress": cfg.refresh.progress and cfg.progress,
    }
    atomic_write_text(layout.refresh_config, json.dumps(with_absolute_paths(refresh), indent=2))
    return layout.refresh_config


# --------------------------------------------------------------------------- the run
def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Run (or resume) fine-tuning; returns the last metrics row on every rank. Raises
    StopRequested when a stop signal ended the run early (its checkpoint is complete)."""
    problem = pretraining_run(RunLayout(cfg.run_dir))
    if problem is not None:  # before the run folder is locked: nothing is written into it
        raise ValueError(problem)
    return run_guarded(cfg, lambda stop, dist: _finetune(cfg, stop, dist))


def pretraining_run(layout: RunLayout) -> str | None:
    """Why ``layout.root`` is a pre-training run, one line, or None. Reads only: fine-tuning
    into it would write ``data/`` and ``negatives/`` beside its checkpoints, and resuming it
    would mean setting those aside."""
    what = pretraining_evidence(layout)
    if what is None:
        return None
    return (
        f"{layout.root}: a pre-training run ({what}); fine-tuning writes a run folder of its "
        f"own: give --run_dir a new folder, with --model.init {layout.root} to start from "
        "this run's newest checkpoint"
    )


def _finetune(cfg: FinetuneConfig, stop: StopSignals, dist: eng.DistInfo) -> dict[str, Any]:
    layout = RunLayout(cfg.run_dir)
    torch.manual_seed(cfg.seed)
    init_dir = resolve_encoder(cfg.model.init)
    # the model first: an init that cannot serve the pooling (no MLM head) or without its own
    # tokenizer is refused before anything is tokenized or mined into the run
    tokenizer = ance_data.tokenizer_fingerprint(init_dir)
    pieces = MODEL_KINDS[cfg.model.kind].build(cfg, init_dir, tokenizer)
    model = pieces.model
    ts = _prepare_data(cfg, layout, init_dir, tokenizer, dist)
    sampler = ResumableDistributedSampler(ts.num_queries, dist.world_size, dist.rank, seed=cfg.seed)
    batch_size = cfg.micro_batch_size
    if len(sampler) < batch_size:
        raise ValueError(
            f"{ts.num_queries} training queries over {dist.world_size} ranks cannot fill "
            f"micro batches of {batch_size}"
        )
    micro_per_epoch = len(sampler) // batch_size  # the partial last batch of an epoch is skipped
    max_steps = steps_for(cfg, max(1, micro_per_epoch // cfg.grad_accum))
    trainer = Trainer(cfg, dist, model, sampler, max_steps=max_steps, stop=stop)
    feed = NegativesFeed(cfg.negatives, layout, ts, dist, trainer.note)
    restored = trainer.resume(feed.resume_state())
    version, start_problem = feed.start(restored is not None, trainer.step)
    trainer.start_log(
        f"finetune: {ts.num_queries} queries, {ts.num_passages} passages, "
        f"negatives v{version}" + (f", resumed at step {restored.step}" if restored else "")
    )
    trainer.note(pieces.note)
    if start_problem is not None:
        trainer.note(f"finetune: {start_problem}")
    hooks = Hooks(
        write_models=pieces.write_models,
        metrics=("loss", "accuracy"),
        counts=pieces.counts,
        consumed=lambda batch: batch_size,
        marker=lambda: {**pieces.marker, **feed.marker()},
        log_fields=lambda: feed.log_fields(trainer.step),
        after_step=feed.after_step,
        forward_backward=_grad_cache(cfg, model, trainer),
    )
    if dist.rank == 0:
        refresh_file = _write_refresh_config(cfg, layout)
        if cfg.refresher == "local":
            feed.start_local_refresher(refresh_file)
    try:
        if cfg.negatives.mine_first and trainer.step == 0:
            if restored is None:
                trainer.save(0, hooks)
            feed.wait_for_first_mined(stop)
        build = pieces.batches(
            BatchBuilder(ts, cfg.negatives.n_hard, cfg.seed, teacher=cfg.distill.enabled)
        )
        last = trainer.fit(batch_stream(sampler, batch_size, build, feed.negatives), hooks)
        if dist.rank == 0 and trainer.step >= max_steps:
            atomic_write_text(layout.finished, json.dumps({"step": trainer.step}))
    finally:
        feed.stop_local_refresher()
        trainer.close()
    return last


def _grad_cache(cfg: FinetuneConfig, model: DualEncoder, trainer: Trainer) -> GradCache | None:
    """The GradCache step when ``grad_cache`` asks for one (said in the log), else None."""
    gc = cfg.grad_cache
    if not gc.enabled:
        return None
    trainer.note(
        f"finetune: GradCache, chunks of {gc.query_chunk or cfg.micro_batch_size} queries "
        f"and {gc.passage_chunk or 'all the'} passages"
    )
    return GradCache(gc, model.loss_grads)


def _prepare_data(
    cfg: FinetuneConfig,
    layout: RunLayout,
    init_dir: Path,
    tokenizer: dict[str, Any],
    dist: eng.DistInfo,
) -> ance_data.TrainingSet:
    """Rank 0 tokenizes the BEIR split with the init's tokenizer (``tokenizer``: its
    fingerprint) (once: ``data.prepared``
    or ``RUN/data``) and publishes the BM25 negatives as v0 when no version exists; every
    rank then loads the training set."""
    prepared = Path(cfg.data.prepared or layout.data)
    beir = cfg.data.beir
    if cfg.data.pairs:
        beir = str(prepared.with_name(prepared.name + "_pairs"))
    if dist.rank == 0:
        layout.root.mkdir(parents=True, exist_ok=True)
        layout.finished.unlink(missing_ok=True)
        if cfg.data.pairs:
            pairs_data.stage(
                cfg.data.pairs,
                beir,
                format=cfg.data.pairs_format,
                corpus=cfg.data.corpus or None,
                by_id=cfg.data.by_id,
            )
        ance_data.prepare(
            beir,
            cfg.data.split,
            init_dir,
            prepared,
            q_max_len=cfg.data.q_max_len,
            p_max_len=cfg.data.p_max_len,
            workers=cfg.data.workers,
            progress=cfg.progress,
            tokenizer=tokenizer,
        )
    eng.barrier()
    ts = ance_data.load(prepared)
    if dist.rank == 0 and cfg.distill.enabled and not cfg.distill.teacher:
        _publish_teacher_scores(cfg, layout, ts, beir)
    elif dist.rank == 0 and not (layout.negatives / handoff.POINTER).exists():
        # --progress false silences bm25s's bars too
        bm25_cfg = replace(cfg.refresh, progress=cfg.refresh.progress and cfg.progress)
        if cfg.data.pairs:
            manifest = publish_given(bm25_cfg, ts, layout.negatives)
            print(
                f"finetune: {cfg.data.pairs}'s negatives published as v{manifest['version']} "
                f"(BM25's for {manifest['queries_from_bm25']} queries it gives none)",
                file=sys.stderr,
            )
        else:
            manifest = publish_bm25(bm25_cfg, ts, layout.negatives)
            print(f"finetune: BM25 negatives published as v{manifest['version']}", file=sys.stderr)
    eng.barrier()
    return ts


def _publish_teacher_scores(
    cfg: FinetuneConfig, layout: RunLayout, ts: ance_data.TrainingSet, beir: str
) -> None:
    """Distillation's first version: each query's teacher-scored passages, from
    ``distill.scores`` or the pairs file's own scores; on resume, the version published is
    kept while its source is unchanged (an edited scores file is refused, naming it)."""
    source = cfg.distill.scores or cfg.data.pairs
    digest = pairs_data.source_fingerprint(source)
    if (layout.negatives / handoff.POINTER).exists():
        first = handoff.load_version(
            layout.negatives, handoff.published_versions(layout.negatives)[0]
        )
        if first.manifest.get("teacher_sha256") != digest:
            raise ValueError(
                f"{source}: the teacher scores changed since this run published them "
                f"({layout.negatives}): resume with the file it started with, or start a new run"
            )
        return
    if cfg.distill.scores:
        from retromae_ds.data.teacher_scores import read_teacher_scores

        scores = read_teacher_scores(
            cfg.distill.scores, format=cfg.distill.scores_format,
            query_ids=set(ts.query_ids), corpus_ids=set(ts.passage_ids.to_pylist()),
        )  # fmt: skip
        scored, what = scores.scores, scores.format
    else:
        scored, what = pairs_data.staged_scores(beir), cfg.data.pairs_format
    meta = {"source": "teacher_scores", "teacher": str(source), "teacher_format": what,
            "teacher_sha256": digest}  # fmt: skip
    manifest = publish_scored(cfg.refresh, ts, layout.negatives, scored, str(source), meta)
    print(
        f"finetune: {source}'s teacher scores published as v{manifest['version']} "
        f"({manifest['num_negatives']} scored negatives)",
        file=sys.stderr,
    )


def _dual_encoder(cfg: FinetuneConfig, init_dir: Path, tokenizer: dict[str, Any]) -> ModelPieces:
    """The dual encoder's pieces (``finetuning.kind``): its model, its folders at each
    checkpoint (``save_encoders``), and what a step counts."""
    spec, temperature = cfg.model.resolve(init_dir)
    model = _build_model(cfg, init_dir, spec, temperature, SpecialIds.from_fingerprint(tokenizer))
    # what a user of the saved encoder should read texts up to: the init's own length when it
    # has one (fine-tuning on shorter passages does not shorten what it reads), else the
    # passage length trained at
    lengths = {
        "q_max_len": cfg.data.q_max_len,
        "p_max_len": cfg.data.p_max_len,
        "max_seq_length": max(cfg.data.p_max_len, spec.max_length or 0),
    }
    return ModelPieces(
        model=model,
        batches=lambda build: build,
        write_models=lambda state, staging: save_encoders(model, state, staging, init_dir, lengths),
        counts=lambda batch: {  # tokens stay on the device: no read per step
            "tokens": batch["q_mask"].sum() + batch["p_mask"].sum(),
            "slots": batch["q_mask"].numel() + batch["p_mask"].numel(),
            "queries": len(batch["q_ids"]),
        },
        marker={"objective": "contrastive"},
        note=(
            f"finetune: {spec.pooling} pooling, normalize {str(spec.normalize).lower()} "
            f"(pooling from {spec.source}), temperature {temperature:g}"
            + (f"; distillation {json.dumps(model.distill.as_dict())}" if model.distill else "")
        ),
    )


MODEL_KINDS: dict[str, ModelKind] = {
    "dual_encoder": ModelKind(check=lambda cfg: None, build=_dual_encoder),
    "cross_encoder": cross_encoder.KIND,
}
"""``model.kind`` -> what it refuses and how its pieces are built (``finetuning.kind``)."""


def _build_model(
    cfg: FinetuneConfig,
    init_dir: Path,
    spec: sbert.EmbeddingSpec,
    temperature: float,
    special: SpecialIds,
) -> DualEncoder:
    """The dual encoder from the init: one shared tower or two (``model.shared``), each with
    its MLM head for the DupMAE poolings."""
    head = get_pooling(spec.pooling).needs_head
    encoder = load_tower(init_dir, head=head)
    query_encoder = None if cfg.model.shared else load_tower(init_dir, head=head)
    for tower in (encoder, query_encoder):
        if tower is not None and cfg.model.gradient_checkpointing:
            tower.gradient_checkpointing_enable()
    return DualEncoder(
        encoder,
        query_encoder,
        pooling=spec.pooling,
        normalize=spec.normalize,
        temperature=temperature,
        bow_topk=spec.bow_topk,
        special_ids=special.all,
        distill=cfg.distill.resolved(temperature) if cfg.distill.enabled else None,
    )


def finetune_command(cfg: FinetuneConfig) -> int:
    """``retromae-ds finetune``: :func:`finetune` with a training job's exit statuses
    (``training.loop.run_job``)."""
    return run_job(finetune, cfg, "retromae-ds finetune")


def main(argv: list[str] | None = None) -> int:
    """``python -m retromae_ds.finetune`` (what the ``deepspeed`` launcher, ``torchrun`` and
    ``slurm/finetune.sh`` start): the same command as ``retromae-ds finetune``."""
    return job_main(
        FinetuneConfig,
        finetune_command,
        argv,
        prog="retromae-ds finetune",
        description=DESCRIPTIONS["finetune"],
    )


if __name__ == "__main__":
    sys.exit(main())
