"""The leaves every layer may import: errors and their one-line reporting (``errors``), fault
injection for the tests (``faults``), atomic writes and checksums (``fsutil``), the
counter-based hash of the masking (``hashing``), special token ids (``special_tokens``) and
the typed configuration with its command-line parsers (``config``)."""
