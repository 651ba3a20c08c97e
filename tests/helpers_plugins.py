"""A temporary installed package: a module and a dist-info with entry points on ``sys.path``,
as ``pip install`` would leave them, for tests that extend the library from outside it."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install_package(
    site: Path, name: str, source: str, entry_points: dict[str, dict[str, str]]
) -> Path:
    """Write module ``name`` (``source``, dedented) and ``name-0.1.dist-info`` whose
    ``entry_points.txt`` holds ``{group: {entry name: "module:attr"}}`` into ``site``;
    returns ``site``. The caller puts ``site`` on ``sys.path`` (``monkeypatch.syspath_prepend``)
    and, for a subprocess, on ``PYTHONPATH``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{name}.py").write_text(textwrap.dedent(source))
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n"
    )
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {target}" for key, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site
