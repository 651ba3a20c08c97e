#!/usr/bin/env python
"""The teacher study of docs/results.md (issue 58):
``python scripts/teacher_study.py --data ../shared/data/scifact [--out runs/teacher]``.

See ``retromae_recipes/teacher.py`` for the recipe."""

import sys
from pathlib import Path

# run from a checkout: the recipes package sits beside scripts/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retromae_recipes.teacher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
