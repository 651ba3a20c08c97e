"""Approximate search against exact on real embeddings at 100k and 1M passages (issue 43):
recall@10 / recall@200 of every index type against exact search, recall on the real SciFact
passages inside the corpus, the overlap of the negatives mined from each index's ranking with
exact's, build seconds, queries/s and bytes per vector.

No real English collection of a million passages is on the project's machines, so the corpus
is built from real text (``passages``):

- rows 0..5,182: SciFact's 5,183 abstracts intact (title + text), the judged collection;
- every other row: 48 words recombined from two real passages of one source, the first 24
  words from a sentence start in one document and the next 24 from a sentence start in
  another document of the same source (SciFact abstracts, WikiText-2 test paragraphs, or the
  built-in corpus of Python docstrings and pydoc topics, ``retromae_ds.data.builtin_corpus``),
  sources and documents drawn in proportion to their words (seed 0); duplicates dropped.

The first 100,000 rows are the 100k corpus (SciFact's abstracts included). Queries: SciFact's
1,109 claims (train + test); positives for mining: their qrels (train + test).

Three steps, each resumable:

    python benchmarks/bench_search_scale.py throughput --n 2000         # encoder speed (fp32/bf16)
    python benchmarks/bench_search_scale.py embed --n 1000000 --out runs/search_scale
    python benchmarks/bench_search_scale.py measure --out runs/search_scale --n 100000 \\
        --threads 1 --json out.json

``embed`` writes the passages (``passages.txt``, one a line), the query vectors and the corpus
vectors in chunks of ``--chunk`` rows (``chunks/chunk_00000.npy``, each written to a temporary
name and renamed, so a killed run loses at most one chunk and a rerun continues), float32,
all-MiniLM-L6-v2 (mean pooling, normalised, 384-d) at ``--max-length`` tokens under
``--amp`` autocast. ``measure`` reads the first ``--n`` rows of the chunks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

import common
import numpy as np
from bench_search import recall, search_all

HALF_WORDS = 24
MIN_HALF_WORDS = 12
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


# --------------------------------------------------------------------------- the corpus
def _documents(data: Path) -> dict[str, list[list[str]]]:
    """{source: documents as word lists} of SciFact, WikiText-2 and the built-in corpus."""
    from retromae_ds.data.builtin_corpus import iter_documents

    scifact = [
        f"{d['title']} {d['text']}"
        for d in map(json.loads, (data / common.SCIFACT).open(encoding="utf-8"))
    ]
    wiki = [
        line.strip()
        for line in (data / common.WIKI).open(encoding="utf-8")
        if line.strip() and not line.strip().startswith("=")  # headings
    ]
    builtin = [d["text"] for d in iter_documents()]
    return {"scifact": scifact, "wikitext2": wiki, "builtin": builtin}


def _sentence_starts(text: str) -> tuple[list[str], list[int]]:
    words, starts = [], []
    for sentence in _SENTENCE_END.split(text):
        sentence_words = sentence.split()
        if sentence_words:
            starts.append(len(words))
            words += sentence_words
    return words, starts


def passages(data: Path, n: int, seed: int = 0) -> tuple[list[str], int]:
    """(n passages, how many of the first are SciFact's abstracts): the abstracts intact,
    then recombined 48-word passages (module docstring); deterministic for a seed."""
    sources = _documents(data)
    rows = list(sources["scifact"])
    n_real = len(rows)
    seen = set(rows)
    rng = np.random.default_rng(seed)
    split = {}
    for name, texts in sources.items():
        docs = [_sentence_starts(t) for t in texts]
        docs = [(w, s) for w, s in docs if len(w) >= MIN_HALF_WORDS]
        words = np.array([len(w) for w, _ in docs], dtype=np.float64)
        split[name] = (docs, np.cumsum(words) / words.sum(), words.sum())
    names = list(split)
    share = np.cumsum([split[name][2] for name in names])
    share /= share[-1]

    def draw(cumulative: np.ndarray) -> int:
        return min(
            int(np.searchsorted(cumulative, rng.random(), side="right")), len(cumulative) - 1
        )

    def half(docs, cumulative, avoid: int) -> tuple[int, str] | None:
        d = draw(cumulative)
        if d == avoid:
            return None
        words, starts = docs[d]
        start = starts[int(rng.integers(len(starts)))]
        cut = words[start : start + HALF_WORDS]
        return (d, " ".join(cut)) if len(cut) >= MIN_HALF_WORDS else None

    while len(rows) < n:
        docs, cumulative, _ = split[names[draw(share)]]
        first = half(docs, cumulative, -1)
        second = half(docs, cumulative, first[0]) if first else None
        if second is None:
            continue
        text = f"{first[1]} {second[1]}"
        if text not in seen:
            seen.add(text)
            rows.append(text)
    return rows[:n], min(n_real, n)


def queries_and_positives(data: Path) -> tuple[list[str], list[np.ndarray]]:
    """SciFact's claims with qrels (train + test) and their positive rows (the abstracts'
    rows 0..5,182, in corpus.jsonl's order)."""
    scifact = data / "scifact"
    row_of = {d["_id"]: i for i, d in enumerate(map(json.loads, (scifact / "corpus.jsonl").open()))}
    positives: dict[str, list[int]] = {}
    for split in ("train", "test"):
        for line in (scifact / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]:
            qid, did, score = line.split("\t")
            if int(score) > 0:
                positives.setdefault(qid, []).append(row_of[did])
    text = {q["_id"]: q["text"] for q in map(json.loads, (scifact / "queries.jsonl").open())}
    ids = sorted(positives, key=int)
    return [text[q] for q in ids], [np.array(sorted(set(positives[q]))) for q in ids]


def encoder(max_length: int, amp: str, batch_size: int = 64):
    import torch

    from retromae_ds.retrieval.encode import HFEncoder
    from retromae_recipes.common import minilm_dir

    return HFEncoder.from_dir(
        minilm_dir(), pooling="mean", normalize=True, max_length=max_length,
        batch_size=batch_size, device="cpu", progress=False,
        amp_dtype=torch.bfloat16 if amp == "bf16" else None,
    )  # fmt: skip


# --------------------------------------------------------------------------- steps
def throughput(args) -> None:
    """Passages/s of all-MiniLM-L6-v2 on the first ``--n`` recombined passages (past
    SciFact's abstracts, which every length truncates), fp32 and bf16, each max length
    and thread count."""
    import torch

    texts, n_real = passages(Path(args.data), 5183 + args.n)
    texts = texts[n_real:]
    rows = []
    for threads, max_length, amp in itertools.product(
        args.threads, args.max_lengths, ("fp32", "bf16")
    ):
        torch.set_num_threads(threads)
        enc = encoder(max_length, amp)
        enc(texts[:128])  # warm-up
        seconds = []
        with OtherLoad() as load:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                enc(texts)
                seconds.append(time.perf_counter() - t0)
        rows.append(
            {"threads": threads, "max_length": max_length, "amp": amp, "seconds": seconds,
             "passages_per_s": len(texts) / float(np.median(seconds)),
             "other_cores": load.cores}
        )  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    common.write_json(args.json, {"machine": common.machine(), "n": len(texts), "rows": rows})


def chunk_path(out: Path, i: int) -> Path:
    return out / "chunks" / f"chunk_{i:05d}.npy"


def embed(args) -> None:
    out = Path(args.out)
    (out / "chunks").mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    meta = {"n": args.n, "chunk": args.chunk, "max_length": args.max_length, "amp": args.amp}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if {k: old[k] for k in meta} != meta:
            sys.exit(f"{out} holds another embedding ({old}); pick another --out")
    data = Path(args.data)
    texts_path = out / "passages.txt"
    if texts_path.exists():
        texts = texts_path.read_text(encoding="utf-8").split("\n")[: args.n]
        n_real = json.loads(meta_path.read_text())["scifact_rows"]
    else:
        texts, n_real = passages(data, args.n)
        tmp = texts_path.with_suffix(".tmp")
        tmp.write_text("\n".join(t.replace("\n", " ") for t in texts), encoding="utf-8")
        tmp.rename(texts_path)
    meta_path.write_text(json.dumps({**meta, "scifact_rows": n_real}))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    enc = encoder(args.max_length, args.amp)
    if not (out / "queries.npy").exists():
        query_texts, positives = queries_and_positives(data)
        (out / "positives.json").write_text(json.dumps([p.tolist() for p in positives]))
        np.save(out / "queries.npy", enc(query_texts))
    t_all = time.perf_counter()
    for i, start in enumerate(range(0, args.n, args.chunk)):
        path = chunk_path(out, i)
        if path.exists() or i % args.workers != args.worker:
            continue
        t0 = time.perf_counter()
        vectors = enc(texts[start : start + args.chunk])
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, vectors)
        tmp.rename(path)
        seconds = time.perf_counter() - t0
        print(
            f"chunk {i}: rows {start}-{start + len(vectors)} in {seconds:.0f} s "
            f"({len(vectors) / seconds:.0f} passages/s; {time.perf_counter() - t_all:.0f} s "
            "this run)",
            flush=True,
        )
    print("done", flush=True)


def load_corpus(out: Path, n: int) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    parts, have, i = [], 0, 0
    while have < n:
        path = chunk_path(out, i)
        if not path.exists():
            sys.exit(f"{out}: {have} rows embedded, --n {n} asks for more (run embed)")
        parts.append(np.load(path))
        have, i = have + len(parts[-1]), i + 1
    assert meta["chunk"] > 0
    return np.ascontiguousarray(np.concatenate(parts)[:n], dtype=np.float32)


# --------------------------------------------------------------------------- measure
def settings_to_sweep(kind: str, lists: int, args) -> list[dict]:
    """The auto setting first, then the sweep: nprobe for IVF kinds, ef_search for HNSW."""
    if kind == "flat":
        return [{}]
    if kind == "hnsw":
        return [{}] + [{"ef_search": e} for e in args.ef_searches]
    return [{}] + [{"nprobe": p} for p in args.nprobes if p <= lists]


class OtherLoad:
    """Cores' worth of CPU that other processes used while the block ran: the machine's busy
    time (``/proc/stat``) less this process's own (all its threads), over the wall time."""

    def __enter__(self) -> OtherLoad:
        self._start = self._now()
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, own = (b - a for a, b in zip(self._start, self._now(), strict=True))
        self.seconds, self.cores = wall, max(0.0, (busy - own) / max(wall, 1e-9))

    @staticmethod
    def _now() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return time.perf_counter(), busy, own.user + own.system


def timed_search(index, queries: np.ndarray, k: int, threads: list[int], rounds: int):
    """(ids of the last search, {threads: seconds of each round}, {threads: other load})."""
    import torch

    from retromae_ds.search.faiss_backend import set_threads

    seconds, other = {}, {}
    for t in threads:
        torch.set_num_threads(t)
        set_threads(t)
        seconds[t] = []
        with OtherLoad() as load:
            for _ in range(rounds):
                t0 = time.perf_counter()
                _, ids = search_all(index, queries, k)
                seconds[t].append(time.perf_counter() - t0)
        other[t] = load.cores
    torch.set_num_threads(threads[0])
    set_threads(threads[0])
    return ids, seconds, other


def mined(ids_QK: np.ndarray, positives: list[np.ndarray], n: int, strategy: str):
    from retromae_ds.refresher.config import MiningConfig
    from retromae_ds.refresher.mining import mine

    cfg = MiningConfig(strategy=strategy)
    return mine(
        ids_QK, positives, cfg.num_negatives, strategy=cfg.strategy, skip_top=cfg.skip_top,
        seed=cfg.seed, num_passages=n,
    )  # fmt: skip


def overlap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(
        np.mean(
            [len(set(x.tolist()) & set(y.tolist())) / len(y) for x, y in zip(a, b, strict=True)]
        )
    )


def real_recall(found: np.ndarray, exact: np.ndarray, k: int, n_real: int) -> float:
    """Of exact's top k that are SciFact abstracts (rows < n_real), the share found (pooled)."""
    hit = total = 0
    for a, b in zip(found, exact, strict=True):
        real = {i for i in b[:k].tolist() if i < n_real}
        hit, total = hit + len(real & set(a[:k].tolist())), total + len(real)
    return hit / max(total, 1)


def measure(args) -> None:
    import torch

    from retromae_ds.search.build import build_index, resolve_index
    from retromae_ds.search.exact import rescore
    from retromae_ds.search.faiss_backend import set_threads
    from retromae_ds.search.kinds import ivf_lists

    out = Path(args.out)
    threads = args.threads
    torch.set_num_threads(threads[0])
    set_threads(threads[0])
    corpus = load_corpus(out, args.n)
    queries = np.load(out / "queries.npy")
    positives = [np.array(p) for p in json.loads((out / "positives.json").read_text())]
    n_real = json.loads((out / "meta.json").read_text())["scifact_rows"]
    n, dim, k = len(corpus), corpus.shape[1], args.k
    print(f"{n} x {dim} corpus ({n_real} SciFact abstracts), {len(queries)} queries, top {k}, "
          f"threads {threads}", flush=True)  # fmt: skip
    rows: list[dict] = []
    exact_ids = exact_mined = None
    for kind in args.kinds:
        with OtherLoad() as build:
            index = build_index(kind, dim=dim, n=n, seed=0, train_size=args.train_size)
            index.add(corpus)
        choice = resolve_index(kind, n=n, dim=dim, train_size=args.train_size)
        lists = getattr(getattr(index, "layout", None), "nlist", 0) or 0
        bytes_per_vector = 4 * dim if choice.exact else index.nbytes() / n
        for setting in settings_to_sweep(kind if kind in ("hnsw", "flat") else "ivf", lists, args):
            if "nprobe" in setting:
                index.nprobe = setting["nprobe"]
            if "ef_search" in setting:
                index.ef_search = setting["ef_search"]
            ids, seconds, other = timed_search(index, queries, k, threads, args.rounds)
            _, rescored = rescore(queries, corpus, ids)
            negatives = {s: mined(rescored, positives, n, s) for s in ("random", "top")}
            if exact_ids is None:
                assert choice.exact, "the first of --kinds must be flat (the reference)"
                exact_ids, exact_mined = ids, negatives
            row = {
                "kind": kind, "factory": choice.factory, "auto": not setting,
                "nprobe": getattr(index, "nprobe", 0), "ef_search": getattr(index, "ef_search", 0),
                "n": n, "queries": len(queries), "threads_build": threads[0],
                "build_s": build.seconds, "build_other_cores": build.cores,
                "bytes_per_vector": bytes_per_vector, "search_s": seconds,
                "search_other_cores": other,
                "queries_per_s": {t: len(queries) / float(np.median(s)) for t, s in seconds.items()},
                "recall_at_10": recall(ids, exact_ids, 10),
                f"recall_at_{k}": recall(ids, exact_ids, k),
                "recall_at_10_rescored": recall(rescored, exact_ids, 10),
                f"scifact_recall_at_{k}": real_recall(ids, exact_ids, k, n_real),
                "scifact_recall_at_10": real_recall(rescored, exact_ids, 10, n_real),
                "mined_overlap_random": overlap(negatives["random"], exact_mined["random"]),
                "mined_overlap_top": overlap(negatives["top"], exact_mined["top"]),
            }  # fmt: skip
            row["speed_vs_exact"] = {
                t: row["queries_per_s"][t] / (rows or [row])[0]["queries_per_s"][t] for t in threads
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        del index
        common.write_json(  # after each kind: a run cut short keeps what it measured
            args.json,
            {"machine": common.machine(), "settings": vars(args), "scifact_rows": n_real,
             "ivf_lists_auto": ivf_lists(n, n), "rows": rows},
        )  # fmt: skip
    print_rows(rows, k, threads)


def table(args) -> None:
    """A ``measure`` JSON as the markdown table docs/ance.md quotes."""
    saved = json.loads(Path(args.measured).read_text())
    threads = saved["settings"]["threads"]
    rows = [
        {key: {int(t): v for t, v in value.items()} if isinstance(value, dict) else value
         for key, value in row.items()}
        for row in saved["rows"]
    ]  # fmt: skip
    print_rows(rows, saved["settings"]["k"], threads)


def print_rows(rows: list[dict], k: int, threads: list[int]) -> None:
    headers = ["index: faiss string, knobs", "build s", "bytes/vector"]
    for t in threads:
        headers += [f"queries/s, {t} thread{'s' * (t > 1)}: median [min-max]", "× exact"]
    headers += ["recall@10", f"recall@{k}", "recall@10 rescored", f"SciFact recall@{k}",
                "mined overlap: top / random", "other load: build / searches"]  # fmt: skip
    table = []
    for r in rows:
        knobs = [f"nprobe {r['nprobe']}"] if r["nprobe"] else []
        if "HNSW" in r["factory"]:
            knobs.append(f"efSearch {r['ef_search'] or 'auto'}")
        name = "" if r["kind"] == r["factory"] else f"{r['kind']}: "
        setting = f"{name}`{r['factory']}`" + "".join(f", {x}" for x in knobs)
        line = [setting + (" (auto)" if r["auto"] else ""), f"{r['build_s']:.1f}",
                f"{r['bytes_per_vector']:,.0f}"]  # fmt: skip
        for t in threads:
            q = [r["queries"] / s for s in r["search_s"][t]]
            line += [f"{r['queries_per_s'][t]:,.0f} [{min(q):,.0f}-{max(q):,.0f}]",
                     f"{r['speed_vs_exact'][t]:.1f}×"]  # fmt: skip
        loads = " / ".join(f"{r['search_other_cores'][t]:.2f}" for t in threads)
        line += [f"{r['recall_at_10']:.3f}", f"{r[f'recall_at_{k}']:.3f}",
                 f"{r['recall_at_10_rescored']:.3f}", f"{r[f'scifact_recall_at_{k}']:.3f}",
                 f"{r['mined_overlap_top']:.3f} / {r['mined_overlap_random']:.3f}",
                 f"{r['build_other_cores']:.2f} / {loads}"]  # fmt: skip
        table.append(line)
    print()
    common.print_table(headers, table)


# --------------------------------------------------------------------------- cost model
# Projection inputs that were NOT measured here (docs/ance.md, "Cost model", says why each).
ANCE_V100_S_PER_PASSAGE = 4.5e-3
"""ANCE (Xiong et al. 2021): MS MARCO's 8.8M passages in ~10 h on one V100."""
TENSOR_TFLOPS = {"V100": 125.0, "H100": 989.0}
"""Peak dense fp16/bf16 tensor-core TFLOP/s (NVIDIA's data sheets; H100 SXM)."""
FP32_TFLOPS = {"V100": 15.7, "H100": 67.0}
"""Peak fp32 TFLOP/s: exact search as an fp32 matmul (faiss-gpu's flat default)."""
MATMUL_EFFICIENCY = 0.5
"""Share of fp32 peak an exact-search matmul + top-k is assumed to reach."""
MARCO_PASSAGES, MARCO_QUERIES, DIM = 8_841_823, 502_939, 768
QUERY_OVER_PASSAGE = 32 / 128
"""A query's encode cost over a passage's (32 vs 128 tokens; linear in length)."""
STEP_QUERIES, STEP_PASSAGES_PER_QUERY, BACKWARD_FACTOR = 32, 8, 3
"""A training step per GPU: 32 queries, a positive and 7 negatives each; forward +
backward = 3 forwards."""


def bytes_per_vector(kind: str, dim: int) -> float:
    """Index bytes per vector at ``dim`` (the formulas the 384-d measurement matches)."""
    return {"flat": 4 * dim, "ivf": 4 * dim + 8, "ivfpq": 96 + 8, "hnsw": 4 * dim + 64 * 4}[kind]


def refresh_seconds(n: int, q: int, gpus: int, gpu: str) -> dict[str, float]:
    per_passage = ANCE_V100_S_PER_PASSAGE * TENSOR_TFLOPS["V100"] / TENSOR_TFLOPS[gpu]
    encode = (n + q * QUERY_OVER_PASSAGE) * per_passage / gpus
    search = 2 * q * (n / gpus) * DIM / (FP32_TFLOPS[gpu] * 1e12 * MATMUL_EFFICIENCY)
    step = BACKWARD_FACTOR * STEP_QUERIES * (STEP_PASSAGES_PER_QUERY + QUERY_OVER_PASSAGE)
    return {"per_passage": per_passage, "encode": encode, "search": search,
            "step": step * per_passage}  # fmt: skip


def hours(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def cost(args) -> None:
    """The projection table of docs/ance.md's cost model, and the measured CPU terms."""
    measured = json.loads(Path(args.measured).read_text())
    speed = json.loads(Path(args.throughput).read_text())
    flat = next(r for r in measured["rows"] if r["kind"] == "flat")
    n = flat["n"]
    pair_s = 1 / (flat["queries_per_s"]["1"] * n)  # one core, 384-d
    one = {r["amp"]: r for r in speed["rows"] if r["threads"] == 1}
    rows = [["encode a passage, all-MiniLM-L6-v2, 64 tokens, fp32 / bf16",
             f"{1e3 / one['fp32']['passages_per_s']:.2f} / "
             f"{1e3 / one['bf16']['passages_per_s']:.2f} ms"],
            [f"exact search, a query × a passage, 384-d, N = {n:,}", f"{pair_s * 1e9:.1f} ns"]]  # fmt: skip
    for r in measured["rows"]:
        if r["auto"] and r["kind"] != "flat":
            rows.append([f"build `{r['factory']}`, a vector", f"{r['build_s'] / n * 1e6:.0f} µs"])
    best = [r for r in measured["rows"] if r[f"recall_at_{measured['settings']['k']}"] >= 0.95]
    fastest = max(best, key=lambda r: r["speed_vs_exact"]["1"])
    knobs = [f"{name} {fastest[key]}" for name, key in (("nprobe", "nprobe"),
             ("efSearch", "ef_search")) if fastest[key]]  # fmt: skip
    rows.append([f"fastest with recall@200 ≥ 0.95: `{fastest['factory']}` {', '.join(knobs)}",
                 f"{fastest['speed_vs_exact']['1']:.1f}× exact"])  # fmt: skip
    common.print_table(["measured term (one core)", "value"], rows)
    exact_core_s = MARCO_PASSAGES * DIM / 384 * pair_s * MARCO_QUERIES
    print(f"\nMS MARCO's exact search (8.8M × 503k queries, 768-d) at the measured cost: "
          f"{hours(exact_core_s)} on one core; with the fastest setting above "
          f"{hours(exact_core_s / fastest['speed_vs_exact']['1'])}\n")  # fmt: skip
    headers = ["corpus", "GPUs", "GPU", "s a passage", "encode", "exact search", "refresh",
               "training step", "refreshes / 1,000 steps"]  # fmt: skip
    table = []
    for name, n_p in (("MS MARCO 8.8M", MARCO_PASSAGES), ("100M", 100_000_000)):
        for gpu in ("V100", "H100"):
            for gpus in (1, 8, 64):
                t = refresh_seconds(n_p, MARCO_QUERIES, gpus, gpu)
                total = t["encode"] + t["search"]
                table.append([name, str(gpus), gpu, f"{t['per_passage'] * 1e3:.2f} ms",
                              hours(t["encode"]), hours(t["search"]), hours(total),
                              f"{t['step']:.2f} s", f"{1000 * t['step'] / total:.2f}"])  # fmt: skip
    common.print_table(headers, table)
    headers = ["corpus", "GPUs"] + [f"{k} GB a rank" for k in ("flat", "ivf", "ivfpq", "hnsw")]
    table = [
        [name, str(g)]
        + [
            f"{n_p / g * bytes_per_vector(k, DIM) / 1e9:,.1f}"
            for k in ("flat", "ivf", "ivfpq", "hnsw")
        ]  # fmt: skip
        for name, n_p in (("MS MARCO 8.8M", MARCO_PASSAGES), ("100M", 100_000_000))
        for g in (1, 8, 64)
    ]
    print()
    common.print_table(headers, table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(common.DEFAULT_DATA))
    p.add_argument("--json", default=None)
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("throughput", help="encoder passages/s, fp32 and bf16")
    t.add_argument("--n", type=int, default=2000)
    t.add_argument("--max-lengths", type=int, nargs="+", default=[64, 96])
    t.add_argument("--repeats", type=int, default=2)
    t.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads")
    e = sub.add_parser("embed", help="embed the corpus in resumable chunks")
    e.add_argument("--n", type=int, default=1_000_000)
    e.add_argument("--out", default="runs/search_scale")
    e.add_argument("--chunk", type=int, default=20_000)
    e.add_argument("--max-length", type=int, default=64)
    e.add_argument("--amp", choices=["fp32", "bf16"], default="bf16")
    e.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    e.add_argument("--workers", type=int, default=1, help="processes sharing the chunks")
    e.add_argument("--worker", type=int, default=0, help="this one: chunks i % workers == worker")
    m = sub.add_parser("measure", help="indexes against exact search on the first --n rows")
    m.add_argument("--n", type=int, default=100_000)
    m.add_argument("--out", default="runs/search_scale")
    m.add_argument("--k", type=int, default=200, help="top K searched (the mining top-K)")
    m.add_argument("--kinds", nargs="+", default=["flat", "ivf", "ivfpq", "hnsw"],
                   help="index kinds or faiss strings; the first must be flat")  # fmt: skip
    m.add_argument("--nprobes", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    m.add_argument("--ef-searches", type=int, nargs="*", default=[200, 300, 600])
    m.add_argument("--train-size", type=int, default=0)
    m.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="OpenMP threads: builds on the first, searches timed on each")  # fmt: skip
    m.add_argument("--rounds", type=int, default=3, help="timed searches per setting")
    r = sub.add_parser("table", help="print a measure step's JSON as a markdown table")
    r.add_argument("measured")
    c = sub.add_parser("cost", help="the cost model's projection from measured JSONs")
    c.add_argument("--measured", default="runs/search_scale/measure_1m.json")
    c.add_argument("--throughput", default="runs/search_scale/throughput.json")
    args = p.parse_args()
    steps = {"throughput": throughput, "embed": embed, "measure": measure, "cost": cost,
             "table": table}  # fmt: skip
    steps[args.step](args)


if __name__ == "__main__":
    main()
