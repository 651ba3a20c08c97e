"""The retrieval layer, below both fine-tuning and evaluation: BEIR reading (``beir``),
encoding with a pooling (``encode``), BM25 (``lexical``) and the ranking measures
(``metrics``). Nearest-neighbour search is ``retromae_ds.search``; poolings are
``retromae_ds.hf.pooling``."""
