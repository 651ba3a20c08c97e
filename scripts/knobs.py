#!/usr/bin/env python
"""One knob at a time (docs/results.md):
``python scripts/knobs.py --study runs/demo --out runs/knobs``.

See ``retromae_recipes/knobs.py`` for the protocol."""

import sys
from pathlib import Path

# run from a checkout: the recipes package sits beside scripts/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retromae_recipes.knobs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
