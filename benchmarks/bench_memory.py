"""Resident memory over a long run: the allocator's free pages returned after each step, or not.

A tiny RetroMAE model (bert-base vocabulary, 30,522) trains on variable-length batches of 32
(20-126 tokens: what the collator sees from real text) with AdamW, one process per arm:
``trim`` calls ``components.memory.release_freed_memory`` after each optimizer step, as the
Trainer does; ``keep`` is the same with ``RETROMAE_DS_MALLOC_TRIM=0`` (glibc keeps the free
pages). Prints RSS every ``--every`` steps and, per arm, the growth from ``--from`` to the
last step.

    python benchmarks/bench_memory.py --steps 1000 --keep-steps 150 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import numpy as np, torch
sys.path.insert(0, {repo!r})
from retromae_ds.components.memory import release_freed_memory
from retromae_ds.data.collate import MaskingConfig, PretrainCollator
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel
from retromae_ds.base.special_tokens import SpecialIds

VOCAB, steps, every = 30522, {steps}, {every}
special = SpecialIds(cls=2, sep=3, pad=0, mask=4, all=(0, 1, 2, 3, 4), vocab_size=VOCAB)
collator = PretrainCollator(special, MaskingConfig(), 128, decoder=True)
torch.manual_seed(0)
encoder = build_encoder(EncoderConfig(name="tiny", max_position_embeddings=128), VOCAB, 0)
model = PretrainModel(encoder, ObjectiveConfig(name="retromae", decoder_ratio=0.5))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
rng = np.random.default_rng(0)

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

start = time.perf_counter()
for step in range(1, steps + 1):
    items = []
    for r in range(32):
        n = int(rng.integers(20, 127))
        ids = (rng.zipf(1.3, n) % (VOCAB - 5) + 5).astype(np.int32)
        items.append((step * 32 + r, ids, (rng.random(n) < 0.75).astype(np.uint8)))
    out = model(collator(items))
    out["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    release_freed_memory()
    if step % every == 0 or step == 1:
        row = {{"step": step, "rss_mib": rss_mib(), "seconds": time.perf_counter() - start}}
        print(json.dumps(row), flush=True)
"""


def run(arm: str, steps: int, every: int) -> list[dict]:
    env = {**os.environ, "RETROMAE_DS_MALLOC_TRIM": "1" if arm == "trim" else "0"}
    code = CHILD.format(repo=str(REPO), steps=steps, every=every)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    rows = []
    for line in proc.stdout:
        rows.append(json.loads(line))
        print(f"  {arm}: step {rows[-1]['step']:>5}  {rows[-1]['rss_mib']:>7.0f} MiB", flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"{arm} arm failed (exit {proc.returncode})")
    return rows


def growth(rows: list[dict], start: int) -> dict:
    first = next(r for r in rows if r["step"] >= start)
    last = rows[-1]
    return {
        "from_step": first["step"],
        "to_step": last["step"],
        "rss_from_mib": first["rss_mib"],
        "rss_to_mib": last["rss_mib"],
        "change": last["rss_mib"] / first["rss_mib"] - 1,
        "mib_per_step": (last["rss_mib"] - first["rss_mib"]) / max(last["step"] - first["step"], 1),
        "seconds_per_step": last["seconds"] / last["step"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help="steps of the trim arm")
    p.add_argument("--keep-steps", type=int, default=150, help="steps of the keep arm (0: skip)")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--from", dest="start", type=int, default=100, help="growth measured from")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = {"trim": run("trim", args.steps, args.every)}
    if args.keep_steps:
        result["keep"] = run("keep", args.keep_steps, args.every)
    summary = {arm: growth(rows, min(args.start, rows[-1]["step"])) for arm, rows in result.items()}
    print("\n| arm | steps | RSS at first | RSS at last | change | MiB/step | s/step |")
    print("|---|---|---|---|---|---|---|")
    for arm, g in summary.items():
        print(
            f"| {arm} | {g['from_step']}-{g['to_step']} | {g['rss_from_mib']:,.0f} MiB "
            f"| {g['rss_to_mib']:,.0f} MiB | {100 * g['change']:+.1f} % "
            f"| {g['mib_per_step']:.2f} | {g['seconds_per_step']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": result, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
