#!/usr/bin/env python
"""The batch-size experiment of issue 57 (docs/results.md):
``python scripts/batch_effect.py --wikitext ../shared/data/wikitext2 [--out runs/batch_effect]``.

See ``retromae_recipes/batch_effect.py`` for the recipe."""

import sys
from pathlib import Path

# run from a checkout: the recipes package sits beside scripts/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retromae_recipes.batch_effect import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
