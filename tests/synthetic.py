"""Deterministic synthetic documents for tests (no external text)."""

from __future__ import annotations

WORDS = (
    "retrieval encoder masked auto encoder decoder sentence embedding position visible hidden "
    "token word piece corpus query passage negative positive contrastive gradient optimizer "
    "checkpoint shard manifest sampler epoch rank world replica attention window stream"
).split()


def synthetic_texts(n: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """Deterministic pseudo-English documents, with some long ones and some empty ones."""
    import random

    rng = random.Random(seed)
    texts = []
    for i in range(n):
        k = 0 if i % 17 == 5 else rng.randint(1, max_words if i % 7 else max_words * 6)
        texts.append(
            " ".join(rng.choice(WORDS) + ("s" if rng.random() < 0.2 else "") for _ in range(k))
        )
    return texts
