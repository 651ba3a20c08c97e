"""Pre-training as a user runs it: ``python -m retromae_ds.pretrain`` (one process, torchrun or
the deepspeed launcher) on CPU, and its metrics log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


TINY = [
    "--progress", "false",
    "--model.encoder.name", "tiny",
    "--model.encoder.max_position_embeddings", "64",
]  # fmt: skip
"""Quiet, the ``tiny`` preset at 64 positions: what every pre-training test runs."""
TINY_TRAIN = [*TINY, "--micro_batch_size", "8", "--optim.lr", "1e-3", "--optim.warmup_steps", "2"]
"""``TINY`` with the batch and learning rate the short test runs train at."""


def pretrain_args(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    """``retromae_ds.pretrain``'s arguments on ``shards`` into ``run_dir`` with ``TINY_TRAIN``."""
    return ["--data.shards", str(shards), "--run_dir", str(run_dir), *TINY_TRAIN, *overrides]


def launch_cmd(module: str, args: list[str], ranks: int = 1, launcher: str = "torchrun"):
    """The command line of ``python -m MODULE ARGS`` on ``ranks`` CPU ranks: one plain process,
    ``torchrun`` (``torch.distributed.run --standalone``) or the ``deepspeed`` launcher."""
    if ranks == 1:
        return [sys.executable, "-m", module, *args]
    if launcher == "deepspeed":
        port = str(free_port())
        return [
            "deepspeed",
            f"--num_gpus={ranks}",
            "--master_port",
            port,
            "--module",
            module,
            *args,
        ]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={ranks}", "-m", module, *args,
    ]  # fmt: skip


def run_logged(cmd: list[str], log: Path, *, env: dict, timeout: int, check: bool = True):
    """``cmd`` run from the repository, its output kept in ``log``; a failure (with ``check``)
    is an AssertionError quoting the error lines and naming the log."""
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    log.write_text(result.stdout + "\n---- stderr ----\n" + result.stderr)
    if check and result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "rror" in line or "Abort" in line]
        raise AssertionError(
            f"training failed ({result.returncode}); full log {log}; errors:\n"
            + "\n".join(errors[-40:])
        )
    return result


def pretrain(
    run_dir: Path,
    shards: Path,
    *overrides: str,
    ranks: int = 1,
    launcher: str = "torchrun",
    env: dict | None = None,
    check: bool = True,
):
    cmd = launch_cmd(
        "retromae_ds.pretrain", pretrain_args(shards, run_dir, *overrides), ranks, launcher
    )
    log = run_dir.parent / f"{run_dir.name}.launcher.log"
    return run_logged(cmd, log, env={**ENV, **(env or {})}, timeout=900, check=check)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def synthetic_shards(root: Path, tokenizer_dir: Path, docs: int, seed: int) -> Path:
    """``docs`` synthetic documents (``seed``) preprocessed into ``root/shards`` with the test
    tokenizer at max length 64: the small corpus the training tests run on."""
    from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

    from synthetic import synthetic_texts

    src = root / "docs.jsonl"
    with open(src, "w") as f:
        for i, text in enumerate(synthetic_texts(docs, seed=seed, max_words=40)):
            f.write(json.dumps({"_id": str(i), "text": text}) + "\n")
    cfg = PreprocessConfig(
        inputs=[str(src)],
        out=str(root / "shards"),
        tokenizer=str(tokenizer_dir),
        max_length=64,
        progress=False,
    )
    run_preprocess(cfg)
    return root / "shards"
