"""Training throughput: tokens/s of a pre-training step, side by side.

For each encoder size and objective it times the same batches through

- ``torch``: a plain PyTorch loop (forward, backward, AdamW step): the baseline;
- ``deepspeed``: the project's DeepSpeed engine (one process, ZeRO-2),

and reports tokens/s, the ratio DeepSpeed / plain torch (the engine's overhead) and the cost of
each decoder as the ratio objective / MLM (DupMAE: RetroMAE's decoder plus the bag-of-words
task, the MLM head over every ordinary token: its cost over RetroMAE is dupmae / retromae). Decoder objectives run twice, on the reference
attention path (dense mask + SDPA) and on ``auto`` (FlexAttention on CUDA; window / chunked on
CPU), so the fused paths are measured against their baseline in the same process. With
``--peak-tflops`` (default: 989 for bf16 / 494 for fp32-TF32 on CUDA, an H100/H200's dense
peak) it adds the model FLOPs utilisation of the encoder: (6 × non-embedding encoder
parameters + 12 × layers × hidden × L) FLOPs per token over the step time.

    python benchmarks/bench_train.py [--sizes tiny small] [--device cuda --dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB = 8000
CUDA_PEAK_TFLOPS = {"bf16": 989.0, "fp32": 494.0}


def _imports(device: str):
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from retromae_ds.base.special_tokens import SpecialIds
    from retromae_ds.components import engine
    from retromae_ds.components.optim import build_optimizer
    from retromae_ds.data.collate import MaskingConfig, PretrainCollator
    from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
    from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel
    from retromae_ds.training.config import OptimConfig

    return (
        engine,
        MaskingConfig,
        PretrainCollator,
        SpecialIds,
        EncoderConfig,
        build_encoder,
        (
            ObjectiveConfig,
            PretrainModel,
            OptimConfig,
            build_optimizer,
        ),
    )


def make_batches(n, batch, length, decoder, device, M, vocab=VOCAB):
    """Full-length rows of Zipf-distributed ids with realistic word starts."""
    _, MaskingConfig, PretrainCollator, SpecialIds = M[:4]
    special = SpecialIds(cls=2, sep=3, pad=0, mask=4, all=(0, 1, 2, 3, 4), vocab_size=vocab)
    rng = np.random.default_rng(0)
    collator = PretrainCollator(special, MaskingConfig(), length, decoder=decoder)
    out = []
    for b in range(n):
        items = []
        for r in range(batch):
            ids = (rng.zipf(1.3, length - 2) % (vocab - 5) + 5).astype(np.int32)
            starts = (rng.random(length - 2) < 0.75).astype(np.uint8)
            items.append((b * batch + r, ids, starts))
        out.append({k: v.to(device) for k, v in collator(items).items()})
    return out


def build(size, objective, attention, length, device, M, vocab=VOCAB):
    EncoderConfig, build_encoder = M[4], M[5]
    ObjectiveConfig, PretrainModel = M[6][0], M[6][1]
    torch.manual_seed(0)
    encoder = build_encoder(EncoderConfig(name=size, max_position_embeddings=length), vocab, 0)
    model = PretrainModel(
        encoder, ObjectiveConfig(name=objective, attention=attention, decoder_ratio=0.5)
    )
    return model.to(device)


def encoder_flops_per_token(model, length: int) -> float:
    """6N + 12·layers·hidden·L (PaLM appendix B), N = encoder parameters without embeddings."""
    enc = model.encoder
    c = enc.config
    n = sum(p.numel() for name, p in enc.base_model.named_parameters() if "embeddings" not in name)
    return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * length


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_torch(model, batches, args, M) -> list[float]:
    OptimConfig, build_optimizer = M[6][2], M[6][3]
    opt = build_optimizer(model, OptimConfig())
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    windows = []
    for rep in range(args.repeats + 1):  # the first window warms up (and compiles)
        _sync(args.device)
        t = time.perf_counter()
        for i in range(args.steps):
            with autocast:
                out = model(batches[i % len(batches)])
            out["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(args.device)
        if rep:
            windows.append(time.perf_counter() - t)
    return windows


def time_deepspeed(model, batches, args, M) -> list[float]:
    eng = M[0]
    OptimConfig, build_optimizer = M[6][2], M[6][3]
    opt = build_optimizer(model, OptimConfig())
    ds = eng.build_ds_config(
        ["ds_configs/zero2.json", f"ds_configs/{args.dtype}.json"],
        micro_batch=args.batch,
        grad_accum=1,
        world_size=1,
        grad_clip=1.0,
        cuda=args.device == "cuda",
    )
    engine = eng.initialize(model, opt, None, ds)
    windows = []
    for rep in range(args.repeats + 1):
        _sync(args.device)
        t = time.perf_counter()
        for i in range(args.steps):
            out = engine(batches[i % len(batches)])
            engine.backward(out["loss"])
            engine.step()
        _sync(args.device)
        if rep:
            windows.append(time.perf_counter() - t)
    return windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    p.add_argument(
        "--objectives", nargs="+", default=["retromae", "dupmae", "bowdpr", "seed", "mlm"]
    )
    p.add_argument("--attention", nargs="+", default=["reference", "auto"])
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary (BERT: 30522)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--no-deepspeed", action="store_true", help="plain torch loop only")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible to torch")
    peak = args.peak_tflops
    if peak is None and args.device == "cuda":
        peak = CUDA_PEAK_TFLOPS[args.dtype]
    if args.device == "cuda" and args.dtype == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
    M = _imports(args.device)
    from retromae_ds.modeling.objective import OBJECTIVES, Objective

    if not args.no_deepspeed:
        M[0].setup_distributed()  # DeepSpeed's process group (the plain loop needs none)
    rows = []
    for size in args.sizes:
        for objective in args.objectives:
            kind = OBJECTIVES[objective]
            # the attention backend matters only to an objective that adds decoder layers
            attentions = args.attention if kind.build is not Objective.build else ["-"]
            decoder = kind.decoder_inputs
            batches = make_batches(4, args.batch, args.length, decoder, args.device, M, args.vocab)
            tokens = (
                sum(int(b["attention_mask"].sum()) for b in batches) / len(batches) * args.steps
            )
            for attention in attentions:
                attn = "reference" if attention == "-" else attention
                model = build(size, objective, attn, args.length, args.device, M, args.vocab)
                flops_tok = encoder_flops_per_token(model, args.length)
                windows = time_torch(model, batches, args, M)
                t_torch = min(windows)
                row = {
                    "size": size,
                    "objective": objective,
                    "attention": attention,
                    "torch_tokens_per_s": tokens / t_torch,
                    "torch_windows_tokens_per_s": [tokens / w for w in windows],
                }
                if not args.no_deepspeed:
                    model = build(size, objective, attn, args.length, args.device, M, args.vocab)
                    try:
                        ds_windows = time_deepspeed(model, batches, args, M)
                        t_ds = min(ds_windows)
                    except Exception as e:  # noqa: BLE001 - the row says why, the others still run
                        row["deepspeed_error"] = f"{type(e).__name__}: {e}"[:200]
                    else:
                        row["deepspeed_tokens_per_s"] = tokens / t_ds
                        row["deepspeed_windows_tokens_per_s"] = [tokens / w for w in ds_windows]
                        row["deepspeed_over_torch"] = t_torch / t_ds
                best = row.get("deepspeed_tokens_per_s", row["torch_tokens_per_s"])
                if peak:
                    row["encoder_mfu"] = best * flops_tok / (peak * 1e12)
                rows.append(row)
                print(json.dumps(row), flush=True)
    key = "torch_tokens_per_s" if args.no_deepspeed else "deepspeed_tokens_per_s"
    print(
        f"\n{args.device} {args.dtype}, batch {args.batch} x length {args.length}, "
        f"vocabulary {args.vocab}, {args.steps} "
        f"steps per window, best of {args.repeats}, {torch.get_num_threads()} threads"
        + (f", MFU against {peak:g} TFLOP/s" if peak else "")
    )
    print(
        "| size | objective | attention | plain torch tok/s | its windows | DeepSpeed tok/s "
        "| DeepSpeed / torch "
        "| objective / MLM | auto / reference | encoder MFU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = [x for x in rows if x["size"] == r["size"]]
        mlm = next((x for x in same if x["objective"] == "mlm"), None)
        ref = next(
            (x for x in same if x["objective"] == r["objective"] and x["attention"] == "reference"),
            None,
        )
        have = key in r
        rel = f"{r[key] / mlm[key]:.2f}" if have and mlm and key in mlm else ""
        vs_ref = (
            f"{r[key] / ref[key]:.2f}"
            if have and ref and key in ref and r["attention"] not in ("-", "reference")
            else ""
        )
        mfu = f"{100 * r['encoder_mfu']:.1f} %" if "encoder_mfu" in r else ""
        w = r["torch_windows_tokens_per_s"]
        print(
            f"| {r['size']} | {r['objective']} | {r['attention']} | {r['torch_tokens_per_s']:,.0f} "
            f"| {min(w):,.0f}–{max(w):,.0f} | {r.get('deepspeed_tokens_per_s', 0):,.0f} | {r.get('deepspeed_over_torch', 0):.2f} "
            f"| {rel} | {vs_ref} | {mfu} |"
            + (f" DeepSpeed failed: {r['deepspeed_error']}" if "deepspeed_error" in r else "")
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
