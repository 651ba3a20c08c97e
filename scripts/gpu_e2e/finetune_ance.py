"""GPU check, end-to-end step (b): ANCE fine-tuning of all-MiniLM-L6-v2 on SciFact with the
local refresher encoding and searching on the device.

``retromae-ds finetune --refresher local --refresh.device DEVICE --refresh.search_backend
torch --negatives.mine_first true``: the trainer saves a step-0 checkpoint and waits until its
refresher has encoded the corpus with it, searched with the ``torch`` search backend (exact
matmul + top-k on the device) and published a version; every step then trains on model-mined
negatives, and later checkpoints feed later versions while the trainer runs. Passes when a
version whose manifest says ``source: model`` was published, the trainer's metrics rows show it
in use, and the loss is finite. The refresher's device is named explicitly, so a refresher
that could not use it would have failed the run rather than fallen back to the CPU.

    python scripts/gpu_e2e/finetune_ance.py --device cuda --work /tmp/w --results results/
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from harness import REPO, CheckFailed, Runner, beir_slice, cli, main, minilm, read_jsonl, scifact

# cpu: 16 train queries over their judged abstracts and 100 others, 4 steps (smoke);
# cuda: all of SciFact train (809 queries, 5,183 abstracts), 30 steps of 32 queries in bf16
SIZES = {
    "cpu": dict(
        train_queries=16, extra_docs=100, q_len=32, p_len=64, batch=4, n_hard=1,
        num_negatives=3, top_k=20, steps=4, every=2, precision="fp32", threads="1",
    ),
    "cuda": dict(
        train_queries=None, extra_docs=None, q_len=64, p_len=256, batch=32, n_hard=3,
        num_negatives=8, top_k=100, steps=30, every=10, precision="bf16", threads="0",
    ),
}  # fmt: skip


def step(args: argparse.Namespace, runner: Runner) -> tuple[str, dict]:
    size = SIZES[args.device]
    work = runner.work
    beir = scifact()
    if size["train_queries"] is not None:
        beir = beir_slice(
            beir,
            work / "scifact",
            splits={"train": size["train_queries"]},
            extra_docs=size["extra_docs"],
        )
    run = work / "run"
    runner.run(
        "finetune",
        cli(
            "finetune", "--run_dir", str(run), "--progress", "false",
            "--data.beir", str(beir), "--model.init", str(minilm()),
            "--data.q_max_len", str(size["q_len"]), "--data.p_max_len", str(size["p_len"]),
            "--micro_batch_size", str(size["batch"]), "--negatives.n_hard", str(size["n_hard"]),
            "--max_steps", str(size["steps"]), "--log_every", "1",
            "--optim.lr", "3e-5", "--optim.warmup_steps", "2",
            "--checkpoint.every_steps", str(size["every"]), "--checkpoint.keep_last", "2",
            "--negatives.refresh_every", str(max(1, size["every"] // 2)),
            "--negatives.mine_first", "true", "--negatives.mine_first_timeout_s", "300",
            "--refresher", "local", "--refresh.device", args.device,
            "--refresh.search_backend", "torch",
            "--refresh.threads", size["threads"], "--refresh.poll_s", "0.5",
            "--refresh.progress", "false",
            "--refresh.mining.num_negatives", str(size["num_negatives"]),
            "--refresh.mining.top_k", str(size["top_k"]),
            "--deepspeed.config",
            json.dumps(["ds_configs/zero2.json", f"ds_configs/{size['precision']}.json"]),
        ),
    )  # fmt: skip

    sys.path.insert(0, str(REPO))
    from retromae_ds.finetuning import handoff

    negatives = run / "negatives"
    manifests = {
        v: json.loads(handoff.manifest_file(negatives, v).read_text())
        for v in handoff.published_versions(negatives)
    }
    sources = {v: m.get("source") for v, m in manifests.items()}
    mined = sorted(v for v, source in sources.items() if source == "model")
    rows = read_jsonl(run / "metrics.jsonl")
    used = sorted({r["negatives_version"] for r in rows})
    refresh_cfg = json.loads((run / "refresh_config.json").read_text())
    figures = {
        "sizes": size,
        "beir": str(beir),
        "versions_published": sources,
        "versions_used": used,
        "steps_per_version": {v: sum(r["negatives_version"] == v for r in rows) for v in used},
        "refresh_device": refresh_cfg.get("device"),
        "refresh_search_backend": refresh_cfg.get("search_backend"),
        "first_mined": manifests[mined[0]] if mined else None,
        "losses": [r["loss"] for r in rows],
    }
    if not mined:
        raise CheckFailed(f"no version mined by the model was published: {sources}", figures)
    if not set(mined) & set(used):
        raise CheckFailed(f"model-mined versions {mined} never used; used {used}", figures)
    if [r["step"] for r in rows] != list(range(1, size["steps"] + 1)):
        raise CheckFailed(f"logged steps {[r['step'] for r in rows]}", figures)
    if not all(math.isfinite(r["loss"]) for r in rows):
        raise CheckFailed("a non-finite loss was logged", figures)
    if (refresh_cfg.get("device"), refresh_cfg.get("search_backend")) != (args.device, "torch"):
        raise CheckFailed(f"refresher ran with {refresh_cfg}", figures)
    first = manifests[mined[0]]
    if not str(first.get("device", "")).startswith(args.device):
        raise CheckFailed(f"v{mined[0]} was mined on {first.get('device')!r}", figures)
    if first.get("search_backend") != "torch":
        raise CheckFailed(f"v{mined[0]} was searched with {first.get('search_backend')!r}", figures)
    timings = first.get("timings", {})
    verdict = (
        f"model-mined negatives v{mined[0]} (from step {first.get('step')}, refresher on "
        f"{args.device}, torch search backend: encode "
        f"{timings.get('encode_passages_s', '?')} s, search {timings.get('search_s', '?')} s) "
        "trained on from step "
        f"{next(r['step'] for r in rows if r['negatives_version'] in mined)}; versions used "
        f"{used}; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} over {len(rows)} steps"
    )
    return verdict, figures


if __name__ == "__main__":
    sys.exit(main("finetune", step))
