#!/usr/bin/env python
"""Fixed-seed training runs whose logged losses must not change under a refactor.

Runs pre-training (RetroMAE, SEED-Encoder, MLM; one process and two torchrun ranks with a
stop + exact resume) and fine-tuning (one process; one process training on negatives its local
refresher mined from the step-0 encoder, ``mine_first`` with one version, so the swap point is
fixed; two ranks with a stop + resume) with the
code of a given checkout, on data built once (the built-in corpus), and writes every logged
row plus the wall time of each run. ``--compare A B`` says, run by run, whether the losses
are bit-identical and the ratio of the trainer's tokens/s.

    python scripts/loss_parity.py run --code /path/to/old/checkout --out runs/parity/old
    python scripts/loss_parity.py run --code . --out runs/parity/new
    python scripts/loss_parity.py compare runs/parity/old runs/parity/new
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LOSS_KEYS = ("loss", "mlm_loss", "decoder_loss", "mlm_accuracy", "accuracy")


def _data(root: Path) -> tuple[Path, Path]:
    """Shards and a BEIR task from the first 1,500 built-in documents (built once)."""
    from retromae_ds.data.builtin_corpus import iter_documents, split_for_retrieval, write_beir
    from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

    shards, beir = root / "shards", root / "beir"
    if not (beir / "qrels" / "train.tsv").exists():
        records = list(iter_documents(1500))
        corpus, queries, qrels = split_for_retrieval(records, every=2)
        write_beir(beir, corpus, queries, qrels[len(qrels) // 2 :], qrels[: len(qrels) // 2])
    if not (shards / "manifest.json").exists():
        run_preprocess(
            PreprocessConfig(
                inputs=[str(beir / "corpus.jsonl")],
                out=str(shards),
                train_tokenizer=2000,
                max_length=64,
                workers=1,
                progress=False,
            )
        )
    return shards, beir


def _launch(code: Path, module: str, args: list[str], ranks: int, log: Path) -> float:
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = [*launcher, "-m", module, *args, "--progress", "false"]
    t0 = time.perf_counter()
    with open(log, "a") as f:
        proc = subprocess.run(cmd, cwd=code, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - t0


def run(code: Path, out: Path, data_root: Path) -> None:
    shards, beir = _data(data_root)
    out.mkdir(parents=True, exist_ok=True)
    pre = ["--data.shards", str(shards), "--micro_batch_size", "8", "--log_every", "1",
           "--model.encoder.name", "tiny", "--model.encoder.max_position_embeddings", "64"]  # fmt: skip
    ft = ["--data.beir", str(beir), "--micro_batch_size", "8", "--log_every", "1",
          "--negatives.n_hard", "2", "--negatives.refresh_every", "4", "--data.p_max_len", "64"]  # fmt: skip
    # retromae_ds.train: the pre-training module's old name, which every checkout answers to
    # (retromae_ds/train.py forwards to retromae_ds.pretrain since issue 29)
    plans = {
        "pretrain_retromae_1rank": [("retromae_ds.train", 1, ["--max_steps", "16", "--checkpoint.every_steps", "8"])],
        "pretrain_seed_1rank": [("retromae_ds.train", 1, ["--max_steps", "8", "--model.objective.name", "seed"])],
        "pretrain_mlm_1rank": [("retromae_ds.train", 1, ["--max_steps", "8", "--model.objective.name", "mlm"])],
        "pretrain_retromae_2ranks_resume": [
            ("retromae_ds.train", 2, ["--max_steps", "8", "--stop_at_step", "4"]),
            ("retromae_ds.train", 2, ["--max_steps", "8"]),
        ],
        "finetune_1rank": [("retromae_ds.finetune", 1, ["--max_steps", "12", "--checkpoint.every_steps", "6"])],
        "finetune_refresh_1rank": [("retromae_ds.finetune", 1, [
            "--max_steps", "8", "--refresher", "local", "--negatives.mine_first", "true",
            "--refresh.max_versions", "1", "--refresh.search_backend", "torch", "--refresh.top_k", "20",
        ])],
        "finetune_2ranks_resume": [
            ("retromae_ds.finetune", 2, ["--max_steps", "8", "--stop_at_step", "4"]),
            ("retromae_ds.finetune", 2, ["--max_steps", "8"]),
        ],
    }  # fmt: skip
    results = {}
    for name, steps in plans.items():
        run_dir = out / name
        seconds = 0.0
        for module, ranks, extra in steps:
            common = pre if module == "retromae_ds.train" else ft
            if module == "retromae_ds.finetune":
                init = out / "pretrain_retromae_1rank" / "checkpoints" / "step_00000016"
                common = [*common, "--model.init", str(init)]
            args = ["--run_dir", str(run_dir), *common, *extra]
            seconds += _launch(code, module, args, ranks, out / f"{name}.log")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results[name] = {"seconds": seconds, "rows": rows}
        print(f"{name}: {len(rows)} rows, {seconds:.1f} s", flush=True)
    (out / "parity.json").write_text(json.dumps(results, indent=1))


def compare(a: Path, b: Path) -> int:
    ra = json.loads((a / "parity.json").read_text())
    rb = json.loads((b / "parity.json").read_text())
    bad = 0
    for name in ra:
        xs, ys = ra[name]["rows"], rb.get(name, {}).get("rows", [])
        keys = [k for k in LOSS_KEYS if any(k in r for r in xs)]
        same = len(xs) == len(ys) and all(
            x["step"] == y["step"] and all(x.get(k) == y.get(k) for k in keys)
            for x, y in zip(xs, ys, strict=True)
        )
        bad += not same
        tps = [statistics.fmean(r["tokens_per_s"] for r in rows) for rows in (xs, ys) if rows]
        ratio = tps[1] / tps[0] if len(tps) == 2 else float("nan")
        print(
            f"{name:34} {len(xs):3} rows  losses {'bit-identical' if same else 'DIFFER'}  "
            f"tokens/s B/A {ratio:.3f}  wall {ra[name]['seconds']:.1f}s -> "
            f"{rb[name]['seconds']:.1f}s"
        )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--code", default=".", help="checkout whose retromae_ds runs")
    r.add_argument("--out", required=True)
    r.add_argument("--data", default="runs/parity/data", help="shared data folder (built once)")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run(Path(args.code).resolve(), Path(args.out).resolve(), Path(args.data).resolve())
        return 0
    return compare(Path(args.a), Path(args.b))


if __name__ == "__main__":
    sys.exit(main())
