"""The ``retromae-ds`` command line: one entry point, one subcommand per job; ``--help`` of
each lists every option with its default.

retromae-ds demo [--full]      the main job on the built-in corpus (README; recipes/demo.py,
                               added through the ``retromae_ds.commands`` entry point)
retromae-ds preprocess ...     raw text -> Arrow shards (also tools/preprocess_shards.py)
retromae-ds train-tokenizer    train a WordPiece tokenizer on inputs
retromae-ds make-tokenizer     a BERT tokenizer folder from a vocab.txt (e.g. Chinese BERT)
retromae-ds inspect DIR        summary of a shards folder
retromae-ds pretrain ...       RetroMAE / SEED-Encoder / MLM pre-training (--config FILE, --a.b VALUE)
retromae-ds finetune ...       ANCE dense-retrieval fine-tuning (--config FILE, --a.b VALUE)
retromae-ds refresh ...        the asynchronous hard-negative refresher of a fine-tuning run
retromae-ds eval ...           retrieval metrics of an encoder on a BEIR folder
retromae-ds export CKPT OUT    an encoder as a Hugging Face (sentence-transformers) folder
retromae-ds long-task ...      the long-document retrieval task from raw articles"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from importlib.metadata import entry_points

from retromae_ds.config import HelpWithDefaults
from retromae_ds.errors import USER_ERRORS, run_reporting

COMMANDS = "retromae_ds.commands"
"""Entry-point group of the commands other packages add: each entry is a callable that adds
its subparser (with ``func``) to the ``retromae-ds`` subparsers."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64MB', '512KiB', '1G' or a plain byte count -> bytes (powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 64MB, 512KB, 1000000)")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def add_preprocess_args(p: argparse.ArgumentParser) -> None:
    from retromae_ds.data.segment import SEGMENTERS

    p.add_argument(
        "inputs",
        nargs="*",
        help="files, globs or folders (.jsonl[.gz], .txt, .parquet, BEIR, datasets)",
    )
    p.add_argument("--out", required=True, help="output folder")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="local Hugging Face fast tokenizer folder")
    tok.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB_SIZE",
        help="train a WordPiece tokenizer first",
    )
    p.add_argument(
        "--no-lowercase", dest="lowercase", action="store_false", help="keep case when training"
    )
    p.add_argument("--max-length", type=int, default=512, help="model length incl. special tokens")
    p.add_argument(
        "--shard-size",
        type=parse_size,
        default=0,
        help="input text per shard, e.g. 64MB (default: 1/64 of the input, within 1-64 MB)",
    )
    p.add_argument(
        "--pack", action="store_true", help="pack short rows into samples up to the max length"
    )
    p.add_argument(
        "--segmenter",
        choices=SEGMENTERS,
        default="none",
        help="whole-word masking of Chinese: word starts from jieba's words (auto: when the "
        "inputs hold Han characters); needs the 'chinese' extra",
    )
    p.add_argument("--segmenter-dict", default=None, help="a jieba dictionary replacing its own")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="a document that cannot be read or tokenized: stop naming it, or skip and count it",
    )
    p.add_argument(
        "--num-tasks", type=int, default=1, help="split the work over T independent processes"
    )
    p.add_argument(
        "--task-index",
        type=int,
        default=None,
        help="this process's task (default: Slurm array index)",
    )
    p.add_argument("--merge", action="store_true", help="write the manifest over all tasks' shards")
    p.add_argument("--text-field", default="text", help="text field of JSON records")
    p.add_argument(
        "--title-field", default=None, help="prepended to the text (BEIR corpus: 'title')"
    )
    p.add_argument(
        "--id-field", default=None, help="document id field (default: _id or id when present)"
    )
    p.add_argument("--title-sep", default=" ", help="between title and text")
    p.add_argument(
        "--txt-mode",
        choices=("line", "paragraph"),
        default="line",
        help=".txt files: a document per line, or per blank-line-separated paragraph",
    )
    p.add_argument("--split", default=None, help="split of a DatasetDict folder (default: train)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def preprocess_config_from_args(args: argparse.Namespace):
    from retromae_ds.data.preprocess import PreprocessConfig
    from retromae_ds.data.sources import SourceOptions

    task_index = args.task_index
    if task_index is None:
        task_index = int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)) - int(
            os.environ.get("SLURM_ARRAY_TASK_MIN", 0)
        )
    if not args.merge and not args.inputs:
        raise ValueError("no inputs given")
    return PreprocessConfig(
        inputs=args.inputs,
        out=args.out,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        lowercase=args.lowercase,
        max_length=args.max_length,
        shard_size=args.shard_size,
        pack=args.pack,
        segmenter=args.segmenter,
        segmenter_dict=args.segmenter_dict,
        workers=args.workers,
        on_error=args.on_error,
        num_tasks=args.num_tasks,
        task_index=task_index if args.num_tasks > 1 else 0,
        merge=args.merge,
        progress=args.progress,
        source=SourceOptions(
            text_field=args.text_field,
            title_field=args.title_field,
            id_field=args.id_field,
            title_sep=args.title_sep,
            txt_mode=args.txt_mode,
            split=args.split,
        ),
    )


def cmd_preprocess(args: argparse.Namespace) -> int:
    from retromae_ds.data.preprocess import run_preprocess

    run_preprocess(preprocess_config_from_args(args))
    return 0


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from retromae_ds.data.sources import SourceOptions, expand_inputs, plan_units, read_unit
    from retromae_ds.data.tokenizer import train_wordpiece

    opts = SourceOptions(
        text_field=args.text_field, title_field=args.title_field, txt_mode=args.txt_mode
    )
    units, _ = plan_units(expand_inputs(args.inputs), 64 * 2**20, opts)

    def texts():
        return (t for u in units for t in read_unit(u, opts).texts)

    tok = train_wordpiece(texts, args.vocab_size, args.out, lowercase=args.lowercase)
    print(f"train-tokenizer: {len(tok)} tokens -> {args.out}")
    return 0


def cmd_make_tokenizer(args: argparse.Namespace) -> int:
    from retromae_ds.data.tokenizer import make_wordpiece

    tok = make_wordpiece(
        args.vocab,
        args.out,
        lowercase=args.lowercase,
        chinese=args.chinese,
        max_length=args.max_length,
    )
    print(f"make-tokenizer: {len(tok)} tokens -> {args.out}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from retromae_ds.data.dataset import ShardDataset

    ds = ShardDataset(args.folder, verify=args.verify)
    print(json.dumps(ds.summary(), indent=2))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from retromae_ds.export import export_encoder

    out = export_encoder(
        args.checkpoint,
        args.out,
        pooling=args.pooling,
        normalize=args.normalize,
        overwrite=args.overwrite,
    )
    print(f"export: encoder -> {out}")
    return 0


def cmd_long_task(args: argparse.Namespace) -> int:
    from retromae_ds.data.long_task import build

    out = build(
        args.raw, args.out, min_words=args.min_words, deep_after=args.deep_after, seed=args.seed
    )
    with open(out / "corpus.jsonl", encoding="utf-8") as f:
        docs = sum(1 for _ in f)
    print(f"long-task: {docs} articles -> {out} (qrels test: titles, deep: deep sentences)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retromae-ds", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpWithDefaults),
    )

    p = sub.add_parser("preprocess", help="raw text -> memory-mapped Arrow shards")
    add_preprocess_args(p)
    p.set_defaults(func=cmd_preprocess)

    p = sub.add_parser(
        "make-tokenizer", help="a BERT fast-tokenizer folder from a WordPiece vocab.txt"
    )
    p.add_argument("--vocab", required=True, help="vocab.txt, one token a line")
    p.add_argument("--out", required=True, help="tokenizer folder to write")
    p.add_argument("--no-lowercase", dest="lowercase", action="store_false", help="keep case")
    p.add_argument(
        "--chinese",
        action="store_true",
        help="check that the vocabulary covers Han characters (BERT-Base Chinese)",
    )
    p.add_argument("--max-length", type=int, default=512, help="model length incl. special tokens")
    p.set_defaults(func=cmd_make_tokenizer)

    p = sub.add_parser("train-tokenizer", help="train a WordPiece tokenizer on inputs")
    p.add_argument("inputs", nargs="+", help="files, globs or folders")
    p.add_argument("--out", required=True, help="tokenizer folder to write")
    p.add_argument("--vocab-size", type=int, default=30522, help="WordPiece entries")
    p.add_argument("--no-lowercase", dest="lowercase", action="store_false", help="keep case")
    p.add_argument("--text-field", default="text", help="text field of JSON records")
    p.add_argument("--title-field", default=None, help="prepended to the text")
    p.add_argument(
        "--txt-mode", choices=("line", "paragraph"), default="line", help=".txt: line or paragraph"
    )
    p.set_defaults(func=cmd_train_tokenizer)

    p = sub.add_parser("inspect", help="summary of a shards folder")
    p.add_argument("folder", help="a shards folder (manifest.json)")
    p.add_argument("--verify", action="store_true", help="check every shard's sha256")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("export", help="encoder of a checkpoint -> Hugging Face folder")
    p.add_argument("checkpoint", help="a complete checkpoint folder, or a run folder")
    p.add_argument("out", help="the Hugging Face folder to write")
    p.add_argument(
        "--pooling",
        choices=("auto", "cls", "mean"),
        default="auto",
        help="sentence embedding (default: the encoder's own, else cls)",
    )
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalise embeddings (default: the encoder's own, else no)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty OUT that is not a previous export (never a run or checkpoint)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "long-task", help="a long-document BEIR task from WikiText articles (title / deep sentence)"
    )
    p.add_argument("raw", help="a WikiText wiki.*.raw file")
    p.add_argument("--out", required=True, help="BEIR folder to write")
    p.add_argument("--min-words", type=int, default=1000, help="shortest article kept")
    p.add_argument(
        "--deep-after", type=int, default=600, help="deep queries start after this many words"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of deep sentences")
    p.set_defaults(func=cmd_long_task)

    # listed for --help; parsed in main() so that other commands do not import torch/faiss
    sub.add_parser("pretrain", help="pre-train on DeepSpeed (--config FILE, --section.field VALUE)")
    sub.add_parser("eval", help="retrieval metrics of an encoder on a BEIR folder")
    sub.add_parser("finetune", help="ANCE fine-tuning on DeepSpeed (--config FILE, --a.b VALUE)")
    sub.add_parser("refresh", help="hard-negative refresher of a fine-tuning run (--run_dir RUN)")

    # commands other packages add (entry-point group ``retromae_ds.commands``; this
    # repository's recipes add ``demo``): the library never imports them by name
    for ep in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        ep.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pretrain"]:  # free-form --section.field overrides: parsed by the trainer
        from retromae_ds.pretrain import main as pretrain_main

        return pretrain_main(argv[1:])
    if argv[:1] == ["finetune"]:
        from retromae_ds.finetune import main as finetune_main

        return finetune_main(argv[1:])
    if argv[:1] == ["refresh"]:
        from retromae_ds.ance.refresher import main as refresh_main

        return refresh_main(argv[1:])
    if argv[:1] == ["eval"]:
        from retromae_ds.eval.run import add_eval_args, cmd_eval

        parser = argparse.ArgumentParser(prog="retromae-ds eval", formatter_class=HelpWithDefaults)
        add_eval_args(parser)
        return _run(cmd_eval, parser.parse_args(argv[1:]), "eval")
    args = build_parser().parse_args(argv)
    return _run(args.func, args, args.command)


def _run(func, args: argparse.Namespace, command: str) -> int:
    # RuntimeError too: these commands raise it for a model folder they cannot use
    return run_reporting(f"retromae-ds {command}", func, args, errors=(*USER_ERRORS, RuntimeError))


if __name__ == "__main__":
    sys.exit(main())
