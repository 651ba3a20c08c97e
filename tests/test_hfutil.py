"""quiet_transformers / load_pretrained: no LOAD REPORT table or progress bar for the expected
differences between a checkpoint and the loading class; real errors still raise, with it."""

from __future__ import annotations

import logging
import sys

import pytest

from retromae_ds.hf.util import quiet_transformers
from retromae_ds.modeling.load import load_pretrained


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A tiny BERT saved with its MLM head, and the same body saved without one."""
    from transformers import BertConfig, BertForMaskedLM, BertModel

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    root = tmp_path_factory.mktemp("tiny_bert")
    BertForMaskedLM(config).save_pretrained(root / "mlm")
    BertModel(config).save_pretrained(root / "body")
    return root


@pytest.fixture
def err(capfd):
    """Everything written to stderr while the test body runs (transformers' handler may hold
    the stderr of an earlier capture: point it at this one)."""
    from transformers.utils import logging as hf_logging

    library = hf_logging.get_logger()
    streams = [(h, h.setStream(sys.stderr)) for h in library.handlers if hasattr(h, "setStream")]
    capfd.readouterr()
    yield lambda: capfd.readouterr().err
    for handler, stream in streams:
        handler.setStream(stream)


def test_an_mlm_folder_loads_as_automodel_without_a_report(tiny_folders, err):
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    AutoModel.from_pretrained(str(tiny_folders / "mlm"), local_files_only=True)
    noisy = err()
    assert "LOAD REPORT" in noisy and "pooler.dense.weight" in noisy  # what the helper hides

    library = hf_logging.get_logger()
    before = (list(library.handlers), library.propagate)
    with quiet_transformers():
        AutoModel.from_pretrained(str(tiny_folders / "mlm"), local_files_only=True)
    assert err() == ""  # neither the report nor the "Loading weights" bar
    assert (list(library.handlers), library.propagate) == before

    AutoModel.from_pretrained(str(tiny_folders / "mlm"), local_files_only=True)
    assert "LOAD REPORT" in err()  # only for the duration


def test_errors_still_raise_with_the_report_that_explains_them(tiny_folders, err):
    from transformers import AutoModel

    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"), quiet_transformers():
        AutoModel.from_pretrained(str(tiny_folders / "mlm"), local_files_only=True, vocab_size=60)
    replayed = err()
    assert "LOAD REPORT" in replayed and "MISMATCH" in replayed
    with pytest.raises(OSError), quiet_transformers():
        AutoModel.from_pretrained(str(tiny_folders / "nowhere"), local_files_only=True)


def test_errors_logged_inside_pass_through_at_once(err):
    from transformers.utils import logging as hf_logging

    with quiet_transformers():
        hf_logging.get_logger("transformers.test").warning("held back")
        hf_logging.get_logger("transformers.test").error("shown")
    out = err()
    assert "shown" in out and "held back" not in out


def test_load_pretrained_names_only_unexpected_missing_weights(tiny_folders, err):
    from transformers import AutoModel, AutoModelForMaskedLM

    model = load_pretrained(AutoModel, tiny_folders / "mlm")  # no pooler: expected
    assert type(model).__name__ == "BertModel" and err() == ""
    load_pretrained(AutoModelForMaskedLM, tiny_folders / "body")
    lines = err().strip().splitlines()
    assert len(lines) == 1 and "newly initialised" in lines[0] and "cls.predictions" in lines[0]
    load_pretrained(AutoModelForMaskedLM, tiny_folders / "body", may_miss=("cls.",))
    assert err() == ""


def test_verbose_transformers_shows_everything(tiny_folders, err):
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.INFO)
    try:
        with quiet_transformers():
            AutoModel.from_pretrained(str(tiny_folders / "mlm"), local_files_only=True)
    finally:
        hf_logging.set_verbosity(level)
    assert "LOAD REPORT" in err()
