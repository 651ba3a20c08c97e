"""The inverse-cloze task (data/ict_task.py): sentences taken out of WikiText paragraphs as
queries, the rest of the paragraph their one positive, split by article."""

from __future__ import annotations

import json
import re

import pytest

from retromae_ds.data.ict_task import build, wikitext_raws
from retromae_ds.retrieval.beir import load_beir


def _article(k: int, paragraphs: int) -> str:
    def sentence(p: int, s: int) -> str:
        return f"Topic{k} paragraph {p} sentence {s} speaks of the @-@ matter of item{k} here ."

    body = " \n \n ".join(" ".join(sentence(p, s) for s in range(5)) for p in range(paragraphs))
    return f" = Article {k} = \n \n {body} \n \n = = Section = = \n \n Too short . \n"


TEXT = "".join(_article(k, 2 + k % 3) for k in range(20))


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _qrels(out, split):
    return dict(
        line.split("\t")[:2]
        for line in (out / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]
    )


def test_queries_taken_out_of_their_paragraph_and_split_by_article(tmp_path):
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(TEXT, encoding="utf-8")
    out = build([raw], tmp_path / "ict", min_words=40, dev_fraction=0.2, test_fraction=0.2)
    corpus = {d["_id"]: d["text"] for d in _rows(out / "corpus.jsonl")}
    queries = {q["_id"]: q["text"] for q in _rows(out / "queries.jsonl")}
    # every paragraph of 5 sentences (60 words) is a passage; "Too short ." is not
    assert len(corpus) == sum(2 + k % 3 for k in range(20))
    articles = {}
    for split in ("train", "dev", "test"):
        for qid, doc in _qrels(out, split).items():
            query, passage = queries[qid], corpus[doc]
            assert "@" not in query and "the-matter" in query  # WikiText's @-@ joined back
            assert query not in passage, "the query sentence must be taken out of its passage"
            # same article and paragraph: the passage is the rest of the query's paragraph
            prefix = " ".join(query.split()[:3])
            assert set(re.findall(r"Topic\d+ paragraph \d+", passage)) == {prefix}
            # the passage keeps at least half of the paragraph's 5 sentences
            assert passage.count(" sentence ") >= 3
            articles.setdefault(query.split()[0], set()).add(split)
    assert all(len(splits) == 1 for splits in articles.values()), articles  # no crossing
    summary = json.loads((out / "ict_task.json").read_text())
    counts = summary["queries"]
    assert counts["train"] + counts["dev"] + counts["test"] == len(queries)
    total = len(queries)
    assert 0 < counts["test"] <= 0.2 * total and 0 < counts["dev"] <= 0.2 * total
    assert counts["train"] >= 0.6 * total
    assert len(load_beir(out, "dev").query_texts) == counts["dev"]
    # a pure function of the file and the settings
    again = build([raw], tmp_path / "again", min_words=40, dev_fraction=0.2, test_fraction=0.2)
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv", "qrels/test.tsv"):
        assert (again / name).read_text() == (out / name).read_text()
    # the same folder with other settings is refused, not silently reused
    assert build([raw], out, min_words=40, dev_fraction=0.2, test_fraction=0.2) == out
    with pytest.raises(ValueError, match="ict_task.json"):
        build([raw], out, min_words=30, dev_fraction=0.2, test_fraction=0.2)
    # one query a paragraph: one query per passage
    one = build([raw], tmp_path / "one", per_paragraph=1)
    assert json.loads((one / "ict_task.json").read_text())["passages"] == len(corpus)
    assert sum(json.loads((one / "ict_task.json").read_text())["queries"].values()) == len(corpus)


def test_no_paragraph_is_an_error_naming_the_file(tmp_path):
    raw = tmp_path / "w.raw"
    raw.write_text(" = Short = \n \n a few words . Two of them . \n", encoding="utf-8")
    with pytest.raises(ValueError, match="w.raw"):
        build([raw], tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="wiki.test.raw"):
        wikitext_raws(tmp_path)


def test_wikitext_2_gives_thousands_of_train_queries(tmp_path, shared_data):
    folder = shared_data / "wikitext2"
    if not (folder / "wiki.test.raw").is_file():
        pytest.skip("WikiText-2 is absent from the shared data folder")
    out = build(wikitext_raws(folder), tmp_path / "ict")
    summary = json.loads((out / "ict_task.json").read_text())
    assert summary["queries"]["train"] >= 3000, summary
    assert min(summary["queries"]["dev"], summary["queries"]["test"]) >= 300, summary
