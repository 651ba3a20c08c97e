"""An inverse-cloze retrieval task built offline from WikiText (``wiki.*.raw``): sentences as
queries, the paragraphs they were taken out of as passages, split by article.

``build(raws, out)`` writes a BEIR folder: every paragraph of ``min_words``+ words (headings
aside) and two or more sentences is one passage, with some of its sentences taken out; each
sentence taken out is a query whose one positive is its paragraph without it (inverse cloze,
Lee et al. 2019, with the sentence always removed). A paragraph gives up to ``per_paragraph``
queries (0: as many as fit) while the passage keeps at least ``keep`` of the paragraph's
words, so the queries of one paragraph share its passage (the contrastive loss masks a
shared positive rather than count it as a negative: ``finetuning.loss``). Query sentences
have 6-60 words. WikiText's ``@-@``, ``@,@`` and ``@.@`` tokens are joined back.

Articles, in an order drawn with ``seed``, fill ``qrels/test.tsv`` and ``qrels/dev.tsv`` up to
``test_fraction`` and ``dev_fraction`` of the queries (an article that would overshoot goes
to the next split), the rest ``qrels/train.tsv``: no article's paragraphs cross splits. The
corpus holds every split's passages. Everything is a pure function of the files and the
settings; ``ict_task.json`` records the settings and the counts, and a folder built with
others is refused rather than reused.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from retromae_ds.base.fsutil import atomic_write_text
from retromae_ds.data.builtin_corpus import write_beir
from retromae_ds.data.long_task import parse_articles

_SENTENCE = re.compile(r"(?<=[.!?]) (?=[A-Z])")
_AT = re.compile(r" @([-,.])@ ")
SPLITS = ("train", "dev", "test")
QUERY_WORDS = (6, 60)


def _clean(text: str) -> str:
    return _AT.sub(r"\1", text).strip()


def paragraph_queries(
    paragraph: str, rng: random.Random, per_paragraph: int, keep: float
) -> tuple[list[str], str] | None:
    """(the sentences taken out, the paragraph without them) or None when none can be."""
    sentences = _SENTENCE.split(paragraph)
    if len(sentences) < 2:
        return None
    words = [len(s.split()) for s in sentences]
    total, left = sum(words), sum(words)
    order = [i for i, n in enumerate(words) if QUERY_WORDS[0] <= n <= QUERY_WORDS[1]]
    rng.shuffle(order)
    taken: list[int] = []
    for i in order:
        if per_paragraph and len(taken) == per_paragraph:
            break
        if left - words[i] >= keep * total:
            taken.append(i)
            left -= words[i]
    if not taken:
        return None
    taken.sort()
    passage = " ".join(s for i, s in enumerate(sentences) if i not in taken)
    return [_clean(sentences[i]) for i in taken], _clean(passage)


def _article_units(body: str, title: str, settings: dict[str, Any]) -> list[tuple[list[str], str]]:
    rng = random.Random(f"{settings['seed']}:{title}")
    units = []
    for paragraph in body.split("\n"):
        if paragraph.startswith("=") or len(paragraph.split()) < settings["min_words"]:
            continue
        found = paragraph_queries(paragraph, rng, settings["per_paragraph"], settings["keep"])
        if found is not None:
            units.append(found)
    return units


def _assign(counts: list[int], order: list[int], fractions: dict[str, float]) -> list[str]:
    """Each article's split: test, then dev, filled in ``order`` up to their fractions."""
    total = sum(counts)
    target = {s: fractions[s] * total for s in ("test", "dev")}
    filled = {"test": 0, "dev": 0}
    split = ["train"] * len(counts)
    for a in order:
        for s in ("test", "dev"):
            if filled[s] + counts[a] <= target[s]:
                split[a], filled[s] = s, filled[s] + counts[a]
                break
    return split


def build(
    raws: Sequence[str | Path],
    out: str | Path,
    *,
    min_words: int = 40,
    per_paragraph: int = 0,
    keep: float = 0.5,
    dev_fraction: float = 0.1,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> Path:
    """Write the BEIR folder ``out`` (see the module docstring); an existing one is kept."""
    out = Path(out)
    settings = {"min_words": min_words, "per_paragraph": per_paragraph, "keep": keep, "seed": seed}
    wanted = {**settings, "dev_fraction": dev_fraction, "test_fraction": test_fraction}
    if (out / "ict_task.json").is_file():
        made = json.loads((out / "ict_task.json").read_text())
        if made["settings"] != wanted or made["sources"] != [str(r) for r in raws]:
            raise ValueError(
                f"{out}/ict_task.json: built from other files or settings ({made['settings']}); "
                "remove the folder or use another output folder"
            )
        return out
    if (
        not 0 < keep < 1
        or dev_fraction < 0
        or test_fraction < 0
        or dev_fraction + test_fraction >= 1
    ):
        raise ValueError(
            f"ict_task: keep in (0, 1) and dev_fraction + test_fraction < 1, not keep {keep}, "
            f"dev_fraction {dev_fraction}, test_fraction {test_fraction}"
        )
    articles = [(Path(raw).name, a) for raw in raws for a in parse_articles(raw)]
    units = [_article_units(a.body, f"{name}:{a.title}", settings) for name, a in articles]
    counts = [sum(len(qs) for qs, _ in u) for u in units]
    if not sum(counts):
        raise ValueError(
            f"{', '.join(map(str, raws))}: no paragraph of {min_words}+ words and 2+ sentences "
            "under a WikiText ' = Title = ' line"
        )
    order = sorted(range(len(articles)), key=lambda a: random.Random(f"{seed}:{a}").random())
    split_of = _assign(counts, order, {"dev": dev_fraction, "test": test_fraction})
    corpus, queries, qrels = [], [], {s: [] for s in SPLITS}
    for a, article_units in enumerate(units):
        for sentences, passage in article_units:
            doc_id = f"p{len(corpus)}"
            corpus.append({"_id": doc_id, "title": "", "text": passage})
            for sentence in sentences:
                qid = f"q{len(queries)}"
                queries.append({"_id": qid, "text": sentence})
                qrels[split_of[a]].append((qid, doc_id))
    write_beir(out, corpus, queries, qrels["test"], qrels["train"])
    dev = "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in qrels["dev"])
    atomic_write_text(out / "qrels" / "dev.tsv", dev)
    summary = {
        "sources": [str(r) for r in raws],
        "settings": wanted,
        "passages": len(corpus),
        "queries": {s: len(qrels[s]) for s in SPLITS},
        "articles": {s: split_of.count(s) for s in SPLITS},
        "articles_without_queries": counts.count(0),
    }
    atomic_write_text(out / "ict_task.json", json.dumps(summary, indent=2) + "\n")
    return out


def wikitext_raws(folder: str | Path) -> list[Path]:
    """The ``wiki.{train,valid,test}.raw`` files of a WikiText folder that exist, in that
    order (WikiText-2's shared copy holds only the test file)."""
    folder = Path(folder)
    found = [folder / f"wiki.{s}.raw" for s in ("train", "valid", "test")]
    found = [p for p in found if p.is_file()]
    if not found:
        raise FileNotFoundError(f"{folder}: no wiki.train.raw, wiki.valid.raw or wiki.test.raw")
    return found
