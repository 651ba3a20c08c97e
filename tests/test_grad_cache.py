"""GradCache (``retromae_ds.finetuning.grad_cache``) on real DeepSpeed engines, CPU and gloo.

The oracle is written here, independent of the library: the plain step that embeds the same
chunks in the same order with a graph (so dropout draws the same masks) and backpropagates one
contrastive loss over the whole global batch, every rank's queries against every rank's
passages (hard negatives, other positives masked). One spawn of a single rank and one of two
ranks compute everything (DeepSpeed starts once per process); the tests read their results:

- gradients with the cache, dropout on, equal the oracle's: every pooling, two towers, at 1
  rank, and at 2 ranks (gathered negatives) under ZeRO 0, 1, 2 and 3; fp32 to rtol 1e-4, and
  under bf16 autocast to the looser ``BF16`` tolerance;
- chunks that do not divide the batch (and a chunk larger than it) give the same gradients;
- two cached micro-batches of gradient accumulation give the plain steps' mean (ZeRO 1-3);
- ``loss_chunk`` (the second pass a few queries at a time) to the looser ``LOSS_CHUNK``;
- 2 ranks with B queries each train as 1 rank with 2B, step for step (losses, weights);
- a ``finetune --grad_cache.*`` run with dropout stops and resumes exactly (own processes).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
from helpers_train import free_port, launch_cmd, metrics, run_logged

from helpers_ance import ENV, write_synthetic_beir, write_tiny_encoder
from helpers_model import NO_DROPOUT, small_config

VOCAB, SPECIAL = 60, (0, 1, 2, 3, 4)
DROPOUT = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
PER_RANK, GROUP = 3, 2  # queries per rank; passages per query (positive + 1 hard negative)
FP32 = dict(rtol=1e-4, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=1e-3)
"""bf16 autocast: the chunked re-forward sums the parameter gradients in another order, in
bf16 matmuls. Each ``atol`` is relative to the model's largest gradient (``_close``): in fp32
the chunks' summation order leaves near-zero elements a few 1e-9 apart."""
LOSS_CHUNK = dict(rtol=1e-2, atol=2e-3)
"""``grad_cache.loss_chunk``: the cached gradients differ from the plain loss's by fp32
rounding (the regrouped score products, about 1e-4 relative), which the backward through a
saturated softmax and the layer norms amplifies in a few near-cancelling elements."""
STAGES = (0, 1, 2, 3)
CASES = {  # name: (pooling, two towers, chunk sizes q/p)
    "cls": ("cls", False, (2, 4)),
    "mean_two_towers": ("mean", True, (1, 5)),
    "dupmae_two_towers": ("dupmae", True, (2, 3)),
}


# ------------------------------------------------------------------------------ the pieces
def _model(pooling: str, two: bool, seed: int, dropout: bool = True):
    from transformers import BertConfig, BertForMaskedLM, BertModel

    from retromae_ds.finetuning.model import DualEncoder
    from retromae_ds.hf.pooling import get_pooling

    torch.manual_seed(seed)
    config = BertConfig(
        **small_config(VOCAB, 16, 1, max_position_embeddings=16),
        **(DROPOUT if dropout else NO_DROPOUT),
    )
    head = get_pooling(pooling).needs_head

    def tower():
        return BertForMaskedLM(config) if head else BertModel(config, add_pooling_layer=False)

    return DualEncoder(
        tower(),
        tower() if two else None,
        pooling=pooling,
        normalize=pooling == "mean",
        temperature=0.05 if pooling == "mean" else 0.5,
        bow_topk=8,
        special_ids=SPECIAL,
    )


def _global_batch(world: int, seed: int, per_rank: int = PER_RANK) -> dict[str, torch.Tensor]:
    """Every rank's queries and passages (rank order); a passage shared by two queries and a
    query with two positives make masked columns."""
    g = torch.Generator().manual_seed(seed)
    b, p = world * per_rank, world * per_rank * GROUP

    def texts(n: int, length: int):
        ids = torch.randint(5, VOCAB, (n, length), generator=g)
        ids[:, 0] = 2
        lengths = torch.randint(3, length + 1, (n,), generator=g)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
        return ids * mask, mask

    q_ids, q_mask = texts(b, 6)
    p_ids, p_mask = texts(p, 9)
    p_index = torch.randperm(1000, generator=g)[:p]
    p_index[GROUP] = p_index[-GROUP]  # one passage for a query of each rank
    positives = torch.full((b, 2), -1, dtype=torch.int64)
    positives[:, 0] = p_index[::GROUP]
    positives[0, 1] = p_index[GROUP]  # query 0 has query 1's positive as a second one
    return dict(q_ids=q_ids, q_mask=q_mask, p_ids=p_ids, p_mask=p_mask, p_index=p_index,
                positives=positives)  # fmt: skip


def _rank_part(full: dict[str, torch.Tensor], rank: int, per_rank: int = PER_RANK):
    q, p = (
        slice(rank * per_rank, (rank + 1) * per_rank),
        slice(rank * per_rank * GROUP, (rank + 1) * per_rank * GROUP),
    )
    return {k: v[q] if k.startswith("q_") or k == "positives" else v[p] for k, v in full.items()}


def _oracle_grads(model, full, world, chunk_q, chunk_p, seeds, autocast=False):
    """The plain step, written out: rank r's chunks embedded in GradCache's order from seed
    ``seeds[r]``, with a graph; one cross-entropy over all queries against all passages."""
    model.zero_grad()
    qs, ps = [], []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for r in range(world):
            part = _rank_part(full, r)
            torch.manual_seed(seeds[r])
            for s in range(0, part["q_ids"].shape[0], chunk_q):
                qs.append(
                    model.embed(
                        part["q_ids"][s : s + chunk_q], part["q_mask"][s : s + chunk_q], query=True
                    )
                )
            for s in range(0, part["p_ids"].shape[0], chunk_p):
                ps.append(
                    model.embed(
                        part["p_ids"][s : s + chunk_p], part["p_mask"][s : s + chunk_p], query=False
                    )
                )
        q, p = torch.cat(qs), torch.cat(ps)
        scores = q @ p.T / model.temperature
        target = torch.arange(q.shape[0]) * GROUP
        other = (full["p_index"][None, :, None] == full["positives"][:, None, :]).any(-1)
        other[torch.arange(q.shape[0]), target] = False
        scores = scores.masked_fill(other, torch.finfo(scores.dtype).min)
    torch.nn.functional.cross_entropy(scores.float(), target).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _engine(model, stage: int, world: int, lr: float = 0.0, accum: int = 1):
    """A DeepSpeed engine with plain SGD (AdamW would turn rounding-level gradients, e.g. the
    attention keys' bias, into full-size steps)."""
    from retromae_ds.components import engine as eng

    cfg = eng.build_ds_config(
        [f"ds_configs/zero{stage}.json", "ds_configs/fp32.json"],
        micro_batch=PER_RANK, grad_accum=accum, world_size=world, grad_clip=0.0, cuda=False,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return eng.initialize(model, optimizer, None, cfg)


def _cached_grads(model, stage, world, batch, chunks, seed, autocast=False, loss_chunk=0):
    """GradCache's step on a DeepSpeed engine: the full gradients before the optimizer step
    (DeepSpeed's ``safe_get_full_grad``: every stage, every rank takes part)."""

    from retromae_ds.finetuning.grad_cache import GradCache, GradCacheConfig

    engine = _engine(model, stage, world)
    cfg = GradCacheConfig(query_chunk=chunks[0], passage_chunk=chunks[1], loss_chunk=loss_chunk)
    step = GradCache(cfg, model.loss_grads)
    torch.manual_seed(seed)
    step(engine, batch, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast))
    return _full_grads(engine)


def _full_grads(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient before the optimizer step (DeepSpeed's
    ``safe_get_full_grad``: every stage, every rank takes part), then the step."""
    from deepspeed.utils import safe_get_full_grad

    grads = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_grad(param)
        if full is not None:
            grads[name] = full.detach().clone().float().cpu()
    engine.step()
    return grads


def _accumulated(world: int, rank: int, stage: int) -> tuple[dict, dict]:
    """Two micro-batches with the cache in one optimizer step (``grad_accum`` 2): (DeepSpeed's
    gradients, the plain step's mean over the two)."""
    import copy

    from retromae_ds.finetuning.grad_cache import GradCache, GradCacheConfig

    model = _model("cls", False, seed=0)
    oracle = copy.deepcopy(model)
    engine = _engine(model, stage, world, accum=2)
    step = GradCache(GradCacheConfig(query_chunk=2, passage_chunk=4), model.loss_grads)
    want: dict[str, torch.Tensor] = {}
    for micro in range(2):
        full, seeds = (
            _global_batch(world, seed=20 + micro),
            [30 + 10 * micro + r for r in range(world)],
        )
        for name, grad in _oracle_grads(oracle, full, world, 2, 4, seeds).items():
            want[name] = want.get(name, 0) + grad / 2
        torch.manual_seed(seeds[rank])
        step(engine, _rank_part(full, rank), torch.autocast("cpu", enabled=False))
        if micro == 0:
            engine.step()  # not a boundary: nothing is reduced or stepped yet
    return _full_grads(engine), want


def _train(world: int, rank: int, steps: int, stage: int) -> tuple[list[float], dict]:
    """``steps`` SGD steps with the cache (dropout off), the global batch of step s split
    over the ranks: (the global mean loss of each step, the final weights on rank 0)."""
    from retromae_ds.components import engine as eng
    from retromae_ds.finetuning.grad_cache import GradCache, GradCacheConfig

    per_rank = 2 * PER_RANK // world
    model = _model("cls", False, seed=3, dropout=False)
    engine = _engine(model, stage, world, lr=0.5)
    step = GradCache(GradCacheConfig(query_chunk=2, passage_chunk=5), model.loss_grads)
    losses = []
    for s in range(steps):
        batch = _rank_part(_global_batch(1, 100 + s, per_rank=2 * PER_RANK), rank, per_rank)
        out = step(engine, batch, torch.autocast("cpu", enabled=False))
        engine.step()
        losses.append(float(eng.all_reduce_mean(out["loss"].detach().reshape(1))))
    return losses, eng.consolidated_state_dict(engine)


# ------------------------------------------------------------------------------ the workers
def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )  # fmt: skip
    os.chdir(Path(__file__).resolve().parents[1] / "retromae_ds")  # ds_configs/ resolve
    import copy

    from retromae_ds.components import engine as eng

    eng.setup_distributed(120)
    torch.set_num_threads(1)
    seeds = [11 + r for r in range(world)]
    results: dict = {"grads": {}, "train": None}
    full = _global_batch(world, seed=1)
    batch = _rank_part(full, rank)
    for stage in STAGES if world > 1 else (2,):
        for name, (pooling, two, chunks) in CASES.items():
            model = _model(pooling, two, seed=0)
            want = _oracle_grads(copy.deepcopy(model), full, world, *chunks, seeds)
            got = _cached_grads(model, stage, world, batch, chunks, seeds[rank])
            results["grads"][(stage, name)] = (got, want)
    if world > 1:  # the second pass a query at a time: the passages' gradient all-reduced
        model = _model("cls", False, seed=0)
        want = _oracle_grads(copy.deepcopy(model), full, world, 2, 4, seeds)
        got = _cached_grads(model, 3, world, batch, (2, 4), seeds[rank], loss_chunk=1)
        results["grads"][("loss_chunk", 3)] = (got, want)
        for stage in (1, 2, 3):
            results["grads"][("accum", stage)] = _accumulated(world, rank, stage)
    if world == 1:
        for pooling in _poolings():
            model = _model(pooling, False, seed=0)
            want = _oracle_grads(copy.deepcopy(model), full, 1, 2, 4, seeds)
            results["grads"][("pooling", pooling)] = (
                _cached_grads(model, 0, 1, batch, (2, 4), seeds[0]),
                want,
            )
        for chunks in ((2, 4), (PER_RANK + 5, 100)):  # 3 = 2 + 1 queries, 6 = 4 + 2 passages
            model = _model("cls", False, seed=0, dropout=False)  # the plain step in one piece
            want = _oracle_grads(copy.deepcopy(model), full, 1, PER_RANK, PER_RANK * GROUP, seeds)
            got = _cached_grads(model, 0, 1, batch, chunks, seeds[0])
            results["grads"][("uneven", chunks)] = (got, want)
        model = _model("cls", False, seed=0)
        want = _oracle_grads(copy.deepcopy(model), full, 1, 2, 4, seeds, autocast=True)
        got = _cached_grads(model, 0, 1, batch, (2, 4), seeds[0], autocast=True)
        results["grads"][("bf16", "cls")] = (got, want)
    results["train"] = {stage: _train(world, rank, 3, stage) for stage in (2, 3)}
    if rank == 0:
        torch.save(results, out)
    eng.barrier()


def _poolings() -> list[str]:
    from retromae_ds.hf.pooling import pooling_names

    return list(pooling_names())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: rank 0's results}: one 1-rank and one 2-rank spawn, side by side."""
    ctx = mp.get_context("spawn")
    folder = tmp_path_factory.mktemp("grad_cache")
    procs, files = [], {}
    for world in (1, 2):
        port, files[world] = free_port(), str(folder / f"world{world}.pt")
        for rank in range(world):
            procs.append(ctx.Process(target=_worker, args=(rank, world, port, files[world])))
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
        assert proc.exitcode == 0, f"a GradCache worker failed ({proc.exitcode})"
    return {world: torch.load(f, weights_only=False) for world, f in files.items()}


def _close(got: dict, want: dict, tol: dict, what) -> None:
    assert set(got) == set(want), (what, set(got) ^ set(want))
    # relative to the largest gradient of the model: some are zero but for rounding (the
    # attention keys' bias: softmax ignores a shift)
    scale = max(float(g.abs().max()) for g in want.values())
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=tol["rtol"], atol=tol["atol"] * float(scale),
            msg=lambda m, name=name: f"{what} {name}: {m}",
        )  # fmt: skip


# ------------------------------------------------------------------------------ the tests
def test_cached_gradients_equal_the_plain_step_with_dropout_at_one_rank(runs):
    """Every pooling (the DupMAE ones through the MLM head), two towers: fp32, rtol 1e-4."""
    grads = runs[1]["grads"]
    assert {k[1] for k in grads if k[0] == "pooling"} >= {"cls", "mean", "dupmae", "dupmae_bow"}
    for key, (got, want) in grads.items():
        if key[0] in (2, "pooling"):
            _close(got, want, FP32, key)


def test_cached_gradients_equal_the_plain_step_at_two_ranks_under_each_zero_stage(runs):
    """Gathered in-batch negatives across 2 ranks, hard negatives, dropout on; ZeRO 0-3."""
    grads = runs[2]["grads"]
    assert {k[0] for k in grads} >= set(STAGES)
    for key, (got, want) in grads.items():
        if key[0] in STAGES:
            _close(got, want, FP32, key)


def test_gradient_accumulation_over_cached_micro_batches_at_two_ranks(runs):
    """``grad_accum`` 2: the chunks of the first micro-batch never close the accumulation
    boundary, the last chunk of the second does; ZeRO 1, 2 and 3 give the plain steps' mean."""
    grads = runs[2]["grads"]
    assert {k for k in grads if k[0] == "accum"} == {("accum", s) for s in (1, 2, 3)}
    for key in sorted(k for k in grads if k[0] == "accum"):
        _close(*grads[key], FP32, key)


def test_loss_chunk_scores_a_few_queries_at_a_time_to_fp32_rounding(runs):
    """``grad_cache.loss_chunk``: the second pass one query at a time, 2 ranks (the passages'
    gradient summed over chunks and ranks), ZeRO-3, against the plain step: to ``LOSS_CHUNK``;
    and the loss function itself against autograd through the plain loss."""
    from retromae_ds.finetuning.loss import contrastive_loss, contrastive_loss_grads

    _close(*runs[2]["grads"][("loss_chunk", 3)], LOSS_CHUNK, "loss_chunk")
    full = _global_batch(1, seed=2)
    g = torch.Generator().manual_seed(0)
    q, p = torch.randn(PER_RANK, 8, generator=g), torch.randn(PER_RANK * GROUP, 8, generator=g)
    index, positives = full["p_index"], full["positives"]
    q_leaf, p_leaf = q.clone().requires_grad_(), p.clone().requires_grad_()
    loss, accuracy = contrastive_loss(q_leaf, p_leaf, index, positives, temperature=0.5)
    want = torch.autograd.grad(loss, [q_leaf, p_leaf])
    for chunk in (1, 2, PER_RANK):
        got = contrastive_loss_grads(q, p, index, positives, temperature=0.5, chunk=chunk)
        torch.testing.assert_close(got[0], loss.detach(), rtol=1e-6, atol=0)
        assert got[1] == accuracy
        torch.testing.assert_close(got[2], want[0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[3], want[1], rtol=1e-5, atol=1e-7)


def test_an_incomplete_last_chunk_is_scaled_right(runs):
    """Chunks of 2 of 3 queries and 4 of 6 passages, and chunks larger than the batch, give
    the gradients of the whole batch in one piece."""
    grads = runs[1]["grads"]
    for chunks in ((2, 4), (PER_RANK + 5, 100)):
        _close(*grads[("uneven", chunks)], FP32, chunks)


def test_bf16_autocast_gradients_within_the_stated_tolerance(runs):
    got, want = runs[1]["grads"][("bf16", "cls")]
    _close(got, want, BF16, "bf16")


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_with_b_train_as_one_rank_with_2b(runs, stage):
    losses1, weights1 = runs[1]["train"][stage]
    losses2, weights2 = runs[2]["train"][stage]
    assert len(losses1) == 3 and len(set(losses1)) == 3  # the steps trained
    torch.testing.assert_close(torch.tensor(losses2), torch.tensor(losses1), rtol=1e-5, atol=0)
    for name, value in weights1.items():
        torch.testing.assert_close(
            weights2[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


# ------------------------------------------------------------------------------ finetune runs
def _finetune(run_dir: Path, args: list[str], *more: str) -> str:
    cmd = launch_cmd("retromae_ds.finetune", ["--run_dir", str(run_dir), *args, *more])
    return run_logged(cmd, run_dir.parent / f"{run_dir.name}.log", env=ENV, timeout=300).stderr


def _losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in metrics(run_dir) if "loss" in row]


def test_finetune_with_grad_cache_resumes_exactly(tmp_path, tokenizer_dir):
    """``retromae-ds finetune --grad_cache.*`` with dropout: a run stopped at step 2 and
    resumed computes the uninterrupted run's losses bit for bit (the random-number state
    GradCache restores chunk by chunk ends where an exact resume expects it)."""
    beir = write_synthetic_beir(tmp_path / "beir", num_docs=60, num_queries=20)
    dropout_encoder = write_tiny_encoder(tmp_path / "encoder_dropout", tokenizer_dir)
    config = json.loads((dropout_encoder / "config.json").read_text())
    config.update(DROPOUT)
    (dropout_encoder / "config.json").write_text(json.dumps(config))
    common = [
        "--data.beir", str(beir), "--progress", "false", "--data.q_max_len", "12",
        "--data.p_max_len", "24", "--micro_batch_size", "5", "--negatives.n_hard", "1",
        "--max_steps", "4", "--log_every", "1", "--optim.lr", "1e-3",
        "--optim.warmup_steps", "1", "--checkpoint.every_steps", "2",
    ]  # fmt: skip
    cache = ["--grad_cache.query_chunk", "2", "--grad_cache.passage_chunk", "3"]
    dropout = [*common, "--model.init", str(dropout_encoder), *cache]
    log = _finetune(tmp_path / "straight", dropout)
    assert "GradCache, chunks of 2 queries and 3 passages" in log
    _finetune(tmp_path / "resumed", dropout, "--stop_at_step", "2")
    assert len(_losses(tmp_path / "resumed")) == 2
    _finetune(tmp_path / "resumed", dropout, "--checkpoint.resume", "auto")
    straight = _losses(tmp_path / "straight")
    assert len(straight) == 4 and _losses(tmp_path / "resumed") == straight
