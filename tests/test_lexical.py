"""The BM25 reference row: the measured figure on real SciFact, and its ranking rules on a
small hand-made collection."""

from __future__ import annotations

import pytest

from retromae_ds.retrieval.beir import BeirData
from retromae_ds.retrieval.lexical import bm25_run, evaluate_bm25


def test_bm25_ranks_by_stemmed_terms_and_skips_a_query_s_own_id():
    data = BeirData(
        corpus_ids=["a", "b", "c", "q2"],
        corpus_texts=["proteins folding in cells", "the weather is cold", "running dogs", "x"],
        query_ids=["q1", "q2"],
        query_texts=["protein folds", "dog runs"],
        qrels={"q1": {"a": 1}, "q2": {"c": 1}},
    )
    run = bm25_run(data, k=2)
    assert next(iter(run["q1"])) == "a"  # protein(s) / fold(s, ing): the stemmer matches
    assert next(iter(run["q2"])) == "c" and "q2" not in run["q2"]
    result = evaluate_bm25(data, measures=["ndcg@10", "mrr@10"])
    assert result["metrics"] == {"ndcg@10": 1.0, "mrr@10": 1.0}


def test_bm25_on_scifact_test_is_the_reference_figure():
    from helpers_data import SHARED_DATA

    folder = SHARED_DATA / "scifact"
    if not (folder / "corpus.jsonl").is_file():
        pytest.skip(f"{folder} is absent (real SciFact data)")
    result = evaluate_bm25(folder, "test", ["ndcg@10", "recall@100"])
    assert result["num_queries"] == 300
    assert result["metrics"]["ndcg@10"] == pytest.approx(0.686, abs=0.001)  # data/README.md
