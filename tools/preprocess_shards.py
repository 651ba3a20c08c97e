#!/usr/bin/env python
"""Offline, parallel tokenization of raw text into memory-mapped Arrow shards.

Same as ``retromae-ds preprocess``; ``--help`` lists the options. Example:

    python tools/preprocess_shards.py ../shared/data/wikitext2/wiki.test.raw \
        --train_tokenizer 8000 --out shards/wiki --workers 2
"""

import sys

from retromae_ds.cli import main

if __name__ == "__main__":
    sys.exit(main(["preprocess", *sys.argv[1:]]))
