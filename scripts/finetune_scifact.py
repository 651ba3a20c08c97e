#!/usr/bin/env python
"""The SciFact fine-tuning recipe of docs/results.md:
``python scripts/finetune_scifact.py --data ../shared/data/scifact [--out runs/ft_scifact]``.

See ``retromae_recipes/finetune.py`` for the recipe."""

import sys
from pathlib import Path

# run from a checkout: the recipes package sits beside scripts/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retromae_recipes.finetune import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
