"""The fine-tuning anchors' training-data formats (``retromae_ds.data.pairs``): each writer's
file read back gives the same examples (as far as the format holds them), each ST export loads
with ``datasets`` and trains one step in sentence-transformers on all-MiniLM-L6-v2, the FE and
Tevatron files match their tools' schemas, grouped ST anchors become one example, ids resolve
against a real BEIR corpus (SciFact), bad input is one line naming file, line and field, and an
interrupted write leaves nothing at the final path. Real files in ``tmp_path``, no mocks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pytest

from retromae_ds.data.pairs import (
    Corpus,
    Example,
    Passage,
    read_examples,
    write_examples,
)

EXAMPLES = [
    Example(
        "what is a cat",
        (Passage("a small feline", id="d1", title="Cats", score=0.9),),
        (
            Passage("dogs bark at night", id="d2", rank=1, score=0.5),
            Passage("fish swim in water", id="d3", rank=2, score=0.4),
        ),
        query_id="q1",
    ),
    Example(
        "why is the sky blue",
        (
            Passage("rayleigh scattering of light", id="d4", score=0.8),
            Passage("sunlight scatters off air", id="d5", score=0.7),
        ),
        (
            Passage("grass is green in spring", id="d6", rank=1, score=0.3),
            Passage("the sea is salty", id="d7", rank=2, score=0.2),
        ),
        query_id="q2",
    ),
]


def _write_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    docs = {p.id: p for ex in EXAMPLES for p in (*ex.positives, *ex.negatives)}
    with open(folder / "corpus.jsonl", "w") as f:
        for p in docs.values():
            f.write(json.dumps({"_id": p.id, "title": p.title or "", "text": p.text}) + "\n")
        f.write(json.dumps({"_id": "d9", "title": "", "text": "an unused passage"}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for ex in EXAMPLES:
            f.write(json.dumps({"_id": ex.query_id, "text": ex.query}) + "\n")
    return folder


def _texts(examples):
    return [
        (
            e.query,
            tuple(p.full_text for p in e.positives),
            tuple(p.full_text for p in e.negatives),
        )
        for e in examples
    ]


def _scores(examples):
    return [
        (tuple(p.score for p in e.positives), tuple(p.score for p in e.negatives)) for e in examples
    ]


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    "fmt,suffix,scores",
    [
        ("st-triplet", ".jsonl", False),
        ("st-triplet", ".parquet", True),
        ("st-ntuple", ".jsonl", True),
        ("st-ntuple", ".parquet", False),
        ("st-labeled-pair", ".jsonl", False),
        ("st-labeled-list", ".jsonl", True),
        ("st-labeled-list", ".parquet", False),
        ("flagembedding", ".jsonl", None),
    ],
)
def test_text_formats_read_back_to_the_same_texts_and_scores_when_kept(
    tmp_path, fmt, suffix, scores
):
    """ST and FE hold one string per passage: texts (title joined) come back, scores when
    written (ST with scores=True, FE always); ids and ranks are lost."""
    path = tmp_path / f"out{suffix}"
    counts = write_examples(EXAMPLES, path, fmt, scores=scores)
    assert counts["examples"] == 2 and counts["skipped"] == 0
    back = list(read_examples(path))
    assert _texts(back) == _texts(EXAMPLES)
    if scores is False:
        assert all(s is None for pos, neg in _scores(back) for s in (*pos, *neg))
    else:
        assert _scores(back) == _scores(EXAMPLES)
    assert all(p.id is None and p.rank is None for e in back for p in (*e.positives, *e.negatives))


def test_tevatron_keeps_ids_titles_and_texts_but_not_scores(tmp_path):
    path = tmp_path / "tev.jsonl"
    write_examples(EXAMPLES, path, "tevatron")
    back = list(read_examples(path))
    strip = [
        Example(
            e.query,
            tuple(Passage(p.text, p.id, p.title) for p in e.positives),
            tuple(Passage(p.text, p.id, p.title) for p in e.negatives),
            e.query_id,
        )
        for e in EXAMPLES
    ]
    assert back == strip


def test_mined_keeps_everything_with_its_corpus_and_ids_scores_ranks_without(tmp_path):
    corpus = _write_corpus(tmp_path / "beir")
    path = tmp_path / "mined.jsonl"
    write_examples(EXAMPLES, path, "mined")
    assert list(read_examples(path, corpus=corpus)) == EXAMPLES
    ids_only = list(read_examples(path, format="mined"))
    assert [e.query_id for e in ids_only] == ["q1", "q2"]
    assert all(p.text is None for e in ids_only for p in (*e.positives, *e.negatives))
    assert [[(p.id, p.rank, p.score) for p in e.negatives] for e in ids_only] == [
        [(p.id, p.rank, p.score) for p in e.negatives] for e in EXAMPLES
    ]
    # ids only can be written to a text format only once resolved
    with pytest.raises(ValueError, match="has no text.*corpus="):
        write_examples(ids_only, tmp_path / "fe.jsonl", "flagembedding")
    assert not (tmp_path / "fe.jsonl").exists()


def test_st_labeled_pairs_with_scores_are_written_as_st_does_but_not_read_back(tmp_path):
    path = tmp_path / "lp.jsonl"
    write_examples(EXAMPLES, path, "st-labeled-pair", scores=True)
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["anchor", "positive", "score"]
    with pytest.raises(ValueError, match="column 'score' without 'label'"):
        list(read_examples(path))


def test_ntuple_skips_short_examples_and_cuts_long_ones_counting_both(tmp_path):
    short = Example("q", (Passage("p"),), (Passage("n"),))
    counts = write_examples([*EXAMPLES, short], tmp_path / "n.jsonl", "st-ntuple", num_negatives=2)
    assert counts == {"examples": 3, "rows": 3, "skipped": 1, "truncated": 0}
    counts = write_examples(EXAMPLES, tmp_path / "n1.jsonl", "st-ntuple", num_negatives=1)
    assert counts["truncated"] == 2
    assert list(json.loads((tmp_path / "n1.jsonl").read_text().splitlines()[0])) == [
        "anchor",
        "positive",
        "negative_1",
    ]


# --------------------------------------------------------------------------- ST trains
def _load_table(path: Path, cache: Path):
    import datasets

    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path), cache_dir=str(cache))
    return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(cache))


def _more_examples() -> list[Example]:
    extra = [
        Example(
            f"question number {i}",
            (Passage(f"answer text {i}"),),
            (Passage(f"wrong text {i}"), Passage(f"other text {i}")),
        )
        for i in range(3)
    ]
    return [*EXAMPLES, *extra]


@pytest.mark.parametrize(
    "fmt,suffix",
    [
        ("st-triplet", ".jsonl"),
        ("st-ntuple", ".parquet"),
        ("st-labeled-pair", ".jsonl"),
        ("st-labeled-list", ".jsonl"),
    ],
)
def test_each_st_export_loads_with_datasets_and_trains_one_step(
    tmp_path, minilm_dir, monkeypatch, fmt, suffix
):
    """Loaded as ST's users load it and trained one step: MultipleNegativesRankingLoss for
    triplets and n-tuples, ContrastiveLoss for labeled pairs (bi-encoder), LambdaLoss for
    labeled lists (cross-encoder)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    path = tmp_path / f"train{suffix}"
    write_examples(_more_examples(), path, fmt)
    data = _load_table(path, tmp_path / "cache")
    assert data.column_names[:2] == ["anchor", "positive"]
    trained = _train_one_step(fmt, data, minilm_dir, tmp_path / "out")
    assert math.isfinite(trained["loss"]) and trained["changed"]
    # ST's collator saw the columns as meant: texts (anchor, positive, negatives) and labels
    expected = {"st-triplet": (3, None), "st-ntuple": (4, None), "st-labeled-pair": (2, 4)}
    assert trained["roles"] in (None, expected.get(fmt, (2, 4)))


def _st_parts(fmt: str, model_dir: Path):
    """(model, loss, collator, trainer class, arguments class) as ST's trainer builds them."""
    if fmt == "st-labeled-list":
        from sentence_transformers import cross_encoder as ce
        from sentence_transformers.cross_encoder.data_collator import CrossEncoderDataCollator
        from sentence_transformers.cross_encoder.losses import LambdaLoss

        model = ce.CrossEncoder(str(model_dir), num_labels=1, device="cpu")
        collator = CrossEncoderDataCollator(preprocess_fn=model.preprocess)
        return (
            model,
            LambdaLoss(model),
            collator,
            ce.CrossEncoderTrainer,
            ce.CrossEncoderTrainingArguments,
        )
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.sentence_transformer.data_collator import (
        SentenceTransformerDataCollator,
    )

    model = st.SentenceTransformer(str(model_dir), device="cpu")
    loss = (
        losses.ContrastiveLoss(model)
        if fmt == "st-labeled-pair"
        else losses.MultipleNegativesRankingLoss(model)
    )
    collator = SentenceTransformerDataCollator(preprocess_fn=model.preprocess)
    return (
        model,
        loss,
        collator,
        st.SentenceTransformerTrainer,
        st.SentenceTransformerTrainingArguments,
    )


def _train_one_step(fmt: str, data, model_dir: Path, out: Path) -> dict:
    """One optimizer step. With ``accelerate`` installed, ST's own Trainer; without it (the
    dev environment), the Trainer's step by hand: its collator, its ``collect_features`` and
    the loss, exactly as ``compute_loss`` calls them, then backward and an AdamW step."""
    import importlib.util

    import torch

    model, loss, collator, trainer_class, args_class = _st_parts(fmt, model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    roles = None
    if importlib.util.find_spec("accelerate") is not None:
        args = args_class(
            output_dir=str(out),
            max_steps=1,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
        )
        trainer = trainer_class(model=model, args=args, train_dataset=data, loss=loss)
        value = trainer.train().training_loss
    else:
        batch = collator([data[i] for i in range(min(4, len(data)))])
        for name in ("dataset_name", "prompt", "task"):
            batch.pop(name, None)
        features, labels = trainer_class.collect_features(None, batch)
        roles = (len(features), None if labels is None else len(labels))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = loss(features, labels)
        step.backward()
        optimizer.step()
        value = step.item()
    after = list(model.parameters())
    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, after, strict=True))
    return {"loss": value, "changed": changed, "roles": roles}


# --------------------------------------------------------------------------- FE and Tevatron
def test_flagembedding_and_tevatron_files_match_their_documented_schemas(tmp_path):
    """FE: ``{query: str, pos: [str], neg: [str], pos_scores: [float], neg_scores: [float]}``
    (FlagEmbedding loads it with ``datasets.load_dataset("json")``); Tevatron: ``{query_id,
    query, positive_passages: [{docid, title, text}], negative_passages}``. Each then read the
    way its tool's dataset reads it."""
    import datasets

    fe, tev = tmp_path / "fe.jsonl", tmp_path / "tev.jsonl"
    write_examples(EXAMPLES, fe, "flagembedding")
    write_examples(EXAMPLES, tev, "tevatron")
    cache = str(tmp_path / "cache")
    data = datasets.load_dataset("json", data_files=str(fe), split="train", cache_dir=cache)
    schema = data.data.schema
    assert schema.field("query").type == pa.string()
    for name in ("pos", "neg"):
        assert schema.field(name).type == pa.list_(pa.string())
        assert schema.field(f"{name}_scores").type == pa.list_(pa.float64())
    row = data[0]
    assert isinstance(row["pos"], list) and isinstance(row["neg"], list)  # FE asserts this
    assert row["pos"] == ["Cats a small feline"] and row["pos_scores"] == [0.9]

    data = datasets.load_dataset("json", data_files=str(tev), split="train", cache_dir=cache)
    passage = pa.struct([("docid", pa.string()), ("title", pa.string()), ("text", pa.string())])
    for name in ("positive_passages", "negative_passages"):
        assert data.data.schema.field(name).type == pa.list_(passage)
    assert data.data.schema.field("query_id").type == pa.string()
    group = data[0]
    first = group["positive_passages"][0]  # Tevatron joins title and text so
    assert first["title"] + " " + first["text"] == "Cats a small feline"
    assert group["query"] == "what is a cat" and group["query_id"] == "q1"


def test_flagembedding_reads_the_file_with_its_own_dataset_class(tmp_path):
    pytest.importorskip(
        "FlagEmbedding",
        reason="FlagEmbedding is not installed (it is in the bench extra, its own environment)",
    )
    from transformers import AutoTokenizer

    path = tmp_path / "fe.jsonl"
    write_examples(EXAMPLES, path, "flagembedding")
    try:  # FlagEmbedding 1.2.x
        from FlagEmbedding.baai_general_embedding.finetune.arguments import DataArguments
        from FlagEmbedding.baai_general_embedding.finetune.data import TrainDatasetForEmbedding
    except ImportError:
        pytest.skip("this FlagEmbedding version has no baai_general_embedding.finetune dataset")
    args = DataArguments(train_data=str(path), train_group_size=2)
    dataset = TrainDatasetForEmbedding(
        args, tokenizer=AutoTokenizer.from_pretrained("bert-base-uncased")
    )
    assert len(dataset) == 2
    query, passages = dataset[1]
    assert query == "why is the sky blue" and len(passages) == 2
    assert passages[0] in {"rayleigh scattering of light", "sunlight scatters off air"}


# --------------------------------------------------------------------------- ST grouping
def test_a_repeated_st_anchor_is_one_example_in_every_table_kind(tmp_path):
    import datasets

    rows = [
        {"anchor": "a", "positive": "p1", "negative": "n1"},
        {"anchor": "b", "positive": "p2", "negative": "n2"},
        {"anchor": "a", "positive": "p3", "negative": "n1"},
        {"anchor": "a", "positive": "p1", "negative": "n4"},
    ]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "t.parquet"))
    table.save_to_disk(str(tmp_path / "folder"))
    for path in (jsonl, tmp_path / "t.parquet", tmp_path / "folder"):
        by_anchor = {e.query: e for e in read_examples(path)}
        assert sorted(by_anchor) == ["a", "b"], path
        assert [p.text for p in by_anchor["a"].positives] == ["p1", "p3"]
        assert [p.text for p in by_anchor["a"].negatives] == ["n1", "n4"]
        assert by_anchor["a"].where.endswith(("t.jsonl:1", "row 1"))
    labeled = tmp_path / "labeled.jsonl"
    labeled.write_text(
        '{"query": "a", "text": "p1", "label": 1}\n{"query": "b", "text": "x", "label": 1}\n'
        '{"query": "a", "text": "n1", "label": 0}\n'
    )
    (a,) = [e for e in read_examples(labeled) if e.query == "a"]
    assert ([p.text for p in a.positives], [p.text for p in a.negatives]) == (["p1"], ["n1"])


# --------------------------------------------------------------------------- real ids
def test_scifact_ids_resolve_against_its_beir_corpus(tmp_path, shared_data):
    scifact = shared_data / "scifact"
    qrels = [
        line.split("\t") for line in (scifact / "qrels" / "train.tsv").read_text().splitlines()[1:6]
    ]
    texts = {}
    with open(scifact / "corpus.jsonl") as f:
        for line in f:
            record = json.loads(line)
            texts[record["_id"]] = (record.get("title") or "", record["text"])
    negative = next(iter(texts))
    fe = tmp_path / "fe_ids.jsonl"
    fe.write_text(
        "".join(json.dumps({"query": q, "pos": [d], "neg": [negative]}) + "\n" for q, d, _ in qrels)
    )
    tev = tmp_path / "tev_ids.jsonl"
    tev.write_text(
        "".join(
            json.dumps(
                {
                    "query_id": q,
                    "query": "q",
                    "positive_passages": [{"docid": d}],
                    "negative_passages": [],
                }
            )
            + "\n"
            for q, d, _ in qrels
        )
    )
    corpus = Corpus(scifact)
    try:
        for examples in (
            list(read_examples(fe, corpus=corpus, by_id=True)),
            list(read_examples(tev, corpus=corpus)),
        ):
            assert [e.positives[0].id for e in examples] == [d for _, d, _ in qrels]
            for example, (_, doc_id, _) in zip(examples, qrels, strict=True):
                title, text = texts[doc_id]
                assert (example.positives[0].title or "", example.positives[0].text) == (
                    title,
                    text,
                )
        first = list(read_examples(fe, corpus=corpus, by_id=True))[0]
        assert first.query_id == qrels[0][0] and first.query and first.query != qrels[0][0]
    finally:
        corpus.close()
    fe.write_text(json.dumps({"query": qrels[0][0], "pos": ["no-such-doc"]}) + "\n")
    with pytest.raises(
        ValueError, match=r"fe_ids\.jsonl:1: field 'pos\[0\]': id 'no-such-doc' is not in"
    ):
        list(read_examples(fe, corpus=scifact, by_id=True))


# --------------------------------------------------------------------------- bad input
FE_OK = '{"query": "q", "pos": ["p"], "neg": ["n"]}'
BAD_JSONL = [
    ("fe", '{"query": "q"}', "missing field 'pos'"),
    ("fe", '{"query": "q", "pos": "p"}', "field 'pos' is a string, not a list"),
    ("fe", '{"query": "  ", "pos": ["p"]}', "field 'query' is empty"),
    ("fe", '{"query": "q", "pos": ["p", ""]}', "field 'pos[1]' is empty"),
    ("fe", '{"query": "q", "pos": ["p", 3]}', "field 'pos[1]' is a number, not a string"),
    ("fe", '{"query": "q", "pos": []}', "field 'pos': the query has no positive passage"),
    ("fe", '{"query": "q", "pos": ["p"], "pos_scores": [1, 2]}', "field 'pos_scores' has 2 scores"),
    (
        "fe",
        '{"query": "q", "pos": ["p"], "neg": ["n"], "neg_scores": ["x"]}',
        "field 'neg_scores[0]' is a string",
    ),
    ("fe", '{"query": "q", "pos": ["p"]', "not valid JSON"),
    (
        "tev",
        '{"query_id": "1", "query": "q", "positive_passages": [{"title": "t"}]}',
        "missing field 'positive_passages[0].text'",
    ),
    (
        "tev",
        '{"query_id": "1", "query": "q", "positive_passages": [], "negative_passages": []}',
        "field 'positive_passages': the query has no positive",
    ),
    (
        "mined",
        '{"query_id": "q1", "positives": [{"id": "d1"}], "negatives": [{"id": "nope", "rank": 1}]}',
        "field 'negatives[0].id': id 'nope' is not in",
    ),
    (
        "mined",
        '{"query_id": "q1", "positives": [{"id": "d1"}], "negatives": [{"id": "d2", "rank": 0}]}',
        "field 'negatives[0].rank' is 0, not a rank",
    ),
    (
        "mined",
        '{"query_id": "q7", "positives": [{"id": "d1"}]}',
        "field 'query_id': query id 'q7' is not in the queries",
    ),
    ("st", '{"anchor": "a", "positive": "p"}', "missing field 'negative'"),
    (
        "st",
        '{"anchor": "a", "positive": "p", "negative": null}',
        "field 'negative' is null, not a string",
    ),
    ("label", '{"anchor": "a", "positive": "p", "label": 2}', "field 'label' is 2; labels are 1"),
    (
        "label",
        '{"anchor": "b", "positive": "p", "label": 0}',
        "field 'label': the query has no positive",
    ),
]
FIRST = {
    "fe": FE_OK,
    "tev": '{"query_id": "0", "query": "q", "positive_passages": [{"docid": "1", "title": "", "text": "p"}]}',
    "mined": '{"query_id": "q1", "positives": [{"id": "d1"}]}',
    "st": '{"anchor": "x", "positive": "p", "negative": "n"}',
    "label": '{"anchor": "x", "positive": "p", "label": 1}',
}


@pytest.mark.parametrize("kind,line,message", BAD_JSONL, ids=[m for _, _, m in BAD_JSONL])
def test_bad_input_is_one_line_naming_file_line_and_field(tmp_path, kind, line, message):
    corpus = _write_corpus(tmp_path / "beir")
    path = tmp_path / "pairs.jsonl"
    path.write_text(f"{FIRST[kind]}\n\n{line}\n")  # the bad record is on line 3
    with pytest.raises(ValueError) as info:
        list(read_examples(path, corpus=corpus if kind == "mined" else None))
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path}:3: ") and message in text, text


def test_bad_rows_of_tables_and_unknown_files_are_one_line(tmp_path):
    import datasets

    rows = [
        {"anchor": "a", "positive": "p", "negative": "n"},
        {"anchor": "", "positive": "p", "negative": "n"},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(ValueError, match=r"t\.parquet: row 2: field 'anchor' is empty$"):
        list(read_examples(tmp_path / "t.parquet"))
    unknown = tmp_path / "odd.jsonl"
    unknown.write_text('{"foo": {"bar": 1}}\n')
    with pytest.raises(
        ValueError, match=r"odd\.jsonl:1: cannot tell the format .*known formats: flagembedding"
    ):
        read_examples(unknown)
    with pytest.raises(ValueError, match="unknown pairs format 'fe'"):
        read_examples(unknown, format="fe")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_examples(tmp_path / "absent.jsonl")


# --------------------------------------------------------------------------- atomic writes
@pytest.mark.parametrize(
    "fmt,suffix", [("flagembedding", ".jsonl"), ("st-triplet", ".parquet"), ("mined", ".jsonl")]
)
def test_an_interrupted_write_leaves_no_file_and_an_older_one_intact(tmp_path, fmt, suffix):
    def failing():
        yield from EXAMPLES
        raise RuntimeError("interrupted mid-write")

    fresh = tmp_path / f"fresh{suffix}"
    with pytest.raises(RuntimeError, match="interrupted"):
        write_examples(failing(), fresh, fmt)
    assert not fresh.exists()
    older = tmp_path / f"older{suffix}"
    write_examples(EXAMPLES[:1], older, fmt)
    before = older.read_bytes()
    with pytest.raises(RuntimeError, match="interrupted"):
        write_examples(failing(), older, fmt)
    assert older.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [older.name]  # no temporary left
