"""Fine-tuning step speed of the SciFact recipe by the CPU's matrix instructions.

Run from the repository root (about 5 minutes on 2 cores)::

    python benchmarks/bench_finetune_isa.py [--steps 20] [--repeats 2] [--json out.json]

The recipe's BM25 arm (``retromae_recipes/finetune.py``: all-MiniLM-L6-v2, batch 16 with 3 hard
negatives each, passages at 128 tokens, bf16 under DeepSpeed) trained for ``--steps`` steps
in a fresh ``python -m retromae_ds.finetune`` process per run, with oneDNN capped at each
instruction set of ``--isa`` through ``ONEDNN_MAX_CPU_ISA`` (oneDNN's own switch; the
machine is unchanged otherwise). Baseline: the uncapped run (oneDNN's best for this CPU,
e.g. AMX). Variants alternate round by round. Reports training tokens/s (the trainer's own
rate, start-up excluded), seconds per step and the ratio to the baseline: what the recipe's
time on a CPU with AMX says about one without.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import common

sys.path.insert(0, str(common.REPO))  # the recipes package sits at the repository root


def _isa_in_use(env: dict[str, str]) -> str:
    """What oneDNN reports it runs a bf16 matmul with under ``env``."""
    code = (
        "import torch\n"
        "x = torch.randn(64, 384, dtype=torch.bfloat16)\n"
        "with torch.no_grad(): torch.nn.Linear(384, 384).bfloat16()(x)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    impl = [line.split(",")[6] for line in out.splitlines() if ",exec,cpu,matmul," in line]
    return impl[-1] if impl else "?"


def _run(config: dict, run_dir: Path, env: dict[str, str]) -> dict[str, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = {**config, "run_dir": str(run_dir)}
    config["refresh"] = {**config["refresh"], "run_dir": str(run_dir)}
    path = run_dir.with_name(run_dir.name + "_config.json")
    path.write_text(json.dumps(config))
    seconds, proc = common.time_call(
        lambda: subprocess.run(
            [sys.executable, "-m", "retromae_ds.finetune", "--config", str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # the trainer reports on stderr
            text=True,
        )
    )
    if proc.returncode != 0:
        raise SystemExit(f"finetune failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r][1:]  # the first window holds warm-up
    return {
        "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rows),
        "queries_per_s": statistics.fmean(r["queries_per_s"] for r in rows),
        "wall_s": seconds,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(common.DEFAULT_DATA))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--isa", default="AVX512_CORE_BF16,AVX512_CORE")
    p.add_argument("--max-wait", type=float, default=60.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from retromae_ds.base.config import to_dict
    from retromae_recipes.finetune import Recipe, RecipeConfig

    scifact = Path(args.data) / "scifact"
    if not (scifact / "corpus.jsonl").is_file():
        raise SystemExit(f"SciFact not found under {scifact} (pass --data DIR)")
    scratch = common.new_scratch("bench_finetune_isa_")
    try:
        recipe = Recipe(
            RecipeConfig(
                data=str(scifact), out=str(scratch), steps=args.steps, curve_seeds=[], seeds=[0]
            )
        )
        config = to_dict(recipe.config("bm25", 0))
        base_env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        base_env.setdefault("DS_ACCELERATOR", "cpu")
        variants = {"default (baseline)": base_env}
        for isa in [s for s in args.isa.split(",") if s]:
            variants[isa] = {**base_env, "ONEDNN_MAX_CPU_ISA": isa}
        isa_used = {name: _isa_in_use(env) for name, env in variants.items()}
        _run(config, scratch / "warmup", base_env)  # tokenizes the data, builds DS ops
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        loads: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, env in variants.items():
                loads[name] = common.wait_until_quiet(args.max_wait)
                results[name].append(_run(config, scratch / "run", env))
        base = max(r["tokens_per_s"] for r in results["default (baseline)"])
        rows, payload = [], {}
        for name, runs in results.items():
            best = max(r["tokens_per_s"] for r in runs)
            qps = max(r["queries_per_s"] for r in runs)
            rows.append(
                [
                    name,
                    isa_used[name],
                    f"{best:,.0f}",
                    f"{config['micro_batch_size'] / qps:.2f}",
                    f"{base / best:.2f}",
                    f"{min(r['wall_s'] for r in runs):.0f}",
                    f"{loads[name]:.2f}",
                ]
            )
            payload[name] = {"isa": isa_used[name], "runs": runs, "other_load": loads[name]}
        print(
            f"recipe BM25 arm, {args.steps} steps, batch {config['micro_batch_size']}, "
            f"best of {args.repeats}"
        )
        common.print_table(
            [
                "oneDNN cap",
                "bf16 matmul kernel",
                "tokens/s",
                "s/step",
                "time vs baseline",
                "run wall s",
                "other load",
            ],
            rows,
        )
        common.write_json(
            args.json, {"machine": common.machine(), "steps": args.steps, "results": payload}
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
