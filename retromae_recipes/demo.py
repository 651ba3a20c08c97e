"""The README's main job: the study's MLM-base protocol in miniature, on the built-in corpus,
offline, on CPU.

Run with ``retromae-ds demo [--out runs/demo]``. Does RetroMAE / SEED-Encoder continued
pre-training turn an MLM-pretrained encoder into a better zero-shot retriever than more MLM at
the same budget (the RetroMAE report: chinese-bert 2.87 % -> 38.76 % on C-MTEB retrieval)? In
miniature, on text every Python installation carries, so it needs no data folder:

1. write the built-in corpus (stdlib docstrings + pydoc topics) and a retrieval task made from
   it (docstring summary line -> its body; the summaries are held out of pre-training), with
   its queries split into train and test;
2. preprocess the corpus into shards (a WordPiece tokenizer trained on it);
3. pre-train one MLM base (``tiny`` encoder), once; then, for each seed, continue it with MLM,
   RetroMAE and SEED-Encoder (same steps, batch, data, learning rate) on DeepSpeed (CPU), each
   stage its own process, logging zero-shot nDCG@10 on the train queries as they train;
4. evaluate every encoder and the base zero-shot (CLS and mean pooling, inner product) on the
   test queries, then again after a short contrastive fine-tune with BM25 negatives; BM25
   itself is the reference row;
5. print the mean ± std table and the verdicts against the papers' orderings; write the plots
   (``study.png``, the curve ``study_curve.png``) and the report (``study.md``). ``--beir DIR``
   evaluates every encoder on that BEIR folder too.

The protocol is ``retromae_recipes.study`` (``bert_config``): the same code as the study of
docs/results.md, on different inputs. Reruns skip finished cells.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import fields, replace
from pathlib import Path

from retromae_ds.data.builtin_corpus import iter_documents, split_for_retrieval, write_beir
from retromae_recipes.report import report
from retromae_recipes.report_rows import aggregate
from retromae_recipes.study import Study
from retromae_recipes.study_config import DEMO, DemoBudget, StudyConfig, bert_config


def builtin_task(folder: Path, max_docs: int | None = None, test_every: int = 3) -> Path:
    """The built-in retrieval task as a BEIR folder; every ``test_every``-th query (by a hash
    of its id) is a test query, the others train the fine-tuning stage."""
    if (folder / "qrels" / "train.tsv").exists():
        return folder
    records = list(iter_documents(max_docs))
    corpus, queries, qrels = split_for_retrieval(records, every=2)

    def is_test(qid: str) -> bool:
        return int(hashlib.sha1(qid.encode()).hexdigest()[:8], 16) % test_every == 0

    test = [(q, d) for q, d in qrels if is_test(q)]
    train = [(q, d) for q, d in qrels if not is_test(q)]
    return write_beir(folder, corpus, queries, test, train)


def with_sizes(budget: DemoBudget, **sizes: int | None) -> DemoBudget:
    """``budget`` with the sizes given (not None) in place of its own; a name it lacks is an
    error."""
    known = sorted(f.name for f in fields(budget))
    unknown = sorted(set(sizes) - set(known))
    if unknown:
        raise ValueError(f"not a size of the demo's budget: {unknown}; known: {known}")
    return replace(budget, **{k: v for k, v in sizes.items() if v is not None})


def run_demo(
    out: str | Path,
    *,
    budget: DemoBudget = DEMO,
    workers: int = 2,
    max_docs: int | None = None,
    base_steps: int | None = None,
    steps: int | None = None,
    finetune_steps: int | None = None,
    seeds: list[int] | None = None,
    objectives: tuple[str, ...] = ("none", "mlm", "retromae"),
    beir: list[str] | None = None,
    command: str = "retromae-ds demo",
) -> dict:
    """The main job at ``budget`` (``DEMO``, or ``DEMO_FULL`` for ``--full``); a size given
    here (not None) replaces the budget's (``max_docs`` 0: every built-in document)."""
    budget = with_sizes(
        budget,
        max_docs=max_docs,
        base_steps=base_steps,
        steps=steps,
        finetune_steps=finetune_steps,
    )
    out = Path(out)
    t0 = time.perf_counter()
    task = _write_task(out, budget.max_docs or None)
    cfg = demo_config(out, task, budget, workers, seeds, objectives, beir)
    study = Study(cfg)
    _print_protocol(cfg, budget)
    rows = study.run()
    pretraining = study.pretraining()
    _report(out, rows, pretraining, command, t0)
    return {"rows": rows, "aggregate": aggregate(rows), "pretraining": pretraining}


def _write_task(out: Path, max_docs: int | None) -> Path:
    """The built-in task under ``out/builtin``, its size said in one line."""
    task = builtin_task(out / "builtin", max_docs)
    n_docs, n_train, n_test = (
        len(path.read_text(encoding="utf-8").splitlines()) - skip
        for path, skip in (
            (task / "corpus.jsonl", 0),
            (task / "qrels" / "train.tsv", 1),
            (task / "qrels" / "test.tsv", 1),
        )
    )
    print(
        f"built-in task: {n_docs:,} documents, {n_train} train / {n_test} test queries -> {task}",
        flush=True,
    )
    return task


def demo_config(
    out: Path,
    task: Path,
    budget: DemoBudget,
    workers: int,
    seeds: list[int] | None,
    objectives: tuple[str, ...],
    beir: list[str] | None,
) -> StudyConfig:
    """The study's MLM-base protocol (``bert_config``) on the built-in ``task`` at ``budget``:
    the corpus pre-trains, the task fine-tunes and evaluates."""
    steps = budget.steps
    return bert_config(
        str(out),
        pretrain_inputs=[str(task / "corpus.jsonl")],
        finetune_beir=str(task),
        extra_beir=list(beir or []),
        workers=workers,
        objectives=list(objectives),
        finetune_objectives={"bert": list(objectives)},
        vocab_size=budget.vocab_size,
        mask_ratio=budget.mask_ratio,
        length_grouping=budget.length_grouping,
        packing=budget.packing,
        base_steps=budget.base_steps,
        base_lr=budget.base_lr,
        pretrain_steps={"bert": steps},
        pretrain_batch={"bert": budget.batch},
        pretrain_lr={"bert": budget.lr},
        curve_every={"bert": max(1, steps // budget.curve_points)},
        finetune_steps={"bert": budget.finetune_steps},
        **({"seeds": list(seeds)} if seeds is not None else {}),
    )


def _print_protocol(cfg: StudyConfig, budget: DemoBudget) -> None:
    print(
        f"protocol: one MLM base ({budget.base_steps} steps of {cfg.base_batch} × "
        f"{cfg.max_length} tokens), continued by "
        f"{', '.join(o for o in cfg.objectives if o != 'none')} × seeds {cfg.seeds} "
        f"({budget.steps} steps of {budget.batch} at lr {budget.lr:g} each); "
        f"zero-shot, then {budget.finetune_steps} fine-tuning steps",
        flush=True,
    )


def _report(out: Path, rows: list[dict], pretraining: list[dict], command: str, t0: float) -> None:
    """Write and print the report (tables, verdicts, plots) and where everything lies."""
    notes = [
        "The built-in task: docstring summary line -> its body, over the stdlib docstrings and "
        "pydoc topics (retromae_ds/data/builtin_corpus.py).",
        "",
        f"Wall time: {time.perf_counter() - t0:.0f} s.",
    ]
    body = report(rows, out, "retromae-ds demo: the MLM-base protocol", command, pretraining, notes)
    print(body)
    print(
        f"demo done in {time.perf_counter() - t0:.0f}s; report {out / 'study.md'}, plots "
        f"{out / 'study.png'} and {out / 'study_curve.png'} (zero-shot nDCG@10 against tokens "
        f"seen), encoders under {out / 'cells'}",
        flush=True,
    )
