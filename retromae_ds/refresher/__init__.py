"""The asynchronous hard-negative refresher, a process of its own (``retromae-ds refresh``):
its settings (``config``), its loop over new checkpoints (``process``), its stages
(``stages``: encode in checksummed shards with the embedding cache, search, mine, publish),
the candidate pool, the mining filters, publication through the hand-off, and BM25's first
version (``bm25``). It reads the trainer's data and model (``retromae_ds.finetuning``) and
never the other way round; see docs/ance.md.
"""
