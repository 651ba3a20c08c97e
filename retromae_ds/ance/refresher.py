"""The old name of ``retromae_ds.refresh`` (``retromae-ds refresh``): ``python -m
retromae_ds.ance.refresher`` in a command line written before the split goes on working."""

from __future__ import annotations

import sys

from retromae_ds.refresh import main

if __name__ == "__main__":
    sys.exit(main())
