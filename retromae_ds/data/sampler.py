"""Deterministic, resumable distributed sampler.

Every epoch has one global order, a pseudo-random permutation of ``range(num_samples)`` that
depends only on (seed, epoch). It is computed index by index with a keyed Feistel network and
cycle walking, so no rank ever materialises an O(N) permutation: a rank of a billion-sample
corpus costs nothing to create and O(batch) to advance.

Rank ``r`` of ``W`` reads global positions ``r, r + W, r + 2W, ...``. The remainder
(``num_samples % W``) is handled by ``remainder``:

- ``"pad"`` (default, for training): the order is extended by its own first positions so that
  every rank gets ``ceil(N / W)`` samples; every sample is seen at least once per epoch, with
  ``(-N) % W`` extra reads of the samples at the start of the order.
- ``"drop"``: the last ``N % W`` positions of the order are dropped; ranks are disjoint, every
  rank gets ``N // W`` samples, and the dropped ones differ from epoch to epoch.
- ``"uneven"`` (for evaluation and encoding): ranks are disjoint and together cover every
  sample exactly once; ranks differ in length by at most one.

Exact resume: the trainer calls ``advance(n)`` for the samples it has *consumed* (not the
ones a DataLoader prefetched), so ``state_dict()`` names the next unseen sample whatever the
worker count; ``load_state_dict`` makes the next ``__iter__`` start there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.utils.data

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (vectorised, wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A bijection of ``range(n)`` keyed by ``key``, evaluated elementwise."""

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = n
        bits = max(2, int(n - 1).bit_length() if n > 1 else 2)
        bits += bits % 2  # balanced halves
        self.half = bits // 2
        self.half_mask = np.uint64((1 << self.half) - 1)
        seed = np.array([key & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        self.round_keys = [_mix64(seed + np.uint64(r + 1))[0] for r in range(_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left = x >> np.uint64(self.half)
        right = x & self.half_mask
        for k in self.round_keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.half_mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64)
        if x.size and (x.max() >= self.n):
            raise IndexError("position out of range")
        y = self._encrypt(x)
        # cycle walking: re-encrypt the values that left [0, n); the domain is < 4n, so few rounds
        bad = y >= np.uint64(self.n)
        while bad.any():
            y[bad] = self._encrypt(y[bad])
            bad = y >= np.uint64(self.n)
        return y.astype(np.int64)


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """See the module docstring. ``shuffle=False`` keeps the natural order (still strided)."""

    def __init__(
        self,
        num_samples: int,
        num_replicas: int = 1,
        rank: int = 0,
        *,
        seed: int = 0,
        shuffle: bool = True,
        remainder: str = "pad",
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} / num_replicas {num_replicas} invalid")
        if remainder not in ("pad", "drop", "uneven"):
            raise ValueError(f"remainder must be 'pad', 'drop' or 'uneven', not {remainder!r}")
        if num_samples < 1:
            raise ValueError("sampler over an empty dataset")
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.seed, self.shuffle, self.remainder = seed, shuffle, remainder
        self.epoch = 0
        self.consumed = 0  # samples of this rank's current epoch already used by the trainer
        self._perm: FeistelPermutation | None = None

    # -------------------------------------------------------------------- geometry
    def __len__(self) -> int:
        """Samples this rank yields per epoch."""
        n, w = self.num_samples, self.num_replicas
        if self.remainder == "pad":
            return -(-n // w)
        if self.remainder == "drop":
            return n // w
        return n // w + (1 if self.rank < n % w else 0)

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at this rank's local positions [start, stop) of the current epoch."""
        stop = min(stop, len(self))
        local = np.arange(start, max(start, stop), dtype=np.int64)
        global_pos = local * self.num_replicas + self.rank
        global_pos %= self.num_samples  # "pad" wraps onto the start of the order
        if not self.shuffle:
            return global_pos
        if self._perm is None:
            self._perm = FeistelPermutation(self.num_samples, _epoch_key(self.seed, self.epoch))
        return self._perm(global_pos)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed, self._perm = epoch, 0, None

    # -------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[int]:
        chunk = 4096
        for begin in range(self.consumed, len(self), chunk):
            yield from self.indices(begin, begin + chunk).tolist()

    def advance(self, n: int) -> None:
        """Record that the trainer consumed ``n`` more samples of this rank. Crossing the end
        of the epoch moves to the next one."""
        if n < 0:
            raise ValueError("cannot advance by a negative count")
        length = len(self)
        if length == 0:  # this rank has nothing to read (e.g. "uneven" with rank >= N)
            return
        self.consumed += n
        if self.consumed >= length:
            self.epoch += self.consumed // length
            self.consumed %= length
            self._perm = None

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "remainder": self.remainder,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples", "num_replicas", "rank", "shuffle", "remainder"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r}, this run has {getattr(self, key)!r}; "
                    "exact resume needs the same data, world size and sampler settings"
                )
        self.epoch, self.consumed, self._perm = int(state["epoch"]), int(state["consumed"]), None


def _epoch_key(seed: int, epoch: int) -> int:
    mixed = _mix64(
        np.array([(seed * 0x9E3779B97F4A7C15 + epoch) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    )
    return int(mixed[0])
