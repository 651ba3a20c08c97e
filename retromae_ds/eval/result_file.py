"""Where ``eval --out`` may write its result: never among its own inputs.

``check_out(out, model=..., beir=...)`` refuses (a ``ValueError`` naming the path and why,
before anything is encoded) an output inside the folder ``--model`` names, or inside the
checkpoint and the run that folder belongs to (a checkpoint's ``encoder/`` named directly
protects its checkpoint and run too), or inside the BEIR folder; a folder; and an existing
file that is not an earlier result of ``eval`` (a JSON object with its keys). Writing over an
earlier result is the ordinary rerun. The write itself is atomic (``write_result``: temp +
rename, so an earlier result stays whole); a full disk is one line naming the file and the
free space, like export's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from retromae_ds.base.errors import disk_full_error
from retromae_ds.base.fsutil import atomic_write_text
from retromae_ds.components.checkpoint import is_checkpoint
from retromae_ds.components.layout import RunLayout

RESULT_KEYS = ("dataset", "split", "metrics", "settings")
"""Keys every result of ``evaluate_beir`` holds: a file with them is an earlier result."""


def _protected(model: Path) -> list[Path]:
    """The folder ``model`` names and, when it lies inside a checkpoint, that checkpoint and
    its run (resolved)."""
    real = model.resolve()
    folders = [real]
    for parent in real.parents:
        if is_checkpoint(parent):
            folders.append(parent)
            if parent.parent.name == RunLayout(".").checkpoints.name:
                folders.append(parent.parent.parent)
            break
    return folders


def earlier_result(path: Path) -> str | None:
    """None when ``path`` holds an earlier eval result, else why it does not."""
    try:
        with open(path, "rb") as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        return f"not readable as JSON: {type(exc).__name__}"
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = [key for key in RESULT_KEYS if key not in record]
    return f"no {', '.join(missing)}" if missing else None


def check_out(out: str | Path, *, model: str | Path | None, beir: str | Path | None) -> None:
    """Raise ``ValueError`` unless ``eval`` may write its result to ``out`` (module doc)."""
    out = Path(out)
    real = out.resolve()
    inputs = []
    if model is not None:
        inputs += [(folder, "model folder", model) for folder in _protected(Path(model))]
    if beir is not None:
        inputs.append((Path(beir).resolve(), "BEIR folder", beir))
    for folder, what, named in inputs:
        if real == folder or real.is_relative_to(folder):
            part = "" if folder == Path(named).resolve() else f" (its run or checkpoint {folder})"
            raise ValueError(
                f"--out {out}: inside the {what} {named}{part}; eval never writes among its "
                "inputs: choose a path outside it"
            )
    if real.is_dir():
        raise ValueError(f"--out {out}: a folder; --out names the result file to write")
    if real.exists():
        why = earlier_result(real)
        if why is not None:
            raise ValueError(
                f"--out {out}: exists and is not an earlier eval result ({why}); refusing to "
                "replace it: remove it or choose another path"
            )


def write_result(out: str | Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``out`` atomically; a full disk raises ``DiskFull`` naming ``out``,
    the free space and the result's size (an earlier result there is left as it was)."""
    out = Path(out)
    text = json.dumps(result, indent=2) + "\n"
    try:
        atomic_write_text(out, text)
    except OSError as exc:
        full = disk_full_error(exc, out.parent, f"the eval result {out}", len(text.encode()))
        if full is None:
            raise
        raise full from exc
