"""Fine-tuning pairs in the anchors' formats: one typed record (:class:`Example`, its
:class:`Passage` s), streaming readers (:func:`read_examples`) and atomic writers
(:func:`write_examples`) for sentence-transformers (ST), FlagEmbedding (FE), Tevatron and the
id-level file ``retromae-ds mine`` writes.

**The record.** An :class:`Example` is one query (``query`` text and/or ``query_id``) with its
``positives`` and ``negatives``; each :class:`Passage` has ``text`` and/or a corpus ``id``, an
optional ``title``, ``score`` (FE's ``pos_scores``/``neg_scores``, mine's scores) and ``rank``
(mine's negatives). ``Passage.full_text`` is ``(title + " " + text).strip()``, as the BEIR
loader builds it; the formats holding one string per passage (ST, FE) write it. FE's
``prompt`` and ``type`` are kept. ``Example.where`` (``file:line`` or ``file: row N``) is not
part of equality.

**Formats read** (``format="auto"`` decides from the file kind and the first record):

- ``flagembedding``: jsonl ``{"query": str, "pos": [str], "neg"?: [str], "pos_scores"?:
  [float], "neg_scores"?: [float], "prompt"?: str, "type"?: str}`` (score lists as long as
  their passage lists).
- ``st``: an ST table: ``.jsonl`` (columns in the first object's key order), ``.parquet`` or a
  ``datasets.save_to_disk`` folder (one split). As ST's collator reads it: the label column is
  the first of ``label``, ``labels``, ``score``, ``scores``; of the other columns the first is
  the anchor, the second the positive, any further ones negatives (``negative`` or
  ``negative_1..n``). Also ST's labeled forms: ``(anchor, text, label 1|0)`` and
  ``(anchor, [texts], labels [1|0, ...])`` (or ``scores``, the first text the positive, as
  ``mine_hard_negatives(output_format="labeled-list", output_scores=True)`` writes it); a
  triplet's/n-tuple's ``scores`` column ``[positive, negative_1, ...]`` becomes the scores. A
  repeated anchor is one example with all its rows' positives and negatives (duplicates
  dropped, first seen kept). ``score`` alone (STS-style pairs) is refused: it does not say
  which text is positive.
- ``tevatron``: jsonl ``{"query_id", "query", "positive_passages": [{"docid", "title",
  "text", "score"?}], "negative_passages": [...]}`` (``score``: the teacher score Tevatron's
  ``DistilTrainDataset`` reads); a passage with a ``docid`` and no text is looked up in the
  corpus. Tevatron's id form ``{"query_id", "query_text"?, "positive_document_ids",
  "negative_document_ids"}`` is read too.
- ``mined`` (``retromae-ds mine``'s output), jsonl, one line per query::

      {"query_id": str, "query"?: str,
       "positives": [{"id": str, "score"?: float}],
       "negatives": [{"id": str, "rank"?: int, "score"?: float}]}

  ``rank`` is the negative's 1-based position in the query's retrieved list, ``score`` the
  encoder's similarity; negatives are listed best first. Keys whose value is unknown are left
  out.

**Texts or ids.** ``corpus=`` (a BEIR folder, or its ``corpus.jsonl`` with ``queries.jsonl``
beside it; ``_id``/``docid``, ``title``, ``text``) resolves passage ids, and query ids when a
queries file is there; without a corpus an id-only passage stays ``Passage(id=...)``.
``by_id=True`` reads FE's and ST's strings as ids (query ids and passage ids). The
:class:`Corpus` keeps one byte offset per id (about 100 bytes of memory each), never the texts.

**Errors.** Bad input raises ``ValueError`` (``InputError``) in one line naming the file, the
line (``path:N``; ``path: row N`` for parquet and ``datasets`` folders, both 1-based) and the
field: a missing field, a wrong type, an unknown corpus id, an empty query or passage, a query
with no positive, score lists of the wrong length. An unrecognisable file is one line naming
it and the known formats.

**Memory.** Readers stream: jsonl line by line, parquet in record batches, ``datasets``
folders memory-mapped. ST tables take two passes: the first hashes each anchor (16 bytes a
row, in numpy), the second yields an example as soon as its last row is read, holding only the
rows of anchors whose repeats are still ahead (none for a table sorted by anchor).

**Formats written** (``write_examples(examples, path, format)``; ST formats as ``.parquet``
when the path ends so, jsonl otherwise; one temporary file in the same folder, fsynced and
renamed: an interrupted write leaves no file at ``path`` and an older one there intact):

- ``st-triplet``: ``anchor, positive, negative``, one row per (positive, negative) pair,
  ``scores: [pos, neg]`` with ``scores=True`` (ST ``output_format="triplet"``).
- ``st-ntuple``: ``anchor, positive, negative_1..negative_n``, one row per positive; ``n`` is
  ``num_negatives`` or the first example's count; an example with fewer is skipped, with more
  keeps its first ``n`` (ST ``"n-tuple"``; ``scores: [pos, neg_1, ...]``).
- ``st-labeled-pair``: ``anchor, positive, label``: each positive (label 1) then each negative
  (label 0); ``score`` instead of ``label`` with ``scores=True`` (ST ``"labeled-pair"``).
- ``st-labeled-list``: ``anchor, positive, labels``: per positive, ``positive`` is the list
  ``[that positive, negatives...]`` and ``labels`` ``[1, 0, ...]`` (``scores`` with
  ``scores=True``) (ST ``"labeled-list"``, for cross-encoder listwise losses).
- ``flagembedding``: FE jsonl; ``pos_scores``/``neg_scores`` when every passage of the example
  has a score (``scores=None``), always (``True``, a missing score is an error) or never.
- ``tevatron``: Tevatron jsonl with texts (``docid``/``query_id`` ``""`` where unknown).
- ``mined``: the id-level format above.

ST triplet/n-tuple/labeled-list skip an example without negatives, as ST does; the returned
counts say how many (``skipped``) and how many were cut (``truncated``). What each loses:
ST and FE lose ids, ranks and titles (joined into the text); ST loses scores unless
``scores=True``; Tevatron loses scores and ranks; ``mined`` loses texts (ids only; read back
with ``corpus=``); only FE keeps ``prompt``/``type``.

**Modules.** This module is the front door and re-exports the public names: the records, the
format names, the field checks and :class:`Corpus` are in :mod:`retromae_ds.data.pairs_records`,
the readers in :mod:`retromae_ds.data.pairs_read`, the writers in
:mod:`retromae_ds.data.pairs_write` (both import the records, never each other).
"""

# ``name as name``: an explicit re-export, the public names of the split modules.
from retromae_ds.data.pairs_read import read_examples as read_examples
from retromae_ds.data.pairs_records import KNOWN as KNOWN
from retromae_ds.data.pairs_records import LABEL_COLUMNS as LABEL_COLUMNS
from retromae_ds.data.pairs_records import READ_FORMATS as READ_FORMATS
from retromae_ds.data.pairs_records import WRITE_FORMATS as WRITE_FORMATS
from retromae_ds.data.pairs_records import Corpus as Corpus
from retromae_ds.data.pairs_records import Example as Example
from retromae_ds.data.pairs_records import Passage as Passage
from retromae_ds.data.pairs_write import write_examples as write_examples
