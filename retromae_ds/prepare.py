"""The data commands: ``retromae-ds preprocess``, ``train-tokenizer``, ``make-tokenizer``,
``inspect`` and ``long-task`` (jobs layer: each takes its config from ``data/`` and calls
the library there; descriptions in ``base.commands``)."""

from __future__ import annotations

import json

from retromae_ds.data.dataset import InspectConfig, ShardDataset
from retromae_ds.data.long_task import LongTaskConfig, build
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
from retromae_ds.data.tokenizer import (
    MakeTokenizerConfig,
    TrainTokenizerConfig,
    make_wordpiece,
    train_wordpiece,
)


def preprocess_command(cfg: PreprocessConfig) -> int:
    """``retromae-ds preprocess`` (``tools/preprocess_shards.py`` too)."""
    if not cfg.merge and not cfg.inputs:
        raise ValueError("preprocess: no inputs given")
    run_preprocess(cfg)
    return 0


def train_tokenizer_command(cfg: TrainTokenizerConfig) -> int:
    from retromae_ds.data.sources import SourceOptions, expand_inputs, plan_units, read_unit

    opts = SourceOptions(
        text_field=cfg.text_field, title_field=cfg.title_field, txt_mode=cfg.txt_mode
    )
    units, _ = plan_units(expand_inputs(cfg.inputs), 64 * 2**20, opts)

    def texts():
        return (t for u in units for t in read_unit(u, opts).texts)

    tok = train_wordpiece(texts, cfg.vocab_size, cfg.out, lowercase=cfg.lowercase)
    print(f"train-tokenizer: {len(tok)} tokens -> {cfg.out}")
    return 0


def make_tokenizer_command(cfg: MakeTokenizerConfig) -> int:
    tok = make_wordpiece(
        cfg.vocab, cfg.out, lowercase=cfg.lowercase, chinese=cfg.chinese, max_length=cfg.max_length
    )
    print(f"make-tokenizer: {len(tok)} tokens -> {cfg.out}")
    return 0


def inspect_command(cfg: InspectConfig) -> int:
    ds = ShardDataset(cfg.folder, verify=cfg.verify)
    print(json.dumps(ds.summary(), indent=2))
    return 0


def long_task_command(cfg: LongTaskConfig) -> int:
    out = build(cfg.raw, cfg.out, min_words=cfg.min_words, deep_after=cfg.deep_after, seed=cfg.seed)
    with open(out / "corpus.jsonl", encoding="utf-8") as f:
        docs = sum(1 for _ in f)
    print(f"long-task: {docs} articles -> {out} (qrels test: titles, deep: deep sentences)")
    return 0
