"""Fine-tuning batches: each query's positive and hard negatives drawn as a pure function of
(seed, epoch, query, negatives version), so a resumed run draws the same batches. With
``teacher`` (distillation) a batch also holds ``teacher`` ``[B, 1 + n_hard]``: the version's
teacher scores of each query's drawn positive and negatives, in the passages' order."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from retromae_ds.data.sampler import ResumableDistributedSampler
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.negatives import NegativesInUse


class BatchBuilder:
    """Batches as a pure function of (seed, epoch, query index, negatives version)."""

    def __init__(
        self, ts: ance_data.TrainingSet, n_hard: int, seed: int, *, teacher: bool = False
    ) -> None:
        self.ts, self.n_hard, self.seed, self.teacher = ts, n_hard, seed, teacher
        width = max(len(p) for p in ts.positives)
        self.positives = np.full((ts.num_queries, width), -1, dtype=np.int64)
        for q, pos in enumerate(ts.positives):
            self.positives[q, : len(pos)] = pos

    def __call__(
        self, queries: np.ndarray, epoch: int, negatives: handoff.Negatives
    ) -> dict[str, torch.Tensor]:
        ts = self.ts
        if self.teacher and not negatives.scored:
            raise ValueError(
                f"negatives v{negatives.version} carries no teacher scores, and the run distils"
            )
        passages, teacher = [], []
        for q in queries.tolist():
            rng = np.random.default_rng([self.seed, epoch, q, negatives.version])
            pos = ts.positives[q]
            pool = negatives.of(q)
            if len(pool) == 0 and self.n_hard:
                raise ValueError(f"negatives v{negatives.version} has none for query {q}")
            # positions into the pool: the same draw as ``rng.choice(pool, ...)``
            hard = rng.choice(len(pool), size=self.n_hard, replace=len(pool) < self.n_hard)
            first = rng.integers(len(pos))
            passages += [int(pos[first]), *pool[hard].tolist()]
            if self.teacher:
                teacher.append([negatives.positive_scores_of(q)[first],
                                *negatives.scores_of(q)[hard]])  # fmt: skip
        p_index = np.asarray(passages, dtype=np.int64)
        q_ids, q_mask = ance_data.token_batch(ts.queries, ts.query_rows[queries], ts.special)
        p_ids, p_mask = ance_data.token_batch(ts.corpus, ts.passage_rows[p_index], ts.special)
        batch = {
            "q_ids": q_ids,
            "q_mask": q_mask,
            "p_ids": p_ids,
            "p_mask": p_mask,
            "p_index": torch.from_numpy(p_index),
            "positives": torch.from_numpy(self.positives[queries]),
        }
        if self.teacher:
            batch["teacher"] = torch.tensor(teacher, dtype=torch.float32)
        return batch


def batch_stream(
    sampler: ResumableDistributedSampler,
    batch_size: int,
    build: BatchBuilder,
    negatives: NegativesInUse,
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of ``batch_size`` queries in the sampler's order, on the negatives version in
    use when each is drawn (an epoch's partial tail is skipped); the trainer advances the
    sampler by what each batch consumed."""
    while True:
        if sampler.consumed + batch_size > len(sampler):
            sampler.advance(len(sampler) - sampler.consumed)
        queries = sampler.indices(sampler.consumed, sampler.consumed + batch_size)
        yield build(queries, sampler.epoch, negatives.current)
