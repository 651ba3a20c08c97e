"""Named extension points: one registry per kind of thing users add (objectives, poolings,
measures, index kinds).

A ``Registry`` maps a lower-case name to one entry. The library registers its own entries
where they are defined; another package adds entries through an entry-point group
(``[project.entry-points."retromae_ds.objectives"]`` in its ``pyproject.toml``), loaded the
first time a name is not found, so an installed package extends every command without the
library importing it. A name is registered once: the same entry again is a no-op, a
different one under that name a ``ValueError`` (two packages cannot silently shadow each
other).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``name -> entry`` of one kind (``kind`` names it in errors: "objective"), extended
    by the ``group`` entry points of installed packages."""

    def __init__(self, kind: str, group: str) -> None:
        self.kind, self.group = kind, group
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Make ``entry`` known as ``name``; returns ``entry`` (usable as a decorator's body)."""
        key = _key(name)
        if not key.replace("_", "a").isalnum() or not key[:1].isalpha():
            raise ValueError(f"{self.kind} name {name!r}: expected a word such as 'retromae'")
        if self._entries.get(key, entry) is not entry:
            raise ValueError(f"{self.kind} {key!r} is already registered ({self._entries[key]!r})")
        self._entries[key] = entry
        return entry

    def decorator(self, name: str) -> Callable[[T], T]:
        """``@REGISTRY.decorator("name")`` registers what it decorates under ``name``."""
        return lambda entry: self.register(name, entry)

    def get(self, name: str, where: str = "") -> T:
        """The entry named ``name`` (any case); one line naming ``where`` (the option) and the
        registered names for an unknown one."""
        key = _key(name)
        if key not in self._entries:
            self._load_added()
        if key not in self._entries:
            head = f"{where}: " if where else ""
            raise ValueError(
                f"{head}unknown {self.kind} {name!r}; expected one of {', '.join(self.names())} "
                f"(or a package's {self.group!r} entry point)"
            )
        return self._entries[key]

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if _key(name) not in self._entries:
            self._load_added()
        return _key(name) in self._entries

    def names(self, installed: bool = False) -> tuple[str, ...]:
        """The registered names, in registration order (the library's first); with
        ``installed``, the installed packages' entry points are registered first (what a
        ``--help`` or an error message lists)."""
        if installed:
            self._load_added()
        return tuple(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def copy(self) -> Registry[T]:
        """A registry with the same kind, group and entries (tests register into a copy)."""
        other: Registry[T] = Registry(self.kind, self.group)
        other._entries = dict(self._entries)
        return other

    def unregister(self, name: str) -> None:
        """Forget ``name`` (tests that register a temporary entry clean up with this)."""
        self._entries.pop(_key(name), None)

    def _load_added(self) -> None:
        """Register the ``group`` entry points not registered yet."""
        for point in entry_points(group=self.group):
            if _key(point.name) not in self._entries:
                self.register(point.name, point.load())


def _key(name: str) -> str:
    return str(name).strip().lower()
