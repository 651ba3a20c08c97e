"""The study report's DupMAE section (issue 44): DupMAE, each of its poolings, against RetroMAE
and MLM, mean ± std over seeds, in a table of its own and in verdict lines that say which way
each comparison falls.

Pure bookkeeping on the aggregated rows of ``retromae_recipes.report_rows.aggregate``
(``retromae_recipes.report`` calls ``section`` when some row is a DupMAE cell); nothing here
trains or imports torch. A fine-tuned DupMAE row with pooling ``dupmae_bow`` or ``dupmae`` is
the encoder fine-tuned with that pooling; its ``cls`` and ``mean`` rows are the encoder
fine-tuned with CLS pooling, as for every other objective
(``retromae_recipes.study.Study.finetune_poolings``).
"""

from __future__ import annotations

from typing import Any

from retromae_recipes.report_rows import (
    FLOOR,
    NAMES,
    STAGES,
    compare,
    report_order,
    row_key,
    table,
)

OBJECTIVES = ("mlm", "retromae", "dupmae")
"""The arms of the comparison, in report order."""
LABELS = {"mlm": "MLM", "retromae": "RetroMAE", "dupmae": "DupMAE"}
CLAIMS = (
    # (x, x's pooling, y, y's pooling, who says x > y)
    ("dupmae", "dupmae", "retromae", "cls", "DupMAE paper: [CLS ; OT] beats RetroMAE's [CLS]"),
    ("dupmae", "dupmae", "mlm", "cls", "DupMAE paper: [CLS ; OT] beats BERT's (MLM) [CLS]"),
    ("dupmae", "dupmae_bow", "retromae", "cls", "no published claim: the OT vector alone"),
    ("dupmae", "dupmae", "dupmae", "cls", "the paper's premise: the OT vector adds to [CLS]"),
    ("dupmae", "cls", "retromae", "cls", "no published claim: what the BoW task does to [CLS]"),
    ("dupmae", "cls", "mlm", "cls", "no published claim"),
    ("dupmae", "mean", "retromae", "mean", "no published claim"),
)
"""The comparisons the section states, each on every (task, start, stage) holding both rows.
OT: the ordinary-token (bag-of-words) vector, pooling ``dupmae_bow``."""
PLAIN = {
    "higher": "{x} ahead of {y}",
    "lower": "{x} behind {y}",
    "no clear difference": "neither ahead",
}
"""Which way a comparison falls, in words (``compare``'s answers; the floor and the
one-seed answers say it themselves)."""


def _name(a: dict[str, Any]) -> str:
    return f"{LABELS[a['objective']]} [{a['pooling']}]"


def _ratio(a: dict[str, Any], b: dict[str, Any], m: str) -> str:
    floor = FLOOR.get(m, 0.0)
    if max(a[m], b[m]) < floor:
        return ""
    if b[m] < floor or b[m] <= 0:
        return f" ({_name(b)} below the floor {floor})" if floor else ""
    return f" ({a[m] / b[m]:.2f}×)"


def verdicts(agg: list[dict[str, Any]]) -> list[str]:
    """One line per ``CLAIMS`` entry, stage and measure (nDCG@10; rerank MAP where present):
    both means ± std, the ratio, ``compare``'s answer and which way it falls."""
    by_key = {row_key(a): a for a in agg}
    out = []
    dense = [a for a in report_order(agg) if a["objective"] == "dupmae"]
    for task, start in dict.fromkeys((a["task"], a["start"]) for a in dense):
        for stage in STAGES:
            for x, xp, y, yp, who in CLAIMS:
                a = by_key.get((task, start, x, stage, xp))
                b = by_key.get((task, start, y, stage, yp))
                if not (a and b):
                    continue
                for m in ("ndcg@10", "rerank_map"):
                    if m not in a or m not in b:
                        continue
                    verdict = compare(a, b, m)
                    falls = PLAIN.get(verdict, "").format(x=_name(a), y=_name(b))
                    out.append(
                        f"{task}, {start}, {stage}: {_name(a)} {a[m]:.4f} ± {a[m + '_std']:.4f} "
                        f"vs {_name(b)} {b[m]:.4f} ± {b[m + '_std']:.4f} {NAMES[m]}"
                        f"{_ratio(a, b, m)}: {verdict}{' — ' + falls if falls else ''} ({who})"
                    )
    return out


def section(agg: list[dict[str, Any]]) -> list[str]:
    """The report's Markdown lines: the MLM, RetroMAE and DupMAE rows (BM25 first) and the
    verdicts; nothing when no row is a DupMAE cell."""
    if not any(a["objective"] == "dupmae" for a in agg):
        return []
    rows = [a for a in agg if a["start"] == "lexical" or a["objective"] in OBJECTIVES]
    return [
        "## DupMAE vs RetroMAE vs MLM",
        "",
        table(rows),
        "",
        "DupMAE's poolings: `cls` its [CLS] vector, `dupmae_bow` the ordinary-token vector "
        "(the MLM head over each ordinary token, max-pooled, its top-k entries kept), `dupmae` "
        "the two concatenated (docs/dupmae.md). After fine-tuning, a `dupmae_bow` or `dupmae` "
        "row is the encoder fine-tuned with that pooling; `cls` and `mean` rows are fine-tuned "
        "with CLS pooling, as for every objective. A difference is clear beyond twice the "
        "combined standard error over seeds.",
        "",
        *[f"- {v}" for v in verdicts(agg)],
    ]
