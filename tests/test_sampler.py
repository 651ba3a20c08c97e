"""Tests of the Feistel permutation and the resumable distributed sampler.

Cheapest first: the permutation alone, then the per-rank geometry of every remainder mode,
then exact resume from a state dict, then resume through real DataLoaders (worker processes).
The oracles are written here: plain Python lists of what each rank must hold.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections import Counter

import numpy as np
import pytest
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from retromae_ds.data.sampler import (
    FeistelPermutation,
    LengthGroupedSampler,
    ResumableDistributedSampler,
)

MODES = ("pad", "drop", "uneven")
FAST = settings(max_examples=150, deadline=None)

worlds = st.integers(1, 8)
sizes = st.integers(1, 2000)
seeds = st.integers(0, 2**32)
modes = st.sampled_from(MODES)


def rank_lists(n: int, world: int, mode: str, **kw) -> list[list[int]]:
    return [
        list(ResumableDistributedSampler(n, world, r, remainder=mode, **kw)) for r in range(world)
    ]


def global_order(n: int, seed: int, epoch: int) -> list[int]:
    sampler = ResumableDistributedSampler(n, seed=seed, remainder="uneven")
    sampler.set_epoch(epoch)
    return list(sampler)


# --------------------------------------------------------------------------- permutation
EDGE_SIZES = sorted(
    {1, 2, 3, 5, 7, 1000, 1001} | {p + d for p in (2**k for k in range(1, 13)) for d in (-1, 0, 1)}
)


@pytest.mark.parametrize("n", EDGE_SIZES)
def test_feistel_is_a_bijection_at_edge_sizes(n):
    for key in (0, 1, 2**63 + 12345):
        out = FeistelPermutation(n, key)(np.arange(n))
        assert out.dtype == np.int64
        assert sorted(out.tolist()) == list(range(n))


@FAST
@given(n=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
def test_feistel_is_a_bijection(n, key):
    perm = FeistelPermutation(n, key)
    out = perm(np.arange(n))
    assert np.array_equal(np.sort(out), np.arange(n))
    # elementwise evaluation agrees with the vectorised one (no hidden cross-element state)
    picks = np.arange(0, n, max(1, n // 7))
    assert [int(perm(np.array([p]))[0]) for p in picks] == out[picks].tolist()


@FAST
@given(n=st.integers(50, 5000), key=st.integers(0, 2**64 - 1), delta=st.integers(1, 2**20))
def test_feistel_differs_between_keys(n, key, delta):
    other = (key + delta) % 2**64
    a = FeistelPermutation(n, key)(np.arange(n))
    b = FeistelPermutation(n, other)(np.arange(n))
    assert not np.array_equal(a, b)


def test_feistel_on_a_huge_domain_is_cheap_and_injective():
    n = 3 * 10**9 + 7  # no O(n) state: evaluating a few positions must be instant
    positions = np.arange(0, n, n // 100_000)
    out = FeistelPermutation(n, 42)(positions)
    assert out.min() >= 0 and out.max() < n
    assert len(np.unique(out)) == len(positions)


def test_feistel_rejects_out_of_range_positions():
    perm = FeistelPermutation(10, 0)
    with pytest.raises(IndexError):
        perm(np.array([10]))
    with pytest.raises(ValueError):
        FeistelPermutation(-1, 0)
    assert perm(np.array([], dtype=np.int64)).size == 0


# --------------------------------------------------------------------------- geometry
def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, 2, 2)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, 0, 0)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, remainder="wrap")
    with pytest.raises(ValueError):
        ResumableDistributedSampler(0)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10).advance(-1)


@FAST
@given(n=sizes, world=worlds, mode=modes, seed=seeds, shuffle=st.booleans())
def test_ranks_partition_the_data_as_documented(n, world, mode, seed, shuffle):
    ranks = rank_lists(n, world, mode, seed=seed, shuffle=shuffle)
    lengths = [len(r) for r in ranks]
    for r, indices in enumerate(ranks):
        assert len(ResumableDistributedSampler(n, world, r, remainder=mode)) == len(indices)
        assert all(0 <= i < n for i in indices)
    counts = Counter(i for indices in ranks for i in indices)
    if mode == "uneven":
        assert sorted(counts.elements()) == list(range(n))  # disjoint and complete
        assert max(lengths) - min(lengths) <= 1
        assert lengths == sorted(lengths, reverse=True)
    elif mode == "drop":
        assert lengths == [n // world] * world
        assert max(counts.values(), default=1) == 1  # disjoint
        assert n - len(counts) == n % world  # exactly the remainder is missing
    else:
        assert lengths == [-(-n // world)] * world
        assert set(counts) == set(range(n))  # every sample at least once
        assert sum(counts.values()) - len(counts) == (-n) % world  # extra reads = padding
        if (-n) % world <= n:  # the padding fits in one pass over the order
            assert Counter(counts.values()) == Counter({1: n - (-n) % world, 2: (-n) % world})


@FAST
@given(n=sizes, world=worlds, mode=modes)
def test_no_shuffle_is_the_strided_natural_order(n, world, mode):
    ranks = rank_lists(n, world, mode, shuffle=False)
    for r, indices in enumerate(ranks):
        if mode == "uneven":
            expected = list(range(r, n, world))
        elif mode == "drop":
            expected = list(range(r, (n // world) * world, world))
        else:
            expected = [(r + k * world) % n for k in range(-(-n // world))]
        assert indices == expected


@FAST
@given(n=sizes, world=worlds, mode=modes, seed=seeds, epoch=st.integers(0, 1000))
def test_order_depends_only_on_seed_and_epoch(n, world, mode, seed, epoch):
    def run() -> list[list[int]]:
        out = []
        for r in range(world):
            s = ResumableDistributedSampler(n, world, r, seed=seed, remainder=mode)
            s.set_epoch(epoch + 1)  # visit another epoch first: no state may leak
            list(s)
            s.set_epoch(epoch)
            out.append(list(s))
        return out

    assert run() == run()


@FAST
@given(n=st.integers(50, 2000), seed=seeds, epoch=st.integers(0, 1000))
def test_order_changes_with_epoch_and_seed(n, seed, epoch):
    base = global_order(n, seed, epoch)
    assert base != global_order(n, seed, epoch + 1)
    assert base != global_order(n, seed + 1, epoch)
    assert base != list(range(n))


@FAST
@given(n=st.integers(50, 2000), world=st.integers(2, 8), seed=seeds)
def test_drop_mode_drops_different_samples_each_epoch(n, world, seed):
    if n % world == 0:
        return
    dropped = []
    for epoch in range(5):
        seen = set()
        for r in range(world):
            s = ResumableDistributedSampler(n, world, r, seed=seed, remainder="drop")
            s.set_epoch(epoch)
            seen.update(s)
        dropped.append(frozenset(range(n)) - seen)
    assert len(set(dropped)) > 1


@FAST
@given(n=sizes, world=worlds, seed=seeds, epoch=st.integers(0, 100))
def test_ranks_read_the_global_order_strided(n, world, seed, epoch):
    """Rank r reads global positions r, r + W, ... of one shared per-epoch order."""
    order = global_order(n, seed, epoch)
    for r in range(world):
        s = ResumableDistributedSampler(n, world, r, seed=seed, remainder="pad")
        s.set_epoch(epoch)
        assert list(s) == [order[(r + k * world) % n] for k in range(len(s))]


# --------------------------------------------------------------------------- exact resume
EPOCHS = 4


def uninterrupted(n: int, world: int, rank: int, mode: str, seed: int) -> list[int]:
    out = []
    s = ResumableDistributedSampler(n, world, rank, seed=seed, remainder=mode)
    for epoch in range(EPOCHS):
        s.set_epoch(epoch)
        out.extend(s)
    return out


def finish(sampler: ResumableDistributedSampler) -> list[int]:
    """Everything ``sampler`` yields from its current position to the end of epoch EPOCHS-1."""
    out = list(sampler)
    for epoch in range(sampler.epoch + 1, EPOCHS):
        sampler.set_epoch(epoch)
        out.extend(sampler)
    return out


@FAST
@given(
    n=sizes,
    world=worlds,
    data=st.data(),
    mode=modes,
    seed=seeds,
)
def test_resume_from_state_dict_continues_exactly(n, world, data, mode, seed):
    rank = data.draw(st.integers(0, world - 1), label="rank")
    per_epoch = len(ResumableDistributedSampler(n, world, rank, remainder=mode))
    if per_epoch == 0:
        return  # drop/uneven ranks without samples: see test_advance_terminates_on_empty_rank
    full = uninterrupted(n, world, rank, mode, seed)
    k = data.draw(st.integers(0, (EPOCHS - 1) * per_epoch), label="k")

    first = ResumableDistributedSampler(n, world, rank, seed=seed, remainder=mode)
    it = iter(first)  # a live iterator (as a DataLoader holds) must not disturb the state
    next(it)
    remaining = k
    while remaining:  # advance in uneven steps, as batches of varying size would
        step = data.draw(st.integers(1, remaining), label="step")
        first.advance(step)
        remaining -= step
    state = first.state_dict()
    assert (state["epoch"], state["consumed"]) == divmod(k, per_epoch)

    fresh = ResumableDistributedSampler(n, world, rank, seed=seed, remainder=mode)
    fresh.load_state_dict(state)
    assert finish(fresh) == full[k:]


@pytest.mark.parametrize("k", [0, 4095, 4096, 5000, 9999, 10000, 25000])
def test_resume_across_iteration_chunks(k):
    """__iter__ works in chunks of 4096 positions; resume inside and across them."""
    n, world, rank, mode, seed = 20011, 2, 1, "pad", 3
    full = uninterrupted(n, world, rank, mode, seed)
    first = ResumableDistributedSampler(n, world, rank, seed=seed, remainder=mode)
    first.advance(k)
    fresh = ResumableDistributedSampler(n, world, rank, seed=seed, remainder=mode)
    fresh.load_state_dict(first.state_dict())
    assert finish(fresh) == full[k:]


@pytest.mark.parametrize(
    ("field", "other"),
    [
        ("num_replicas", {"num_replicas": 4}),
        ("num_samples", {"num_samples": 101}),
        ("seed", {"seed": 1}),
        ("shuffle", {"shuffle": False}),
        ("remainder", {"remainder": "drop"}),
    ],
)
def test_load_state_dict_refuses_other_settings(field, other):
    settings_ = {"num_samples": 100, "num_replicas": 2, "seed": 0, "shuffle": True}
    saved = ResumableDistributedSampler(**settings_, rank=1)
    saved.advance(7)
    target = ResumableDistributedSampler(**{**settings_, **other}, rank=1)
    with pytest.raises(ValueError, match=field):
        target.load_state_dict(saved.state_dict())
    assert (target.epoch, target.consumed) == (0, 0)  # a refused state changes nothing


def test_set_epoch_restarts_the_epoch_and_same_epoch_keeps_position():
    s = ResumableDistributedSampler(100, 3, 1, seed=5)
    s.advance(10)
    s.set_epoch(0)  # the trainer calls set_epoch(start_epoch) after a resume: keep position
    assert s.consumed == 10
    s.set_epoch(1)
    assert (s.epoch, s.consumed) == (1, 0)


# A rank whose epoch is empty: "drop" with fewer samples than ranks, or "uneven" ranks past
# the last sample. len() is 0 there; advance() once looped forever on it (consumed -= 0). The
# call runs in a forked child so that a regression costs a timeout, not the test session.
def _advance_zero(n: int, world: int, rank: int, mode: str) -> None:
    s = ResumableDistributedSampler(n, world, rank, remainder=mode)
    assert len(s) == 0 and list(s) == []
    with contextlib.suppress(ValueError):  # refusing is acceptable; hanging is not
        s.advance(0)


@pytest.mark.parametrize(("n", "world", "rank", "mode"), [(3, 8, 0, "drop"), (3, 8, 5, "uneven")])
def test_advance_terminates_on_empty_rank(n, world, rank, mode):
    child = multiprocessing.get_context("fork").Process(
        target=_advance_zero, args=(n, world, rank, mode)
    )
    child.start()
    child.join(timeout=5)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(
            f"BUG: ResumableDistributedSampler({n}, {world}, {rank}, remainder={mode!r})"
            ".advance(0) loops forever (its epoch is empty)"
        )
    assert child.exitcode == 0


# --------------------------------------------------------------------------- DataLoader resume
class IndexDataset(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def make_loader(sampler, n: int, batch_size: int, workers: int):
    return torch.utils.data.DataLoader(
        IndexDataset(n),
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
    )


def train(sampler, n, batch_size, workers, epochs, stop_after=None) -> list[int]:
    """The trainer's loop: set_epoch, consume batches, advance by what was consumed."""
    seen: list[int] = []
    loader = make_loader(sampler, n, batch_size, workers)
    steps = 0
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            seen.extend(batch.tolist())
            sampler.advance(len(batch))
            steps += 1
            if steps == stop_after:
                return seen  # the loader's workers have prefetched well past this point
    return seen


@pytest.mark.parametrize(("workers_before", "workers_after"), [(2, 0), (0, 2)])
@pytest.mark.parametrize("stop_after", [3, 7, 8])  # 7: exactly at the epoch end
def test_resume_through_dataloader(workers_before, workers_after, stop_after):
    n, world, rank, batch_size, epochs = 53, 2, 1, 4, 2  # 27 samples = 7 batches per epoch

    def sampler():
        return ResumableDistributedSampler(n, world, rank, seed=11)

    expected = train(sampler(), n, batch_size, 0, epochs)
    assert len(expected) == epochs * 27

    first = sampler()
    before = train(first, n, batch_size, workers_before, epochs, stop_after=stop_after)
    state = first.state_dict()
    resumed = sampler()
    resumed.load_state_dict(state)
    after = train(resumed, n, batch_size, workers_after, epochs)
    assert before + after == expected


# ------------------------------------------------------------------ length-grouped order
def _lengths(n: int, seed: int = 0) -> np.ndarray:
    """Skewed lengths, like documents: most short, a few very long."""
    return np.minimum(8192, np.random.default_rng(seed).lognormal(6, 1.2, n).astype(np.int64) + 2)


def grouped(n, world, rank, mode="pad", *, block=8, group_blocks=4, seed=0, lengths=None):
    table = _lengths(n) if lengths is None else lengths
    return LengthGroupedSampler(
        n,
        world,
        rank,
        lengths=lambda idx: table[idx],
        block=block,
        group_blocks=group_blocks,
        seed=seed,
        remainder=mode,
    )


@FAST
@given(
    n=sizes, world=worlds, mode=modes, seed=seeds, micro=st.integers(1, 5), blocks=st.integers(1, 6)
)
def test_length_grouping_keeps_the_coverage_of_every_remainder_mode(
    n, world, mode, seed, micro, blocks
):
    lists = [
        list(grouped(n, world, r, mode, block=micro * world, group_blocks=blocks, seed=seed))
        for r in range(world)
    ]
    plain = rank_lists(n, world, mode, seed=seed)
    assert [len(x) for x in lists] == [len(x) for x in plain]
    counts = Counter(i for x in lists for i in x)
    if mode == "uneven":
        assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}
    elif mode == "pad":
        assert set(counts) == set(range(n))
    else:
        assert max(counts.values(), default=1) == 1


def _padding(batches: list[np.ndarray], lengths: np.ndarray) -> float:
    """Fraction of a padded batch's tokens that are padding, over all batches."""
    total = sum(len(b) * lengths[b].max() for b in batches)
    return 1 - sum(lengths[b].sum() for b in batches) / total


def test_each_step_reads_samples_of_similar_length_on_every_rank():
    n, world, micro = 4000, 2, 8
    lengths = _lengths(n, 1)
    steps = {}
    for name, make in (
        ("plain", lambda r: ResumableDistributedSampler(n, world, r, seed=3)),
        (
            "grouped",
            lambda r: grouped(
                n, world, r, block=micro * world, group_blocks=16, seed=3, lengths=lengths
            ),
        ),
    ):
        per_rank = [np.array(list(make(r))).reshape(-1, micro) for r in range(world)]
        steps[name] = per_rank
    plain = _padding([b for r in steps["plain"] for b in r], lengths)
    packed = _padding([b for r in steps["grouped"] for b in r], lengths)
    assert plain > 0.5 and packed < 0.5 * plain, (plain, packed)
    # the ranks' micro-batches of a step come from one block: their longest samples agree
    longest = np.stack([lengths[r].max(1) for r in steps["grouped"]])
    assert np.median(longest.max(0) / longest.min(0)) < 1.2
    # long blocks are not all at the start of a group: the first blocks are not the longest
    per_group = longest.max(0)[: len(longest[0]) // 16 * 16].reshape(-1, 16)
    assert (per_group[:, 0] < per_group.max(1)).mean() > 0.5


@FAST
@given(n=st.integers(1, 600), world=st.integers(1, 4), data=st.data(), seed=seeds)
def test_length_grouped_resume_continues_exactly(n, world, data, seed):
    micro = data.draw(st.integers(1, 4))
    sampler = grouped(n, world, 0, block=micro * world, group_blocks=3, seed=seed)
    length = len(sampler)
    stop = data.draw(st.integers(0, 2 * length))
    straight = grouped(n, world, 0, block=micro * world, group_blocks=3, seed=seed)
    expected = []
    for _ in range(3):
        expected += list(straight)
        straight.advance(length)
    sampler.advance(stop)
    state = sampler.state_dict()
    resumed = grouped(n, world, 0, block=micro * world, group_blocks=3, seed=seed)
    resumed.load_state_dict(state)
    got = list(resumed)
    assert got == expected[stop : stop + len(got)] and len(got) == length - stop % length


def test_length_grouped_state_refuses_another_grouping_or_a_plain_state():
    a = grouped(100, 1, 0, block=8, group_blocks=4)
    with pytest.raises(ValueError, match="group_blocks"):
        grouped(100, 1, 0, block=8, group_blocks=5).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="length grouping"):
        a.load_state_dict(ResumableDistributedSampler(100).state_dict())
    with pytest.raises(ValueError, match="block"):
        grouped(100, 1, 0, block=0)
