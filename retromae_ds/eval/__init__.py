"""Retrieval evaluation: BEIR loading, encoding, metrics, and the ``retromae-ds eval`` job."""
