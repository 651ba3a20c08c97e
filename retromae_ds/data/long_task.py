"""A long-document retrieval task built offline from WikiText (``wiki.*.raw``): whole articles,
thousands of tokens each, as the corpus.

WikiText keeps Wikipedia's headings: `` = Title = `` starts an article, `` = = Section = = ``
a section. ``build(raw, out)`` writes a BEIR folder with one document per article (its body,
headings kept, the title line removed) and two query sets:

- ``qrels/test.tsv``: the article's title (queries ``t-<n>``), as the issue-17 task asks;
  mostly answerable from an article's opening, so truncation costs little;
- ``qrels/deep.tsv``: one sentence of the article taken from beyond its first
  ``deep_after`` words (queries ``d-<n>``), removed from the corpus copy, so the article is
  relevant only through text a 512-token encoder never reads (about 380 words fit in 512
  WordPiece tokens).

The choice of sentence is a pure function of the article and ``seed``. Articles shorter
than ``min_words`` words are left out. Evaluate with ``retromae-ds eval --split deep
--max_length 8192``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from retromae_ds.base.config import flag
from retromae_ds.data.builtin_corpus import write_beir

_TITLE = re.compile(r"^ = ([^=].*?) = $")
_SENTENCE = re.compile(r"(?<=[.!?]) (?=[A-Z])")


@dataclass
class Article:
    title: str
    body: str


def parse_articles(path: str | Path) -> list[Article]:
    """WikiText articles in file order (the text before the first title is dropped)."""
    articles: list[Article] = []
    lines: list[str] = []
    title = None
    with open(path, encoding="utf-8", newline="") as f:
        for raw in f:
            line = raw.rstrip("\r\n")
            m = _TITLE.match(line)
            if m:
                if title is not None:
                    articles.append(Article(title, _join(lines)))
                title, lines = m.group(1).strip(), []
            elif title is not None:
                lines.append(line)
    if title is not None:
        articles.append(Article(title, _join(lines)))
    return articles


def _join(lines: list[str]) -> str:
    return "\n".join(line.strip() for line in lines if line.strip())


def _deep_sentence(body: str, after_words: int, rng: random.Random) -> tuple[str, str] | None:
    """(a sentence of 8-60 words starting after ``after_words`` words, the body without it)."""
    paragraphs = body.split("\n")
    seen, options = 0, []
    for p, text in enumerate(paragraphs):
        if text.startswith("="):  # a heading
            seen += len(text.split())
            continue
        for sentence in _SENTENCE.split(text):
            n = len(sentence.split())
            if seen >= after_words and 8 <= n <= 60:
                options.append((p, sentence))
            seen += n
    if not options:
        return None
    p, sentence = options[rng.randrange(len(options))]
    kept = paragraphs[p].replace(sentence, "", 1).replace("  ", " ").strip()
    paragraphs = paragraphs[:p] + ([kept] if kept else []) + paragraphs[p + 1 :]
    return sentence, "\n".join(paragraphs)


def build(
    raw: str | Path,
    out: str | Path,
    *,
    min_words: int = 1000,
    deep_after: int = 600,
    seed: int = 0,
) -> Path:
    """Write the BEIR folder ``out`` (see the module docstring); an existing one is kept."""
    out = Path(out)
    if (out / "qrels" / "deep.tsv").is_file():
        return out
    articles = [a for a in parse_articles(raw) if len(a.body.split()) >= min_words]
    if not articles:
        raise ValueError(f"{raw}: no WikiText article of {min_words}+ words (' = Title = ' lines)")
    corpus, queries, titles, deep = [], [], [], []
    for n, article in enumerate(articles):
        doc_id = f"w{n}"
        rng = random.Random(f"{seed}:{article.title}")
        found = _deep_sentence(article.body, deep_after, rng)
        body = article.body
        if found is not None:
            sentence, body = found
            queries.append({"_id": f"d-{n}", "text": sentence})
            deep.append((f"d-{n}", doc_id))
        corpus.append({"_id": doc_id, "title": "", "text": body})
        queries.append({"_id": f"t-{n}", "text": article.title})
        titles.append((f"t-{n}", doc_id))
    write_beir(out, corpus, queries, titles)
    tmp = out / "qrels" / "deep.tsv.tmp"
    tmp.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in deep))
    tmp.replace(out / "qrels" / "deep.tsv")
    return out


@dataclass(kw_only=True)
class LongTaskConfig:
    """``retromae-ds long-task``: a long-document BEIR task from WikiText articles."""

    raw: str = flag(positional=True)
    """A WikiText wiki.*.raw file."""
    out: str
    """BEIR folder to write."""
    min_words: int = 1000
    """Shortest article kept."""
    deep_after: int = 600
    """Deep queries start after this many words."""
    seed: int = 0
    """Seeds the choice of deep sentences."""
