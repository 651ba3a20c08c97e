"""The long-document task (data/long_task.py): WikiText articles as documents, title and
deep-sentence queries, the deep sentence removed from its article."""

from __future__ import annotations

import json

import pytest

from retromae_ds.cli import main as cli_main
from retromae_ds.data.long_task import build, parse_articles
from retromae_ds.retrieval.beir import load_beir

BODY = " ".join(f"Sentence number {i} tells about the topic of item {i % 7} ." for i in range(400))
TEXT = (
    " \n = Alpha = \n \n "
    + BODY
    + " \n \n = = Later = = \n \n A final note closes Alpha for now . \n"
    " = Beta = \n \n Too short to keep . \n"
    " = Gamma = \n \n " + BODY.replace("topic", "subject") + " \n"
)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_articles_queries_and_the_removed_sentence(tmp_path):
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(TEXT, encoding="utf-8")
    assert [a.title for a in parse_articles(raw)] == ["Alpha", "Beta", "Gamma"]
    out = build(raw, tmp_path / "task", min_words=100, deep_after=600)
    corpus = {d["_id"]: d["text"] for d in _rows(out / "corpus.jsonl")}
    queries = {q["_id"]: q["text"] for q in _rows(out / "queries.jsonl")}
    assert len(corpus) == 2 and "Too short" not in " ".join(corpus.values())  # Beta left out
    assert queries["t-0"] == "Alpha" and queries["t-1"] == "Gamma"
    for n in (0, 1):
        sentence = queries[f"d-{n}"]
        body = corpus[f"w{n}"]
        assert sentence not in body, "the deep sentence must be taken out of its article"
        # it came from beyond the first 600 words of the article
        words_before = int(sentence.split()[2])  # "Sentence number K ..."
        assert words_before * 12 >= 600 - 12
    test = load_beir(out, "test")
    deep = load_beir(out, "deep")
    assert len(test.query_texts) == 2 and len(deep.query_texts) == 2
    again = build(raw, tmp_path / "again", min_words=100, deep_after=600)
    assert (again / "queries.jsonl").read_text() == (out / "queries.jsonl").read_text()


def test_no_long_article_is_an_error_naming_the_file(tmp_path):
    raw = tmp_path / "w.raw"
    raw.write_text(" = Short = \n \n a few words . \n", encoding="utf-8")
    with pytest.raises(ValueError, match="w.raw"):
        build(raw, tmp_path / "t")


def test_wikitext_2_gives_long_articles(tmp_path, shared_data, capsys):
    raw = shared_data / "wikitext2" / "wiki.test.raw"
    assert cli_main(["long-task", str(raw), "--out", str(tmp_path / "wl")]) == 0
    assert "54 articles" in capsys.readouterr().out
    corpus = _rows(tmp_path / "wl" / "corpus.jsonl")
    words = sorted(len(d["text"].split()) for d in corpus)
    # 1,000+ words each (less the deep sentence taken out); thousands of tokens for most
    assert words[0] >= 900 and words[len(words) // 2] > 2000
    deep = (tmp_path / "wl" / "qrels" / "deep.tsv").read_text().splitlines()
    assert len(deep) - 1 >= 50
