"""DupMAE's ordinary-token vector at retrieval time: the masked dense maximum that
``modeling.bow.bow_vectors`` takes when no gradient is wanted (evaluation, export, the
refresher) against the differentiable chunked max-pool it took before (the baseline: the
same values, with the per-entry row bookkeeping its backward pass needs), side by side in one
process on the same hidden states, rounds alternating.

    python benchmarks/bench_bow_eval.py [--texts 64 --length 256 --vocab 21128 --hidden 128]

Reported: seconds per batch of each path (median and range over ``--rounds``), their ratio,
and the largest difference between the two paths' vectors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--vocab", type=int, default=21128, help="BERT-Chinese 21,128; BERT 30,522")
    p.add_argument("--hidden", type=int, default=128, help="tiny 128, BERT-base 768")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import BertConfig, BertForMaskedLM

    from retromae_ds.modeling import bow

    torch.manual_seed(0)
    config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=2 * args.hidden)  # fmt: skip
    model = BertForMaskedLM(config).eval()
    B, L, H = args.texts, args.length, args.hidden
    hidden = torch.randn(B, L, H)
    ids = torch.randint(5, args.vocab, (B, L))
    lengths = torch.randint(L // 4, L + 1, (B,))
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    ids[:, 0] = 2  # [CLS]
    special = torch.tensor([0, 1, 2, 3, 4])

    def dense() -> torch.Tensor:
        with torch.no_grad():
            return bow.bow_vectors(model, hidden, ids, mask, special, topk=0)

    def baseline() -> torch.Tensor:  # what bow_vectors computed before, under no_grad
        with torch.no_grad():
            ordinary = bow.ordinary_positions(ids, mask, special)
            rows = torch.arange(B)[:, None].expand(B, L)
            group = torch.where(ordinary, rows, B).flatten()
            return bow.pooled_vocabulary(model, hidden.reshape(B * L, H), group, B + 1)[:B]

    diff = float((dense() - baseline()).abs().max())
    times: dict[str, list[float]] = {"baseline": [], "dense": []}
    for _ in range(args.rounds):
        for name, fn in (("baseline", baseline), ("dense", dense)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    ratios = [b / d for b, d in zip(times["baseline"], times["dense"], strict=True)]
    rows = [
        [name, f"{statistics.median(v):.3f}", f"{min(v):.3f}–{max(v):.3f}"]
        for name, v in times.items()
    ]
    common.print_table(["path", "s/batch (median)", "range"], rows)
    print(
        f"speed-up dense over baseline: {statistics.median(ratios):.2f}× "
        f"(rounds {min(ratios):.2f}–{max(ratios):.2f}); max |difference| {diff:.2e}; "
        f"{B} texts × {L} positions, |V| {args.vocab:,}, H {H}, {torch.get_num_threads()} threads"
    )
    common.write_json(
        args.json,
        {"args": vars(args), "times": times, "ratios": ratios, "max_abs_diff": diff,
         "machine": common.machine()},
    )  # fmt: skip
    return 0 if diff < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
