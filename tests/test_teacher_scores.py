"""Offline teacher-score files (``retromae_ds.data.teacher_scores``): each anchor's format read
from a small file into hand-computed ``{qid: {did: score}}``, detected automatically; every
bad input refused in one line naming file, line and field; the writer's file read back equal;
FlagEmbedding's own loader (when importable) reading the FE file tested here to the same
scores. Real files in ``tmp_path``, pure Python."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from retromae_ds.data.sources import InputError
from retromae_ds.data.teacher_scores import (
    FORMATS,
    detect_format,
    read_teacher_scores,
    write_teacher_scores,
)


def _jsonl(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


FE_RECORDS = (
    {"query": "q1", "pos": ["d1"], "neg": ["d2", "d3"], "pos_scores": [0.5],
     "neg_scores": [0.25, -1.5]},
    {"query": "q2", "pos": ["d4"], "neg": ["d5", "d1"], "pos_scores": [2.0],
     "neg_scores": [0.125, -0.75]},
)  # fmt: skip
FE_EXPECTED = {
    "q1": {"d1": 0.5, "d2": 0.25, "d3": -1.5},
    "q2": {"d4": 2.0, "d5": 0.125, "d1": -0.75},
}

# format -> (file name, content, expected scores); each computed by hand from the content.
CASES = {
    "retromae": (
        "scores.txt",
        "q1 d1 0.9\nq1\td2\t[0.25]\n\n  q2   d3   -1.5e0  \n",
        {"q1": {"d1": 0.9, "d2": 0.25}, "q2": {"d3": -1.5}},
    ),
    "hofstatter": (
        "bert_cat_ensemble_msmarcopassage_train_scores_ids.tsv",
        # (q1, d1) repeats with the same score, as the published ensemble file does
        "11.5\t2.0\tq1\td1\td2\n11.5\t-3.25\tq1\td1\td3\n7\t1\tq2\td4\td5\n",
        {"q1": {"d1": 11.5, "d2": 2.0, "d3": -3.25}, "q2": {"d4": 7.0, "d5": 1.0}},
    ),
    "simlm": (
        "kd_train.jsonl",
        _jsonl(
            {
                "query_id": "q1",
                "query": "what is a cat",
                "positives": {"doc_id": ["d1"], "score": [4.5]},
                "negatives": {"doc_id": ["d2", "d3"], "score": [-2.0, 0.5]},
            },
            {
                "query_id": 7,
                "query": "why",
                "positives": {"doc_id": [11, "12"], "score": [1, 2.5]},
                "negatives": {"doc_id": [], "score": []},
            },
        ),
        {"q1": {"d1": 4.5, "d2": -2.0, "d3": 0.5}, "7": {"11": 1.0, "12": 2.5}},
    ),
    "flagembedding": ("fe.jsonl", _jsonl(*FE_RECORDS), FE_EXPECTED),
    "st": (
        "st.jsonl",
        _jsonl(
            {
                "anchor": "q1",
                "positive": "d1",
                "negative_1": "d2",
                "negative_2": "d3",
                "scores": [0.9, 0.2, 0.1],
            },
            {
                "anchor": "q2",
                "positive": "d4",
                "negative_1": "d5",
                "negative_2": "d1",
                "scores": [0.8, 0.3, 0.05],
            },
            {
                "anchor": "q1",
                "positive": "d6",
                "negative_1": "d2",
                "negative_2": "d7",
                "scores": [0.7, 0.2, 0.15],
            },
        ),
        {
            "q1": {"d1": 0.9, "d2": 0.2, "d3": 0.1, "d6": 0.7, "d7": 0.15},
            "q2": {"d4": 0.8, "d5": 0.3, "d1": 0.05},
        },
    ),
    "tevatron": (
        "tevatron.jsonl",
        _jsonl(
            {
                "query_id": "q1",
                "query": "what is a cat",
                "positive_passages": [
                    {"docid": "d1", "title": "Cats", "text": "a feline", "score": 9.0}
                ],
                "negative_passages": [
                    {"docid": "d2", "title": "", "text": "dogs", "score": -1.0},
                    {"docid": "d3", "title": "", "text": "fish", "score": 0.0},
                ],
            },
        ),
        {"q1": {"d1": 9.0, "d2": -1.0, "d3": 0.0}},
    ),
    "mined": (
        "mined.jsonl",
        _jsonl(
            {
                "query_id": "q1",
                "positives": [{"id": "d1", "score": 0.8}],
                "negatives": [
                    {"id": "d2", "rank": 1, "score": 0.6},
                    {"id": "d3", "rank": 2, "score": 0.4},
                ],
            },
        ),
        {"q1": {"d1": 0.8, "d2": 0.6, "d3": 0.4}},
    ),
}


def _file(tmp_path: Path, name: str, content: str) -> Path:
    path = tmp_path / name
    path.write_text(content)
    return path


@pytest.mark.parametrize("format", FORMATS)
def test_each_format_reads_its_scores_and_is_detected(tmp_path, format):
    name, content, expected = CASES[format]
    path = _file(tmp_path, name, content)
    assert detect_format(path) == format
    for asked in ("auto", format):
        got = read_teacher_scores(path, format=asked)
        assert got.format == format
        assert got.scores == expected and dict(got) == expected
        assert got.pairs == sum(len(v) for v in expected.values())
        assert len(got) == len(expected)
        assert got.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    first_q = next(iter(expected))
    first_d = next(iter(expected[first_q]))
    assert got[first_q][first_d] == expected[first_q][first_d]


def test_st_parquet_and_ids_checked_against_known_sets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in CASES["st"][1].splitlines()]
    path = tmp_path / "st.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = read_teacher_scores(path, query_ids={"q1", "q2"}, corpus_ids={f"d{i}" for i in range(8)})
    assert got.format == "st" and got.scores == CASES["st"][2]


def test_repeats_last_keeps_the_last_score(tmp_path):
    path = _file(tmp_path, "t.tsv", "3.0\t1.0\tq1\td1\td2\n2.5\t1.0\tq1\td1\td3\n")
    with pytest.raises(InputError):
        read_teacher_scores(path)
    got = read_teacher_scores(path, repeats="last")
    assert got.scores == {"q1": {"d1": 2.5, "d2": 1.0, "d3": 1.0}}


# (file name, content, kwargs, expected fragments after "PATH"): one case per refusal.
FE_OK = FE_RECORDS[0]
ERRORS = {
    "retromae missing score": ("s.txt", "q1 d1 0.5\nq1 d2\n", {}, [":2:", "missing score"]),
    "retromae not a number": (
        "s.txt", "q1 d1 0.5\nq1 d2 high\n", {}, [":2:", "'score'", "'high', not a number"]),
    "retromae nan": ("s.txt", "q1 d1 0.5\nq1 d2 nan\n", {}, [":2:", "'score'", "not a finite"]),
    "retromae inf": ("s.txt", "q1 d1 0.5\n\nq1 d2 -inf\n", {}, [":3:", "'score'", "not a finite"]),
    "retromae unknown query": (
        "s.txt", "q1 d1 0.5\nq9 d2 0.1\n", {"query_ids": {"q1"}},
        [":2:", "'qid'", "query id 'q9'"]),
    "retromae unknown doc": (
        "s.txt", "q1 d1 0.5\nq1 d9 0.1\n", {"corpus_ids": {"d1", "d2"}},
        [":2:", "'did'", "doc id 'd9'"]),
    "retromae repeated pair, other score": (
        "s.txt", "q1 d1 0.5\nq1 d2 0.1\nq1 d1 0.25\n", {},
        [":3:", "'did'", "('q1', 'd1')", "0.25 here and 0.5 at", "s.txt:1"]),
    "hofstatter conflict": (
        "h.tsv", "11.5\t2\tq1\td1\td2\n11.0\t1\tq1\td1\td3\n", {},
        [":2:", "'pos_pid'", "11.0 here and 11.5 at", "h.tsv:1"]),
    "hofstatter nan": ("h.tsv", "1\t2\tq1\td1\td2\n1\tNaN\tq1\td1\td3\n", {},
                       [":2:", "'neg_score'", "not a finite"]),
    "hofstatter missing column": ("h.tsv", "1\t2\tq1\td1\td2\n1\tq1\td1\td3\n", {"format": "hofstatter"},
                                  [":2:", "4 columns", "has 5 (pos_score"]),
    "hofstatter unknown neg": (
        "h.tsv", "1\t2\tq1\td1\td2\n", {"corpus_ids": {"d1"}}, [":1:", "'neg_pid'", "'d2'"]),
    "simlm count mismatch": (
        "k.jsonl", _jsonl({"query_id": "q1", "positives": {"doc_id": ["d1"], "score": [1.0]},
                           "negatives": {"doc_id": ["d2", "d3"], "score": [0.5]}}), {},
        [":1:", "'negatives.score'", "1 scores for 2 ids"]),
    "simlm missing score": (
        "k.jsonl", _jsonl({"query_id": "q1", "positives": {"doc_id": ["d1"]}}), {},
        [":1:", "missing field 'positives.score'"]),
    "simlm no scores": (
        "k.jsonl", _jsonl({"query_id": "q1", "positives": {"doc_id": [1], "score": [1]}},
                          {"query_id": "q2", "positives": {"doc_id": [], "score": []}}), {},
        [":2:", "'positives'", "query 'q2' lists no scores"]),
    "simlm non-number": (
        "k.jsonl", _jsonl({"query_id": "q1", "positives": {"doc_id": ["d1"], "score": ["x"]}}),
        {}, [":1:", "'positives.score[0]'", "a string, not a number"]),
    "simlm unknown doc": (
        "k.jsonl", _jsonl({"query_id": "q1", "positives": {"doc_id": ["d1"], "score": [1]},
                           "negatives": {"doc_id": ["d7"], "score": [0]}}),
        {"corpus_ids": {"d1"}}, [":1:", "'negatives.doc_id[0]'", "doc id 'd7'"]),
    "fe count mismatch": (
        "f.jsonl", _jsonl(FE_OK, {**FE_OK, "neg_scores": [0.1]}), {},
        [":2:", "'neg_scores'", "1 scores for 2 passages"]),
    "fe missing neg_scores": (
        "f.jsonl", _jsonl({k: v for k, v in FE_OK.items() if k != "neg_scores"}), {},
        [":1:", "missing field 'neg_scores[0]'"]),
    "fe nan": ("f.jsonl", '{"query": "q1", "pos": ["d1"], "pos_scores": [NaN]}\n', {},
               [":1:", "'pos_scores[0]'", "not a finite"]),
    "fe passage by text": (
        "f.jsonl", _jsonl({**FE_OK, "neg": ["d2", "a dog barks"]}), {},
        [":1:", "'neg[1]'", "given by text", "--data.pairs"]),
    "fe query by text": (
        "f.jsonl", _jsonl({**FE_OK, "query": "what is a cat"}), {},
        [":1:", "'query'", "given by text"]),
    "fe unknown query": (
        "f.jsonl", _jsonl(FE_OK), {"query_ids": {"q2"}}, [":1:", "'query'", "query id 'q1'"]),
    "st missing scores": (
        "t.jsonl", _jsonl({"anchor": "q1", "positive": "d1", "negative": "d2"}), {},
        [":1:", "missing field 'scores'"]),
    "tevatron missing score": (
        "v.jsonl", _jsonl({"query_id": "q1", "query": "x",
                           "positive_passages": [{"docid": "d1", "text": "a", "score": 1}],
                           "negative_passages": [{"docid": "d2", "text": "b"}]}), {},
        [":1:", "missing field 'negative_passages[0].score'"]),
    "tevatron no docid": (
        "v.jsonl", _jsonl({"query_id": "q1", "query": "x",
                           "positive_passages": [{"text": "a cat", "score": 1}]}), {},
        [":1:", "'positive_passages[0].docid'", "has no id"]),
    "tevatron no query id": (
        "v.jsonl", _jsonl({"query": "x", "positive_passages": [{"docid": "d1", "text": "a",
                                                               "score": 1}]}), {},
        [":1:", "'query_id'", "has no id"]),
    "mined missing score": (
        "m.jsonl", _jsonl({"query_id": "q1", "positives": [{"id": "d1", "score": 1.0}],
                           "negatives": [{"id": "d2", "rank": 1}]}), {},
        [":1:", "missing field 'negatives[0].score'"]),
    "mined inf": (
        "m.jsonl", '{"query_id": "q1", "positives": [{"id": "d1", "score": Infinity}]}\n', {},
        [":1:", "'positives[0].score'", "not a finite"]),
    "empty file": ("e.txt", "", {}, [": empty file"]),
    "blank lines only": ("e.txt", "\n  \n\n", {}, [": empty file"]),
    "empty file, format named": ("e.txt", "", {"format": "retromae"}, [": empty file"]),
    "undetectable": (
        "u.txt", "\nhello world\n", {}, [":2:", "cannot tell", "'hello world'", "known formats"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_line_naming_file_line_and_field(tmp_path, case):
    name, content, kwargs, fragments = ERRORS[case]
    path = _file(tmp_path, name, content)
    with pytest.raises(InputError) as info:
        read_teacher_scores(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path)), message
    rest = message[len(str(path)) :]
    for fragment in fragments:
        assert fragment in rest, (fragment, message)


def test_unknown_format_and_missing_file_are_refused(tmp_path):
    path = _file(tmp_path, "s.txt", "q1 d1 1\n")
    with pytest.raises(ValueError, match="unknown teacher-score format 'kd'"):
        read_teacher_scores(path, format="kd")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_teacher_scores(tmp_path / "nope.txt")


def test_writer_round_trip_is_exact_and_atomic(tmp_path):
    scores = {"q1": {"d1": 0.1 + 0.2, "d2": -1e-30, "d3": 12345.678901234567}, "7": {"9": 3.0}}
    path = tmp_path / "out" / "teacher.tsv"
    assert write_teacher_scores(path, scores) == 4
    back = read_teacher_scores(path)
    assert back.format == "retromae" and back.scores == scores and back.pairs == 4
    # a file read in another format writes and reads back the same
    name, content, expected = CASES["hofstatter"]
    again = tmp_path / "again.txt"
    write_teacher_scores(again, read_teacher_scores(_file(tmp_path, name, content)))
    assert read_teacher_scores(again).scores == expected
    # bad ids or scores: nothing written, an older file intact
    for bad in ({"q 1": {"d1": 1.0}}, {"q1": {"d1": float("nan")}}):
        with pytest.raises(ValueError):
            write_teacher_scores(path, bad)
        assert read_teacher_scores(path).scores == scores
    assert sorted(p.name for p in path.parent.iterdir()) == ["teacher.tsv"]


def test_flagembedding_own_loader_reads_the_fe_file_to_the_same_scores(tmp_path):
    """FlagEmbedding 1.2.11 (the ``bench`` extra, with its transformers 4.46.3) loads the FE
    file of ``CASES`` through ``BGE_M3.data.SameDatasetTrainDataset`` with
    ``knowledge_distillation``; every (query, passage, teacher score) it yields is ours."""
    try:
        from FlagEmbedding.BGE_M3.arguments import DataArguments
        from FlagEmbedding.BGE_M3.data import SameDatasetTrainDataset
    except Exception as exc:  # noqa: BLE001 (not installed, or not importable beside this transformers)
        pytest.skip(f"FlagEmbedding is not importable here ({type(exc).__name__}: {exc})")
    import torch.distributed as dist

    folder = tmp_path / "fe_train"
    folder.mkdir()
    _file(folder, "fe.jsonl", _jsonl(*FE_RECORDS))
    ours = read_teacher_scores(folder / "fe.jsonl")
    started = not dist.is_initialized()
    if started:  # FE asks for the rank; one gloo process
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        args = DataArguments(
            train_data=[str(folder)],
            knowledge_distillation=True,
            train_group_size=3,
            cache_path=str(tmp_path / "cache"),
        )
        data = SameDatasetTrainDataset(args, batch_size=2, seed=1)
        queries, passages, teacher, _ = data[0]
    finally:
        if started:
            dist.destroy_process_group()
    assert sorted(queries) == ["q1", "q2"] and len(passages) == len(teacher) == 6
    seen = set()
    for i, query in enumerate(queries):
        for passage, score in zip(
            passages[3 * i : 3 * i + 3], teacher[3 * i : 3 * i + 3], strict=True
        ):
            assert ours[query][passage] == pytest.approx(score, abs=0), (query, passage)
            seen.add((query, passage))
    assert seen == {(q, d) for q in ours for d in ours[q]}
