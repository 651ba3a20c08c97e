"""Quiet Hugging Face loading: no LOAD REPORT tables, progress bars or warnings for the
expected differences between a checkpoint and the class that loads it.

``from_pretrained`` in transformers 5 logs a "LOAD REPORT" table as a warning
(``transformers.utils.loading_report.log_state_dict_report``) whenever the checkpoint and the
model class differ: an MLM folder loaded as ``AutoModel`` has UNEXPECTED ``cls.*`` keys and a
MISSING pooler, both expected here. Each load also draws a "Loading weights" progress bar.
Wrap loads in ``quiet_transformers()``::

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModel.from_pretrained(folder, local_files_only=True)

``modeling.load.load_pretrained(AutoModel, folder)`` does that for a model, offline, and still
says in one line which weights the checkpoint lacked beyond the expected ones (a wrong folder
would otherwise give a randomly initialised model without a word).

Errors still raise (transformers raises on size mismatches and conversion errors after its
report); the messages held back are then replayed before the exception propagates, so the
report that explains it is not lost. ``TRANSFORMERS_VERBOSITY=info`` (or ``debug``) shows
everything again.

``load_tokenizer_checked(folder)`` loads a model folder's tokenizer offline and refuses a folder
without tokenizer files, or one whose vocabulary is far smaller than the model's: transformers
would otherwise build a stand-in tokenizer of a handful of special tokens and every text would
encode to nearly the same ids.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_lock = threading.RLock()


class _HoldBack(logging.Handler):
    """Keeps records below ERROR; passes ERROR and above on at once, where they would go."""

    def __init__(self, handlers: list[logging.Handler], propagate: bool) -> None:
        super().__init__(logging.NOTSET)
        self.held: list[logging.LogRecord] = []
        self._handlers, self._propagate = handlers, propagate

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR:
            self.held.append(record)
            return
        for handler in self._handlers:
            if record.levelno >= handler.level:
                handler.handle(record)
        if self._propagate:
            logging.getLogger().handle(record)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hold back transformers' log messages below ERROR (load reports, warnings, info) and
    hide its progress bars for the duration; replay the held messages if the block raises.

    Process-wide while it lasts (logging is), so other threads' transformers messages are held
    too; nesting is fine. A no-op for messages when transformers' verbosity is INFO or DEBUG.
    """
    from transformers.utils import logging as hf_logging

    with _lock:
        library = hf_logging.get_logger()  # the "transformers" logger, configured
        verbose = library.getEffectiveLevel() < logging.WARNING
        handlers, propagate = list(library.handlers), library.propagate
        hold = _HoldBack(handlers, propagate)
        if not verbose:
            library.handlers = [hold]
            library.propagate = False
        restore_bars = _hide_progress_bars(hf_logging)
    try:
        yield
    except BaseException:
        with _lock:
            _restore(library, handlers, propagate, restore_bars, verbose)
            for record in hold.held:  # the report that explains the error
                library.handle(record)
        raise
    else:
        with _lock:
            _restore(library, handlers, propagate, restore_bars, verbose)


def _restore(library, handlers, propagate, restore_bars, verbose: bool) -> None:
    if not verbose:
        library.handlers = handlers
        library.propagate = propagate
    restore_bars()


def _hide_progress_bars(hf_logging):
    """Hide transformers' tqdm bars; returns the function that undoes it."""
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    if set_hook is not None:  # transformers >= 5: a hook, restored exactly

        def disabled(factory, args, kwargs):
            kwargs = {**kwargs, "disable": True}
            return previous(factory, args, kwargs) if previous else factory(*args, **kwargs)

        previous = set_hook(disabled)
        return lambda: set_hook(previous)
    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        return hf_logging.enable_progress_bar
    return lambda: None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""Any one of these makes a folder a tokenizer folder (the rest may then be derived)."""


def load_tokenizer_checked(folder: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained(folder, local_files_only=True)``, quietly, refusing
    (``ValueError`` naming the folder) a folder with none of ``TOKENIZER_FILES``, and a
    tokenizer whose vocabulary is under half the ``vocab_size`` of the folder's model config."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such tokenizer folder")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{folder}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer with the model"
        )
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{folder}: cannot load its tokenizer: {exc}") from exc
    model_vocab = config_vocab_size(folder)
    if model_vocab is not None and 2 * len(tokenizer) < model_vocab:
        raise ValueError(
            f"{folder}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size "
            f"is {model_vocab}; the tokenizer files do not belong to this model"
        )
    return tokenizer


def config_vocab_size(folder: Path) -> int | None:
    """``vocab_size`` of ``folder/config.json`` (top level or its ``text_config``), or None."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text_config = config.get("text_config")
    if "vocab_size" not in config and isinstance(text_config, dict):
        config = text_config
    size = config.get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None
