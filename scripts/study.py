#!/usr/bin/env python
"""The study of docs/results.md:
``python scripts/study.py [--quick | --gpu] --data ../shared/data [--out runs/study]``.

See ``retromae_recipes/study.py`` for the protocol."""

import sys
from pathlib import Path

# run from a checkout: the recipes package sits beside scripts/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retromae_recipes.study import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
