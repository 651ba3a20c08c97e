"""Packed vs padded batches: tokens/s of a pre-training step on real shards, side by side.

The same micro-batches of real documents (the shuffled sampler's first ones, as the trainer
draws them) collated two ways:

- ``padded`` (baseline): one row per document, padded to the batch's longest (the default);
- ``packed``: ``--data.packing``, the documents laid end to end in rows of at most
  ``max_length`` with a document mask (``retromae_ds.attention.packing``),

through the same model and a plain PyTorch step (forward, backward, AdamW), the two arms
alternating round by round so they share the machine's noise. Reports real tokens/s per arm
(median of the rounds, with their spread), packed / padded per round (mean ± std), each
arm's pad fraction, and the first step's losses of both arms (without dropout they agree to
float rounding: the check that the speed is not bought with a different computation).

Corpora, preprocessed here from the shared data: ``en512``, WikiText-2 (test) + SciFact's
corpus at 512 tokens (WordPiece of 8,000 trained on them); ``builtin128``, the main job's
built-in corpus (4,000 documents) at 128 tokens with a 4,000-entry WordPiece (the demo's).

    python benchmarks/bench_packing.py [--corpus en512 builtin128] [--size tiny]
        [--objectives mlm retromae seed] [--batch 32] [--steps 4] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from retromae_ds.base.special_tokens import SpecialIds  # noqa: E402
from retromae_ds.components.optim import build_optimizer  # noqa: E402
from retromae_ds.data.collate import IndexedSamples, MaskingConfig, PretrainCollator  # noqa: E402
from retromae_ds.data.dataset import ShardDataset  # noqa: E402
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess  # noqa: E402
from retromae_ds.data.sampler import ResumableDistributedSampler  # noqa: E402
from retromae_ds.data.sources import SourceOptions  # noqa: E402
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder  # noqa: E402
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel  # noqa: E402
from retromae_ds.training.config import OptimConfig  # noqa: E402


def make_shards(corpus: str, data: Path, work: Path) -> Path:
    out = work / corpus
    if corpus == "en512":
        inputs = [str(data / "wikitext2" / "wiki.test.raw"), str(data / "scifact" / "corpus.jsonl")]
        vocab, length = 8000, 512
    elif corpus == "builtin128":
        from retromae_ds.data.builtin_corpus import write_corpus

        write_corpus(work / "builtin.jsonl", 4000)
        inputs, vocab, length = [str(work / "builtin.jsonl")], 4000, 128
    else:
        raise SystemExit(f"unknown corpus {corpus!r}: en512 or builtin128")
    run_preprocess(
        PreprocessConfig(
            inputs=inputs,
            out=str(out),
            train_tokenizer=vocab,
            max_length=length,
            progress=False,
            source=SourceOptions(title_field="title"),
        )
    )
    return out


def batches(shards: Path, n: int, batch: int, decoder: bool, pack: bool):
    data = ShardDataset(shards)
    special = SpecialIds.from_fingerprint(data.manifest["tokenizer"])
    collator = PretrainCollator(
        special, MaskingConfig(), int(data.manifest["max_length"]), decoder=decoder, pack=pack
    )
    samples = IndexedSamples(data)
    order = list(iter(ResumableDistributedSampler(len(data), seed=0)))
    return (
        [collator([samples[i] for i in order[b * batch : (b + 1) * batch]]) for b in range(n)],
        special,
        int(data.manifest["max_length"]),
    )


def build(size: str, objective: str, special: SpecialIds, length: int) -> PretrainModel:
    torch.manual_seed(0)
    encoder = build_encoder(
        EncoderConfig(name=size, max_position_embeddings=length, dropout=0.0),
        special.vocab_size,
        special.pad,
    )
    return PretrainModel(encoder, ObjectiveConfig(name=objective))


def window(model, opt, data, steps: int) -> float:
    t = time.perf_counter()
    for i in range(steps):
        out = model(data[i % len(data)])
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def measure(shards: Path, size: str, objective: str, args) -> dict:
    decoder = objective != "mlm"
    arms = {}
    for name, pack in (("padded", False), ("packed", True)):
        data, special, length = batches(shards, args.steps, args.batch, decoder, pack)
        model = build(size, objective, special, length)
        with torch.no_grad():
            first = {k: float(v) for k, v in model.eval()(data[0]).items() if "loss" in k}
        model.train()
        opt = build_optimizer(model, OptimConfig())
        window(model, opt, data, 1)  # warm-up
        real = sum(int(b["attention_mask"].sum()) for b in data)
        slots = sum(b["attention_mask"].numel() for b in data)
        arms[name] = {"model": model, "opt": opt, "data": data, "real": real, "first": first}
        arms[name]["pad_fraction"] = 1 - real / slots
        arms[name]["times"] = []
    for _ in range(args.rounds):
        for arm in arms.values():
            arm["times"].append(window(arm["model"], arm["opt"], arm["data"], args.steps))
    padded, packed = arms["padded"], arms["packed"]
    ratios = [a / b for a, b in zip(padded["times"], packed["times"], strict=True)]
    row = {"size": size, "objective": objective}
    for name, arm in arms.items():
        rates = [arm["real"] / t for t in arm["times"]]
        row[f"{name}_tokens_per_s"] = statistics.median(rates)
        row[f"{name}_spread"] = [min(rates), max(rates)]
        row[f"{name}_pad_fraction"] = arm["pad_fraction"]
        row[f"{name}_first_losses"] = arm["first"]
    row["packed_over_padded"] = statistics.mean(ratios)
    row["packed_over_padded_std"] = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    row["rounds"] = ratios
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--corpus", nargs="+", default=["en512", "builtin128"])
    p.add_argument("--size", nargs="+", default=["tiny"])
    p.add_argument("--objectives", nargs="+", default=["mlm", "retromae", "seed"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    data = Path(args.data)
    if "en512" in args.corpus and not (data / "wikitext2").is_dir():
        sys.exit(f"{data}: no wikitext2/ (the shared data folder)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for corpus in args.corpus:
            shards = make_shards(corpus, data, Path(tmp))
            for size in args.size:
                for objective in args.objectives:
                    row = {"corpus": corpus, **measure(shards, size, objective, args)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(
        f"\ncpu fp32, micro-batch {args.batch}, {args.steps} steps a window, {args.rounds} "
        f"rounds (arms alternating), {torch.get_num_threads()} threads"
    )
    print(
        "| corpus | size | objective | pad padded | pad packed | padded tok/s | packed tok/s "
        "| packed / padded | first-step loss padded / packed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["padded_first_losses"]["loss"], r["packed_first_losses"]["loss"]
        print(
            f"| {r['corpus']} | {r['size']} | {r['objective']} "
            f"| {100 * r['padded_pad_fraction']:.1f} % | {100 * r['packed_pad_fraction']:.1f} % "
            f"| {r['padded_tokens_per_s']:,.0f} ({r['padded_spread'][0]:,.0f}-"
            f"{r['padded_spread'][1]:,.0f}) | {r['packed_tokens_per_s']:,.0f} "
            f"({r['packed_spread'][0]:,.0f}-{r['packed_spread'][1]:,.0f}) "
            f"| {r['packed_over_padded']:.2f} ± {r['packed_over_padded_std']:.2f} "
            f"| {a:.5f} / {b:.5f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
