"""Issue 55, items 7 and 9: ``eval``'s memory no longer grows with one document's length (a
10 MB JSON line took its peak from 0.44 to 1.57 GB at ``--max_length 64``: the tokenizer
held the whole text), and the encoder's padding mask takes the form the installed
transformers accepts (transformers 4, 4.45.0, 4.46.3 and 4.57.6 checked, refused the 4-D
mask at every training command's first forward). The mask tests also run under the declared
transformers floor in ``scripts/ci_floor.sh``, where they failed before the fix; the memory
test failed here."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_train import ENV, REPO

from retromae_ds.attention.packing import Packing
from retromae_ds.modeling.encoder import encode
from retromae_ds.modeling.long_attention import use_broadcast_mask
from retromae_ds.modeling.mask_form import _takes_4d_mask, takes_4d_mask
from retromae_ds.retrieval.encode import MAX_GROWTH, bounded_texts, cut_chars

from helpers_ance import write_synthetic_beir, write_tiny_encoder
from helpers_model import SMALL_CONFIG
from synthetic import synthetic_texts


def _words(chars: int, seed: int) -> str:
    words = " ".join(synthetic_texts(300, seed=seed, max_words=200))
    return (words + " ") * (chars // max(len(words), 1) + 1)


# --- item 7: a document is cut before it is tokenized, to the same tokens ---


def test_a_cut_text_tokenizes_to_the_whole_texts_ids(tokenizer_dir):
    """Cut-then-tokenized ids equal tokenized-then-truncated ids (WordPiece): short texts,
    long spaced ones, whitespace-free ones, and ones so dense in characters per token
    ([UNK] words over 100 characters) that the first cut holds too few tokens. A
    whitespace-free run longer than ``MAX_GROWTH`` cuts is cut anyway (its tokens differ)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    rng = random.Random(3)
    spaced = _words(60_000, seed=4).replace("e ", "e  ").replace("a ", "a\n")
    unk_words = " ".join("q" * rng.randint(101, 400) for _ in range(400))
    texts = [
        "short one",
        "",
        _words(200_000, seed=3),
        spaced[:90_000],
        "x" * 50_000 + " tail",
        unk_words + " " + _words(20_000, seed=5),
        "\u4e2d\u6587" * 30_000,
    ]
    blob = "x" * 10_000_000 + " tail"
    for max_length in (8, 64, 300):
        cut = bounded_texts(tok, texts, max_length)
        assert cut[:2] == texts[:2]
        assert len(cut[2]) <= cut_chars(max_length) < len(texts[2])  # cut, and bounded
        assert [len(c) < len(t) for c, t in zip(cut, texts, strict=True)] == [0, 0, 1, 1, 0, 1, 1]
        assert len(bounded_texts(tok, [blob], max_length)[0]) <= MAX_GROWTH * cut_chars(max_length)
        whole = tok(texts, truncation=True, max_length=max_length)["input_ids"]
        assert tok(cut, truncation=True, max_length=max_length)["input_ids"] == whole
    assert len(bounded_texts(tok, texts, 64)[5]) > cut_chars(64)  # the [UNK] text grew


_PEAK = """
import resource, sys
from retromae_ds.cli import main
try:
    main(["eval", "--model", sys.argv[1], "--beir", sys.argv[2], "--split", "train",
          "--max_length", "64", "--progress", "false"])
except SystemExit as e:
    if e.code:
        raise
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_one_10_mb_document_evaluates_in_bounded_memory(tmp_path, tokenizer_dir):
    """Item 7: ``eval`` of a corpus with one 10 MB document peaked 1.1 GB above the same
    corpus with a short one (0.44 -> 1.57 GB); it is now ~10 MB, under 100 MB."""
    model = write_tiny_encoder(tmp_path / "model", tokenizer_dir)
    peaks = {}
    for name, chars in (("short", 2000), ("long", 10_000_000)):
        beir = write_synthetic_beir(tmp_path / name, num_docs=30, num_queries=8)
        with open(beir / "corpus.jsonl", "a") as f:
            f.write(json.dumps({"_id": "long", "text": _words(chars, seed=6)[:chars]}) + "\n")
        cmd = [sys.executable, "-c", _PEAK, str(model), str(beir)]
        result = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        peaks[name] = int(result.stdout.split()[-1])
    grown = peaks["long"] - peaks["short"]
    assert grown < 100 * 2**20, f"{grown / 2**20:.0f} MB over the short run's peak"


# --- item 9: the mask form of the installed transformers, outputs unchanged ---


def _masked_lm(family: str, implementation: str) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    config_class, model_class = {
        "bert": (BertConfig, BertForMaskedLM),
        "roberta": (RobertaConfig, RobertaForMaskedLM),
    }[family]
    config = config_class(
        **SMALL_CONFIG, max_position_embeddings=40, attn_implementation=implementation
    )
    model = model_class(config).eval()
    use_broadcast_mask(model)  # as every model built or loaded here (sdpa only)
    return model


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_encode_equals_the_2d_mask_path_of_the_installed_transformers(family, implementation):
    """``encode`` (a 4-D mask where transformers takes one, else a 3-D one) gives exactly the
    hidden states of transformers' own 2-D path, with and without padding."""
    model = _masked_lm(family, implementation)
    ids_BL = torch.randint(5, 100, (3, 20))
    for padded in (False, True):
        mask_BL = torch.ones(3, 20, dtype=torch.long)
        if padded:
            mask_BL[1, 12:] = 0
            mask_BL[2, 5:] = 0
        with torch.no_grad():
            ours = encode(model, ids_BL, mask_BL)
            theirs = model.base_model(input_ids=ids_BL, attention_mask=mask_BL)
        assert torch.equal(ours, theirs.last_hidden_state), (family, implementation, padded)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_packed_documents_get_their_states_alone_in_either_mask_form(family, implementation):
    model = _masked_lm(family, implementation)
    lengths = (7, 9)
    docs = [torch.randint(5, 100, (n,)) for n in lengths]
    ids_BL = torch.cat([*docs, torch.zeros(2, dtype=torch.long)])[None]
    doc_ids = torch.tensor([[0] * 7 + [1] * 9 + [-1] * 2])
    positions = torch.tensor([[*range(7), *range(9), 0, 0]])
    mask_BL = (doc_ids >= 0).long()
    with torch.no_grad():
        together = encode(model, ids_BL, mask_BL, Packing(doc_ids, positions))[0]
        start = 0
        for doc in docs:
            alone = encode(model, doc[None], torch.ones(1, len(doc), dtype=torch.long))[0]
            got = together[start : start + len(doc)]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
            start += len(doc)


def test_roberta_family_positions_start_after_the_padding_id():
    """Under transformers 4 (4.45 - 4.57) ``position_offset`` found no RoBERTa-family offset (the
    method it looked for is a module-level function there): packed rows were two positions
    early, and ``usable_positions`` counted the two offset rows as usable."""
    from retromae_ds.modeling.positions import position_offset, usable_positions

    roberta = _masked_lm("roberta", "eager")
    assert (position_offset(roberta), usable_positions(roberta)) == (2, 38)
    assert (position_offset(_masked_lm("bert", "eager")), usable_positions(roberta.roberta)) == (
        0,
        38,
    )


def test_the_mask_form_is_what_the_body_accepts_and_leaves_the_seed_alone():
    """``takes_4d_mask`` is False exactly when the model's own body refuses a 4-D mask
    (transformers 4), and deciding it draws nothing from torch's generator."""
    model = _masked_lm("bert", "sdpa")
    _takes_4d_mask.cache_clear()
    state = torch.random.get_rng_state()
    four_d = takes_4d_mask(model)
    assert torch.equal(torch.random.get_rng_state(), state)
    ids_BL = torch.randint(5, 100, (2, 6))
    try:
        with torch.no_grad():
            model.base_model(input_ids=ids_BL, attention_mask=torch.ones(2, 1, 1, 6).bool())
        accepted = True
    except ValueError:
        accepted = False
    assert four_d == accepted


def test_ci_floor_tests_the_floor_pyproject_declares():
    """The CI step of scripts/ci_floor.sh installs the ``transformers>=X`` of pyproject.toml."""
    script = (REPO / "scripts" / "ci_floor.sh").read_text()
    assert '"transformers==$FLOOR"' in script and "pyproject.toml" in script
    assert "tests/test_guard_eval_round4.py" in script
    assert Path(REPO / "pyproject.toml").read_text().count('"transformers>=') == 1
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "bash scripts/ci_floor.sh" in ci  # CI runs it, not only a person who remembers to
