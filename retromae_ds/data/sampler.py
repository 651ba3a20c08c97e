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

``LengthGroupedSampler`` keeps all of that and orders each group of consecutive positions of
the epoch's order (``group_blocks`` blocks of ``block`` samples, a block being what one step's
micro-batches on all ranks read together) by sample length, then shuffles the full blocks of
the group: each step's samples have similar lengths, so long inputs are not padded to the
longest of a random batch, while the order stays a pure function of (seed, epoch, position).

Exact resume: the trainer calls ``advance(n)`` for the samples it has *consumed* (not the
ones a DataLoader prefetched), so ``state_dict()`` names the next unseen sample whatever the
worker count; ``load_state_dict`` makes the next ``__iter__`` start there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
        return self._order(global_pos) if self.shuffle else global_pos

    def _order(self, global_pos: np.ndarray) -> np.ndarray:
        """Sample indices at positions ``global_pos`` of the current epoch's order."""
        return self._permutation()(global_pos)

    def _permutation(self) -> FeistelPermutation:
        if self._perm is None:
            self._perm = FeistelPermutation(self.num_samples, _epoch_key(self.seed, self.epoch))
        return self._perm

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


class LengthGroupedSampler(ResumableDistributedSampler):
    """A shuffled order in which every ``block`` consecutive positions (one step of every
    rank: ``micro_batch × world size``) hold samples of similar length.

    The epoch's shuffled order is cut into groups of ``group_blocks × block`` positions; a
    group's samples are sorted by length (longest first, ties by position) and its full blocks
    put in a keyed random order (a short tail block stays last). ``lengths(indices)`` gives
    the lengths of samples (``ShardDataset.lengths_of``); only the groups being read are
    looked at (one group's lengths and sort, O(group), cached), so no rank holds O(N) state.
    Coverage, remainder handling and exact resume are those of the parent.
    """

    def __init__(
        self,
        num_samples: int,
        num_replicas: int = 1,
        rank: int = 0,
        *,
        lengths: Callable[[np.ndarray], np.ndarray],
        block: int,
        group_blocks: int = 64,
        seed: int = 0,
        remainder: str = "pad",
    ) -> None:
        super().__init__(num_samples, num_replicas, rank, seed=seed, remainder=remainder)
        if block < 1 or group_blocks < 1:
            raise ValueError(f"need block >= 1 and group_blocks >= 1, got {block}, {group_blocks}")
        self.lengths, self.block, self.group_blocks = lengths, block, group_blocks
        self._groups: dict[tuple[int, int], np.ndarray] = {}

    def _order(self, global_pos: np.ndarray) -> np.ndarray:
        size = self.block * self.group_blocks
        out = np.empty_like(global_pos)
        groups = global_pos // size
        for g in np.unique(groups).tolist():
            sel = groups == g
            out[sel] = self._group(g)[global_pos[sel] - g * size]
        return out

    def _group(self, g: int) -> np.ndarray:
        """Sample indices at the positions of group ``g`` of the current epoch."""
        key = (self.epoch, g)
        cached = self._groups.get(key)
        if cached is not None:
            return cached
        size = self.block * self.group_blocks
        begin, end = g * size, min((g + 1) * size, self.num_samples)
        members = self._permutation()(np.arange(begin, end, dtype=np.int64))
        n = np.asarray(self.lengths(members), dtype=np.int64)
        if n.shape != members.shape:
            raise ValueError(f"lengths() gave {n.shape} lengths for {members.shape} samples")
        ordered = members[np.lexsort((np.arange(len(members)), -n))]
        full = len(ordered) // self.block
        blocks = FeistelPermutation(
            max(full, 1), _epoch_key(self.seed ^ 0x5BD1E995, self.epoch * 1_000_003 + g)
        )
        order = blocks(np.arange(full, dtype=np.int64)) if full else np.zeros(0, np.int64)
        head = ordered[: full * self.block].reshape(full, self.block)[order].reshape(-1)
        mapped = np.concatenate([head, ordered[full * self.block :]])
        self._groups = {
            k: v for k, v in self._groups.items() if k[0] == self.epoch and k[1] >= g - 1
        }
        self._groups[key] = mapped
        return mapped

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"block": self.block, "group_blocks": self.group_blocks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("block", "group_blocks"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state.get(key)!r}, this run has "
                    f"{getattr(self, key)!r}; exact resume needs the same length grouping"
                )
        super().load_state_dict(state)


def _epoch_key(seed: int, epoch: int) -> int:
    mixed = _mix64(
        np.array([(seed * 0x9E3779B97F4A7C15 + epoch) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    )
    return int(mixed[0])
