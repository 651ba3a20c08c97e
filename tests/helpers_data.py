"""Where the real data of the suite lives: ``../shared/data`` beside the repository (its
README lists SciFact, WikiText-2, CSL and the BERT Chinese vocabulary), or the folder
``RETROMAE_DS_SHARED_DATA`` names. Tests that need it skip, saying why, when it is absent."""

from __future__ import annotations

import os
from pathlib import Path

SHARED_DATA = Path(
    os.environ.get(
        "RETROMAE_DS_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"
    )
)
