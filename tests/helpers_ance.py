"""Small BEIR collections, a tiny encoder and the subprocess environment for the ANCE tests.

Shared by the ANCE, refresher, fine-tuning, Slurm and study tests and
``benchmarks/bench_ance.py``: a synthetic BEIR folder whose positives BM25 ranks high, a
randomly initialised 2-layer BERT saved with the test tokenizer, a fixed slice of SciFact, a
prepared training set, a trainer checkpoint as the refresher sees one, the refresher's command
line, and the environment that runs the package's command-line tools on CPU.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff

from helpers_model import NO_DROPOUT, small_config
from synthetic import synthetic_texts

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def write_synthetic_beir(folder: Path, num_docs: int = 80, num_queries: int = 24) -> Path:
    """Documents from the synthetic generator (some empty); query i has positives d{3i} and
    d{3i+1} (relevance 2 and 1), a judged non-relevant d{3i+2} (relevance 0), and its text is
    taken from its first positive, so BM25 ranks the positives high."""
    (folder / "qrels").mkdir(parents=True)
    texts = synthetic_texts(num_docs, seed=5, max_words=30)
    with open(folder / "corpus.jsonl", "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n")
    lines = ["query-id\tcorpus-id\tscore"]
    with open(folder / "queries.jsonl", "w") as f:
        for q in range(num_queries):
            words = (texts[3 * q] or texts[3 * q + 1] or "retrieval").split()[:6]
            f.write(json.dumps({"_id": f"q{q}", "text": " ".join(words)}) + "\n")
            lines += [f"q{q}\td{3 * q}\t2", f"q{q}\td{3 * q + 1}\t1", f"q{q}\td{3 * q + 2}\t0"]
    (folder / "qrels" / "train.tsv").write_text("\n".join(lines) + "\n")
    return folder


def write_tiny_encoder(folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised 2-layer BERT (no dropout) with the test tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    config = BertConfig(
        **small_config(len(tok), max_position_embeddings=128, pad_token_id=tok.pad_token_id),
        **NO_DROPOUT,
    )
    BertModel(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def scifact_slice(src: Path, dst: Path, extra_docs: int, test_queries: int | None = None) -> Path:
    """Every document judged in train or test, plus ``extra_docs`` others (fixed seed). With
    ``test_queries``: only the first that many test queries (file order) and their judgements,
    the corpus every document they judge plus ``extra_docs`` others."""
    rows = {
        split: (src / "qrels" / f"{split}.tsv").read_text().splitlines()
        for split in ("train", "test")
    }
    if test_queries is not None:
        first = list(dict.fromkeys(row.split("\t")[0] for row in rows["test"][1:]))
        kept = set(first[:test_queries])
        rows = {
            "test": rows["test"][:1] + [r for r in rows["test"][1:] if r.split("\t")[0] in kept]
        }
    judged = {row.split("\t")[1] for split_rows in rows.values() for row in split_rows[1:]}
    lines = (src / "corpus.jsonl").read_text().splitlines()
    ids = [json.loads(line)["_id"] for line in lines]
    others = [i for i, doc in enumerate(ids) if doc not in judged]
    keep = set(random.Random(0).sample(others, extra_docs))
    (dst / "qrels").mkdir(parents=True)
    (dst / "corpus.jsonl").write_text(
        "".join(line + "\n" for i, line in enumerate(lines) if i in keep or ids[i] in judged)
    )
    shutil.copy(src / "queries.jsonl", dst / "queries.jsonl")
    for split, split_rows in rows.items():
        if test_queries is None:  # the files as they are (SciFact's qrels end lines in CRLF)
            shutil.copy(src / "qrels" / f"{split}.tsv", dst / "qrels" / f"{split}.tsv")
        else:
            (dst / "qrels" / f"{split}.tsv").write_text("\n".join(split_rows) + "\n")
    return dst


def assert_refresher_threads(log: str, threads: int) -> None:
    """A refresher run with ``--refresh.threads threads`` and ``mine_first``: the step-0
    version (the trainer waits) used torch's default threads, every later one ``threads``."""
    import re

    lines = re.findall(r"refresh: (\d+) torch CPU threads \(step (\d+); default (\d+)\)", log)
    assert lines, log[-2000:]
    for count, step, default in lines:
        expected = int(default) if int(step) == 0 else threads
        assert int(count) == expected, (step, count, expected, lines)
    assert int(lines[0][1]) == 0, lines  # mine_first: the first version is the init's


def load_current(root: Path, retries: int = 5) -> handoff.Negatives | None:
    """A reader of the hand-off: the version ``CURRENT`` names (None before the first publication). Retries when the
    named version disappears between the two reads (pruned by ``keep_last``)."""
    for attempt in range(retries):
        pointer = handoff.read_pointer(root)
        if pointer is None:
            return None
        try:
            return handoff.load_version(root, pointer["version"], sha256=pointer["sha256"])
        except FileNotFoundError:
            if attempt == retries - 1:
                raise
            time.sleep(0.05)
    return None


def prepared_set(root: Path, beir: Path, tokenizer_dir: Path) -> Path:
    """``beir``'s train split tokenized into ``root`` (queries 16 tokens, passages 32)."""
    return ance_data.prepare(
        beir, "train", tokenizer_dir, root, q_max_len=16, p_max_len=32, progress=False
    )


def fake_checkpoint(run_dir: Path, step: int, encoder_dir: Path) -> Path:
    """A complete trainer checkpoint as the refresher sees one: marker + encoder folder."""
    from retromae_ds.components import checkpoint as ckpt
    from retromae_ds.components.layout import step_tag

    folder = run_dir / "checkpoints" / step_tag(step)
    shutil.copytree(encoder_dir, folder / "encoder")
    (folder / ckpt.COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    return folder


def refresh_cmd(run_dir: Path, *extra: str) -> list[str]:
    """``python -m retromae_ds.refresh`` on ``run_dir`` with small settings."""
    return [
        sys.executable,
        "-m",
        "retromae_ds.refresh",
        "--run_dir",
        str(run_dir),
        "--mining.num_negatives",
        "3",
        "--mining.top_k",
        "20",
        "--batch_size",
        "4",
        "--poll_s",
        "0.2",
        "--progress",
        "false",
        "--device",
        "cpu",
        *extra,
    ]


def run_killed(cmd: list[str], point: str, at: str) -> subprocess.CompletedProcess:
    """``cmd`` run with the fault ``point`` set to ``at`` (``faults.crash``: ``os._exit`` as
    ``kill -9`` does, no cleanup); asserts it died there, returns the finished process."""
    from retromae_ds.base import faults

    killed = subprocess.run(
        cmd, env={**ENV, **faults.env(**{point: at})}, capture_output=True, text=True, timeout=180
    )
    assert killed.returncode == faults.CRASH_EXIT, killed.stderr[-3000:]
    return killed
