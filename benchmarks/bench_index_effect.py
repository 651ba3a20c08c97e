"""What an approximate index does to the fine-tuned model (issue 43, item 4): the SciFact
recipe's ANCE arm (``retromae_recipes/finetune.py``) with its refresher searching through
each ``--indexes`` entry (``refresh.index``), same seeds, everything else equal, scored on
SciFact test.

    # SciFact's own 5,183 passages, the recipe unchanged (refreshes from steps 0 and 50)
    python benchmarks/bench_index_effect.py --data ../shared/data --out runs/index_effect \\
        --indexes flat hnsw --seeds 0 1 2
    # SciFact's passages padded with 94,817 distractors to 100,000; negatives mined from step 0
    python benchmarks/bench_index_effect.py --data ../shared/data --out runs/index_effect \\
        --pad 100000 --checkpoint-every 100 --indexes flat hnsw --seeds 0 1 2

``--pad N`` trains and mines on a corpus of N passages: SciFact's abstracts (their lines of
corpus.jsonl, unchanged, first) and the recombined real-text passages of
``bench_search_scale.passages`` after them (ids ``pad0000001``…), written once to
``OUT/corpus_N.jsonl``. Every evaluation stays on SciFact's own corpus, so the figures
compare with the recipe's. The arms of one ``--pad`` share the embedding cache of the
step-0 encoder (the init): the corpus is encoded once for all of them.

``--pool-k K`` adds a candidate-pool arm (``refresh.mode pool``, K' = K, the first index): v2
re-scores the top K of v1 with the step-50 checkpoint instead of re-encoding the corpus.

Reported per arm: test nDCG@10 per seed, mean ± std, the difference to the first index
(exact) with its combined standard error; of the v1 negatives (mined with the init, the
same for every seed's ranking), the share equal to the first index's and the share that
are distractors; the step at which each later version reached the trainer (versions that
arrive late train less: the refresher runs beside the trainer on shared cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def padded_corpus(data: Path, n: int, out: Path) -> Path:
    """``out/corpus_N.jsonl``: SciFact's corpus lines, then recombined passages to ``n``."""
    from bench_search_scale import passages

    path = out / f"corpus_{n}.jsonl"
    if path.is_file():
        return path
    lines = (data / "scifact" / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    lines = [line for line in lines if line.strip()]
    if n <= len(lines):
        raise SystemExit(f"--pad {n}: SciFact alone has {len(lines)} passages")
    rows, n_real = passages(data, n)
    pad = [
        json.dumps({"_id": f"pad{i:07d}", "title": "", "text": text})
        for i, text in enumerate(rows[n_real:], 1)
    ]
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text("\n".join(lines + pad) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def arms(args) -> dict[str, tuple[str, int]]:
    """{arm name: (refresh.index, pool K' or 0 for a full refresh)}."""
    out = {index: (index, 0) for index in args.indexes}
    out.update({f"pool{k}": (args.indexes[0], k) for k in args.pool_k})
    return out


def run_arm(args, name: str, index: str, pool_k: int, corpus: Path | None) -> Path:
    from retromae_recipes.finetune import Recipe, RecipeConfig

    tag = f"pad{args.pad}" if args.pad else "scifact"
    out = args.out / f"{tag}_{name.replace(',', '_')}"
    cfg = RecipeConfig(
        data=str(args.data / "scifact"),
        out=str(out),
        seeds=args.seeds,
        arms=["ance"],
        steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        refresh_index=index,
        refresh_mode="pool" if pool_k else "full",
        pool_k=pool_k,
        train_corpus=str(corpus) if corpus else "",
        embedding_cache=str(args.out / f"embedding_cache_{tag}"),
        curve_seeds=[],
    )
    Recipe(cfg).run(f"python benchmarks/bench_index_effect.py {' '.join(sys.argv[1:])}")
    return out


def negatives_v1(run: Path):
    from retromae_ds.finetuning import handoff

    return handoff.load_version(run / "negatives", 1)


def swaps(run: Path) -> dict[int, int]:
    """{negatives version: the step it was taken at}, from the trainer's log lines
    ``finetune: step N: negatives vK``."""
    log = run.with_name(run.name + ".log")
    text = log.read_text() if log.is_file() else ""
    return {
        int(v): int(step) for step, v in re.findall(r"finetune: step (\d+): negatives v(\d+)", text)
    }


def summarise(args, outs: dict[str, Path]) -> dict[str, Any]:
    n_real = 5183
    rows: dict[str, Any] = {}
    base = next(iter(outs))
    for name, out in outs.items():
        res = json.loads((out / "finetune_results.json").read_text())
        per_seed = {r["seed"]: r["metrics"]["ndcg@10"] for r in res["rows"] if r["arm"] == "ance"}
        row: dict[str, Any] = {"ndcg@10": per_seed, "swaps": {}, "v1_same": {}, "v1_pad": {}}
        for seed in args.seeds:
            run = out / "runs" / f"ance_s{seed}"
            row["swaps"][seed] = swaps(run)
            neg = negatives_v1(run)
            row["v1_pad"][seed] = float(np.mean(neg.values >= n_real)) if args.pad else 0.0
            other = negatives_v1(outs[base] / "runs" / f"ance_s{seed}")
            same = [
                len(set(neg.of(q).tolist()) & set(other.of(q).tolist())) / max(1, len(other.of(q)))
                for q in range(neg.num_queries)
            ]
            row["v1_same"][seed] = float(np.mean(same))
        xs = list(per_seed.values())
        row["mean"] = statistics.fmean(xs)
        row["std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        rows[name] = row
    for row in rows.values():
        b = rows[base]
        row["diff"] = row["mean"] - b["mean"]
        n = len(row["ndcg@10"])
        row["se"] = (
            math.sqrt((row["std"] ** 2 + b["std"] ** 2) / max(1, n)) if row is not b else 0.0
        )
    return {"pad": args.pad, "seeds": args.seeds, "steps": args.steps, "rows": rows}


def print_table(summary: dict[str, Any]) -> None:
    pad = summary["pad"]
    print(f"\ncorpus: {f'{pad:,} passages (SciFact padded)' if pad else 'SciFact, 5,183'}")
    print(
        "| arm | nDCG@10 per seed | mean ± std | vs first | v1 negatives as first's "
        "| v1 from distractors | versions reached the trainer at step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in summary["rows"].items():
        seeds = ", ".join(f"{v:.4f}" for v in r["ndcg@10"].values())
        same = statistics.fmean(r["v1_same"].values())
        pad = statistics.fmean(r["v1_pad"].values())
        vs = f"{r['diff']:+.4f} (se {r['se']:.4f})" if r["se"] else "–"
        sw = "; ".join(
            ", ".join(f"v{v}@{s}" for v, s in sorted(d.items()) if v > 1) or "–"
            for d in r["swaps"].values()
        )
        print(
            f"| {name} | {seeds} | {r['mean']:.4f} ± {r['std']:.4f} | "
            f"{vs} | {same:.3f} | {pad:.3f} | {sw} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--out", type=Path, default=Path("runs/index_effect"))
    p.add_argument("--indexes", nargs="+", default=["flat", "hnsw"])
    p.add_argument(
        "--pool-k",
        type=int,
        nargs="*",
        default=[],
        help="also a candidate-pool arm per K' (refresh.mode pool, the first index)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--pad", type=int, default=0, help="pad the training corpus to N passages")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.out = args.out.resolve()
    corpus = padded_corpus(args.data, args.pad, args.out) if args.pad else None
    outs = {name: run_arm(args, name, index, k, corpus) for name, (index, k) in arms(args).items()}
    summary = summarise(args, outs)
    print_table(summary)
    path = args.json or args.out / f"summary_{f'pad{args.pad}' if args.pad else 'scifact'}.json"
    path.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
