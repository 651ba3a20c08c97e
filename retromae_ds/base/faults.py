"""Fault injection for tests: the one seam through which a test slows a process down or
kills it at a named point of its work.

A test sets ``RETROMAE_DS_FAULTS`` to a JSON object naming points and their values, e.g.
``{"sleep_after_step_s": 0.3}`` or ``{"crash_in_save_at_step": 4}``; the code under test calls
:func:`pause` or :func:`crash` at those points. The variable is read once per process; unset
(every real run), each call is a dictionary lookup that does nothing. Unknown point names are
an error, so a test cannot silently inject nothing.

Points:

``sleep_after_step_s``
    seconds to sleep after each optimizer step (time for a test to signal a run mid-way);
``crash_in_save_at_step``
    ``os._exit(CRASH_EXIT)`` after every rank wrote that step's checkpoint files but before it
    is marked complete (a crash inside the save);
``sleep_after_encode_batch_s``
    seconds to sleep after each batch the refresher encodes (time to kill it mid-encode);
``sleep_before_shard_rename_s``
    seconds to sleep before a finished shard is renamed into place (time to kill
    preprocessing mid-shard);
``crash_before_embedding_shard_rename``
    ``os._exit(CRASH_EXIT)`` once the refresher's passage-embedding shard of that index is
    written and fsynced under its temporary name, before the rename;
``crash_after_embedding_shard``
    ``os._exit(CRASH_EXIT)`` once that embedding shard is complete (its manifest written);
``crash_in_refresh_at``
    ``os._exit(CRASH_EXIT)`` at a named point of a refresh: ``"search"`` (shards verified,
    nothing searched yet), ``"rescore"`` (a candidate-pool version: its shards verified,
    before the pool is re-scored), ``"merge"`` (every rank's top-K written, before the
    merge), ``"publish"`` (the merged ranking written, before mining and publishing);
``sleep_before_search_s``
    seconds the refresher sleeps when its search stage starts (time to fill a disk between
    the encoding and the search).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

ENV = "RETROMAE_DS_FAULTS"
CRASH_EXIT = 17
"""Exit status of an injected crash (distinct from errors, timeouts and signals)."""
POINTS = (
    "sleep_after_step_s",
    "crash_in_save_at_step",
    "sleep_after_encode_batch_s",
    "sleep_before_shard_rename_s",
    "crash_before_embedding_shard_rename",
    "crash_after_embedding_shard",
    "crash_in_refresh_at",
    "sleep_before_search_s",
)


@functools.cache
def plan() -> dict[str, Any]:
    """The faults this process was asked to inject (``{}`` in every real run)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return {}
    try:
        faults = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV}: not a JSON object ({exc})") from None
    if not isinstance(faults, dict):
        raise ValueError(f"{ENV}: not a JSON object: {text!r}")
    unknown = sorted(set(faults) - set(POINTS))
    if unknown:
        raise ValueError(f"{ENV}: unknown fault point(s) {unknown}; known: {list(POINTS)}")
    return faults


def env(**faults: Any) -> dict[str, str]:
    """``{ENV: json}`` for a test's subprocess environment (checks the point names)."""
    unknown = sorted(set(faults) - set(POINTS))
    if unknown:
        raise ValueError(f"unknown fault point(s) {unknown}; known: {list(POINTS)}")
    return {ENV: json.dumps(faults)}


def pause(point: str) -> None:
    """Sleep for the seconds set for ``point`` (nothing when it is not set)."""
    seconds = plan().get(point)
    if seconds:
        time.sleep(float(seconds))


def crash(point: str, at: int | str) -> None:
    """Exit the process at once with ``CRASH_EXIT`` when ``point`` is set to ``at``."""
    if plan().get(point) == at:
        os._exit(CRASH_EXIT)
