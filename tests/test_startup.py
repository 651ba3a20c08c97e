"""Start-up of one CPU process: DeepSpeed's shared-memory comm op is not compiled.

DeepSpeed's torch backend compiles ``deepspeed_shm_comm`` (a C++ extension, about 60 s of g++
on these machines) whenever it starts on the CPU, unless a cached build is found under
``TORCH_EXTENSIONS_DIR``; the side-by-side benchmark against FlagEmbedding saw 52-62 s before
the first step in 3 of 4 runs. One process has no peer to all-reduce with through shared
memory, so ``setup_distributed`` keeps DeepSpeed from building it (components/engine.py).
The check is what is left in an empty extensions folder, not a wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
from retromae_ds.components.engine import setup_distributed
import deepspeed.comm.comm as comm
dist = setup_distributed()
print(dist.world_size, comm.cdb.shm_comm_op)
"""


def test_one_cpu_process_does_not_compile_the_shm_comm_op(tmp_path):
    ext = tmp_path / "torch_extensions"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
    }
    env.update(TORCH_EXTENSIONS_DIR=str(ext), DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1", "None"], result.stdout
    built = sorted(p.name for p in ext.iterdir()) if ext.exists() else []
    assert not any("shm" in name for name in built), built
