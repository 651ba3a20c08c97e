"""House style is part of the test suite: ruff (configured in pyproject.toml) must be clean."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_is_clean(args):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed; install the dev extra: pip install -e '.[dev]'")
    result = subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
