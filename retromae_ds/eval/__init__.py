"""Retrieval evaluation: the ``retromae-ds eval`` job's body (``run``), reranking, the result
file, the query and passage towers of a run, and the evaluation during pre-training
(``periodic``). It reads the retrieval layer (``retromae_ds.retrieval``)."""
