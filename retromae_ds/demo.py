"""The README's main job: the whole pipeline on the built-in corpus, offline, in minutes on CPU.

1. write the built-in corpus (stdlib docstrings + pydoc topics) and a small retrieval task made
   from it (docstring summary line -> its body; the summaries are held out of pre-training);
2. preprocess it into shards (a WordPiece tokenizer trained on it, two workers);
3. pre-train a tiny RetroMAE encoder on DeepSpeed (one process, CPU, ZeRO-2);
4. export the encoder as a Hugging Face / sentence-transformers folder;
5. evaluate it zero-shot (CLS embedding, inner product) against the same encoder untrained,
   on the built-in task and, when present, SciFact (or any ``--beir`` folder).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from retromae_ds.data.builtin_corpus import iter_documents, split_for_retrieval, write_beir
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

DEFAULT_SCIFACT = Path(__file__).resolve().parents[2] / "shared" / "data" / "scifact"


def run_demo(
    out: str | Path,
    workers: int = 2,
    max_docs: int | None = None,
    steps: int = 400,
    beir: list[str] | None = None,
) -> dict:
    out = Path(out)
    t0 = time.perf_counter()
    records = list(iter_documents(max_docs))
    corpus, queries, qrels = split_for_retrieval(records, every=8)
    task = write_beir(out / "builtin_beir", corpus, queries, qrels)
    print(
        f"[1/5] built-in corpus: {len(corpus):,} documents, {len(queries)} held-out queries -> {task}"
    )

    print("[2/5] preprocess: train a WordPiece tokenizer, tokenize, shard")
    manifest = run_preprocess(
        PreprocessConfig(
            inputs=[str(task / "corpus.jsonl")],
            out=str(out / "shards"),
            train_tokenizer=8000,
            max_length=128,
            shard_size=512 * 2**10,
            workers=workers,
        )
    )
    ShardDataset(out / "shards", verify=True)  # sha256 of every shard against the manifest

    print(f"[3/5] pre-train a tiny RetroMAE encoder for {steps} steps (DeepSpeed, CPU)")
    from retromae_ds.config import from_dict
    from retromae_ds.train import TrainConfig, train

    cfg = from_dict(
        TrainConfig,
        {
            "run_dir": str(out / "pretrain"),
            "micro_batch_size": 32,
            "max_steps": steps,
            "log_every": max(1, steps // 20),
            "data": {"shards": str(out / "shards")},
            "model": {"encoder": {"name": "tiny", "max_position_embeddings": 128}},
            "optim": {"lr": 5e-4, "warmup_ratio": 0.05},
            "checkpoint": {"every_steps": max(1, steps // 2), "keep_last": 1},
        },
    )
    last = train(cfg)
    first = json.loads((out / "pretrain" / "metrics.jsonl").read_text().splitlines()[0])

    print("[4/5] export the encoder")
    from retromae_ds.export import export_encoder

    encoder_dir = export_encoder(out / "pretrain", out / "encoder")
    baseline_dir = _untrained_twin(out / "untrained", encoder_dir)

    print("[5/5] evaluate zero-shot (CLS embedding, exact inner-product search)")
    from retromae_ds.eval.run import evaluate_beir

    tasks = {"built-in (docstring summary -> body)": task}
    for folder in beir or ([str(DEFAULT_SCIFACT)] if DEFAULT_SCIFACT.is_dir() else []):
        tasks[Path(folder).name] = Path(folder)
    results = {}
    for name, folder in tasks.items():
        for label, model in (("untrained", baseline_dir), ("RetroMAE", encoder_dir)):
            r = evaluate_beir(
                str(model), str(folder), "test", max_length=128, progress=False, verbose=False
            )
            results[(name, label)] = r["metrics"]

    lines = [
        f"pre-training: {steps} steps, loss {first['loss']:.2f} -> {last['loss']:.2f} "
        f"(MLM {first['mlm_loss']:.2f} -> {last['mlm_loss']:.2f}, decoder {first['decoder_loss']:.2f} -> "
        f"{last['decoder_loss']:.2f}), {last['tokens_per_s']:,.0f} tokens/s",
        "",
        "| task | encoder | nDCG@10 | MRR@10 | Recall@100 |",
        "|---|---|---|---|---|",
    ]
    for (name, label), m in results.items():
        lines.append(
            f"| {name} | {label} | {m['ndcg@10']:.4f} | {m['mrr@10']:.4f} | {m['recall@100']:.4f} |"
        )
    report = "\n".join(lines)
    print(report)
    (out / "results.md").write_text(report + "\n")
    summary = {
        "documents": manifest["counts"]["documents"],
        "steps": steps,
        "first": first,
        "last": last,
        "results": [{"task": n, "encoder": e, **m} for (n, e), m in results.items()],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(
        f"demo done in {time.perf_counter() - t0:.0f}s; encoder in {encoder_dir}, report in {out / 'results.md'}"
    )
    return summary


def _untrained_twin(folder: Path, trained: Path) -> Path:
    """The same architecture and tokenizer, randomly initialised: the zero-shot floor."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModel.from_config(AutoConfig.from_pretrained(str(trained)))
    model.save_pretrained(str(folder), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(trained)).save_pretrained(str(folder))
    return folder
