"""Nearest-neighbour search over dense embeddings, for the refresher's search stage and for
``eval``, through one protocol:

- ``index``: ``Index`` (what every index keeps: add, search, train, search_parts),
  ``IndexChoice`` (what a setting resolved to), ``SettingError`` / ``spelled_as`` (errors
  that the command reading the settings re-raises with its own option names);
- ``exact``: ``ExactIndex`` (faiss flat or torch matmul + top-k; blocks merged exactly),
  ``search_blocks`` (shards loaded one at a time), ``rescore`` (exact scores of candidates);
- ``approximate``: ``ApproximateIndex`` (any faiss ``index_factory`` index, trained on a sample);
- ``kinds``: ``index_setting`` (the ``index`` setting checked once: an ``IndexSetting``), the
  named kinds and the ``auto`` rule (no faiss);
- ``build``: ``build`` (an ``IndexSetting`` sized to a corpus: the empty index, built once),
  ``resolve_index`` / ``build_index`` from plain settings;
- ``merge``: ``merge_topk``, top-k lists computed apart merged exactly;
- ``arrays``: input checks and the ``Metric`` / ``Backend`` names;
- ``faiss_backend``: the one module that imports faiss.

The names below are importable from the package itself; each module is loaded on first use,
so ``search.kinds`` (the commands' config checks) does not load faiss.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "ExactIndex": "exact",
    "search_blocks": "exact",
    "rescore": "exact",
    "ApproximateIndex": "approximate",
    "Index": "index",
    "IndexChoice": "index",
    "SettingError": "index",
    "spelled_as": "index",
    "IndexSetting": "kinds",
    "index_setting": "kinds",
    "resolve_index": "build",
    "build_index": "build",
    "KINDS": "kinds",
    "merge_topk": "merge",
    "check_matrix": "arrays",
    "l2_normalize": "arrays",
    "Backend": "arrays",
    "Metric": "arrays",
    "faiss_gpus_usable": "faiss_backend",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
