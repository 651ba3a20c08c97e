"""Top-k lists computed apart, merged exactly: the blocks of one index, the embedding shards
searched one at a time, the refresher's ranks (``merge_topk``), and the padding of a list
shorter than ``k`` (``pad_topk``).

Conventions of every index here: ``k`` may exceed the number of vectors, missing slots have id
``-1`` and score ``-inf``; merged results order equal scores by id ascending.
"""

from __future__ import annotations

import numpy as np


def pad_topk(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Widen a ``[Q, <=k]`` result to ``[Q, k]`` with -inf / -1 slots."""
    missing = k - ids.shape[1]
    if missing <= 0:
        return scores, ids
    return (
        np.hstack([scores, np.full((len(scores), missing), -np.inf, dtype=np.float32)]),
        np.hstack([ids, np.full((len(ids), missing), -1, dtype=np.int64)]),
    )


def merge_topk(
    scores_a: np.ndarray, ids_a: np.ndarray, scores_b: np.ndarray, ids_b: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Best ``k`` of two ``[Q, *]`` results (ids must be global), score descending, id ascending.

    Padding slots (id -1) sort last and pad the output when both inputs hold fewer than k.
    """
    scores = np.concatenate([scores_a, scores_b], axis=1).astype(np.float32, copy=False)
    ids = np.concatenate([ids_a, ids_b], axis=1).astype(np.int64, copy=False)
    padding = ids < 0
    scores = np.where(padding, -np.inf, scores)
    # lexsort: last key is primary -> padding last, then score descending, then id ascending
    order = np.lexsort((ids, -scores, padding), axis=1)[:, :k]
    return pad_topk(np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1), k)
