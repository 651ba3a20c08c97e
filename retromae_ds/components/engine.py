"""The one module that talks to DeepSpeed: process group, engine, and checkpoint I/O.

Rank and world size come from the environment, whoever launched us: one plain process,
``torchrun``, the ``deepspeed`` launcher (RANK / WORLD_SIZE / LOCAL_RANK) or ``srun``
(SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID). CUDA uses NCCL; CPU uses gloo with DeepSpeed's
CPU accelerator (``DS_ACCELERATOR=cpu``).

Batch size, accumulation and gradient clipping come from the training config and are written
into the DeepSpeed dict here; a ds_config file that sets them differently is an error rather
than a silent override. The optimizer is ``torch.optim.AdamW`` passed from code (a
config-declared optimizer would JIT-build fused Adam for ~90 s on CPU).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from retromae_ds.base.config import resumable

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


@dataclass(kw_only=True)
class DeepSpeedSettings:
    """How DeepSpeed runs: ZeRO stage / offload and precision, as ds_config JSON files."""

    config: list[str] = field(
        default_factory=lambda: ["ds_configs/zero2.json", "ds_configs/fp32.json"]
    )
    """ds_config files merged in order (ZeRO settings, then precision)."""
    timeout_s: int = resumable(600)
    """Collective timeout: a rank that died makes the others fail after this, not hang."""


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def env_int(*names: str, default: int) -> int:
    """The first of the environment variables ``names`` that is set, as an int."""
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHM_COMM_OP = "deepspeed_shm_comm"


def _without_shm_comm(deepspeed: Any) -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op for one CPU process.

    DeepSpeed's torch backend builds ``deepspeed_shm_comm`` (a C++ extension: about 60 s of
    g++ on a 2-core machine, cached per machine under ``TORCH_EXTENSIONS_DIR``) every time it
    starts on the CPU, to speed up all-reduces between the ranks of a node. One process has
    no peer to reduce with, so the op is marked incompatible and ``build_shm_op`` returns None;
    gloo carries the (trivial) collectives. Runs with several ranks keep the op (built once
    per machine, then loaded from the cache)."""
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict) and compatible.get(SHM_COMM_OP):
        deepspeed.ops.__compatible_ops__ = {**compatible, SHM_COMM_OP: False}


def setup_distributed(timeout_s: int = 600) -> DistInfo:
    """Initialise the process group (idempotent) and return this process's place in it."""
    rank = env_int("RANK", "SLURM_PROCID", default=0)
    world = env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local = env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise RuntimeError("multi-process run without MASTER_ADDR / MASTER_PORT in the environment")
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import datetime

    import deepspeed

    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        if not cuda and world == 1:
            _without_shm_comm(deepspeed)
        deepspeed.init_distributed(
            dist_backend=backend, verbose=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if world > 1:  # one line per rank: where each rank ran, in its own log (srun, launchers)
        print(
            f"rank {rank}/{world} (local {local}) on {socket.gethostname()}, {backend}, "
            f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            file=sys.stderr,
            flush=True,
        )
    return DistInfo(rank, world, local, device, backend)


def shipped_ds_configs() -> list[str]:
    """Names of the ds_config files shipped inside the package (``zero2.json``, ...)."""
    folder = resources.files("retromae_ds") / "ds_configs"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".json"))


def resolve_ds_config(name: str) -> Path | Traversable:
    """Where ds_config ``name`` is read from.

    A file that exists as given (relative to the working directory, or absolute) wins: a
    user's own config. Otherwise ``zero2.json`` or ``ds_configs/zero2.json`` (any path whose
    folder is called ``ds_configs``) names the copy shipped inside the package, so configs
    resolve from any working directory and in a non-editable install. Anything else is a
    FileNotFoundError listing the shipped configs; a path into some other folder never falls
    back silently to a shipped file of the same name.
    """
    path = Path(name)
    if path.is_file():
        return path
    shipped = shipped_ds_configs()
    if path.name in shipped and path.parent.name in ("", "ds_configs"):
        return resources.files("retromae_ds") / "ds_configs" / path.name
    raise FileNotFoundError(
        f"ds_config file not found: {name} (not a file from {Path.cwd()}, and not one of "
        f"the configs shipped in retromae_ds/ds_configs: {', '.join(shipped)})"
    )


def build_ds_config(
    files: list[str],
    *,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    grad_clip: float,
    cuda: bool,
) -> dict[str, Any]:
    """Merge the ds_config files and write the training config's batch settings into them."""
    merged: dict[str, Any] = {}
    for name in files:
        path = resolve_ds_config(name)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON ({exc})") from exc
        _deep_update(merged, data)
    wanted = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "gradient_clipping": grad_clip,
    }
    for key, value in wanted.items():
        if key in merged and merged[key] not in (value, "auto"):
            raise ValueError(
                f"ds_config sets {key}={merged[key]!r} but the training config implies {value!r}; "
                "set batch size, accumulation and clipping in the training config only"
            )
        merged[key] = value
    if not cuda and merged.get("fp16", {}).get("enabled"):
        raise ValueError("fp16 does not run on CPU; use ds_configs/bf16.json or fp32.json")
    merged["zero_allow_untested_optimizer"] = True
    return merged


def _deep_update(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_update(into[k], v)
        else:
            into[k] = v


def initialize(model: torch.nn.Module, optimizer, scheduler, ds_config: dict[str, Any]):
    """Wrap model/optimizer/scheduler in a DeepSpeed engine. Parameters the model's forward
    reads outside their owners' forward (``model.external_parameters()``, if it has that
    method) are registered for ZeRO-3's gathering first."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for param in getattr(model, "external_parameters", list)():
        register_external_parameter(model, param)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    return engine


def backward_parts(engine, parts: int, part_loss: Callable[[int], torch.Tensor]) -> None:
    """Several backward passes inside one micro-batch (GradCache's chunks): ``part_loss(i)``
    (a forward through ``engine(...)``, so ZeRO-3 gathers the weights and counts the pass)
    then ``engine.backward`` of it, for ``i`` in ``range(parts)``. Only the last pass may close
    the gradient-accumulation boundary, and does when the micro-batch does: the earlier ones
    accumulate as the micro-batches before a boundary do (ZeRO 0/1 keep them on the
    parameters, ZeRO 2/3 reduce them into their partitions as they go), the last triggers the
    reduction a plain ``engine.backward`` would. Each pass is scaled by the accumulation steps
    as a plain one is; the engine's own boundary setting is put back afterwards (as
    DeepSpeed's ``coalesce_grad_reduction`` does), so ``engine.step()`` counts as usual."""
    closes = engine.is_gradient_accumulation_boundary()
    saved = engine._is_gradient_accumulation_boundary
    try:
        for i in range(parts):
            engine.set_gradient_accumulation_boundary(closes and i == parts - 1)
            engine.backward(part_loss(i))
    finally:
        engine._is_gradient_accumulation_boundary = saved


def save_engine(engine, folder: Path, tag: str, client_state: dict[str, Any]) -> None:
    """DeepSpeed state (module, optimizer, scheduler) into ``folder/tag``; every rank calls it."""
    engine.save_checkpoint(str(folder), tag=tag, client_state=client_state, save_latest=False)


def load_engine(engine, folder: Path, tag: str) -> dict[str, Any]:
    path, client_state = engine.load_checkpoint(str(folder), tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {folder / tag}")
    return client_state


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _on_backend_device(values: torch.Tensor) -> torch.Tensor:
    """A copy of ``values`` where the process group can reduce it: NCCL reduces CUDA tensors
    only, so a host tensor (token totals) goes to this rank's GPU and back."""
    if values.device.type == "cpu" and torch.distributed.get_backend() == "nccl":
        return values.to(torch.device("cuda", torch.cuda.current_device()))
    return values.clone()


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """Element-wise mean over ranks, on ``values``' device (every rank must call it)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        reduced = _on_backend_device(values)
        torch.distributed.all_reduce(reduced)
        reduced /= torch.distributed.get_world_size()
        return reduced.to(values.device)
    return values


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over ranks (every rank must call it)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        reduced = _on_backend_device(values)
        torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
        return reduced.to(values.device)
    return values


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (picklable objects; every rank must call it)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def any_ranks(flags: list[bool], device: torch.device) -> list[bool]:
    """For each flag, True on every rank when it is true on at least one (one all-reduce);
    every rank must call it."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return list(flags)
    value = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return [bool(v) for v in value.tolist()]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on at least one; every rank must call it."""
    return any_ranks([flag], device)[0]


def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full (unpartitioned) module weights on rank 0 (None elsewhere), for any ZeRO stage;
    every rank must call it.

    Under ZeRO-3 the parameters are gathered one module at a time with DeepSpeed's public
    ``deepspeed.zero.GatheredParameters`` (read-only, ``modifier_rank=None``: no broadcast on
    exit), so at most one layer is whole on each rank at a time, and rank 0 copies it to CPU.
    This is what the private ``engine._zero3_consolidated_16bit_state_dict()`` does, with the
    same result: the same keys as ``module.state_dict()`` (persistent buffers included) and
    tied weights as one shared tensor; but a bf16 run's parameters are its fp32 master weights
    (``_master_weights``), not their bf16 copies.
    """
    rank = torch.distributed.get_rank()
    master = _master_weights(engine)  # collective: before any rank returns
    if not engine.zero_optimization_partition_weights():
        state = engine.module.state_dict()
        return _with_master(state, master) if rank == 0 else None
    import deepspeed

    # the keys and their order come from state_dict() itself (partitioned parameters are empty
    # placeholders there, so this costs nothing); persistent buffers are the ones it lists
    keys = list(engine.module.state_dict().keys())
    wanted = set(keys)
    state: dict[str, torch.Tensor] = {}
    first_key: dict[int, str] = {}  # id(parameter) -> its first key: tied weights stay tied

    # every path, like state_dict(): a module or parameter registered twice appears twice
    for path, module in engine.module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        with deepspeed.zero.GatheredParameters(
            list(module.parameters(recurse=False)), modifier_rank=None
        ):
            if rank != 0:
                continue
            for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
                if id(param) in first_key:
                    state[prefix + name] = state[first_key[id(param)]]
                else:  # a copy: the gathered storage is released on exit
                    state[prefix + name] = param.detach().to("cpu", copy=True)
                    first_key[id(param)] = prefix + name
            for name, buf in module.named_buffers(recurse=False, remove_duplicate=False):
                if prefix + name in wanted:  # buffers are never partitioned
                    state[prefix + name] = buf.detach().to("cpu", copy=True)
    return _with_master({key: state[key] for key in keys}, master) if rank == 0 else None


def _master_weights(engine) -> dict[str, torch.Tensor]:
    """The fp32 master copies of a bf16 / fp16 run's parameters (DeepSpeed's public
    ``safe_get_full_fp32_param``: ZeRO 1-3 and the bf16 optimizer), on CPU; empty for an fp32
    run. Every rank must call it (it gathers the optimizer's partitions)."""
    params = list(engine.module.named_parameters())
    if not any(p.dtype in (torch.bfloat16, torch.float16) for _, p in params):
        return {}
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in params:
        full = safe_get_full_fp32_param(param)
        if full is not None:
            out[name] = full.detach().to("cpu", torch.float32, copy=True)
    return out


def _with_master(
    state: dict[str, torch.Tensor], master: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state`` with each parameter replaced by its fp32 master copy (a tied weight under
    every key that shares it), so saved models keep the precision training updates in rather
    than the bf16 copy the forward pass uses."""
    if not master:
        return state
    keys_of: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, tensor in state.items():
        keys_of.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(key)
    out = dict(state)
    for name, full in master.items():
        tensor = state.get(name)
        if tensor is None:
            continue
        for key in keys_of[(tensor.data_ptr(), tuple(tensor.shape))]:
            out[key] = full
    return out
