"""One front door to the indexes: ``resolve_index`` turns the ``index`` setting (a kind or a
faiss ``index_factory`` string, ``search.kinds``) and its companions into an ``IndexChoice``
at a given corpus size and dimension, checking everything that can be checked before any
vector is seen; ``build_index`` returns the empty index it names (``ExactIndex`` for flat,
``ApproximateIndex`` otherwise), to be filled with ``add``.

    index = build_index("ivf", dim=768, n=len(passages), prefix="refresh.")
    index.add(passages)
    scores_QK, ids_QK = index.search(queries, 200)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from retromae_ds.search.approximate import ApproximateIndex
from retromae_ds.search.arrays import Backend, Metric
from retromae_ds.search.exact import ExactIndex
from retromae_ds.search.kinds import EXACT, check_index_setting, factory_for


@dataclass(frozen=True)
class IndexChoice:
    """What an ``index`` setting resolved to for one corpus (recorded in the refresher's
    manifest)."""

    index: str
    """The setting as given (``auto``, ``ivf``, ``IVF4096,PQ32``, ...)."""
    factory: str
    """The faiss ``index_factory`` string it stands for; ``Flat``: exact search."""
    backend: str
    """``faiss`` or ``torch`` (``auto`` resolved)."""
    nprobe: int
    """IVF lists probed per query (0: no lists)."""
    ef_search: int
    """HNSW candidate list: the value searches use (0: no graph; or auto resolved without a
    ``k``, which sets it per search: 4·k, at least 64)."""
    train_size: int
    """Vectors sampled to train lists or codes (0: no training)."""

    @property
    def exact(self) -> bool:
        return self.factory == EXACT

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _label(index: str, factory: str, prefix: str) -> str:
    return f"{prefix}index {index!r}" + ("" if index == factory else f" ({factory})")


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
    prefix: str = "",
) -> IndexChoice:
    """The ``IndexChoice`` of ``index`` for ``n`` vectors of ``dim``, or a ValueError naming
    the setting at fault (``prefix``: how settings are spelled, e.g. ``refresh.``). ``k``:
    the results each search asks for, so that an automatic ``ef_search`` is recorded as the
    value those searches use (0: not known, recorded as 0)."""
    check_index_setting(index, backend, prefix)
    for name, value in (("nprobe", nprobe), ("ef_search", ef_search), ("train_size", train_size)):
        if value < 0:
            raise ValueError(f"{prefix}{name} must be >= 0 (0: auto), got {value}")
    factory = factory_for(index, n, dim, train_size, backend)
    resolved_backend = "torch" if backend == "torch" else "faiss"
    if factory == EXACT:
        if index != "auto":
            for name, value in (("nprobe", nprobe), ("ef_search", ef_search)):
                if value:
                    raise ValueError(
                        f"{prefix}{name} applies to approximate indexes; {prefix}index "
                        f"{index!r} searches exactly"
                    )
        return IndexChoice(index, factory, resolved_backend, 0, 0, 0)
    probe = ApproximateIndex(
        dim,
        factory,
        nprobe=nprobe,
        ef_search=ef_search,
        train_size=train_size,
        gpu=False,
        label=_label(index, factory, prefix),
        prefix=prefix,
        strict=index != "auto",
    )
    return IndexChoice(
        index,
        factory,
        resolved_backend,
        probe.nprobe,
        probe.ef_search_for(min(k, n)) if k else probe.ef_search,
        probe.training_vectors(n),
    )


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
    prefix: str = "",
) -> ExactIndex | ApproximateIndex:
    """The empty index ``index`` names for ``n`` vectors of ``dim`` (``resolve_index``);
    ``device`` is the torch backend's, ``seed`` samples the training vectors."""
    choice = resolve_index(
        index,
        n=n,
        dim=dim,
        backend=backend,
        nprobe=nprobe,
        ef_search=ef_search,
        train_size=train_size,
        prefix=prefix,
    )
    if choice.exact:
        return ExactIndex(dim, metric=metric, backend=backend, device=device)
    return ApproximateIndex(
        dim,
        choice.factory,
        metric=metric,
        nprobe=choice.nprobe,
        ef_search=choice.ef_search,
        train_size=choice.train_size,
        seed=seed,
        label=_label(index, choice.factory, prefix),
        prefix=prefix,
        strict=index != "auto",
    )
