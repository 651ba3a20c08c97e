#!/usr/bin/env python
"""The study of docs/results.md: ``python scripts/study.py [--quick] [--out runs/study]``.

See ``retromae_ds/study.py`` for the protocol."""

import sys

from retromae_ds.study import main

if __name__ == "__main__":
    sys.exit(main())
