"""``retromae-ds eval``: retrieval metrics of an encoder on a BEIR folder, as a job (its body
is ``retromae_ds.eval.run.evaluate_beir``)."""

from __future__ import annotations

from dataclasses import asdict

from retromae_ds.eval.run import INDEX_OPTIONS, EvalConfig, evaluate_beir
from retromae_ds.search.index import spelled_as


def eval_command(cfg: EvalConfig) -> int:
    """``retromae-ds eval``; returns the exit status. Every field of ``EvalConfig`` but the
    model, folder, split and output file is a setting of ``evaluate_beir`` of the same name
    (the index options as the ``IndexSetting`` checked when the config was built)."""
    skip = ("model", "beir", "split", "out", *INDEX_OPTIONS)
    settings = {k: v for k, v in asdict(cfg).items() if k not in skip}
    with spelled_as(cfg.option):  # what the corpus cannot satisfy, named as eval's option
        evaluate_beir(
            cfg.model, cfg.beir, cfg.split, out_json=cfg.out, index=cfg.index_setting, **settings
        )
    return 0
