"""Word segmentation for whole-word masking of text without spaces (Chinese).

A BERT tokenizer splits Han text into single characters, so the word starts read off the
tokenizer make every character a "word" and whole-word masking degenerates into character
masking (the reason chinese-bert-wwm exists). With a segmenter, a token starts a word only
where the tokenizer says so *and* its first character does not lie inside a segmenter word
that contains a Han character. So:

- a Chinese word of the segmenter is one masking unit (e.g. 飞行器 = 飞 行 器);
- Latin words and numbers keep the tokenizer's boundaries (WordPiece ``##`` pieces, BPE
  words), inside Chinese text too;
- a segmenter word that mixes scripts (T恤) is one unit as well.

``jieba`` (MIT, pure Python, ships its dictionary) is the segmenter, an optional extra
(``pip install 'retromae-ds[chinese]'``). Its identity (version, dictionary hash, HMM) goes
into the preprocessing plan and the manifest: another dictionary is another dataset.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEGMENTERS = ("none", "jieba", "auto")
HAN = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")
"""Han characters: CJK Unified Ideographs (with extensions A-F) and compatibility ones."""
_HAN_BYTES = re.compile(
    rb"[\xe4-\xe9][\x80-\xbf][\x80-\xbf]"  # UTF-8 of U+4000..U+9FFF
    rb"|\xe3[\x90-\xbf][\x80-\xbf]"  # U+3400..U+3FFF
    rb"|\\u[3-9][0-9a-fA-F]{3}"  # JSON's \uXXXX escapes of the same range
)
EXTRA = "chinese"
"""The pyproject extra that installs the segmenter."""


@dataclass(frozen=True)
class SegmenterSpec:
    """Which segmenter a worker builds: picklable, and what the plan records."""

    name: str = "jieba"
    dictionary: str | None = None
    """A jieba main dictionary file replacing the shipped one (None: jieba's ``dict.txt``)."""
    hmm: bool = True
    """jieba's HMM for words missing from the dictionary."""


def _import_jieba():
    try:
        import jieba
    except ImportError as exc:
        raise ImportError(
            f"--segmenter jieba needs the jieba package: pip install 'retromae-ds[{EXTRA}]' "
            "(or pip install jieba)"
        ) from exc
    jieba.setLogLevel(logging.WARNING)
    return jieba


def dictionary_path(spec: SegmenterSpec) -> Path:
    if spec.dictionary is not None:
        path = Path(spec.dictionary)
        if not path.is_file():
            raise FileNotFoundError(f"segmenter dictionary not found: {path}")
        return path
    jieba = _import_jieba()
    return Path(jieba.__file__).parent / "dict.txt"


def identity(spec: SegmenterSpec) -> dict[str, Any]:
    """What makes two segmentations equal: name, version, dictionary hash, HMM."""
    jieba = _import_jieba()
    path = dictionary_path(spec)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {
        **asdict(spec),
        "dictionary": str(path) if spec.dictionary else "jieba/dict.txt",
        "version": jieba.__version__,
        "dictionary_sha256": digest,
    }


def inputs_have_han(paths: list[str]) -> bool:
    """Whether any input file holds a Han character (raw UTF-8, or a JSON ``\\uXXXX``
    escape); ``--segmenter auto`` segments only then."""
    for path in paths:
        files = [Path(path)] if os.path.isfile(path) else sorted(Path(path).rglob("*"))
        for file in files:
            if not file.is_file() or file.stat().st_size == 0:
                continue
            with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if _HAN_BYTES.search(m):
                    return True
    return False


def resolve(name: str, paths: list[str], dictionary: str | None = None, hmm: bool = True):
    """The segmenter a preprocessing run uses: None, or its spec (``auto``: jieba when the
    inputs hold Han text)."""
    if name not in SEGMENTERS:
        raise ValueError(f"segmenter must be one of {SEGMENTERS}, not {name!r}")
    if name == "none" or (name == "auto" and not inputs_have_han(paths)):
        if dictionary is not None:
            raise ValueError("--segmenter_dict given, but no segmenter is used")
        return None
    spec = SegmenterSpec("jieba", dictionary, hmm)
    dictionary_path(spec)  # a missing file or package fails here, before any work
    return spec


class Segmenter:
    """A built segmenter (one per worker process)."""

    def __init__(self, spec: SegmenterSpec) -> None:
        jieba = _import_jieba()
        self.spec = spec
        self._tk = jieba.Tokenizer(str(dictionary_path(spec)))
        self._tk.initialize()

    def words(self, text: str) -> list[tuple[str, int, int]]:
        """(word, start, end) character spans covering ``text``."""
        return list(self._tk.tokenize(text, HMM=self.spec.hmm))

    def inside_words(self, text: str) -> np.ndarray:
        """bool [len(text)]: characters inside, and not first of, a word with a Han
        character; a token starting at such a character continues the word before it."""
        inside = np.zeros(len(text), dtype=bool)
        for word, start, end in self.words(text):
            if end - start > 1 and HAN.search(word):
                inside[start + 1 : end] = True
        return inside


def apply(segmenter: Segmenter, backend, texts: list[str], starts, offsets) -> None:
    """Clear, in place, the word-start flags of tokens that continue a segmenter word.

    ``starts``/``offsets`` are ``TokenizedDocs``' flags and document offsets of ``texts``
    tokenized by ``backend`` without special tokens. Only documents with Han text are
    segmented (and re-encoded for their character offsets)."""
    han = [i for i, text in enumerate(texts) if HAN.search(text)]
    if not han:
        return
    encodings = backend.encode_batch([texts[i] for i in han], add_special_tokens=False)
    for doc, enc in zip(han, encodings, strict=True):
        begin, end = int(offsets[doc]), int(offsets[doc + 1])
        if len(enc.ids) != end - begin:
            raise RuntimeError("tokenizer gave different token counts for the same text")
        if end == begin:
            continue
        inside = segmenter.inside_words(texts[doc])
        first_char = np.fromiter((o[0] for o in enc.offsets), dtype=np.int64, count=end - begin)
        first_char = np.minimum(first_char, max(len(inside) - 1, 0))
        flags = starts[begin:end]
        flags[inside[first_char]] = 0
        flags[0] = 1
