"""The study's result rows: their vocabulary in report order (arms, poolings, stages,
measures), mean ± std over seeds (``aggregate``), the Markdown table of them and the comparison
of two aggregated rows (``compare``, with the ``FLOOR`` below which a measure says nothing).

Shared by the report (``retromae_recipes.report``) and its DupMAE section
(``retromae_recipes.report_dupmae``), so neither imports the other's pieces; pure bookkeeping
on result rows, nothing here trains or imports torch.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from retromae_ds.hf.pooling import DEFAULT_POOLING, registered

ARMS = ("none", "mlm", "retromae", "dupmae", "bowdpr", "seed", "seed_strong")
"""A study's arms: ``none`` (the starting encoder itself) and the continuations, among them
``dupmae`` (RetroMAE v2, docs/dupmae.md), ``bowdpr`` (docs/bowdpr.md) and ``seed_strong`` (SEED-Encoder with a strong
decoder); the pre-training objectives proper are
``retromae_ds.modeling.objectives.OBJECTIVES``."""
POOLING_ORDER = tuple(p.name for p in registered())
"""Poolings in report order: the library's registry order (``retromae_ds.hf.pooling``: cls,
mean, dupmae_bow, dupmae)."""
HEAD_POOLINGS = tuple(p.name for p in registered() if p.needs_head)
"""The poolings through the MLM head (DupMAE's: the ordinary tokens' top-k vector, and [CLS]
concatenated with it), in report order."""
STAGES = ("zero_shot", "bm25", "ance")
MEASURES = ("ndcg@10", "mrr@10", "recall@100")
RERANK_MEASURES = ("rerank_map", "rerank_mrr@10")
"""Reranking of each query's candidates (positives + BM25 negatives; ``eval.rerank``), in
the rows of a study that asks for it."""
NAMES = {
    "ndcg@10": "nDCG@10",
    "mrr@10": "MRR@10",
    "recall@100": "Recall@100",
    "rerank_map": "rerank MAP",
    "rerank_mrr@10": "rerank MRR@10",
}


def row_key(r: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """(task, start, objective, stage, pooling): what ``aggregate`` groups seeds by."""
    return (
        r.get("task", "scifact"),
        r["start"],
        r["objective"],
        r["stage"],
        r.get("pooling", DEFAULT_POOLING),
    )


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mean ± std (sample std over seeds) per (task, start, objective, stage, pooling)."""
    groups: dict[tuple[str, str, str, str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault(row_key(r), []).append(r)
    out = []
    for (task, start, objective, stage, pooling), rs in groups.items():
        agg = {
            "task": task,
            "start": start,
            "objective": objective,
            "stage": stage,
            "pooling": pooling,
            "n": len(rs),
        }
        for m in MEASURES + RERANK_MEASURES:
            if not all(m in r["metrics"] for r in rs):
                continue
            xs = [r["metrics"][m] for r in rs]
            agg[m] = statistics.fmean(xs)
            agg[m + "_std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out.append(agg)
    return out


def report_order(agg: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Aggregated rows in table order: task, BM25 first, start, stage, pooling, objective."""
    order = {o: i for i, o in enumerate(("bm25", *ARMS))}
    stage_order = {s: i for i, s in enumerate(STAGES)}
    pooling_order = {p: i for i, p in enumerate(POOLING_ORDER)}
    tasks = list(dict.fromkeys(a["task"] for a in agg))
    return sorted(
        agg,
        key=lambda a: (
            tasks.index(a["task"]),
            a["start"] != "lexical",  # the BM25 reference first
            a["start"],
            stage_order[a["stage"]],
            pooling_order.get(a["pooling"], len(pooling_order)),
            a["pooling"],
            order[a["objective"]],
        ),
    )


def _measures(agg: list[dict[str, Any]]) -> tuple[str, ...]:
    """The retrieval measures, and the reranking ones where some row has them."""
    rerank = tuple(m for m in RERANK_MEASURES if any(m in a for a in agg))
    return MEASURES + rerank


def table(agg: list[dict[str, Any]]) -> str:
    measures = _measures(agg)
    lines = [
        "| task | start | objective | stage | pooling | seeds | "
        + " | ".join(NAMES[m] for m in measures)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(measures),
    ]
    for a in report_order(agg):
        if a["start"] == "lexical":
            cells = " | ".join(f"{a[m]:.4f}" if m in a else "—" for m in measures)
            lines.append(f"| {a['task']} | — | BM25 | — | — | — | {cells} |")
            continue
        cells = " | ".join(f"{a[m]:.4f} ± {a[m + '_std']:.4f}" if m in a else "—" for m in measures)
        lines.append(
            f"| {a['task']} | {a['start']} | {a['objective']} | {a['stage']} | {a['pooling']} "
            f"| {a['n']} | {cells} |"
        )
    return "\n".join(lines)


FLOOR = {"ndcg@10": 0.01, "mrr@10": 0.01}
"""Below these means a ranking measure says nothing about an encoder (a random ranking of a
few thousand documents scores nDCG@10 ≈ 0.003): two encoders both below it are "both at the
floor", and no ratio over a value below it is printed."""


def compare(a: dict[str, Any], b: dict[str, Any], m: str = "ndcg@10") -> str:
    """``higher`` / ``lower`` when the means of ``m`` (aggregated rows with ``n`` seeds and
    ``m_std``) differ by more than two standard errors combined, else ``no clear difference``;
    ``both at the floor`` when both means are below ``FLOOR[m]``."""
    floor = FLOOR.get(m)
    if floor is not None and a[m] < floor and b[m] < floor:
        return f"both at the floor (< {floor})"
    if min(a["n"], b["n"]) < 2:
        return "one seed, no error estimate: no verdict"
    diff = a[m] - b[m]
    se = math.sqrt(a[m + "_std"] ** 2 / a["n"] + b[m + "_std"] ** 2 / b["n"])
    if abs(diff) <= 2 * se:
        return "no clear difference"
    return "higher" if diff > 0 else "lower"
