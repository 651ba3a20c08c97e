"""The study's report: mean ± std over seeds, Markdown tables, verdicts against the papers'
orderings, a PNG plot, and ``study.md`` / ``study_results.json`` in the study folder.

Pure bookkeeping on result rows (``{"task", "start", "objective", "seed", "stage",
"pooling", "metrics"}``, as ``retromae_recipes.study.Study.run`` returns them; a row without
``pooling`` is CLS; a fine-tuned row also names the ``finetune_pooling`` it was trained
with) and on the pre-training summaries (losses, tokens seen, the zero-shot curve logged
during pre-training); nothing here trains or imports torch. The rows' vocabulary
(objectives, stages, measures) in report order, their aggregation, table and comparison live
in ``retromae_recipes.report_rows`` (shared with the DupMAE section). The lexical reference is
a row of start ``lexical``, objective ``bm25``. A study with DupMAE cells gets a section of
its own (``retromae_recipes.report_dupmae``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from retromae_ds.base.fsutil import atomic_write_text
from retromae_ds.hf.pooling import DEFAULT_POOLING
from retromae_recipes import report_dupmae
from retromae_recipes.common import pyplot, save_figure
from retromae_recipes.report_rows import (
    ARMS,
    FLOOR,
    HEAD_POOLINGS,
    NAMES,
    POOLING_ORDER,
    STAGES,
    aggregate,
    compare,
    report_order,
    row_key,
    table,
)

CLAIMS = (
    # (x, y, who says x > y, starts it applies to: () = all)
    ("retromae", "seed", "paper", ()),
    ("retromae", "mlm", "paper", ()),
    ("seed", "mlm", "paper", ()),
    ("seed", "seed_strong", "SEED-Encoder paper: a weak decoder beats a strong one", ()),
    ("retromae", "none", "RetroMAE report: continued pre-training lifts an MLM base", ("bert",)),
    ("bowdpr", "retromae", "bowdpr paper", ()),
    ("bowdpr", "mlm", "bowdpr paper", ()),
)
"""The orderings the verdicts test."""


def pretrain_table(summaries: list[dict[str, Any]]) -> str:
    """Per (start, objective), means over seeds: steps, tokens seen, loss and decoder loss
    (first → last logged row), the last MLM and decoder accuracy, seconds; where a run logged
    DupMAE's bag-of-words loss, that loss (first → last) and its last recall too."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["start"], s["objective"]), []).append(s)
    bow = any("bow_loss" in s["last"] for s in summaries)
    lines = [
        "| start | objective | seeds | steps | tokens seen | loss first → last "
        "| decoder loss first → last | MLM acc. last | decoder acc. last "
        + ("| BoW loss first → last | BoW recall last " if bow else "")
        + "| seconds |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if bow else ""),
    ]

    def mean(ss: list[dict], row: str, key: str) -> float | None:
        xs = [s[row][key] for s in ss if key in s[row]]
        return statistics.fmean(xs) if xs else None

    def fmt(x: float | None, spec: str = ".2f") -> str:
        return "—" if x is None else format(x, spec)

    def first_last(ss: list[dict], key: str) -> str:
        last = mean(ss, "last", key)
        return "—" if last is None else f"{fmt(mean(ss, 'first', key))} → {fmt(last)}"

    for (start, objective), ss in groups.items():
        tokens = statistics.fmean(s.get("tokens_seen", 0) for s in ss)
        bow_cells = (
            f"| {first_last(ss, 'bow_loss')} | {fmt(mean(ss, 'last', 'bow_recall'), '.3f')} "
            if bow
            else ""
        )
        lines.append(
            f"| {start} | {objective} | {len(ss)} | {ss[0]['steps']} | {tokens / 1e6:.2f}M "
            f"| {fmt(mean(ss, 'first', 'loss'))} → {fmt(mean(ss, 'last', 'loss'))} "
            f"| {first_last(ss, 'decoder_loss')} "
            f"| {fmt(mean(ss, 'last', 'mlm_accuracy'), '.3f')} "
            f"| {fmt(mean(ss, 'last', 'decoder_accuracy'), '.3f')} {bow_cells}"
            f"| {statistics.fmean(s['seconds'] for s in ss):.0f} |"
        )
    return "\n".join(lines)


def plot(agg: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars of CLS nDCG@10 (± std) per stage and objective, DupMAE's own poolings as
    bars of their own, one panel per task × start; BM25 as a dotted line."""
    plt = pyplot()
    if plt is None:
        return None
    dense = [
        a
        for a in agg
        if a["start"] != "lexical"
        and (
            a["pooling"] == DEFAULT_POOLING
            or (a["objective"] == "dupmae" and a["pooling"] in HEAD_POOLINGS)
        )
    ]
    panels = list(dict.fromkeys((a["task"], a["start"]) for a in report_order(dense)))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (task, start) in zip(axes[0], panels, strict=True):
        mine = [a for a in dense if a["task"] == task and a["start"] == start]
        stages = [s for s in STAGES if any(a["stage"] == s for a in mine)]
        present = {(a["objective"], a["pooling"]) for a in mine}
        series = [(o, DEFAULT_POOLING) for o in ARMS] + [("dupmae", p) for p in HEAD_POOLINGS]
        series = [s for s in series if s in present]
        width = 0.8 / max(1, len(series))
        by_key = {(a["stage"], a["objective"], a["pooling"]): a for a in mine}
        for k, (obj, pooling) in enumerate(series):
            xs, ys, es = [], [], []
            for i, stage in enumerate(stages):
                a = by_key.get((stage, obj, pooling))
                if a:
                    xs.append(i + k * width)
                    ys.append(a["ndcg@10"])
                    es.append(a["ndcg@10_std"])
            label = obj if pooling == DEFAULT_POOLING else f"{obj} [{pooling}]"
            ax.bar(xs, ys, width, yerr=es, label=label, capsize=3)
        bm25 = next((a for a in agg if a["task"] == task and a["start"] == "lexical"), None)
        if bm25:
            ax.axhline(bm25["ndcg@10"], color="black", linestyle=":", label="BM25")
        ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(stages))])
        ax.set_xticklabels(stages)
        ax.set_title(f"{task}, start: {start} (CLS; DupMAE's poolings in brackets)")
        ax.set_ylabel("nDCG@10 (mean ± std over seeds)")
        ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def curves(pretraining: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, list]]:
    """The zero-shot curves logged during pre-training, mean ± std over seeds:
    ``{(start, objective, metric key): {"tokens": [...], "mean": [...], "std": [...]}}``,
    aligned by evaluation index (every seed evaluates at the same steps). ``tokens`` counts
    from the start's first pre-training: a continuation of the ``bert`` start's MLM base
    (objective ``base``) begins where the base ended."""
    offset = {s["start"]: s.get("tokens_seen", 0) for s in pretraining if s["objective"] == "base"}
    groups: dict[tuple[str, str], list[list[dict]]] = {}
    for s in pretraining:
        if s.get("curve"):
            groups.setdefault((s["start"], s["objective"]), []).append(s["curve"])
    out: dict[tuple[str, str, str], dict[str, list]] = {}
    for (start, objective), runs in groups.items():
        n = min(len(c) for c in runs)
        shift = 0 if objective == "base" else offset.get(start, 0)
        keys = [k for k in runs[0][0] if k.startswith("eval/")]
        for key in keys:
            ys = [[c[i][key] for c in runs] for i in range(n)]
            tokens = [statistics.fmean(c[i]["tokens_seen"] for c in runs) for i in range(n)]
            out[(start, objective, key)] = {
                "tokens": [shift + t for t in tokens],
                "mean": [statistics.fmean(y) for y in ys],
                "std": [statistics.stdev(y) if len(y) > 1 else 0.0 for y in ys],
                "seeds": len(runs),
            }
    return out


def _log_curves(pretraining: list[dict[str, Any]], start: str, metric: str):
    """(objective, tokens, mean over seeds) of one logged training metric."""
    groups: dict[str, list[list[dict]]] = {}
    for s in pretraining:
        if s["start"] == start and s.get("log") and metric in s["log"][0]:
            groups.setdefault(s["objective"], []).append(s["log"])
    for objective, logs in groups.items():
        n = min(len(x) for x in logs)
        tokens = [statistics.fmean(x[i].get("tokens_seen", 0) for x in logs) for i in range(n)]
        yield objective, tokens, [statistics.fmean(x[i][metric] for x in logs) for i in range(n)]


def curve_plot(pretraining: list[dict[str, Any]], path: Path) -> Path | None:
    """Top row: zero-shot nDCG@10 against tokens seen during pre-training, one line per
    objective (mean ± std band over seeds; one colour per objective throughout), one panel
    per start × pooling, the MLM base's own curve first; a panel of DupMAE's poolings holds
    the DupMAE runs' line and, dashed, the other objectives' CLS curves to read it against.
    Bottom row: the decoder loss and accuracy (and MLM accuracy; DupMAE's bag-of-words loss
    where logged) of the same runs against the tokens each stage saw."""
    data = curves(pretraining)
    if not data:
        return None
    plt = pyplot()
    if plt is None:
        return None
    order = {p: i for i, p in enumerate(POOLING_ORDER)}

    def pooling_of(key: str) -> int:  # eval/TASK/POOLING/MEASURE
        return order.get(key.split("/")[-2], len(order))

    panels = sorted(
        {(st, k) for st, _, k in data if k.endswith("/ndcg@10")},
        key=lambda p: (p[0], pooling_of(p[1]), p[1]),
    )
    metrics = ["decoder_loss", "decoder_accuracy", "mlm_accuracy"]
    if any("bow_loss" in row for s in pretraining for row in s.get("log") or []):
        metrics.append("bow_loss")  # DupMAE's bag-of-words task
    cols = max(len(panels), len(metrics))
    fig, axes = plt.subplots(2, cols, figsize=(5.5 * cols, 8), squeeze=False)
    colour = {o: f"C{i}" for i, o in enumerate(("base", *ARMS))}
    for col, (start, key) in enumerate(panels):
        ax = axes[0][col]
        task, pooling = key.split("/")[1:3]
        for objective in ("base", *ARMS):
            c = data.get((start, objective, key))
            if not c:
                continue
            lo = [m - d for m, d in zip(c["mean"], c["std"], strict=True)]
            hi = [m + d for m, d in zip(c["mean"], c["std"], strict=True)]
            label = f"{objective} ({c['seeds']} seeds)"
            ax.plot(c["tokens"], c["mean"], marker=".", label=label, color=colour[objective])
            ax.fill_between(c["tokens"], lo, hi, alpha=0.2, color=colour[objective])
        for objective in ("mlm", "retromae") if pooling in HEAD_POOLINGS else ():
            c = data.get((start, objective, f"eval/{task}/{DEFAULT_POOLING}/ndcg@10"))
            if c:
                ax.plot(c["tokens"], c["mean"], linestyle="--", color=colour[objective],
                        label=f"{objective} [{DEFAULT_POOLING}]")  # fmt: skip
        ax.set_title(f"start {start}: {key.removeprefix('eval/')}")
        ax.set_xlabel("tokens seen (the base's, then the continuation's)")
        ax.set_ylabel("zero-shot nDCG@10 (sample of the tuning split)")
        ax.legend(fontsize=8)
    for ax in axes[0][len(panels) :]:
        ax.axis("off")
    start = panels[0][0]
    for ax, metric in zip(axes[1], metrics, strict=False):
        for objective, tokens, ys in _log_curves(pretraining, start, metric):
            ax.plot(tokens, ys, label=objective, color=colour[objective])
        ax.set_title(f"start {start}: {metric.replace('_', ' ')} (mean over seeds)")
        ax.set_xlabel("tokens seen in this stage")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in axes[1][len(metrics) :]:
        ax.axis("off")
    return save_figure(plt, fig, path)


def verdicts(agg: list[dict[str, Any]]) -> list[str]:
    """Plain statements of where the result agrees with the papers' orderings (``CLAIMS``),
    using a difference larger than the two standard errors combined as 'clearly'."""
    by_key = {row_key(a): a for a in agg}

    def ratio(a, b, m: str) -> str:
        floor = FLOOR.get(m, 0.0)
        if max(a[m], b[m]) < floor:
            return ""
        if b[m] < floor or b[m] <= 0:
            return f" ({b['objective']} below the floor {floor})" if floor else ""
        return f" ({a[m] / b[m]:.1f}×)"

    out = []
    dense = [a for a in report_order(agg) if a["start"] != "lexical"]
    for task, start, pooling in dict.fromkeys((a["task"], a["start"], a["pooling"]) for a in dense):
        where = f"{task}, {start}" + ("" if pooling == DEFAULT_POOLING else f", {pooling} pooling")
        for stage in STAGES:
            for x, y, who, starts in CLAIMS:
                if starts and start not in starts:
                    continue
                a = by_key.get((task, start, x, stage, pooling))
                b = by_key.get((task, start, y, stage, pooling))
                if not (a and b) or (y == "none" and stage != "zero_shot"):
                    continue
                for m in ("ndcg@10", "rerank_map"):
                    if m in a and m in b:
                        out.append(
                            f"{where}, {stage}: {x} {a[m]:.4f} vs {y} {b[m]:.4f} "
                            f"{NAMES[m]}{ratio(a, b, m)}: {compare(a, b, m)} "
                            f"({who}: {x} > {y})"
                        )
        for objective in ARMS:
            a = by_key.get((task, start, objective, "ance", pooling))
            b = by_key.get((task, start, objective, "bm25", pooling))
            if a and b:
                out.append(
                    f"{where}, {objective}: ANCE {a['ndcg@10']:.4f} vs BM25 negatives "
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
    curve_png = curve_plot(pretraining or [], out / "study_curve.png")
    text = [f"# {title}", "", f"Command: `{command}`", "", table(agg), ""]
    if any(a["task"] == "scifact" for a in agg):
        text += [
            "Reference figures on SciFact test (nDCG@10, measured here): BM25 0.686, "
            "all-MiniLM-L6-v2 (mean pooling, 256 tokens) 0.645.",
            "",
        ]
    text += [*notes, "", "## Against the papers' claims", "", *[f"- {v}" for v in verdicts(agg)]]
    dupmae = report_dupmae.section(agg)
    text += ["", *dupmae] if dupmae else []
    if pretraining:
        text += ["", "## Pre-training", "", pretrain_table(pretraining)]
    if png:
        text += ["", f"![nDCG@10 per stage and objective]({png.name})"]
    if curve_png:
        text += ["", f"![zero-shot nDCG@10 against tokens seen in pre-training]({curve_png.name})"]
    body = "\n".join(text) + "\n"
    results = {"rows": rows, "aggregate": agg, "pretraining": pretraining or []}
    atomic_write_text(out / "study_results.json", json.dumps(results, indent=2))
    atomic_write_text(out / "study.md", body)
    return body
