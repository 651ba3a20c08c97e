"""Documents → shard rows: tokenization with word-start flags, chunking and packing (was
``data/tokenize.py``, a name it shared with the standard library's ``tokenize``).

Pure functions of (tokenizer, documents, limits); no I/O. The preprocessing tool calls these
in worker processes.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from retromae_ds.data import schema


@dataclass
class TokenizedDocs:
    """Documents tokenized back to back: doc d owns ``ids[offsets[d]:offsets[d+1]]``."""

    ids: np.ndarray  # int32 [T]
    word_starts: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [D+1]


def make_backend(backend_json: str):
    """A Rust tokenizer that treats special-token strings in raw text as plain text, so a
    document containing the literal text "[SEP]" cannot inject a separator id."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(backend_json)
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = True
    return backend


def continuation_mask(backend) -> np.ndarray | None:
    """bool [vocab]: which ids are WordPiece continuation pieces ("##..."), when that alone
    decides word starts: a WordPiece model behind BERT's pre-tokenizer (which splits off every
    "#", so no word can begin with the prefix, and every later piece of a word carries it).
    None for any other tokenizer, whose word starts must come from its word ids."""
    from tokenizers import models, pre_tokenizers

    if not (
        isinstance(backend.model, models.WordPiece)
        and isinstance(backend.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
    ):
        return None
    prefix = backend.model.continuing_subword_prefix
    vocab = backend.get_vocab(with_added_tokens=True)
    mask = np.zeros(max(vocab.values()) + 1, dtype=bool)
    mask[[i for t, i in vocab.items() if t.startswith(prefix)]] = True
    return mask


PIECE_CHARS = 1 << 17
"""Texts longer than this many characters are tokenized in pieces (``split_long_texts``):
the tokenizers library holds ~65-115 bytes per character of a text it encodes (offsets,
alignments, token strings), so one 8.5 MB record peaked at over 1 GB."""
BATCH_CHARS = 1 << 18
"""Characters per ``encode_batch`` call (besides ``batch_size`` texts): bounds the tokenizer's
memory for any mix of document lengths."""


def split_long_texts(
    texts: list[str], piece_chars: int = PIECE_CHARS
) -> tuple[list[str], np.ndarray]:
    """(pieces, owner): every text of more than ``piece_chars`` characters cut into pieces of
    at most that many, each cut just before a space that precedes a non-space character
    (else before any such whitespace; else, in a window without whitespace, where the limit
    falls), so every piece but the first starts with one whitespace character and a word. Cut
    there, WordPiece behind BERT's pre-tokenizer and byte-level BPE give the same tokens as
    for the whole text. ``owner[k]`` is the index of the text piece ``k`` came from
    (non-decreasing; an empty text is one empty piece)."""
    pieces: list[str] = []
    owner: list[int] = []
    for doc, text in enumerate(texts):
        begin = 0
        while len(text) - begin > piece_chars:
            end = _cut(text, begin, piece_chars)
            pieces.append(text[begin:end])
            owner.append(doc)
            begin = end
        pieces.append(text[begin:])
        owner.append(doc)
    return pieces, np.asarray(owner, dtype=np.int64)


_SPACE_BEFORE_WORD = re.compile(r"\s(?=\S)")


def _cut(text: str, begin: int, limit: int) -> int:
    """Where the piece of ``text`` starting at ``begin`` ends (see ``split_long_texts``): in
    the second half of its window, the last space followed by a non-space, else the last
    whitespace followed by one, else the window's end."""
    end, low = begin + limit, begin + limit // 2
    at = text.rfind(" ", low, end)
    while at != -1 and text[at + 1].isspace():
        at = text.rfind(" ", low, at)
    if at != -1:
        return at
    matches = list(_SPACE_BEFORE_WORD.finditer(text, low, end))
    return matches[-1].start() if matches else end


def tokenize_documents(
    backend,
    texts: list[str],
    batch_size: int = 1024,
    continuation: np.ndarray | None | str = "auto",
    segmenter=None,
    piece_chars: int = PIECE_CHARS,
) -> TokenizedDocs:
    """Tokenize without special tokens. Word starts come from the encodings' word ids, or,
    for WordPiece behind BERT's pre-tokenizer, from the ids themselves (the same flags, twice
    as fast; ``continuation`` is ``continuation_mask(backend)``, computed when "auto").
    With a ``segment.Segmenter``, tokens continuing a segmenter word (Chinese) are no word
    starts. A text longer than ``piece_chars`` is tokenized in pieces (``split_long_texts``)
    and ``batch_size`` texts or ``BATCH_CHARS`` characters at a time, so the memory is
    bounded whatever a record's length."""
    pieces, owner = split_long_texts(texts, piece_chars)
    docs = _tokenize(backend, pieces, batch_size, continuation)
    if segmenter is not None:
        from retromae_ds.data import segment

        segment.apply(segmenter, backend, pieces, docs.word_starts, docs.offsets)
    if len(pieces) != len(texts):  # the documents' offsets: those of their first pieces
        first_piece = np.searchsorted(owner, np.arange(len(texts) + 1), side="left")
        docs = TokenizedDocs(docs.ids, docs.word_starts, docs.offsets[first_piece])
    return docs


def _batches(texts: list[str], batch_size: int) -> Iterator[tuple[int, int]]:
    """[begin, end) ranges of at most ``batch_size`` texts and, unless one text alone is
    longer, ``BATCH_CHARS`` characters."""
    begin = 0
    while begin < len(texts):
        end, chars = begin, 0
        while end < len(texts) and end - begin < batch_size:
            chars += len(texts[end])
            if chars > BATCH_CHARS and end > begin:
                break
            end += 1
        yield begin, end
        begin = end


def _tokenize(backend, texts, batch_size, continuation) -> TokenizedDocs:
    mask = continuation_mask(backend) if isinstance(continuation, str) else continuation
    if mask is not None:
        return _tokenize_wordpiece(backend, texts, batch_size, mask)
    # ids and word starts become arrays batch by batch: Python lists of them would hold
    # ~40 bytes a token for the whole unit
    ids_parts: list[np.ndarray] = []
    starts_parts: list[np.ndarray] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for begin, end in _batches(texts, batch_size):
        encodings = backend.encode_batch(texts[begin:end], add_special_tokens=False)
        id_lists = [enc.ids for enc in encodings]
        word_lists = [enc.word_ids for enc in encodings]
        n = lengths[begin:end] = np.fromiter(map(len, id_lists), dtype=np.int64, count=end - begin)
        total = int(n.sum())
        ids_parts.append(
            np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=total)
        )
        try:
            words = np.fromiter(itertools.chain.from_iterable(word_lists), np.int64, count=total)
        except TypeError:  # a token outside any word (word id None): make it its own word
            flat = itertools.chain.from_iterable(word_lists)
            words = np.array([-1 if w is None else w for w in flat], dtype=np.int64)
        starts = np.ones(total, dtype=np.uint8)
        if total > 1:
            starts[1:] = words[1:] != words[:-1]
        starts[words < 0] = 1
        firsts = np.cumsum(n) - n
        starts[firsts[n > 0]] = 1  # each text's first token
        starts_parts.append(starts)
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.concatenate([np.zeros(0, np.int32), *ids_parts])
    starts = np.concatenate([np.zeros(0, np.uint8), *starts_parts])
    return TokenizedDocs(ids, starts, offsets)


def _tokenize_wordpiece(
    backend, texts: list[str], batch_size: int, continuation: np.ndarray
) -> TokenizedDocs:
    """Fast path: ``encode_batch_fast`` (no offsets, no word ids) and word starts read off
    the ids; equal to the word-id path for WordPiece behind BERT's pre-tokenizer."""
    ids_parts: list[np.ndarray] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for begin, end in _batches(texts, batch_size):
        encodings = backend.encode_batch_fast(texts[begin:end], add_special_tokens=False)
        id_lists = [enc.ids for enc in encodings]
        n = lengths[begin:end] = np.fromiter(map(len, id_lists), dtype=np.int64, count=end - begin)
        ids_parts.append(
            np.fromiter(itertools.chain.from_iterable(id_lists), np.int32, count=int(n.sum()))
        )
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.concatenate([np.zeros(0, np.int32), *ids_parts])
    starts = (~continuation[ids]).view(np.uint8)
    starts[offsets[:-1][lengths > 0]] = 1
    return TokenizedDocs(ids, starts, offsets)


def chunk_cuts(word_starts: np.ndarray, offsets: np.ndarray, limit: int) -> np.ndarray:
    """Row boundaries over the concatenated tokens: each document is split into consecutive
    chunks of at most ``limit`` tokens, cutting before a word start where one lies within the
    window so that words stay whole; empty documents produce no row. Returns sorted cut points
    (the first is 0, the last is the total token count)."""
    if limit < 1:
        raise ValueError(f"chunk limit must be >= 1, got {limit}")
    lengths = np.diff(offsets)
    cuts = [offsets[:-1][lengths > 0]]
    for doc in np.flatnonzero(lengths > limit):
        begin, end = int(offsets[doc]), int(offsets[doc + 1])
        # an array, not a list: a list holds ~36 bytes a word of a document of any length
        starts = np.flatnonzero(word_starts[begin:end]) + begin
        extra = []
        pos = begin
        while end - pos > limit:
            # the last word start in (pos, pos + limit]
            k = int(np.searchsorted(starts, pos + limit, side="right")) - 1
            cut = int(starts[k]) if k >= 0 and starts[k] > pos else pos + limit
            extra.append(cut)
            pos = cut
        cuts.append(np.asarray(extra, dtype=np.int64))
    cuts.append(np.asarray([offsets[-1]], dtype=np.int64))
    return np.unique(np.concatenate(cuts).astype(np.int64))


def pack_rows(row_lengths: np.ndarray, limit: int) -> np.ndarray:
    """Greedy packing of consecutive rows into samples of at most ``limit`` tokens.
    Returns the pack id of every row (non-decreasing, from 0)."""
    pack_ids = np.empty(len(row_lengths), dtype=np.int32)
    pack, used = 0, 0
    for i, n in enumerate(row_lengths.tolist()):
        if used and used + n > limit:
            pack, used = pack + 1, 0
        pack_ids[i] = pack
        used += n
    return pack_ids


def _arrow(values: np.ndarray, type_: pa.DataType, dtype) -> pa.Array:
    """Arrow view of a numpy array. Unlike ``pa.array`` this never makes pyarrow import
    pandas, which costs every fresh worker process ~0.2 s."""
    values = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


def _string_array(strings: list[str]) -> pa.Array:
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("document ids of one shard exceed 2 GiB")
    data = pa.py_buffer(b"".join(encoded))
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets.astype(np.int32)), data]
    )


def build_batch(
    docs: TokenizedDocs, doc_ids: list[str], limit: int, pack: bool
) -> tuple[pa.RecordBatch, dict[str, int]]:
    """One record batch of shard rows for these documents, and its counts."""
    cuts = chunk_cuts(docs.word_starts, docs.offsets, limit)
    row_lengths = np.diff(cuts)
    row_starts = cuts[:-1]
    if len(row_starts):
        row_doc = np.searchsorted(docs.offsets, row_starts, side="right") - 1
        first_row_of_doc = np.searchsorted(row_starts, docs.offsets[row_doc], side="left")
        chunk_index = (np.arange(len(row_starts)) - first_row_of_doc).astype(np.int32)
    else:
        row_doc = np.zeros(0, dtype=np.int64)
        chunk_index = np.zeros(0, dtype=np.int32)
    if int(cuts[-1]) >= 2**31:
        raise ValueError("shard holds 2**31 tokens or more; lower the shard size")
    list_offsets = _arrow(cuts, pa.int32(), np.int32)
    pack_ids = (
        pack_rows(row_lengths, limit) if pack else np.arange(len(row_lengths), dtype=np.int32)
    )
    ids_list = _string_array(doc_ids).take(_arrow(row_doc, pa.int64(), np.int64))
    batch = pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(list_offsets, _arrow(docs.ids, pa.int32(), np.int32)),
            pa.ListArray.from_arrays(list_offsets, _arrow(docs.word_starts, pa.uint8(), np.uint8)),
            ids_list,
            _arrow(chunk_index, pa.int32(), np.int32),
            _arrow(pack_ids, pa.int32(), np.int32),
        ],
        schema=schema.SHARD_SCHEMA,
    )
    lengths = np.diff(docs.offsets)
    counts = {
        "documents": int(len(lengths)),
        "empty_documents": int((lengths == 0).sum()),
        "rows": int(len(row_lengths)),
        "packs": int(pack_ids[-1]) + 1 if len(pack_ids) else 0,
        "tokens": int(cuts[-1]),
    }
    return batch, counts
