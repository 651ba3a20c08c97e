"""Batch collation for pre-training: whole-word MLM masking and the decoder's inputs.

Vectorised numpy over the whole batch (no per-token Python loops), and a pure function of
(run seed, epoch, global sample index, sample content): the same sample is masked the same way
whatever the DataLoader worker count, and a resumed run re-creates the batches it would have
seen. Set ``collator.epoch`` before creating each epoch's DataLoader iterator.

Encoder input, per row: ``[CLS] tokens [SEP] [PAD]...``. Exactly ``round(ratio × words)``
whole words are chosen (the words with the smallest per-row hash keys: a uniformly random
subset), and each of their tokens becomes [MASK] (80 %), a random non-special token (10 %) or
stays (10 %). Special tokens (including an [UNK] inside the text) are recognised by id and are never
masked, counted as words, or reconstruction targets.

Decoder (RetroMAE): ``original_ids`` (unmasked input, for the key/value stream),
``decoder_labels`` (every real token except specials), and what the attention needs to
*compute* position-specific visibility: ``word_ids`` (CLS 0, words 1.., SEP its own word,
padding -1), ``lengths`` and a per-row ``decoder_seed``. The B×L×L mask itself is built only by
the reference attention path (``retromae_ds.attention.rules.two_stream_visible_dense``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from retromae_ds.base.hashing import MASK32, hash3, row_seeds, threshold
from retromae_ds.base.special_tokens import IGNORE, SpecialIds

STREAM_WORDS, STREAM_REPLACE, STREAM_RANDOM, STREAM_DECODER = 1, 2, 3, 4


@dataclass(kw_only=True)
class MaskingConfig:
    """Masking ratios of the pre-training objectives."""

    encoder_ratio: float = 0.3
    """Share of whole words masked in the encoder input (RetroMAE 0.3; BERT-style MLM 0.15)."""
    replace_mask: float = 0.8
    """Of the masked tokens: share replaced by [MASK]."""
    replace_random: float = 0.1
    """Of the masked tokens: share replaced by a random token (the rest stay unchanged)."""

    def __post_init__(self) -> None:
        for name in ("encoder_ratio", "replace_mask", "replace_random"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"masking.{name} must be in [0, 1], got {value}")
        if self.replace_mask + self.replace_random > 1.0:
            raise ValueError("masking.replace_mask + masking.replace_random must be <= 1")


class IndexedSamples(torch.utils.data.Dataset):
    """Wraps a ShardDataset so that items carry their global index (the collator's seed)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        sample = self.dataset[index]
        return index, sample.input_ids, sample.word_starts


class PretrainCollator:
    """Collate ``(index, input_ids, word_starts)`` items into model inputs (see module doc).

    ``pack``: lay the batch's documents end to end in as few rows of ``max_length`` as
    first-fit decreasing finds (``PackedLayout``), instead of one padded row each. Every
    document is masked exactly as unpacked (the draws depend on its index and its own
    positions); ``doc_ids`` and ``position_ids`` (R×L) say where each one lies, and the
    model keeps them apart (``retromae_ds.attention.packing``). Per-document tensors
    (``sample_index``, ``lengths``, ``decoder_seed``) keep the batch's order."""

    def __init__(
        self,
        special: SpecialIds,
        masking: MaskingConfig,
        max_length: int,
        *,
        seed: int = 0,
        decoder: bool = True,
        pad_to_multiple_of: int = 8,
        pack: bool = False,
    ) -> None:
        self.special, self.masking, self.max_length = special, masking, max_length
        self.seed, self.decoder, self.pad_to_multiple_of = seed, decoder, pad_to_multiple_of
        self.pack = pack
        self.epoch = 0
        self._special_ids = np.asarray(special.all, dtype=np.int64)
        is_special = np.zeros(special.vocab_size, dtype=bool)
        is_special[list(special.all)] = True
        self._replacements = np.flatnonzero(~is_special).astype(np.int64)

    def __call__(self, items: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        t = self._token_layout(items)
        special_token = np.isin(t.content_ids, self._special_ids)
        masked_content = self._choose_words(t, special_token)
        input_ids, labels = self._replace(t, masked_content)
        ids, word_ids = t.ids, t.word_ids
        attention_mask = (np.arange(t.L)[None, :] < t.lengths[:, None]).astype(np.int64)
        if self.decoder:
            decoder_labels = np.full((t.B, t.L), IGNORE, dtype=np.int64)
            decoder_labels[t.rows, t.cols] = np.where(special_token, IGNORE, t.content_ids)
        if self.pack:
            # the same rows, masked the same way, laid end to end (see the class doc)
            layout = PackedLayout.first_fit(t.lengths, self.max_length, self.pad_to_multiple_of)
            input_ids = layout.scatter(input_ids, self.special.pad)
            labels = layout.scatter(labels, IGNORE)
            attention_mask = layout.scatter(attention_mask, 0)
            if self.decoder:
                ids = layout.scatter(ids, self.special.pad)
                decoder_labels = layout.scatter(decoder_labels, IGNORE)
                word_ids = layout.scatter(word_ids, -1)
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
            # where the labels are, flat (b * L + i, row-major): the model gathers the
            # predicted positions with them, so their number is known on the host and a GPU
            # never waits for a boolean mask's nonzero
            "label_positions": torch.from_numpy(np.flatnonzero(labels.ravel() != IGNORE)),
            "sample_index": torch.from_numpy(t.indices),
        }
        if self.pack:
            batch.update(
                doc_ids=torch.from_numpy(layout.doc_ids),
                position_ids=torch.from_numpy(layout.position_ids),
            )
        if self.decoder:
            positions = np.flatnonzero(decoder_labels.ravel() != IGNORE)
            batch.update(
                original_ids=torch.from_numpy(ids),
                decoder_labels=torch.from_numpy(decoder_labels),
                decoder_label_positions=torch.from_numpy(positions),
                word_ids=torch.from_numpy(word_ids),
                lengths=torch.from_numpy(t.lengths),
                decoder_seed=torch.from_numpy(
                    row_seeds(self.seed, self.epoch, t.indices, STREAM_DECODER) & MASK32
                ),
            )
        return batch

    def _token_layout(self, items: list[tuple[int, np.ndarray, np.ndarray]]) -> _TokenLayout:
        """The batch's rows ``[CLS] tokens [SEP]`` padded to a multiple, and each token's word
        (``_TokenLayout``)."""
        sp = self.special
        indices = np.fromiter((it[0] for it in items), dtype=np.int64, count=len(items))
        n = np.fromiter((len(it[1]) for it in items), dtype=np.int64, count=len(items))
        if len(items) == 0:
            raise ValueError("empty batch")
        if n.max() + 2 > self.max_length:
            raise ValueError(
                f"a sample of {int(n.max())} tokens does not fit max_length {self.max_length} with [CLS]/[SEP]"
            )
        B = len(items)
        lengths = n + 2
        L = int(lengths.max())
        L = min(-(-L // self.pad_to_multiple_of) * self.pad_to_multiple_of, self.max_length)
        content_ids = np.concatenate([it[1] for it in items]).astype(np.int64)
        content_ws = np.concatenate([it[2] for it in items]).astype(np.int64)

        rows = np.repeat(np.arange(B), n)
        starts = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(n, out=starts[1:])
        cols = np.arange(len(content_ids)) - starts[rows] + 1
        content_ws[starts[:-1][n > 0]] = 1  # a chunk's first token starts a word for masking

        ids = np.full((B, L), sp.pad, dtype=np.int64)
        ids[:, 0] = sp.cls
        ids[rows, cols] = content_ids
        ids[np.arange(B), n + 1] = sp.sep
        # word ids: CLS 0, content words 1..W_b, SEP W_b + 1, padding -1
        words_per_row = np.bincount(rows, weights=content_ws, minlength=B).astype(np.int64)
        token_word = np.cumsum(content_ws) - np.repeat(np.cumsum(words_per_row) - words_per_row, n)
        word_ids = np.full((B, L), -1, dtype=np.int64)
        word_ids[:, 0] = 0
        word_ids[rows, cols] = token_word
        word_ids[np.arange(B), n + 1] = words_per_row + 1
        return _TokenLayout(
            indices, B, L, n, lengths, content_ids, rows, cols, ids, word_ids, words_per_row,
            token_word,
        )  # fmt: skip

    def _choose_words(self, t: _TokenLayout, special_token: np.ndarray) -> np.ndarray:
        """Per content token, whether its word is masked in the encoder's input: exactly
        round(ratio × candidate words) whole words per row, chosen by hash keys. Words
        holding a special id (an [UNK] inside the text) are never candidates."""
        B = t.B
        seeds_words = row_seeds(self.seed, self.epoch, t.indices, STREAM_WORDS)
        word_row = np.repeat(np.arange(B), t.words_per_row)
        word_first = np.cumsum(t.words_per_row) - t.words_per_row
        word_num = np.arange(len(word_row)) - word_first[word_row] + 1  # 1..W_b
        token_flat_word = word_first[t.rows] + t.token_word - 1
        candidate = np.bincount(token_flat_word[special_token], minlength=len(word_row)) == 0
        keys = np.where(candidate, hash3(seeds_words[word_row], word_num, np.int64(0)), 2**33)
        order = np.lexsort((word_num, keys, word_row))  # by row, then key (ties: word number)
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order)) - word_first[word_row[order]]
        candidates_per_row = np.bincount(word_row[candidate], minlength=B)
        k_row = np.floor(self.masking.encoder_ratio * candidates_per_row + 0.5).astype(np.int64)
        chosen_word = (rank < k_row[word_row]) & candidate
        return chosen_word[token_flat_word]

    def _replace(
        self, t: _TokenLayout, masked_content: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(the encoder's input ids, its MLM labels): each masked token becomes [MASK], a
        random token or itself, by hash (BERT's 80/10/10 by default)."""
        cfg, sp = self.masking, self.special
        labels = np.full((t.B, t.L), IGNORE, dtype=np.int64)
        m_rows, m_cols = t.rows[masked_content], t.cols[masked_content]
        labels[m_rows, m_cols] = t.content_ids[masked_content]
        u = hash3(
            row_seeds(self.seed, self.epoch, t.indices, STREAM_REPLACE)[m_rows], m_cols, np.int64(1)
        )
        to_mask = u < threshold(cfg.replace_mask)
        to_random = ~to_mask & (u < threshold(cfg.replace_mask + cfg.replace_random))
        input_ids = t.ids.copy()
        input_ids[m_rows[to_mask], m_cols[to_mask]] = sp.mask
        r = hash3(
            row_seeds(self.seed, self.epoch, t.indices, STREAM_RANDOM)[m_rows[to_random]],
            m_cols[to_random],
            np.int64(2),
        )
        input_ids[m_rows[to_random], m_cols[to_random]] = self._replacements[
            r % len(self._replacements)
        ]
        return input_ids, labels


@dataclass(frozen=True)
class _TokenLayout:
    """One batch laid out: row b is ``[CLS] tokens [SEP]`` padded to ``L``; the content
    tokens flat (``content_ids``) at ``(rows, cols)``; each token's word number."""

    indices: np.ndarray  # [B] sample indices
    B: int
    L: int
    n: np.ndarray  # [B] content tokens per row
    lengths: np.ndarray  # [B] n + 2
    content_ids: np.ndarray  # [N] every row's tokens, flat
    rows: np.ndarray  # [N] the row of each
    cols: np.ndarray  # [N] its column (1..n_b)
    ids: np.ndarray  # [B, L] the original ids
    word_ids: np.ndarray  # [B, L] CLS 0, words 1..W_b, SEP W_b + 1, padding -1
    words_per_row: np.ndarray  # [B] W_b
    token_word: np.ndarray  # [N] each token's word number (1..W_b)


@dataclass(frozen=True)
class PackedLayout:
    """Where each document of a batch lies in the packed rows: row ``rows[d]``, starting at
    position ``offsets[d]``, ``lengths[d]`` positions ([CLS] .. [SEP])."""

    rows: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def first_fit(cls, lengths: np.ndarray, capacity: int, multiple: int) -> PackedLayout:
        """First-fit decreasing: documents longest first (ties: batch order), each into the
        first row with room, a new row when none has. Row length: the fullest row's, rounded
        up to ``multiple`` (at most ``capacity``)."""
        order = np.lexsort((np.arange(len(lengths)), -lengths))
        rows, offsets = np.empty_like(lengths), np.empty_like(lengths)
        fill: list[int] = []
        for d in order.tolist():
            n = int(lengths[d])
            r = next((r for r, used in enumerate(fill) if used + n <= capacity), len(fill))
            if r == len(fill):
                fill.append(0)
            rows[d], offsets[d] = r, fill[r]
            fill[r] += n
        width = min(-(-max(fill) // multiple) * multiple, capacity)
        return cls(rows, offsets, lengths, (len(fill), width))

    @functools.cached_property
    def _where(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document, position inside it, flat packed index) of every real position; computed
        once per batch and shared by every packed tensor."""
        docs = np.repeat(np.arange(len(self.lengths)), self.lengths)
        starts = np.cumsum(self.lengths) - self.lengths
        inside = np.arange(len(docs)) - starts[docs]
        flat = self.rows[docs] * self.shape[1] + self.offsets[docs] + inside
        return docs, inside, flat

    def scatter(self, per_document: np.ndarray, fill: int) -> np.ndarray:
        """A B×L per-document array (each document in its own row from position 0) packed."""
        docs, inside, flat = self._where
        out = np.full(self.shape[0] * self.shape[1], fill, dtype=per_document.dtype)
        out[flat] = per_document[docs, inside]
        return out.reshape(self.shape)

    @property
    def doc_ids(self) -> np.ndarray:
        """R×L: each position's document (-1: padding)."""
        docs, _, flat = self._where
        out = np.full(self.shape[0] * self.shape[1], -1, dtype=np.int64)
        out[flat] = docs
        return out.reshape(self.shape)

    @property
    def position_ids(self) -> np.ndarray:
        """R×L: each position's offset from its document's [CLS] (0: padding)."""
        _, inside, flat = self._where
        out = np.zeros(self.shape[0] * self.shape[1], dtype=np.int64)
        out[flat] = inside
        return out.reshape(self.shape)
