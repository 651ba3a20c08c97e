"""Hugging Face folders: loading models and tokenizers from local folders quietly
(``util``), and the sentence-transformers files that say how a folder pools and normalises
(``sbert``)."""
