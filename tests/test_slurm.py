"""Slurm for real: the session starts its own cluster (tests/slurm_cluster/: Debian's
slurmctld, slurmd and munge; one node, then two nodes in network namespaces joined by a veth
pair) and submits slurm/pretrain.sh and slurm/preprocess.sh with sbatch, as users do.

On CPU with a tiny model: 1 node x 2 tasks trains and its loss falls; preemption by a signal
writes a checkpoint, requeues the job and the resumed run reproduces the uninterrupted losses
exactly; a rank killed with SIGKILL fails the job in bounded time and leaves a loadable
checkpoint; the preprocessing array job equals one local run; 2 nodes x 1 task (srun and the
deepspeed launcher) rendezvous across the virtual link and compute the same losses as 1 x 2;
slurm/finetune.sh runs the ANCE trainer and refresher as concurrent job steps, and the trainer
swaps to negatives the refresher mined from its checkpoints.
Skips, saying why, when not root, when the packages cannot be installed, or when a Slurm that
these tests did not start is present. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers_train import TINY_TRAIN
from slurm_helpers import FINAL_STATES, CannotStart, SlurmCluster, job_processes, wait_for

from retromae_ds.base import faults
from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import step_tag
from retromae_ds.components.signals import EXIT_REQUEUE
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

from synthetic import synthetic_texts

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 20
TRAIN = [
    *TINY_TRAIN,
    "--max_steps",
    str(MAX_STEPS),
    "--log_every",
    "1",
    "--deepspeed.timeout_s",
    "60",
]
COMPARED = ("loss", "mlm_loss", "decoder_loss", "mlm_accuracy", "lr")


@pytest.fixture(scope="session")
def slurm_cluster():
    cluster = SlurmCluster()
    yield cluster
    cluster.stop()


def cluster_with(slurm_cluster: SlurmCluster, nodes: int) -> SlurmCluster:
    try:
        slurm_cluster.start(nodes)
    except CannotStart as exc:
        pytest.skip(f"no Slurm test cluster: {exc}")
    return slurm_cluster


@pytest.fixture
def one_node(slurm_cluster) -> SlurmCluster:
    return cluster_with(slurm_cluster, 1)


@pytest.fixture
def two_nodes(slurm_cluster) -> SlurmCluster:
    return cluster_with(slurm_cluster, 2)


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("slurm_docs") / "docs.jsonl"
    with open(src, "w") as f:
        for i, text in enumerate(synthetic_texts(600, seed=21, max_words=40)):
            f.write(json.dumps({"_id": str(i), "text": text}) + "\n")
    return src


@pytest.fixture(scope="module")
def shards(tmp_path_factory, docs, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("slurm_shards") / "shards"
    run_preprocess(
        PreprocessConfig(
            inputs=[str(docs)],
            out=str(out),
            tokenizer=str(tokenizer_dir),
            max_length=64,
            progress=False,
        )
    )
    return out


def submit_pretrain(
    cluster: SlurmCluster,
    run_dir: Path,
    shards: Path,
    *sbatch_opts: str,
    launcher: str = "srun",
    extra: tuple[str, ...] = (),
    env: dict | None = None,
) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    return cluster.sbatch(
        f"--output={run_dir}/slurm-%j.out",
        "--cpus-per-task=1",
        *sbatch_opts,
        str(REPO / "slurm" / "pretrain.sh"),
        "--run-dir",
        str(run_dir),
        "--launcher",
        launcher,
        "--",
        "--data.shards",
        str(shards),
        *TRAIN,
        *extra,
        env=env,
        cwd=REPO,
    )


def wait_while_running(
    cluster: SlurmCluster, job: int, predicate, what: str, run: Path, interval: float = 0.3
):
    """Wait (bounded) until ``predicate()`` holds; fail at once if the job ends first."""

    def check():
        if predicate():
            return True
        if cluster.job(job).get("JobState") in FINAL_STATES:
            raise AssertionError(f"job {job} ended before {what}:\n{explain(run, job)}")
        return False

    wait_for(check, 180, what, interval=interval)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compared(rows: list[dict]) -> list[dict]:
    return [{"step": r["step"], **{k: r[k] for k in COMPARED}} for r in rows]


def job_log(run_dir: Path, job_id: int) -> str:
    for path in (run_dir / f"slurm-{job_id}.out", run_dir / "logs" / f"slurm-{job_id}.out"):
        if path.exists():
            return path.read_text()
    return f"(no batch log of job {job_id})"


def explain(run_dir: Path, job_id: int) -> str:
    """The batch log and the tails of the rank logs, for assertion messages."""
    parts = [job_log(run_dir, job_id)]
    for log in sorted((run_dir / "logs").glob("*/*.log")):
        parts.append(f"---- {log}\n" + "\n".join(log.read_text().splitlines()[-15:]))
    return "\n".join(parts)


# ------------------------------------------------------------------------ 1 node x 2 tasks
@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory, shards) -> dict:
    """The uninterrupted run every other run is compared with: 1 node x 2 tasks, srun."""
    cluster = cluster_with(slurm_cluster, 1)
    run = tmp_path_factory.mktemp("slurm_reference") / "run"
    t0 = time.monotonic()
    job = submit_pretrain(cluster, run, shards, "--nodes=1", "--ntasks=2")
    state = cluster.wait(job)
    return {"run": run, "job": job, "state": state, "seconds": time.monotonic() - t0}


def test_one_node_two_tasks_trains_and_checkpoints(reference):
    run, job, state = reference["run"], reference["job"], reference["state"]
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", explain(run, job)
    assert state["Restarts"] == "0"
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, [r["loss"] for r in rows]
    final = ckpt.latest_complete(run / "checkpoints")
    assert final is not None and ckpt.read_marker(final)["step"] == MAX_STEPS
    assert ckpt.read_marker(final)["world_size"] == 2
    assert {p.name for p in final.glob("rank_*.pt")} == {"rank_00000.pt", "rank_00001.pt"}
    # MASTER_ADDR: the allocation's first host; MASTER_PORT derived from the job id
    host = state["NodeList"]
    assert f"master {host}:{10000 + job % 20000}" in job_log(run, job)
    logs = run / "logs" / f"job{job}.0"
    for rank in (0, 1):
        text = (logs / f"rank_{rank}.log").read_text()
        assert f"rank {rank}/2 (local {rank}) on {host}, gloo, master {host}:" in text


# ------------------------------------------------------------------------ preemption
def test_signal_checkpoints_requeues_and_resumes_exactly(one_node, tmp_path, shards, reference):
    run = tmp_path / "run"
    # slow steps (a test hook that sleeps after each step) leave time to signal mid-run
    job = submit_pretrain(
        one_node,
        run,
        shards,
        "--nodes=1",
        "--ntasks=2",
        env=faults.env(sleep_after_step_s=0.3),
    )
    wait_while_running(one_node, job, lambda: len(metrics(run)) >= 3, "step 3", run)
    # what Slurm does at the time-limit warning of --signal=B:USR1@lead: USR1 to the batch shell
    signalled = one_node.run("scancel", "--signal=USR1", "--batch", str(job))
    assert signalled.returncode == 0, signalled.stderr
    state = one_node.wait(job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", explain(run, job)
    assert state["Restarts"] == "1", explain(run, job)
    batch_log = job_log(run, job)
    assert "got SIGUSR1" in batch_log and "trainer exited with 85" in batch_log, batch_log
    assert f"job {job} requeued" in batch_log
    first = (run / "logs" / f"job{job}.0" / "rank_0.log").read_text()
    stopped = re.search(r"stop signal: checkpoint of step (\d+) complete", first)
    assert stopped, first[-3000:]
    step = int(stopped.group(1))
    assert 3 <= step < MAX_STEPS
    assert (run / "checkpoints" / step_tag(step) / ckpt.COMPLETE).is_file()
    second = (run / "logs" / f"job{job}.1" / "rank_0.log").read_text()
    assert f"resumed from {run / 'checkpoints' / step_tag(step)} at step {step}" in second
    # every step once, and the losses after the requeue equal the uninterrupted run's
    assert compared(metrics(run)) == compared(metrics(reference["run"]))
    final = ckpt.latest_complete(run / "checkpoints")
    assert ckpt.read_marker(final)["step"] == MAX_STEPS


# ------------------------------------------------------------------------ a rank dies
def test_rank_killed_fails_the_job_in_bounded_time(one_node, tmp_path, shards, reference):
    run = tmp_path / "run"
    job = submit_pretrain(
        one_node,
        run,
        shards,
        "--nodes=1",
        "--ntasks=2",
        extra=("--checkpoint.every_steps", "2"),
        env=faults.env(sleep_after_step_s=0.3),
    )

    def checkpoint_at_least_4():
        done = ckpt.latest_complete(run / "checkpoints")
        return done is not None and ckpt.read_marker(done)["step"] >= 4

    wait_while_running(one_node, job, checkpoint_at_least_4, "a checkpoint of step >= 4", run)
    (victim,) = job_processes(job, RANK="1")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    state = one_node.wait(job, timeout=120)
    elapsed = time.monotonic() - killed_at
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0", explain(run, job)
    assert state["ExitCode"] != f"{EXIT_REQUEUE}:0" and state["Restarts"] == "0"
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end after a rank died"
    print(f"job {job} ended {elapsed:.1f}s after rank 1 was killed")  # shown with pytest -s
    wait_for(lambda: not job_processes(job), 15, "the job's trainer processes to end")
    last = ckpt.latest_complete(run / "checkpoints")
    step = ckpt.read_marker(last)["step"]
    assert 4 <= step < MAX_STEPS and ckpt.read_marker(last)["world_size"] == 2
    # loadable: the same job submitted again resumes from it and finishes like the reference
    again = submit_pretrain(one_node, run, shards, "--nodes=1", "--ntasks=2")
    state = one_node.wait(again)
    assert state["JobState"] == "COMPLETED", explain(run, again)
    resumed = (run / "logs" / f"job{again}.0" / "rank_0.log").read_text()
    assert f"resumed from {last} at step {step}" in resumed
    after = compared([r for r in metrics(run) if r["step"] > step])
    assert after == compared(metrics(reference["run"]))[step:]


# ------------------------------------------------------------------------ preprocessing
def output_files(out: Path) -> dict[str, bytes]:
    files = {p.relative_to(out).as_posix(): p.read_bytes() for p in (out / "shards").iterdir()}
    files["manifest.json"] = (out / "manifest.json").read_bytes()
    return files


def test_preprocess_array_job_equals_one_local_run(one_node, tmp_path, docs, tokenizer_dir):
    opts = ["--max_length", "32", "--shard_size", "3000"]
    run_preprocess(
        PreprocessConfig(
            inputs=[str(docs)],
            out=str(tmp_path / "local"),
            tokenizer=str(tokenizer_dir),
            max_length=32,
            shard_size=3000,
            progress=False,
        )
    )
    out = tmp_path / "array"
    result = one_node.run(
        "bash",
        str(REPO / "slurm" / "preprocess.sh"),
        "--tasks",
        "3",
        "--out",
        str(out),
        "--wait",
        "--",
        str(docs),
        "--tokenizer",
        str(tokenizer_dir),
        *opts,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ids = re.search(r"array (\d+) merge (\d+)", result.stdout)
    assert ids, result.stdout
    logs = sorted(p.name for p in (out / "logs").iterdir())
    array = ids.group(1)
    assert logs == [f"merge-{ids.group(2)}.out"] + [f"preprocess-{array}_{i}.out" for i in range(3)]
    for i in range(3):
        assert (
            f"preprocess task {i}/3" in (out / "logs" / f"preprocess-{array}_{i}.out").read_text()
        )
    local = output_files(tmp_path / "local")
    assert len([name for name in local if name.endswith(".arrow")]) > 3
    assert output_files(out) == local


# ------------------------------------------------------------------------ 2 nodes x 1 task
@pytest.mark.parametrize("launcher", ["srun", "deepspeed"])
def test_two_nodes_rendezvous_across_the_link(two_nodes, tmp_path, shards, reference, launcher):
    run = tmp_path / launcher
    if launcher == "srun":
        # the script submits itself when run outside a job (its sbatch options from its own)
        submitted = two_nodes.run(
            "bash",
            str(REPO / "slurm" / "pretrain.sh"),
            *("--nodes", "2", "--tasks-per-node", "1", "--time", "15", "--run-dir", str(run)),
            *("--", "--data.shards", str(shards), *TRAIN),
            cwd=REPO,
        )
        assert submitted.returncode == 0, submitted.stderr
        job = int(re.fullmatch(r"Submitted batch job (\d+)\s*", submitted.stdout).group(1))
        shown = two_nodes.run("scontrol", "show", "job", str(job)).stdout
        assert "Requeue=1" in shown and "TimeLimit=00:15:00" in shown, shown
        assert f"StdOut={run}/logs/slurm-{job}.out" in shown, shown
    else:
        job = submit_pretrain(
            two_nodes, run, shards, "--nodes=2", "--ntasks-per-node=1", launcher=launcher
        )
    state = two_nodes.wait(job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", explain(run, job)
    assert state["NodeList"] == "n[1-2]"
    logs = run / "logs" / f"job{job}.0"
    if launcher == "srun":
        rank_logs = [logs / "rank_0.log", logs / "rank_1.log"]
    else:  # one deepspeed launcher per node, from a hostfile of the allocation
        assert (logs / "hostfile").read_text() == "n1 slots=1\nn2 slots=1\n"
        rank_logs = [next(logs.glob(f"*_rank{r}.log")) for r in (0, 1)]
    # rank 1 runs in n2's network namespace: it reaches the master n1 (10.200.0.1) only
    # over the veth link
    for rank, (log, node) in enumerate(zip(rank_logs, ("n1", "n2"), strict=True)):
        assert f"rank {rank}/2 (local 0) on {node}, gloo, master n1:" in log.read_text()
    assert compared(metrics(run)) == compared(metrics(reference["run"]))
    final = ckpt.latest_complete(run / "checkpoints")
    assert ckpt.read_marker(final) | {"files": None} == {
        "step": MAX_STEPS,
        "world_size": 2,
        "objective": "retromae",
        "files": None,
    }


# ------------------------------------------------------------------------ ANCE fine-tuning
FT_MAX_STEPS = 200  # about 10 ms a step here: the trainer would finish before the refresher
FT_CKPT_EVERY = 10  # has started, were it not held (below)


def test_finetune_without_a_refresher_step_trains_a_cross_encoder(
    one_node, tmp_path, tokenizer_dir
):
    """slurm/finetune.sh --refresher-tasks 0: no refresher step, the trainer holds every task
    and runs with --refresher none, which a cross-encoder needs (it refuses a refresher)."""
    from helpers_ance import write_synthetic_beir, write_tiny_encoder

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=60, num_queries=20)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    run = tmp_path / "run"
    run.mkdir()
    job = one_node.sbatch(
        f"--output={run}/slurm-%j.out",
        *("--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--time=10"),
        str(REPO / "slurm" / "finetune.sh"),
        *("--run-dir", str(run), "--refresher-tasks", "0", "--"),
        "--progress", "false", "--data.beir", str(beir), "--model.init", str(encoder),
        "--model.kind", "cross_encoder", "--data.q_max_len", "16", "--data.p_max_len", "24",
        "--micro_batch_size", "4", "--negatives.n_hard", "2", "--max_steps", "3",
        "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]',
        env={"PYTHON": sys.executable},
        cwd=REPO,
    )  # fmt: skip
    state = one_node.wait(job, timeout=180)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", explain(run, job)
    batch_log = job_log(run, job)
    assert "trainer 1 task(s)" in batch_log and "refresher 0 task(s)" in batch_log, batch_log
    assert not list((run / "logs" / f"job{job}.0").glob("refresher_*.log"))
    final = ckpt.latest_complete(run / "checkpoints")
    assert ckpt.read_marker(final)["step"] == 3
    assert ckpt.read_marker(final)["model_kind"] == "cross_encoder"


def test_finetune_trainer_and_refresher_as_concurrent_steps(one_node, tmp_path, tokenizer_dir):
    """slurm/finetune.sh on 1 node x 2 tasks: 1 trainer task + 1 refresher task, two
    concurrent ``srun --exact`` steps talking through the run folder only."""
    from retromae_ds.finetuning import handoff

    from helpers_ance import write_synthetic_beir, write_tiny_encoder

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=60, num_queries=20)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    run = tmp_path / "run"
    run.mkdir()
    t0 = time.monotonic()
    job = one_node.sbatch(
        f"--output={run}/slurm-%j.out",
        *("--nodes=1", "--ntasks=2", "--cpus-per-task=1", "--time=15"),
        str(REPO / "slurm" / "finetune.sh"),
        *("--run-dir", str(run), "--refresher-tasks", "1", "--"),
        "--progress", "false", "--data.beir", str(beir), "--model.init", str(encoder),
        "--data.q_max_len", "16", "--data.p_max_len", "24",
        "--micro_batch_size", "4", "--negatives.n_hard", "2",
        "--max_steps", str(FT_MAX_STEPS), "--log_every", "1", "--negatives.refresh_every", "2",
        "--checkpoint.every_steps", str(FT_CKPT_EVERY), "--checkpoint.keep_last", "0",
        "--optim.lr", "1e-3", "--optim.warmup_steps", "1", "--deepspeed.timeout_s", "60",
        "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]',
        "--refresh.device", "cpu", "--refresh.search_backend", "torch", "--refresh.poll_s", "0.3",
        "--refresh.mining.num_negatives", "3", "--refresh.batch_size", "64",
        "--refresh.progress", "false",
        env={"PYTHON": sys.executable},
        cwd=REPO,
    )  # fmt: skip
    neg_root = run / "negatives"

    def first_checkpoint():
        return ckpt.latest_complete(run / "checkpoints") is not None

    wait_while_running(
        one_node, job, first_checkpoint, "the trainer's first checkpoint", run, interval=0.05
    )

    # the refresher step starts late (it polls for refresh_config.json every 5 s, then imports
    # torch): hold the trainer (SIGSTOP) until the refresher has published a version mined from
    # one of its checkpoints, then let it go on; both steps keep running throughout
    def mined():
        pointer = handoff.read_pointer(neg_root)
        return pointer is not None and pointer["version"] >= 1

    # (RANK: the trainer itself, not the srun whose command line names it)
    trainers = job_processes(job, module="retromae_ds.finetune", RANK="0")
    assert len(trainers) == 1, (trainers, explain(run, job))
    os.kill(trainers[0], signal.SIGSTOP)
    try:
        assert not (run / "FINISHED").exists(), "the trainer finished before it was held"
        wait_while_running(one_node, job, mined, "a negatives version from the refresher", run)
    finally:
        os.kill(trainers[0], signal.SIGCONT)
    state = one_node.wait(job, timeout=180)
    elapsed = time.monotonic() - t0
    print(f"finetune job {job} took {elapsed:.1f}s")  # shown with pytest -s
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", explain(run, job)
    assert state["Restarts"] == "0"
    batch_log = job_log(run, job)
    assert "trainer 1 task(s)" in batch_log and "refresher 1 task(s)" in batch_log, batch_log
    assert "trainer exited with 0" in batch_log, batch_log
    # the refresher ended by itself once the trainer had finished
    assert "ending the refresher step" not in batch_log, batch_log
    logs = run / "logs" / f"job{job}.0"
    refresher_log = (logs / "refresher_0.log").read_text()
    assert "refresh: stopping (the run is finished" in refresher_log, refresher_log[-3000:]

    # the trainer's last checkpoint is complete
    final = ckpt.latest_complete(run / "checkpoints")
    marker = ckpt.read_marker(final)
    assert marker["step"] == FT_MAX_STEPS and marker["world_size"] == 1, marker
    assert (final / "encoder" / "dual_encoder.json").is_file()
    assert (run / "FINISHED").is_file()
    assert not list((run / "checkpoints").glob("*.partial"))

    # versions beyond the BM25 v0, each mined from a complete trainer checkpoint
    versions = handoff.published_versions(neg_root)
    assert versions[0] == 0 and len(versions) >= 2, versions
    manifests = {v: json.loads(handoff.manifest_file(neg_root, v).read_text()) for v in versions}
    assert manifests[0]["step"] == 0
    for v in versions[1:]:
        step = manifests[v]["step"]
        assert step > 0 and step % FT_CKPT_EVERY == 0, manifests[v]
        assert ckpt.read_marker(run / "checkpoints" / step_tag(step))["step"] == step

    # the trainer swapped to a refresher version at a step boundary and trained on it
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, FT_MAX_STEPS + 1))
    used = [r["negatives_version"] for r in rows]
    assert used == sorted(used) and used[0] == 0, used
    trained_on = [v for v in set(used) if v >= 1]
    assert trained_on, used
    for v in trained_on:
        first = next(r for r in rows if r["negatives_version"] == v)
        assert first["negatives_staleness"] == first["step"] - manifests[v]["step"], first
    assert marker["negatives_version"] >= used[-1]
