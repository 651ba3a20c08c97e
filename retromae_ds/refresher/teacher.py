"""The online teacher (``--distill.teacher CE``): a cross-encoder that scores every negatives
version as it is published, so every negative a distilling trainer draws has a teacher score.

``OnlineTeacher`` loads the cross-encoder (``retrieval.cross_encoder``) and the texts of the
training queries and passages once (from the BEIR folder the run tokenized: the CE reads the
texts with its own tokenizer, which need not be the student's), then ``scores(negatives)``
scores, per training query, its positives and each of its negatives in the version: the
``handoff.Scores`` that ``handoff.publish`` writes beside the negatives. BM25's first version
(the trainer's), a pairs file's first version and each refresher version go through it
(``publish.mine_and_publish``, ``given.publish_given``), and their manifests record the
teacher, the pairs scored and the pairs per second (``teacher``; ``timings.teacher_s``).

Memory: the texts of the corpus (about its size in UTF-8 strings); the refresher holds them
for as long as it runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.data import TrainingSet


class OnlineTeacher:
    """A cross-encoder and the run's texts: ``scores(negatives) -> handoff.Scores``."""

    def __init__(
        self,
        folder: str | Path,
        ts: TrainingSet,
        *,
        device: str = "auto",
        batch_size: int = 64,
        max_length: int | None = None,
        bf16: bool = False,
    ) -> None:
        from retromae_ds.retrieval.beir import load_corpus, load_queries
        from retromae_ds.retrieval.cross_encoder import CrossEncoderScorer

        self.scorer = CrossEncoderScorer.from_dir(
            folder, device=device, max_length=max_length, batch_size=batch_size, bf16=bf16
        )
        ready = json.loads((ts.corpus.folder.parent / ance_data.READY).read_text())
        beir = Path(ready["beir"])
        doc_ids, texts = load_corpus(beir / "corpus.jsonl")
        text_of = dict(zip(doc_ids, texts, strict=True))
        self.passages = [text_of[d] for d in ts.passage_ids.to_pylist()]
        queries = load_queries(beir / "queries.jsonl")
        self.queries = [queries[q] for q in ts.query_ids]
        self.positives = ts.positives

    def scores(self, negatives: list[np.ndarray]) -> handoff.Scores:
        """Each query's positives' and negatives' cross-encoder logits (one batch of pairs
        per query group, in the order given)."""
        t0 = time.perf_counter()
        q_texts, p_texts, sizes = [], [], []
        for q, (pos, neg) in enumerate(zip(self.positives, negatives, strict=True)):
            rows = [*np.asarray(pos).tolist(), *np.asarray(neg).tolist()]
            q_texts += [self.queries[q]] * len(rows)
            p_texts += [self.passages[i] for i in rows]
            sizes.append((len(pos), len(neg)))
        flat = self.scorer(q_texts, p_texts)
        pos_scores, neg_scores, at = [], [], 0
        for n_pos, n_neg in sizes:
            pos_scores.append(flat[at : at + n_pos])
            neg_scores.append(flat[at + n_pos : at + n_pos + n_neg])
            at += n_pos + n_neg
        self.seconds = time.perf_counter() - t0
        self.pairs = len(flat)
        return handoff.Scores(neg_scores, pos_scores)

    def record(self) -> dict[str, Any]:
        """The manifest's ``teacher``: the scorer's record and this version's pairs."""
        return {
            **self.scorer.record(),
            "version_pairs": self.pairs,
            "version_pairs_per_s": round(self.pairs / max(self.seconds, 1e-9), 1),
        }


_LOADED: dict[tuple[str, int], OnlineTeacher] = {}


def teacher_for(cfg: Any, ts: TrainingSet, device: str = "auto") -> OnlineTeacher | None:
    """The ``refresh`` section's teacher (``cfg.teacher``), loaded once per process and
    training set, or None when it names none."""
    if not cfg.teacher:
        return None
    key = (str(cfg.teacher), id(ts))
    if key not in _LOADED:
        _LOADED[key] = OnlineTeacher(
            cfg.teacher, ts, device=device, batch_size=cfg.teacher_batch_size,
            max_length=cfg.teacher_max_length, bf16=cfg.teacher_bf16,
        )  # fmt: skip
    return _LOADED[key]
