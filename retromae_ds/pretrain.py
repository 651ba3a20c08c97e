"""Pre-training: ``retromae-ds pretrain --config FILE [--section.field VALUE ...]``.

Also ``python -m retromae_ds.pretrain``. Reads shards, builds the collator and the model
(RetroMAE, SEED-Encoder or MLM) and trains them with the shared ``Trainer``
(``retromae_ds.training``): DeepSpeed engine, checkpoints that resume exactly (a run stopped
after step s and resumed, same world size, computes the same losses at every later step),
stop signals -> checkpoint -> exit 85 for requeueing; with ``--eval.beir DIR`` it scores the
encoder's zero-shot retrieval (CLS and mean pooling, DupMAE's on request) every ``--eval.every``
steps into the log (``retromae_ds.eval.periodic``). Launch it as one process, with
``torchrun``, the ``deepspeed`` launcher or ``srun``; rank and world size come from the
environment.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from retromae_ds.base.commands import DESCRIPTIONS
from retromae_ds.base.config import resumable
from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.components import engine as eng
from retromae_ds.components.layout import ENCODER
from retromae_ds.components.signals import StopSignals
from retromae_ds.data.collate import IndexedSamples, MaskingConfig, PretrainCollator
from retromae_ds.data.dataset import SPECIAL_TOKENS, ShardDataset
from retromae_ds.data.sampler import LengthGroupedSampler, ResumableDistributedSampler
from retromae_ds.eval.periodic import PeriodicEvalConfig
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import OBJECTIVES, ObjectiveConfig, PretrainModel
from retromae_ds.modeling.positions import usable_positions
from retromae_ds.training.config import RunConfig
from retromae_ds.training.loop import Hooks, Trainer, job_main, run_guarded, run_job, steps_for


@dataclass(kw_only=True)
class DataConfig:
    shards: str = ""
    """Folder written by ``retromae-ds preprocess``."""
    max_length: int = 0
    """Model sequence length; 0 = the shards' max length."""
    num_workers: int = resumable(0)
    """DataLoader worker processes (results do not depend on it)."""
    length_grouping: int = 0
    """Order each group of this many steps' samples by length (``LengthGroupedSampler``), so
    a batch of long, uneven documents is not mostly padding; 0: the plain shuffled order."""
    packing: bool = False
    """Lay each micro-batch's samples end to end in rows of ``max_length`` (first-fit
    decreasing) instead of one padded row each; a document mask keeps them apart and
    positions restart per document, so each sample trains exactly as alone
    (``retromae_ds.attention.packing``; tests/test_packing.py). Removes the padding's FLOPs
    in the encoder's and decoders' linear layers; attention then spans the packed row."""

    def __post_init__(self) -> None:
        if self.length_grouping < 0:
            raise ValueError(f"data.length_grouping must be >= 0, not {self.length_grouping}")


@dataclass(kw_only=True)
class ModelConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)


@dataclass(kw_only=True)
class PretrainConfig(RunConfig):
    run_dir: str = resumable("runs/pretrain")
    """Where checkpoints, metrics and resolved configs go."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    eval: PeriodicEvalConfig = resumable(default_factory=PeriodicEvalConfig)

    RENAMED: ClassVar[dict[str, str]] = {
        "masking.decoder_ratio": "model.objective.decoder_ratio",
        "resume": "checkpoint.resume",
    }
    """Old field names still accepted (files, command line, saved runs): old -> new."""

    def __post_init__(self) -> None:
        if not self.data.shards:
            raise ValueError("data.shards is required (a folder written by retromae-ds preprocess)")
        if self.masking.encoder_ratio == 0:
            raise ValueError(
                "masking.encoder_ratio 0 masks no word: the encoder's MLM loss would have no "
                "target (a non-finite loss at step 1); use a ratio > 0 (RetroMAE 0.3, BERT 0.15)"
            )
        super().__post_init__()


def pretrain(cfg: PretrainConfig) -> dict[str, Any]:
    """Run (or resume) pre-training; returns the final metrics row on every rank. Raises
    StopRequested when a stop signal ended the run early (its checkpoint is complete)."""
    return run_guarded(cfg, lambda stop, dist: _train(cfg, stop, dist))


def check_max_length(requested: int, manifest: dict[str, Any], shards: str) -> int:
    """The model sequence length: ``data.max_length``, or the manifest's when 0. Raises,
    naming both lengths and where each comes from, when it cannot hold the shards' longest
    row plus [CLS] and [SEP]."""
    max_length = requested or manifest["max_length"]
    rows = manifest["max_tokens_per_row"]
    needed = rows + SPECIAL_TOKENS
    if max_length >= needed:
        return max_length
    have = (
        f"data.max_length {max_length}"
        if requested
        else f"max_length {max_length} in {Path(shards) / 'manifest.json'} (data.max_length 0)"
    )
    fix = (
        f"set data.max_length to {needed} or more (0 takes the shards' own)"
        if requested
        else "the manifest's max_length and max_tokens_per_row disagree (edited or damaged): "
        f"check it with retromae-ds inspect {shards} --verify, or set data.max_length {needed}"
    )
    raise ValueError(
        f"{have} is shorter than the shards' samples: their rows hold up to {rows} tokens + "
        f"{SPECIAL_TOKENS} special tokens = {needed} (max_tokens_per_row + [CLS], [SEP]); {fix}"
    )


def check_masking(masking: MaskingConfig, manifest: dict[str, Any], shards: str) -> None:
    """Refuse an encoder masking ratio that masks no word of any row: a row of ``n`` words
    gets round(ratio x n) of them masked, and no row of these shards holds more words than
    tokens (``max_tokens_per_row``)."""
    longest = manifest["max_tokens_per_row"]
    if masking.encoder_ratio * longest < 0.5:
        raise ValueError(
            f"masking.encoder_ratio {masking.encoder_ratio:g} masks no word: the rows of "
            f"{shards} hold at most {longest} tokens and round({masking.encoder_ratio:g} x "
            f"{longest}) = 0, so the MLM loss would have no target; use at least "
            f"{0.5 / longest:.3g}"
        )


def _train(cfg: PretrainConfig, stop: StopSignals, dist: eng.DistInfo) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    data, special, max_length, collator, sampler, loader = _data_pipeline(cfg, dist)
    manifest = data.manifest
    steps_per_epoch = max(1, len(sampler) // (cfg.micro_batch_size * cfg.grad_accum))
    max_steps = steps_for(cfg, steps_per_epoch)

    folder = check_vocabulary(cfg.model.encoder, cfg.data.shards, manifest["tokenizer"])
    encoder = build_encoder(cfg.model.encoder, special.vocab_size, special.pad, folder=folder)
    if usable_positions(encoder) < max_length:
        raise ValueError(
            f"{cfg.model.encoder.name}: encoder has {usable_positions(encoder)} positions < "
            f"max_length {max_length}; extend it with --model.encoder.max_positions {max_length}"
        )
    model = PretrainModel(encoder, cfg.model.objective)
    trainer = Trainer(cfg, dist, model, sampler, max_steps=max_steps, stop=stop)
    restored = trainer.resume()
    trainer.start_log(
        f"resumed from {restored.checkpoint} at step {restored.step}" if restored else None
    )
    tokenizer_dir = Path(cfg.data.shards) / "tokenizer"

    def write_models(state: dict[str, torch.Tensor], staging: Path) -> None:
        from retromae_ds.data.tokenizer import load_tokenizer

        _write_encoder(model, state, staging / ENCODER)
        tokenizer = load_tokenizer(tokenizer_dir)
        # the tokenizer's own limit must not truncate what the (extended) encoder can read
        tokenizer.model_max_length = usable_positions(encoder)
        tokenizer.save_pretrained(str(staging / ENCODER))

    metrics = ("loss", "mlm_loss", "mlm_accuracy", *model.task.metrics)
    evaluate = _periodic_eval(cfg, trainer, model, tokenizer_dir) if cfg.eval.enabled else None
    hooks = Hooks(
        write_models=write_models,
        metrics=metrics,
        counts=_token_counts,
        consumed=lambda batch: len(batch["sample_index"]),
        marker=model.task.identity,
        evaluate=evaluate,
        eval_every=cfg.eval.every,
    )
    return trainer.fit(_epochs(loader, sampler, collator), hooks)


def _data_pipeline(cfg: PretrainConfig, dist: eng.DistInfo):
    """(shards, special ids, max_length, collator, sampler, loader) of this rank. Opening
    checks every shard is there, has its size and can be read, its sha256 against the
    manifest and its token ids against the vocabulary: a shard this user cannot read, a
    flipped bit or a foreign id stops the run here, naming it, before the engine is built."""
    data = ShardDataset(cfg.data.shards, check_shards=True)
    manifest = data.manifest
    max_length = check_max_length(cfg.data.max_length, manifest, cfg.data.shards)
    check_masking(cfg.masking, manifest, cfg.data.shards)
    special = SpecialIds.from_fingerprint(manifest["tokenizer"])
    collator = PretrainCollator(
        special,
        cfg.masking,
        max_length,
        seed=cfg.seed,
        decoder=OBJECTIVES[cfg.model.objective.name].decoder_inputs,
        pack=cfg.data.packing,
    )
    if cfg.data.length_grouping:
        sampler = LengthGroupedSampler(
            len(data),
            dist.world_size,
            dist.rank,
            lengths=data.lengths_of,
            block=cfg.micro_batch_size * dist.world_size,
            group_blocks=cfg.data.length_grouping * cfg.grad_accum,
            seed=cfg.seed,
        )
    else:
        sampler = ResumableDistributedSampler(len(data), dist.world_size, dist.rank, seed=cfg.seed)
    loader = torch.utils.data.DataLoader(
        IndexedSamples(data),
        batch_size=cfg.micro_batch_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=cfg.data.num_workers,
        # a private generator: creating an iterator must not consume the global torch RNG,
        # or dropout would differ between an uninterrupted and a resumed run
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    return data, special, max_length, collator, sampler, loader


def _token_counts(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | int]:
    """Real tokens (a device tensor: no read per step) and the padded batch's positions."""
    mask = batch["attention_mask"]
    return {"tokens": mask.sum(), "slots": mask.numel()}


def _periodic_eval(
    cfg: PretrainConfig, trainer: Trainer, model: PretrainModel, tokenizer_dir: Path
) -> Callable[[], dict[str, Any]]:
    """The ``evaluate`` hook of ``eval``: rank 0 scores the encoder on the sample (the
    masked-LM model: the DupMAE poolings use its head)."""
    stage = trainer.ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage >= 3:
        raise ValueError(
            "eval.beir needs ZeRO stage <= 2 (rank 0 encodes alone, with whole parameters); "
            "with ZeRO-3 evaluate the checkpoints with retromae-ds eval --model RUN_DIR"
        )
    if trainer.dist.rank != 0:
        return lambda: {}
    from retromae_ds.data.tokenizer import load_tokenizer
    from retromae_ds.eval.periodic import PeriodicEval

    evaluator = PeriodicEval(cfg.eval)
    tokenizer = load_tokenizer(tokenizer_dir)
    trainer.note(evaluator.describe())
    return lambda: evaluator(model.encoder, tokenizer)


def check_vocabulary(
    encoder: EncoderConfig, shards: str, shards_tokenizer: dict[str, Any]
) -> Path | None:
    """A local model folder must speak the shards' token ids: its tokenizer (when it ships
    one) must have the shards' tokenizer fingerprint (vocabulary and special ids), and its
    vocabulary size must be the shards' when it ships none. Presets take the shards' own.
    Returns the folder checked (a run's newest verified encoder: ``resolve_encoder``), None
    for a preset."""
    from retromae_ds.components.checkpoint import resolve_encoder
    from retromae_ds.hf.util import TOKENIZER_FILES, config_vocab_size, load_tokenizer_checked

    if not Path(encoder.name).is_dir():
        return None
    folder = resolve_encoder(encoder.name)
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        from retromae_ds.data.tokenizer import fingerprint, fingerprint_mismatch

        problems = fingerprint_mismatch(
            shards_tokenizer, fingerprint(load_tokenizer_checked(folder))
        )
        if problems:
            raise ValueError(
                f"model.encoder.name {folder} and data.shards {shards} use different tokenizers "
                f"({'; '.join(problems)}); preprocess with --tokenizer {folder}"
            )
        return folder
    model_vocab = config_vocab_size(folder)
    if model_vocab is not None and model_vocab != shards_tokenizer["vocab_size"]:
        raise ValueError(
            f"model.encoder.name {folder}: vocabulary of {model_vocab} tokens and no tokenizer "
            f"to check, but data.shards {shards} were made with {shards_tokenizer['vocab_size']}"
        )
    return folder


def _epochs(
    loader: torch.utils.data.DataLoader,
    sampler: ResumableDistributedSampler,
    collator: PretrainCollator,
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches across epochs; the collator learns each epoch before its iterator starts (the
    sampler resumes mid-epoch at the next unseen sample)."""
    while True:
        collator.epoch = sampler.epoch
        yield from loader


def _write_encoder(module, state: dict[str, torch.Tensor], folder: Path) -> None:
    encoder_state = {
        k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")
    }
    fresh = type(module.encoder)(module.encoder.config)
    missing, unexpected = fresh.load_state_dict(encoder_state, strict=False)
    fresh.tie_weights()
    tied = {k for k in missing if k.endswith(("decoder.weight", "decoder.bias"))}
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"encoder export: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
        )
    fresh.save_pretrained(str(folder), safe_serialization=True)


def pretrain_command(cfg: PretrainConfig) -> int:
    """``retromae-ds pretrain``: :func:`pretrain` with a training job's exit statuses
    (``training.loop.run_job``)."""
    return run_job(pretrain, cfg, "retromae-ds pretrain")


def main(argv: list[str] | None = None) -> int:
    """``python -m retromae_ds.pretrain`` (what the ``deepspeed`` launcher, ``torchrun`` and
    ``slurm/pretrain.sh`` start): the same command as ``retromae-ds pretrain``."""
    return job_main(
        PretrainConfig,
        pretrain_command,
        argv,
        prog="retromae-ds pretrain",
        description=DESCRIPTIONS["pretrain"],
    )


if __name__ == "__main__":
    sys.exit(main())
