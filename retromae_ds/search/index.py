"""The one protocol every index of ``retromae_ds.search`` keeps (``Index``: ``ExactIndex`` and
``ApproximateIndex``), what an ``index`` setting resolved to for one corpus (``IndexChoice``),
and how a bad setting is reported (``SettingError``). No faiss.

An index holds float32 vectors (``add`` appends, ids are row positions in order of addition;
an index that must be trained trains on its first ``add``, or on ``train``'s sample) and
answers ``search(queries_QD, k)`` with ``(scores_QK float32, ids_QK int64)``, best first;
``k`` may exceed what it holds, missing slots have id -1 and score -inf. Merged results
(several blocks, shards or ranks, ``merge.merge_topk``) order equal scores by id ascending.

The settings (``index``, ``backend``, ``nprobe``, ``ef_search``, ``train_size``) are this
package's parameters; how a command spells them (a config section's dotted names, ``eval --nprobe``)
is the command's business. A ``SettingError`` therefore says its message as a function of a
spelling: its ``str`` uses the bare names ("nprobe 99 exceeds the 32 lists of index 'ivf'"),
and ``spelled_as(spell)`` lets the command that read the settings re-raise it, one line,
with its own option names::

    with spelled_as(lambda name: f"--{name}"):
        index = build(setting, n=len(passages), dim=768)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from retromae_ds.search.arrays import Matrix

Spelling = Callable[[str], str]
"""A setting's name (``nprobe``) -> how the reader of the settings spells it
(``--nprobe``)."""
SETTINGS = ("index", "backend", "nprobe", "ef_search", "train_size")
"""The names a ``SettingError`` may spell."""
EXACT = "Flat"
"""The faiss ``index_factory`` string of exact search (``ExactIndex``)."""


def bare(name: str) -> str:
    """The spelling of this package's own parameters: the name itself."""
    return name


class SettingError(ValueError):
    """A bad index setting; ``say(spell)`` is the one-line message with every setting named
    through ``spell`` (``str(error)``: the bare names)."""

    def __init__(self, say: Callable[[Spelling], str]) -> None:
        super().__init__(say(bare))
        self.say = say

    def spelled(self, spell: Spelling) -> str:
        return self.say(spell)


@contextmanager
def spelled_as(spell: Spelling) -> Iterator[None]:
    """Re-raise a ``SettingError`` from the block as a ``ValueError`` of one line naming the
    settings as ``spell`` does (the caller's option names)."""
    try:
        yield
    except SettingError as exc:
        raise ValueError(exc.spelled(spell)) from None


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


@runtime_checkable
class Index(Protocol):
    """Top-k search by inner product or cosine over vectors added to it."""

    dim: int
    """Vector dimension."""
    exact: bool
    """True when its top-k and scores are exact (no rescoring needed)."""
    choice: IndexChoice | None
    """What the ``index`` setting it was built from resolved to (None: built directly)."""

    @property
    def ntotal(self) -> int:
        """Vectors held."""
        ...

    def training_vectors(self, n: int) -> int:
        """How many of ``n`` vectors training samples (0: no training needed); a
        ``SettingError`` when that is too few."""
        ...

    def train(self, embeddings_ND: Matrix) -> None:
        """Train on (a sample of) ``embeddings_ND``; a no-op for an index without training."""
        ...

    def add(self, embeddings_ND: Matrix) -> None:
        """Append vectors; their ids continue from ``ntotal``."""
        ...

    def search(self, queries_QD: Matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores_QK, ids_QK)``, best first; missing slots -inf / -1."""
        ...

    def search_parts(
        self,
        queries_QD: Matrix,
        parts: Iterable[Matrix],
        k: int,
        *,
        query_batch: int | None = None,
        filled: Callable[[], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top-k of ``queries_QD`` over the vectors of ``parts`` (ids continue in order,
        from 0: the index holds nothing before), each part read once (e.g. memory-mapped
        shards loaded one at a time): an exact index searches part by part and never holds
        them; another adds them all, calls ``filled``, then searches ``query_batch``
        queries at a time."""
        ...
