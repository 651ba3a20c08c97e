"""Tokenizers: load a local Hugging Face fast tokenizer, train a WordPiece one, fingerprint it.

Nothing here downloads. The fingerprint (class, vocabulary hash, special-token ids) is written
into every shard manifest and checked by the reader, so a run cannot silently pair shards with
a different vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retromae_ds.base.config import flag

SPECIAL_TOKEN_ATTRS = ("cls", "sep", "pad", "mask", "unk", "bos", "eos")


def load_tokenizer(path: str | Path) -> Any:
    """Load a fast tokenizer from a local folder (never from a hub)."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder not found: {folder}")
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types; name the folder either way
        raise ValueError(f"cannot load a tokenizer from {folder}: {exc}") from exc
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(
            f"{folder}: tokenizer {type(tok).__name__} is not a fast (Rust) tokenizer; "
            "word-start flags need the fast tokenizer's word ids"
        )
    return tok


def backend_json(tok: Any) -> str:
    """The Rust tokenizer as JSON, with truncation and padding switched off."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend.to_str()


def fingerprint(tok: Any) -> dict[str, Any]:
    """Identity of a tokenizer as far as token ids are concerned."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    special = {
        name: getattr(tok, f"{name}_token_id", None)
        for name in SPECIAL_TOKEN_ATTRS
        if getattr(tok, f"{name}_token", None) is not None
    }
    return {
        "class": type(tok).__name__.removesuffix("Fast"),
        "vocab_size": len(vocab),
        "vocab_sha256": digest,
        "special_token_ids": special,
    }


def fingerprint_mismatch(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints; empty when they agree."""
    problems = []
    for key in ("class", "vocab_size", "vocab_sha256", "special_token_ids"):
        if expected.get(key) != actual.get(key):
            problems.append(
                f"{key}: shards have {expected.get(key)!r}, tokenizer has {actual.get(key)!r}"
            )
    return problems


def train_wordpiece(
    texts: Callable[[], Iterable[str]] | list[str],
    vocab_size: int,
    out_dir: str | Path,
    *,
    lowercase: bool = True,
) -> Any:
    """Train a BERT-style WordPiece tokenizer and save it to ``out_dir``.

    ``texts`` is a list or a function returning a fresh iterable (it is read twice).
    Deterministic: the same texts give the same vocabulary in every run. The Rust trainer
    alone is not (huggingface/tokenizers#1794: continuation pieces ``##c`` get ids in
    hash-map order, and ids break ties between equally frequent merges), so every ``##c``
    of the corpus alphabet is registered, in sorted order, before training starts.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    read = (lambda: texts) if isinstance(texts, list) else texts
    normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    alphabet: set[str] = set()
    for text in read():
        alphabet.update(normalizer.normalize_str(text))
    alphabet -= set(" \t\n\r")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [f"##{c}" for c in sorted(alphabet)]

    trainer_backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    trainer_backend.normalizer = normalizer
    trainer_backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=specials + pieces,
        min_frequency=2,
        show_progress=False,
    )
    trainer_backend.train_from_iterator(_batched(read()), trainer=trainer)

    # Rebuild so that only the real special tokens are special; the ##c pieces stay ordinary
    # vocabulary entries.
    tok = _bert_fast(trainer_backend.get_vocab(), normalizer, 512)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return load_tokenizer(out)


def _bert_fast(vocab: dict[str, int], normalizer, max_length: int) -> Any:
    """BERT's WordPiece tokenizer over ``vocab``: ``normalizer``, BERT's pre-tokenizer,
    ``##`` continuation pieces, ``[CLS] A [SEP]`` (pairs ``[CLS] A [SEP] B [SEP]``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(specials)
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )


def make_wordpiece(
    vocab_file: str | Path,
    out_dir: str | Path,
    *,
    lowercase: bool = True,
    chinese: bool = False,
    max_length: int = 512,
) -> Any:
    """A BERT fast-tokenizer folder from a bare WordPiece ``vocab.txt`` (e.g. BERT-Base
    Chinese's 21,128 entries): BERT's normaliser (Han characters split one per token),
    pre-tokenizer and ``[CLS] A [SEP]`` template. ``chinese`` refuses a vocabulary that does
    not cover the common Han characters (where every one would be ``[UNK]``). The folder is
    written whole or not at all."""
    import os
    import shutil
    import tempfile

    from tokenizers import normalizers

    vocab = Path(vocab_file)
    if not vocab.is_file():
        raise FileNotFoundError(f"vocabulary file not found: {vocab}")
    entries = vocab.read_text(encoding="utf-8").splitlines()
    index: dict[str, int] = {}
    for i, token in enumerate(entries):
        index.setdefault(token, i)  # a duplicate line keeps its first id, as BERT's loader
    missing = [t for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]") if t not in index]
    if missing:
        raise ValueError(f"{vocab}: not a BERT WordPiece vocabulary (no {', '.join(missing)})")
    if chinese:
        from retromae_ds.data.segment import HAN

        han = sum(1 for t in entries if len(t) == 1 and HAN.match(t))
        if han < 3000:
            raise ValueError(
                f"{vocab}: only {han} single Han characters (a Chinese BERT vocabulary has "
                "several thousand); Chinese text would be mostly [UNK]"
            )
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        normalizer = normalizers.BertNormalizer(lowercase=lowercase, handle_chinese_chars=True)
        _bert_fast(index, normalizer, max_length).save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_tokenizer(out)


def _batched(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# --------------------------------------------------------------------------- commands
@dataclass(kw_only=True)
class TrainTokenizerConfig:
    """``retromae-ds train-tokenizer``: a WordPiece tokenizer trained on the inputs."""

    inputs: list[str] = flag(positional=True, nargs="+")
    """Files, globs or folders."""
    out: str
    """Tokenizer folder to write."""
    vocab_size: int = 30522
    """WordPiece entries."""
    lowercase: bool = True
    """Lower-case the text (BERT uncased)."""
    text_field: str = "text"
    """Text field of JSON records."""
    title_field: str | None = None
    """Prepended to the text."""
    txt_mode: str = flag("line", choices=("line", "paragraph"))
    """.txt files: a document per line, or per blank-line-separated paragraph."""


@dataclass(kw_only=True)
class MakeTokenizerConfig:
    """``retromae-ds make-tokenizer``: a BERT fast-tokenizer folder from a WordPiece vocab."""

    vocab: str
    """vocab.txt, one token a line."""
    out: str
    """Tokenizer folder to write."""
    lowercase: bool = True
    """Lower-case the text (BERT uncased)."""
    chinese: bool = False
    """Check that the vocabulary covers Han characters (BERT-Base Chinese)."""
    max_length: int = 512
    """Model length including special tokens."""
