"""The study's report: mean ± std over seeds, Markdown tables, verdicts against the papers'
orderings, a PNG plot, and ``study.md`` / ``study_results.json`` in the study folder.

Pure bookkeeping on result rows (``{"task", "start", "objective", "seed", "stage",
"metrics"}``, as ``recipes.study.Study.run`` returns them); nothing here trains or imports
torch. It also names the rows' vocabulary (objectives, stages, measures) in report order.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from retromae_ds.fsutil import atomic_write_text

OBJECTIVES = ("none", "mlm", "retromae", "seed", "seed_strong")
STAGES = ("zero_shot", "bm25", "ance")
MEASURES = ("ndcg@10", "mrr@10", "recall@100")


def _key(r: dict[str, Any]) -> tuple[str, str, str, str]:
    return (r.get("task", "scifact"), r["start"], r["objective"], r["stage"])


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mean ± std (sample std over seeds) per (task, start, objective, stage)."""
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for (task, start, objective, stage), rs in groups.items():
        agg = {"task": task, "start": start, "objective": objective, "stage": stage, "n": len(rs)}
        for m in MEASURES:
            xs = [r["metrics"][m] for r in rs]
            agg[m] = statistics.fmean(xs)
            agg[m + "_std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out.append(agg)
    return out


def _sorted(agg: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = {o: i for i, o in enumerate(OBJECTIVES)}
    stage_order = {s: i for i, s in enumerate(STAGES)}
    tasks = list(dict.fromkeys(a["task"] for a in agg))
    return sorted(
        agg,
        key=lambda a: (
            tasks.index(a["task"]),
            a["start"],
            stage_order[a["stage"]],
            order[a["objective"]],
        ),
    )


def table(agg: list[dict[str, Any]]) -> str:
    lines = [
        "| task | start | objective | stage | seeds | nDCG@10 | MRR@10 | Recall@100 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in _sorted(agg):
        cells = " | ".join(f"{a[m]:.4f} ± {a[m + '_std']:.4f}" for m in MEASURES)
        lines.append(
            f"| {a['task']} | {a['start']} | {a['objective']} | {a['stage']} | {a['n']} | {cells} |"
        )
    return "\n".join(lines)


def pretrain_table(summaries: list[dict[str, Any]]) -> str:
    """Pre-training loss (first → last logged step) and seconds, mean over seeds."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["start"], s["objective"]), []).append(s)
    lines = [
        "| start | objective | seeds | steps | loss first → last | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for (start, objective), ss in groups.items():
        first = statistics.fmean(s["first"]["loss"] for s in ss)
        last = statistics.fmean(s["last"]["loss"] for s in ss)
        secs = statistics.fmean(s["seconds"] for s in ss)
        lines.append(
            f"| {start} | {objective} | {len(ss)} | {ss[0]['steps']} | {first:.2f} → {last:.2f} "
            f"| {secs:.0f} |"
        )
    return "\n".join(lines)


def plot(agg: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars of nDCG@10 (± std) per stage and objective, one panel per task × start."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    panels = list(dict.fromkeys((a["task"], a["start"]) for a in _sorted(agg)))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (task, start) in zip(axes[0], panels, strict=True):
        mine = [a for a in agg if a["task"] == task and a["start"] == start]
        stages = [s for s in STAGES if any(a["stage"] == s for a in mine)]
        objectives = [o for o in OBJECTIVES if any(a["objective"] == o for a in mine)]
        width = 0.8 / max(1, len(objectives))
        for k, obj in enumerate(objectives):
            xs, ys, es = [], [], []
            for i, stage in enumerate(stages):
                a = next((a for a in mine if a["stage"] == stage and a["objective"] == obj), None)
                if a:
                    xs.append(i + k * width)
                    ys.append(a["ndcg@10"])
                    es.append(a["ndcg@10_std"])
            ax.bar(xs, ys, width, yerr=es, label=obj, capsize=3)
        ax.set_xticks([i + width * (len(objectives) - 1) / 2 for i in range(len(stages))])
        ax.set_xticklabels(stages)
        ax.set_title(f"{task}, start: {start}")
        ax.set_ylabel("nDCG@10 (mean ± std over seeds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def verdicts(agg: list[dict[str, Any]]) -> list[str]:
    """Plain statements of where the result agrees with the papers' orderings, using a
    difference larger than the two standard errors combined as 'clearly'."""
    by_key = {(a["task"], a["start"], a["objective"], a["stage"]): a for a in agg}

    def compare(a, b) -> str:
        if min(a["n"], b["n"]) < 2:
            return "one seed, no error estimate: no verdict"
        diff = a["ndcg@10"] - b["ndcg@10"]
        se = math.sqrt(a["ndcg@10_std"] ** 2 / a["n"] + b["ndcg@10_std"] ** 2 / b["n"])
        if abs(diff) <= 2 * se:
            return "no clear difference"
        return "higher" if diff > 0 else "lower"

    out = []
    for task, start in dict.fromkeys((a["task"], a["start"]) for a in _sorted(agg)):
        for stage in STAGES:
            for x, y in (("retromae", "seed"), ("retromae", "mlm"), ("seed", "mlm")):
                a, b = by_key.get((task, start, x, stage)), by_key.get((task, start, y, stage))
                if a and b:
                    out.append(
                        f"{task}, {start}, {stage}: {x} {a['ndcg@10']:.4f} vs {y} "
                        f"{b['ndcg@10']:.4f} nDCG@10: {compare(a, b)} (paper: {x} > {y})"
                    )
        for objective in OBJECTIVES:
            a = by_key.get((task, start, objective, "ance"))
            b = by_key.get((task, start, objective, "bm25"))
            if a and b:
                out.append(
                    f"{task}, {start}, {objective}: ANCE {a['ndcg@10']:.4f} vs BM25 negatives "
                    f"{b['ndcg@10']:.4f}: {compare(a, b)} (paper: ANCE > BM25 negatives)"
                )
    return out


def report(
    rows: list[dict[str, Any]],
    out: Path,
    title: str,
    command: str,
    pretraining: list[dict[str, Any]] | None = None,
    notes: list[str] = (),
) -> str:
    """Write ``study.md``, ``study.png`` and ``study_results.json`` into ``out``; return the
    Markdown."""
    agg = aggregate(rows)
    png = plot(agg, out / "study.png")
    text = [f"# {title}", "", f"Command: `{command}`", "", table(agg), ""]
    if any(a["task"] == "scifact" for a in agg):
        text += [
            "Reference figures on SciFact test (nDCG@10, measured here): BM25 0.686, "
            "all-MiniLM-L6-v2 (mean pooling, 256 tokens) 0.645.",
            "",
        ]
    text += [*notes, "", "## Against the papers' claims", "", *[f"- {v}" for v in verdicts(agg)]]
    if pretraining:
        text += ["", "## Pre-training", "", pretrain_table(pretraining)]
    if png:
        text += ["", f"![nDCG@10 per stage and objective]({png.name})"]
    body = "\n".join(text) + "\n"
    results = {"rows": rows, "aggregate": agg, "pretraining": pretraining or []}
    atomic_write_text(out / "study_results.json", json.dumps(results, indent=2))
    atomic_write_text(out / "study.md", body)
    return body
