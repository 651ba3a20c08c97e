"""``retromae-ds eval``: retrieval metrics of an encoder on a BEIR folder, as a job (its body
is ``retromae_ds.eval.run.evaluate_beir``)."""

from __future__ import annotations

from dataclasses import asdict

from retromae_ds.eval.result_file import check_out, write_result
from retromae_ds.eval.run import INDEX_OPTIONS, EvalConfig, evaluate_beir, format_table
from retromae_ds.eval.two_stage import BM25, evaluate_bm25_beir
from retromae_ds.search.index import spelled_as


def eval_command(cfg: EvalConfig) -> int:
    """``retromae-ds eval``; returns the exit status. Every field of ``EvalConfig`` but the
    model, folder, split, output file and ``rerank`` section is a setting of ``evaluate_beir``
    of the same name (the index options as the ``IndexSetting`` checked when the config was
    built; the section as ``rerank``, ``rerank_negatives``, ``candidates`` and
    ``cross_encoder``). ``--model bm25``: ``two_stage.evaluate_bm25_beir``."""
    if cfg.model == BM25:
        return _bm25_command(cfg)
    skip = ("model", "beir", "split", "out", "rerank", *INDEX_OPTIONS)
    settings = {k: v for k, v in asdict(cfg).items() if k not in skip}
    r = cfg.rerank
    with spelled_as(cfg.option):  # what the corpus cannot satisfy, named as eval's option
        evaluate_beir(
            cfg.model, cfg.beir, cfg.split, out_json=cfg.out, index=cfg.index_setting,
            rerank=r.lists, rerank_negatives=r.negatives, candidates=r.candidates,
            cross_encoder=cfg.cross_encoder(), **settings,
        )  # fmt: skip
    return 0


def _bm25_command(cfg: EvalConfig) -> int:
    """``retromae-ds eval --model bm25``: BM25 as the first stage, reranked when
    ``rerank.model`` asks; the same table and result file as a dense model's."""
    if cfg.out is not None:
        check_out(cfg.out, model=None, beir=cfg.beir)
    result = evaluate_bm25_beir(
        cfg.beir, cfg.split, measures=cfg.measures,
        ignore_identical_ids=cfg.ignore_identical_ids, cross_encoder=cfg.cross_encoder(),
    )  # fmt: skip
    print(format_table(result))
    if cfg.out is not None:
        write_result(cfg.out, result)
        print(f"wrote {cfg.out}")
    return 0
