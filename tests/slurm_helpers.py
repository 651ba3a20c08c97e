"""A real Slurm cluster for the tests: started from tests/slurm_cluster/ (Debian's slurmctld,
slurmd and munge, one node or two in network namespaces), driven with sbatch / scontrol /
scancel, stopped by the pid files of what it started. Every wait here is bounded."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import time
from pathlib import Path

from helpers_proc import processes

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "slurm_cluster"
RUN_DIR = Path("/tmp/retromae_ds_slurm")  # the start script accepts only /tmp, /var/tmp, /run
LOCK = Path("/tmp/retromae_ds_slurm.lock")
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class CannotStart(Exception):
    """The cluster cannot run here (not root, no packages, a Slurm that is not ours)."""


class SlurmCluster:
    def __init__(self, cpus_per_node: int = 4) -> None:
        self.cpus_per_node = cpus_per_node
        self.nodes = 0  # 0: not running
        self.cannot: str | None = None
        self._lock = None

    # ------------------------------------------------------------------ life cycle
    def start(self, nodes: int) -> None:
        """Make sure a cluster of ``nodes`` nodes (1 or 2) runs; restarts it to switch."""
        if self.cannot:
            raise CannotStart(self.cannot)
        if self.nodes == nodes:
            return
        if os.geteuid() != 0:
            self.cannot = "the Slurm tests start slurmctld/slurmd/munged and need root"
            raise CannotStart(self.cannot)
        if self._lock is None:
            self._lock = open(LOCK, "w")  # noqa: SIM115 (held for the session)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.cannot = f"another test session holds {LOCK} (its Slurm test cluster runs)"
                raise CannotStart(self.cannot) from None
        env = {
            **os.environ,
            "SLURM_SIM_DIR": str(RUN_DIR),
            "SLURM_SIM_NODES": str(nodes),
            "SLURM_SIM_CPUS": str(self.cpus_per_node),
        }
        result = subprocess.run(
            ["bash", str(SCRIPTS / "start_cluster.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if result.returncode == 3:
            self.cannot = result.stderr.strip().splitlines()[-1]
            raise CannotStart(self.cannot)
        if result.returncode != 0:
            raise RuntimeError(f"start_cluster.sh failed:\n{result.stdout}\n{result.stderr}")
        self.nodes = nodes

    def stop(self) -> None:
        if self.nodes:
            subprocess.run(
                ["bash", str(SCRIPTS / "stop_cluster.sh")],
                env={**os.environ, "SLURM_SIM_DIR": str(RUN_DIR)},
                capture_output=True,
                timeout=120,
            )
            self.nodes = 0
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # ------------------------------------------------------------------ client commands
    def run(
        self, *args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """A client command (sbatch, scontrol, ...), inside node n1's namespace in 2-node mode."""
        return subprocess.run(
            [str(RUN_DIR / "sl"), *args],
            env={**os.environ, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def sbatch(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> int:
        result = self.run("sbatch", "--parsable", *args, env=env, cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """JobState, ExitCode, Restarts, NodeList of a job (from scontrol, else the job
        completion log once slurmctld has forgotten the job)."""
        result = self.run("scontrol", "show", "job", "-o", str(job_id))
        text = result.stdout if result.returncode == 0 else ""
        if not text:
            comp = RUN_DIR / "logs" / "jobcomp.txt"
            lines = [
                line
                for line in (comp.read_text().splitlines() if comp.exists() else [])
                if line.startswith(f"JobId={job_id} ")
            ]
            text = lines[-1] if lines else ""
        return {
            key: m.group(1)
            for key in ("JobState", "ExitCode", "Restarts", "NodeList", "Reason")
            if (m := re.search(rf"\b{key}=(\S+)", text))
        }

    def wait(self, job_id: int, timeout: float = 300) -> dict[str, str]:
        """Poll until the job has ended for good (a requeued job is not); cancel it and fail
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job(job_id)
            if state.get("JobState") in FINAL_STATES:
                return state
            time.sleep(0.5)
        self.run("scancel", str(job_id))
        raise AssertionError(f"job {job_id} did not end within {timeout}s: {self.job(job_id)}")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def job_processes(job_id: int, module: str = "retromae_ds.pretrain", **env_match: str) -> list[int]:
    """Pids of this machine's processes that belong to Slurm job ``job_id`` (by their
    environment), run ``module`` (found in their command line) and whose environment has
    every ``env_match`` entry."""
    want = {"SLURM_JOB_ID": str(job_id), **env_match}
    found = []
    for pid, read in processes("environ", "cmdline"):
        env = dict(item.split(b"=", 1) for item in read["environ"].split(b"\0") if b"=" in item)
        if module.encode() in read["cmdline"] and all(
            env.get(k.encode()) == v.encode() for k, v in want.items()
        ):
            found.append(pid)
    return found
