"""The teacher study's report (``retromae_recipes.teacher``): mean ± std over seeds per
collection and row, ``report_rows.compare`` verdicts (distilled vs ANCE alone, denoised vs
not, CE-reranked vs first stage, the RetroMAE CE vs the MiniLM CE), the denoising detection
figures and the costs (CE training time, scoring pairs/s, the online teacher's seconds per
negatives version). Pure bookkeeping on result rows and run folders; nothing here trains.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from retromae_ds.base.fsutil import atomic_write_text
from retromae_recipes.report_rows import MEASURES, NAMES, compare

BEIR_BM25_CE_SCIFACT = 0.688
"""The BEIR paper's BM25 + CE (an MS MARCO MiniLM cross-encoder over BM25's top 100) on
SciFact, nDCG@10: a reference only (another teacher, another depth)."""

ROWS = {
    "bm25+ce_minilm": "BM25 + CE (MiniLM)",
    "bm25+ce_retromae": "BM25 + CE (RetroMAE)",
    "ance": "ANCE bi-encoder",
    "ance+ce_minilm": "ANCE + CE (MiniLM)",
    "ance+ce_retromae": "ANCE + CE (RetroMAE)",
    "mined": "mined negatives (static)",
    "denoised": "mined negatives, denoised by the CE",
    "distill_offline": "mined negatives + distillation, offline",
    "distill_online": "ANCE + distillation, online",
}
"""Report rows in table order, with their labels (BM25 and the init come first)."""

COMPARISONS = (
    ("distill_offline", "ance", "distilled (offline) vs ANCE alone"),
    ("distill_online", "ance", "distilled (online) vs ANCE alone"),
    ("distill_offline", "mined", "distilled (offline) vs the same negatives without"),
    ("denoised", "mined", "denoised vs not"),
    ("ance+ce_minilm", "ance", "ANCE + CE (MiniLM) vs ANCE"),
    ("ance+ce_retromae", "ance", "ANCE + CE (RetroMAE) vs ANCE"),
    ("bm25+ce_retromae", "bm25+ce_minilm", "RetroMAE CE vs MiniLM CE, over BM25"),
    ("ance+ce_retromae", "ance+ce_minilm", "RetroMAE CE vs MiniLM CE, over ANCE"),
)


def run_seconds(run: Path) -> float | None:
    """A run's wall time as ``common.run_finetune`` recorded it."""
    timing = run / "recipe_timing.json"
    return json.loads(timing.read_text())["seconds"] if timing.is_file() else None


def online_costs(run: Path) -> dict[str, Any]:
    """The online teacher's cost per negatives version (``timings.teacher_s`` and the pairs
    of each manifest still on disk, and the refresher's rows), and the versions the trainer
    used from which step."""
    from retromae_ds.components.layout import RunLayout
    from retromae_ds.finetuning import handoff

    layout = RunLayout(run)
    versions: dict[int, dict[str, Any]] = {}
    for v in handoff.published_versions(run / "negatives"):
        m = json.loads(handoff.manifest_file(run / "negatives", v).read_text())
        versions[v] = {"step": m.get("step"), "teacher_s": m.get("timings", {}).get("teacher_s"),
                       "pairs": (m.get("teacher") or {}).get("version_pairs")}  # fmt: skip
    if layout.refresh_metrics.is_file():
        for line in layout.refresh_metrics.read_text().splitlines():
            r = json.loads(line)
            versions.setdefault(r["version"], {}).update(
                step=r.get("step"), teacher_s=r.get("teacher_s"), mine_s=r.get("mine_s")
            )
    used: dict[int, int] = {}
    for line in layout.metrics.read_text().splitlines() if layout.metrics.is_file() else []:
        r = json.loads(line)
        if "negatives_version" in r and "step" in r:
            used.setdefault(int(r["negatives_version"]), int(r["step"]))
    return {"versions": {str(k): v for k, v in sorted(versions.items())},
            "first_step_used": {str(k): v for k, v in sorted(used.items())}}  # fmt: skip


def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """mean and sample std over seeds per (task, row), ``compare``'s shape."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key in dict.fromkeys((r["task"], r["row"]) for r in rows if r["metrics"]):
        rs = [r for r in rows if (r["task"], r["row"]) == key]
        agg: dict[str, Any] = {"n": len(rs)}
        for m in MEASURES:
            xs = [r["metrics"][m] for r in rs]
            agg[m] = statistics.fmean(xs)
            agg[m + "_std"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out[key] = agg
    return out


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _versus_fixed(a: dict[str, Any], value: float, m: str = "ndcg@10") -> str:
    return compare(a, {"n": 2, m: value, m + "_std": 0.0}, m)


def _task_section(task: str, results: dict[str, Any], agg) -> list[str]:
    fixed, rows = results["fixed"][task], [r for r in results["rows"] if r["task"] == task]
    head = "| | seeds | " + " | ".join(NAMES[m] for m in MEASURES) + " |"
    lines = [f"## {task}", "", head, "|---|---|" + "---|" * len(MEASURES)]
    for name, label in (("bm25", "BM25"), ("init", "the init, not fine-tuned")):
        lines.append(
            f"| {label} | — | " + " | ".join(f"{fixed[name][m]:.4f}" for m in MEASURES) + " |"
        )
    for name, label in ROWS.items():
        a = agg.get((task, name))
        if a:
            cells = " | ".join(f"{a[m]:.4f} ± {a[m + '_std']:.4f}" for m in MEASURES)
            lines.append(f"| {label} | {a['n']} | {cells} |")
    lines.append("")
    for start in ("minilm", "retromae"):
        a = agg.get((task, f"bm25+ce_{start}"))
        if a:
            lines.append(
                f"- BM25 + CE ({start}) vs BM25, nDCG@10: {a['ndcg@10']:.4f} vs "
                f"{fixed['bm25']['ndcg@10']:.4f}: {_versus_fixed(a, fixed['bm25']['ndcg@10'])}"
            )
    for x, y, label in COMPARISONS:
        if (task, x) in agg and (task, y) in agg:
            a, b = agg[(task, x)], agg[(task, y)]
            lines.append(
                f"- {label}, nDCG@10: {a['ndcg@10']:.4f} vs {b['ndcg@10']:.4f}: {compare(a, b)}"
            )
    if task == "scifact":
        lines.append(
            f"- Reference only: the BEIR paper's BM25 + CE on SciFact is {BEIR_BM25_CE_SCIFACT} "
            "(an MS MARCO cross-encoder over BM25's top 100)."
        )
    lines += ["", *_denoise_lines(rows), *_cost_lines(rows)]
    return lines


def _denoise_lines(rows: list[dict[str, Any]]) -> list[str]:
    held = [r["mine"]["denoise"] for r in rows if r["row"] == "holdout"]
    out = []
    if held:
        found = [d.get("holdout_detection") or {} for d in held]
        out.append(
            "Denoising (held-out positives of the train queries with two or more, "
            f"{len(held)} seeds): rule {held[0]['mode']} at "
            f"{_fmt(_mean([d['value'] for d in held]), '.3f')} (fitted: "
            f"{sum(1 for d in held if d.get('fitted'))} of {len(held)}); precision "
            f"{_fmt(_mean([f.get('precision') for f in found]), '.3f')}, recall "
            f"{_fmt(_mean([f.get('recall') for f in found]), '.3f')} over "
            f"{_fmt(_mean([f.get('labelled') for f in found]), '.1f')} held-out positives "
            "that came back as candidates (precision is a lower bound: a flagged candidate "
            "may be an unlabelled positive)."
        )
    else:
        out.append("Denoising: no train query has two positives: the rule's default value, "
                   "no precision or recall.")  # fmt: skip
    den = [r["mine"] for r in rows if r["row"] == "denoised"]
    mined = [r["mine"] for r in rows if r["row"] == "mined"]
    if den and mined:
        out.append(
            f"The denoised file dropped {_fmt(_mean([d['denoise']['denoised'] for d in den]), '.1f')} "
            f"negatives a seed: {_fmt(_mean([d['negatives'] for d in den]), '.0f')} left of "
            f"{_fmt(_mean([d['negatives'] for d in mined]), '.0f')}."
        )
    return [*out, ""]


def _cost_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = ["Costs (mean over seeds):", ""]
    for start in ("minilm", "retromae"):
        rr = [r for r in rows if r.get("ce") == start and r["row"].startswith("bm25+")]
        if rr:
            pps = _mean([r["cross_encoder"]["pairs_per_s"] for r in rows if r.get("ce") == start])
            out.append(
                f"- CE ({start}): training {_fmt(_mean([r['train_s'] for r in rr]))} s; "
                f"reranking {_fmt(pps)} pairs/s on CPU ({rr[0]['cross_encoder']['pairs']} pairs "
                f"over BM25, depth {rr[0]['cross_encoder']['depth']})"
            )
    mines = [r["mine"] for r in rows if "mine" in r and r["mine"].get("ce_pairs_per_s")]
    if mines:
        out.append(f"- mine with the CE: {_fmt(_mean([m['ce_pairs_per_s'] for m in mines]))} "
                   "pairs/s")  # fmt: skip
    for arm in ("ance", "mined", "denoised", "distill_offline", "distill_online"):
        rs = [r for r in rows if r["row"] == arm]
        if rs:
            out.append(f"- {ROWS[arm]}: {_fmt(_mean([r['train_s'] for r in rs]))} s a run")
    for r in (r for r in rows if r["row"] == "distill_online"):
        vs = r["online"]["versions"]
        per = ", ".join(
            f"v{v} (step {x.get('step')}): {_fmt(x.get('teacher_s'))} s" for v, x in vs.items()
        )
        used = ", ".join(f"v{v} from step {s}" for v, s in r["online"]["first_step_used"].items())
        out.append(f"- online teacher, seed {r['seed']}: scoring per version {per}; trained on "
                   f"{used}")  # fmt: skip
    return [*out, ""]


def _curve_lines(curves: dict[str, Any], students: dict[str, Any]) -> list[str]:
    """The teachers' budget curves: BM25's top K on the validation split reranked by each
    kept checkpoint (step 0: BM25 alone), and the students on the same queries."""
    out = []
    for key, curve in curves.items():
        task, start, seed = key.split("/")
        points, picked = curve["points"], curve["picked"]
        out += [f"### The teacher's budget curve: {task}, CE from {start}, seed {seed[1:]}", "",
                "BM25's top K of the validation queries (never trained on) reranked by each "
                "kept checkpoint; step 0 is BM25 alone. The teacher: "
                + (f"step {picked} (the best here)." if picked else "the last step."), "",
                "| CE step | " + " | ".join(NAMES[m] for m in MEASURES) + " |",
                "|---|" + "---|" * len(MEASURES)]  # fmt: skip
        for p in points:
            out.append(f"| {p['step']} | " + " | ".join(f"{p['metrics'][m]:.4f}" for m in MEASURES)
                       + " |")  # fmt: skip
        s = students.get(task) or {}
        if s:
            line = f"The students on the same queries, nDCG@10: the init {s['init']['ndcg@10']:.4f}"
            ance = [x["ndcg@10"] for x in s.get("ance", [])]
            if ance:
                std = statistics.stdev(ance) if len(ance) > 1 else 0.0
                line += (f"; the ANCE bi-encoder {statistics.fmean(ance):.4f} ± {std:.4f} "
                         f"({len(ance)} seeds)")  # fmt: skip
            out += ["", line + "."]
        out.append("")
    return out


def write_report(results: dict[str, Any], out: Path, command: str) -> str:
    agg = aggregate(results["rows"])
    o = results["options"]
    text = [
        "# A cross-encoder teacher: reranking, denoising, distillation (issue 58)",
        "",
        f"Command: `{command}`",
        "",
        f"Seeds {o['seeds']}; bi-encoders {o['steps']} steps of {o['batch']} queries, "
        f"cross-encoders {o['ce_steps']} steps of {o['ce_batch']} (seed "
        f"{'each bi-encoder seed' if o.get('ce_seed') is None else o['ce_seed']}; pairs cut at "
        f"{o['ce_q_max_len'] + o['ce_p_max_len'] - 1} tokens"
        + (f", scored at {o['ce_max_length']}" if o.get("ce_max_length") else "")
        + "), reranking the top "
        f"{o['rerank_depth']}; distillation {o['distill_loss']} (teacher temperature "
        f"{o['teacher_temperature']}). Verdicts: `report_rows.compare` (a difference beyond two "
        "combined standard errors over seeds).",
        "",
    ]
    for task in results["tasks"]:
        if task in results["fixed"]:  # none with --stages curve
            text += _task_section(task, results, agg)
    text += _curve_lines(results.get("ce_curves") or {}, results.get("students_on_dev") or {})
    text.append(f"Wall time of this invocation: {results['seconds'] / 60:.1f} min.")
    body = "\n".join(text) + "\n"
    atomic_write_text(out / "teacher.md", body)
    return body
