"""The folders of a model's towers, resolved and loaded safely while a live run prunes them.

A dual encoder fine-tuned with ``--model.shared false`` has two towers: its checkpoints hold
``encoder/`` (passages) and ``query_encoder/`` (queries); its export holds the passage tower at
its root and the query tower in ``query_encoder/``, routed by a sentence-transformers
``Router`` (``retromae_ds.hf.sbert.routed_towers``). :func:`resolve_towers` turns what
``--model`` names (a run folder, a checkpoint, a checkpoint's tower, an export, any Hugging
Face folder) into those folders, each checked against its checkpoint's record
(``components.checkpoint``): a run or a checkpoint gives both of its towers; a tower named
alone is used for queries and passages, and a sibling query tower left out is said.

:func:`load_newest` loads them through a caller's function and keeps what it loaded only if
the checkpoint was still all there once read: a live run (``keep_last``) may delete it
between resolving and reading. A run folder is then loaded again from its newest checkpoint
(said in one line); a checkpoint named explicitly is an error saying it was removed, as for
``export``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import ENCODER, QUERY_ENCODER, RunLayout
from retromae_ds.hf import sbert

T = TypeVar("T")
ATTEMPTS = 3
"""Loads of a run folder tried while its live run keeps pruning the checkpoint being read."""


@dataclass(frozen=True)
class Towers:
    """The folders to encode with: passages (and queries, unless ``query`` names a separate
    tower); ``checkpoint``: the checkpoint they belong to, if any."""

    passage: Path
    query: Path | None = None
    checkpoint: Path | None = None


def is_run(path: Path) -> bool:
    """A run folder (or its ``checkpoints/``): a name for its newest checkpoint."""
    return not ckpt.is_checkpoint(path) and (
        RunLayout(path).checkpoints.is_dir() or ckpt.latest_complete(path) is not None
    )


def resolve_towers(model: str | Path, *, log: Callable[[str], None] | None = None) -> Towers:
    """The towers ``model`` names (see the module doc), checked against their checkpoint's
    record: a run folder falls back to its newest checkpoint whose towers verify."""
    path = Path(model)
    if ckpt.is_checkpoint(path) or is_run(path):
        found = ckpt.resolve_checkpoint(path, under=ckpt.MODEL_FILES, log=log)
        query = found / QUERY_ENCODER
        return Towers(found / ENCODER, query if query.is_dir() else None, found)
    routed = sbert.routed_towers(path)
    if routed is not None:  # an export of separate towers
        passage, query = routed
        return Towers(ckpt.resolve_encoder(passage), ckpt.resolve_encoder(query))
    folder = ckpt.resolve_encoder(path, log=log)
    real = folder.resolve()
    owner = real.parent if ckpt.is_checkpoint(real.parent) else None
    if owner is not None and real.name == ENCODER and (owner / QUERY_ENCODER).is_dir():
        _say(
            log,
            f"{path}: the passage tower of {owner.name} encodes the queries too; its query "
            f"tower {owner / QUERY_ENCODER} is not used (name the checkpoint or its run to "
            "encode the queries with it)",
        )
    return Towers(folder, None, owner)


def still_there(checkpoint: Path) -> bool:
    """Whether the record and every tower file it lists still exist: a pruned checkpoint
    loses them one by one, and a file is only ever deleted, so all of them there after a
    load means every read saw a whole file."""
    try:
        files = ckpt.read_marker(checkpoint).get("files") or {f"{ENCODER}/config.json": None}
    except (OSError, ValueError, AttributeError):
        return False
    return all((checkpoint / rel).is_file() for rel in files if rel.startswith(ckpt.MODEL_FILES))


def load_newest(
    model: str | Path,
    load: Callable[[Towers], T],
    *,
    what: str = "eval",
    log: Callable[[str], None] | None = None,
) -> tuple[Towers, T]:
    """``(towers, load(towers))`` for the towers ``model`` names, kept only when their
    checkpoint was all there once loaded; a run folder whose checkpoint was pruned meanwhile
    is loaded again from its newest (said once), a named checkpoint raises
    ``FileNotFoundError`` saying it was removed."""
    path = Path(model)
    named_run = is_run(path)
    gone: Path | None = None
    for attempt in range(ATTEMPTS):
        try:
            towers = resolve_towers(path, log=log)
        except FileNotFoundError:  # a run's checkpoints all pruned while being verified
            if not named_run or attempt == ATTEMPTS - 1:
                raise
            continue
        if gone is not None and towers.checkpoint is not None:
            _say(
                log,
                f"{what}: {gone.name} was removed (the run's keep_last pruning) while it was "
                f"being read; using {towers.checkpoint.name}, now the newest",
            )
        try:
            loaded = load(towers)
        except Exception:
            if towers.checkpoint is None or still_there(towers.checkpoint):
                raise  # not a pruning: the loader's own message is the right one
        else:
            if towers.checkpoint is None or still_there(towers.checkpoint):
                return towers, loaded
        gone = towers.checkpoint
        if not named_run:
            break
    assert gone is not None
    hint = (
        f"retry (pruned {ATTEMPTS} times in a row: keep more checkpoints, or evaluate after "
        "the run)"
        if named_run
        else "retry with a newer checkpoint, or name the run folder to use its newest"
    )
    raise FileNotFoundError(
        f"{gone}: checkpoint {gone.name} was removed (a live run's keep_last pruning) while "
        f"it was being read; {hint}"
    )


def _say(log: Callable[[str], None] | None, text: str) -> None:
    if log is None:
        print(text, file=sys.stderr, flush=True)
    else:
        log(text)
