"""From a checked ``index`` setting (``kinds.IndexSetting``) to the empty index it names for one
corpus: ``build`` sizes the setting to ``n`` vectors of ``dim`` (``kinds.factory_for``), builds
the index once (``ExactIndex`` for flat, ``ApproximateIndex`` otherwise; the layout checks of
an approximate index are made on the index itself, so nothing is built twice) and records what
it resolved to as the index's ``choice``. ``resolve_index`` / ``build_index`` do both steps
from the plain settings (benchmarks, tests)::

    setting = index_setting("ivf", nprobe=8)              # checked once, where it is read
    index = build(setting, n=len(passages), dim=768)      # an Index, sized to the corpus
    index.add(passages)
    scores_QK, ids_QK = index.search(queries, 200)

Errors are ``index.SettingError``s naming the settings bare; a command re-raises them with its
own option names (``index.spelled_as``).
"""

from __future__ import annotations

import torch

from retromae_ds.search.approximate import ApproximateIndex
from retromae_ds.search.arrays import Backend, Metric
from retromae_ds.search.exact import ExactIndex
from retromae_ds.search.index import EXACT, Index, IndexChoice
from retromae_ds.search.kinds import IndexSetting, factory_for, index_setting


def build(
    setting: IndexSetting,
    *,
    n: int,
    dim: int,
    k: int = 0,
    metric: Metric = "ip",
    device: str | torch.device | None = None,
    seed: int = 0,
) -> Index:
    """The empty index ``setting`` names for ``n`` vectors of ``dim``; its ``choice`` says
    what the setting resolved to (``k``: the results each search asks for, so that an
    automatic ``ef_search`` is recorded as the value those searches use; 0: not known,
    recorded as 0). ``device``: the torch backend's; ``seed`` samples the training vectors.
    A ``SettingError`` when the corpus cannot satisfy the setting (too few vectors for the
    lists or codes, ``nprobe`` beyond the lists, a factory string faiss cannot build)."""
    factory = factory_for(setting.index, n, dim, setting.train_size, setting.backend)
    backend = "torch" if setting.backend == "torch" else "faiss"
    if factory == EXACT:
        index: Index = ExactIndex(dim, metric=metric, backend=setting.backend, device=device)
        index.choice = IndexChoice(setting.index, factory, backend, 0, 0, 0)
        return index
    approximate = ApproximateIndex(
        dim,
        factory,
        metric=metric,
        nprobe=setting.nprobe,
        ef_search=setting.ef_search,
        train_size=setting.train_size,
        seed=seed,
        given=setting.index,
        strict=setting.index != "auto",
    )
    approximate.train_size = approximate.training_vectors(n)  # the count, resolved once
    approximate.choice = IndexChoice(
        setting.index,
        factory,
        backend,
        approximate.nprobe,
        approximate.ef_search_for(min(k, n)) if k else approximate.ef_search,
        approximate.train_size,
    )
    return approximate


def resolve_index(
    index: str,
    *,
    n: int,
    dim: int,
    backend: Backend = "auto",
    nprobe: int = 0,
    ef_search: int = 0,
    train_size: int = 0,
    k: int = 0,
) -> IndexChoice:
    """What ``index`` and its companions resolve to for ``n`` vectors of ``dim`` (``build``'s
    ``choice``), or a ``SettingError`` naming the setting at fault."""
    setting = index_setting(
        index, backend=backend, nprobe=nprobe, ef_search=ef_search, train_size=train_size
    )
    choice = build(setting, n=n, dim=dim, k=k).choice
    assert choice is not None
    return choice


def build_index(
    index: str,
    *,
    dim: int,
    n: int,
    metric: Metric = "ip",
    backend: Backend = "auto",
    device: str | torch.device | None = None,
    nprobe: int = 0,
    ef_search: int = 0,
    train_size: int = 0,
    seed: int = 0,
) -> Index:
    """``index_setting`` then ``build``: the empty index ``index`` names for ``n`` vectors."""
    setting = index_setting(
        index, backend=backend, nprobe=nprobe, ef_search=ef_search, train_size=train_size
    )
    return build(setting, n=n, dim=dim, metric=metric, device=device, seed=seed)
