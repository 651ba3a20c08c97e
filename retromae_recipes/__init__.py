"""Experiments built on the library, kept out of it (torchtune's ``retromae_recipes/``).

``retromae_recipes.study`` is the study of docs/results.md (``python scripts/study.py``),
``retromae_recipes.report`` turns its results into tables, verdicts and a plot, and ``retromae_recipes.demo`` is
the README's main job (``retromae-ds demo``). They drive the library only through its public
pieces: typed configs (``retromae_ds.pretrain.PretrainConfig``, ``retromae_ds.finetune.FinetuneConfig``)
written as JSON and run with ``python -m retromae_ds.pretrain --config FILE``, one process per
stage.
"""
