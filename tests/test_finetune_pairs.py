"""``finetune --data.pairs``: the anchors' training files (FlagEmbedding jsonl, ST tables,
Tevatron, mine's file) staged as a BEIR folder, their negatives the run's v0, an edited file
refused on resume, bad input one line naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_finetune import finetune, metrics

from retromae_ds.data.pairs import Example, Passage, write_examples
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff, pairs_data
from retromae_ds.finetuning.pairs_data import stage

from helpers_ance import write_synthetic_beir, write_tiny_encoder


def _beir_texts(beir: Path) -> tuple[dict[str, str], dict[str, str]]:
    docs = {}
    for line in (beir / "corpus.jsonl").read_text().splitlines():
        r = json.loads(line)
        docs[r["_id"]] = r["text"]
    queries = {}
    for line in (beir / "queries.jsonl").read_text().splitlines():
        r = json.loads(line)
        queries[r["_id"]] = r["text"]
    return docs, queries


def _fe_file(beir: Path, path: Path, *, lacking: int = 0) -> dict[str, list[str]]:
    """An FE jsonl of the synthetic set's queries (texts only): positive d{3q}, negatives
    d{3q+5}, d{3q+7} (the first ``lacking`` queries none); returns query text -> negative
    texts."""
    docs, queries = _beir_texts(beir)
    examples, negs = [], {}
    for q in range(len(queries)):
        pos = docs[f"d{3 * q}"]
        if not pos or not queries[f"q{q}"]:
            continue
        cand = [docs.get(f"d{3 * q + k}", "") for k in (5, 7)]
        neg = [] if q < lacking else [t for t in cand if t and t != pos]
        negs[queries[f"q{q}"]] = neg
        examples.append(
            Example(
                query=queries[f"q{q}"],
                positives=(Passage(text=pos, score=0.9),),
                negatives=tuple(Passage(text=t, score=0.5) for t in neg),
            )
        )
    write_examples(examples, path, "flagembedding")
    return negs


def test_staging_merges_queries_drops_positive_negatives_and_refuses_an_edited_source(tmp_path):
    src = tmp_path / "train.jsonl"
    rows = [
        {"query": "what is a cat", "pos": ["a cat is an animal"], "neg": ["a dog barks"],
         "pos_scores": [0.9], "neg_scores": [0.2]},
        # the same query again: one more positive, and a 'negative' that is a positive
        {"query": "what is a cat", "pos": ["cats purr"], "neg": ["a cat is an animal", "rain"]},
        {"query": "why rain", "pos": ["rain falls from clouds"], "neg": []},
    ]  # fmt: skip
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = stage(src, tmp_path / "staged")
    record = pairs_data.staged_record(out)
    assert record["counts"] == {
        "examples": 3,
        "passages": 5,
        "corpus_passages": 0,
        "queries": 2,
        "queries_with_negatives": 1,
        "negatives_that_were_positives": 1,
    }
    qrels = (out / "qrels" / "train.tsv").read_text().splitlines()[1:]
    assert len(qrels) == 3  # 2 positives of the cat query, 1 of the rain query
    negs = [json.loads(x) for x in (out / pairs_data.NEGATIVES).read_text().splitlines()]
    lines = (out / "corpus.jsonl").read_text().splitlines()
    corpus = {json.loads(x)["_id"]: json.loads(x)["text"] for x in lines}
    cat = next(n for n in negs if n["negatives"])
    assert [corpus[p] for p in cat["negatives"]] == ["a dog barks", "rain"]
    assert cat["negative_scores"] == [0.2, None]  # FE's scores kept for distillation
    # the same source again: reused as it is
    mtime = (out / pairs_data.STAGED).stat().st_mtime_ns
    stage(src, tmp_path / "staged")
    assert (out / pairs_data.STAGED).stat().st_mtime_ns == mtime
    # an edited source: refused in one line naming it, the staged folder untouched
    src.write_text(src.read_text().replace("rain falls", "rain drops"))
    with pytest.raises(ValueError, match=r"data.pairs .*train.jsonl changed since") as err:
        stage(src, tmp_path / "staged")
    assert "\n" not in str(err.value)
    assert (out / pairs_data.STAGED).stat().st_mtime_ns == mtime


def test_bad_pairs_name_file_and_line_and_leave_nothing(tmp_path):
    src = tmp_path / "ids.jsonl"
    line = {"query_id": "q1", "query": "cats", "positives": [{"id": "d9"}], "negatives": []}
    src.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=r"ids.jsonl:1: passage id 'd9' has no text"):
        stage(src, tmp_path / "staged", format="mined")
    assert not (tmp_path / "staged").exists()
    assert not any(p.name.startswith(".staged") for p in tmp_path.iterdir())
    src.write_text(json.dumps({"query": "cats", "pos": []}) + "\n")
    with pytest.raises(ValueError, match=r"ids.jsonl:1"):
        stage(src, tmp_path / "staged2", format="flagembedding")


@pytest.mark.slow
def test_finetune_trains_on_an_fe_file_with_its_negatives_as_v0(tmp_path, tokenizer_dir):
    beir = write_synthetic_beir(tmp_path / "beir", num_docs=90, num_queries=28)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    fe = tmp_path / "fe.jsonl"
    given = _fe_file(beir, fe, lacking=2)
    common = [
        "--data.pairs", str(fe), "--model.init", str(encoder),
        "--data.q_max_len", "16", "--data.p_max_len", "32", "--micro_batch_size", "4",
        "--negatives.n_hard", "1", "--refresh.mining.num_negatives", "3",
        "--max_steps", "3", "--log_every", "1", "--optim.lr", "1e-3",
        "--optim.warmup_steps", "1",
        "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]',
    ]  # fmt: skip
    run = tmp_path / "run"
    finetune(run, *common, "--stop_at_step", "2")
    manifest = json.loads(handoff.manifest_file(run / "negatives", 0).read_text())
    assert manifest["source"] == "file" and manifest["queries_from_bm25"] == 2
    ts = ance_data.load(run / "data")
    neg = handoff.load_version(run / "negatives", 0)
    docs, _ = _beir_texts(run / "data_pairs")
    q_text = {
        json.loads(x)["_id"]: json.loads(x)["text"]
        for x in (run / "data_pairs" / "queries.jsonl").read_text().splitlines()
    }
    pid = ts.passage_ids.to_pylist()
    from_file = 0
    for q, qid in enumerate(ts.query_ids):
        got = [docs[pid[i]] for i in neg.of(q)]
        if given[q_text[qid]]:
            assert got == [t for t in given[q_text[qid]] if t], qid  # the file's, in order
            from_file += 1
        else:
            assert len(got) == 3 and not set(got) & {docs[pid[p]] for p in ts.positives[q]}
    assert from_file == len(ts.query_ids) - 2
    # resumed with the same file: goes on; with an edited one: refused in one line
    finetune(run, *common)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    fe.write_text(fe.read_text().replace('"neg": [', '"neg": ["an edited negative", ', 1))
    result = finetune(run, *common, "--max_steps", "4", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "changed since this run staged and tokenized it" in last and "fe.jsonl" in last


def test_ids_into_a_corpus_keep_the_corpus_ids_and_its_other_passages(tmp_path):
    beir = write_synthetic_beir(tmp_path / "beir", num_docs=30, num_queries=6)
    docs, _ = _beir_texts(beir)
    mined = [
        Example(query=None, query_id="q1", positives=(Passage(id="d3"),),
                negatives=(Passage(id="d10", rank=1, score=0.7), Passage(id="d4", rank=2)))
    ]  # fmt: skip
    write_examples(mined, tmp_path / "mined.jsonl", "mined")
    out = stage(tmp_path / "mined.jsonl", tmp_path / "staged", corpus=beir)
    counts = pairs_data.staged_record(out)["counts"]
    assert counts["corpus_passages"] == counts["passages"] == len(docs)  # the whole corpus
    assert (out / "qrels" / "train.tsv").read_text().splitlines()[1:] == ["q1\td3\t1"]
    (neg,) = [json.loads(x) for x in (out / pairs_data.NEGATIVES).read_text().splitlines()]
    assert neg == {"query_id": "q1", "negatives": ["d10", "d4"], "negative_scores": [0.7, None]}
    staged_docs, queries = _beir_texts(out)
    assert staged_docs == docs and queries == {"q1": _beir_texts(beir)[1]["q1"]}


def test_an_st_table_and_a_tevatron_file_stage_alike(tmp_path):
    import datasets

    rows = {
        "anchor": ["what is a cat", "what is a cat", "why rain"],
        "positive": ["a cat is an animal", "cats purr", "rain falls from clouds"],
        "negative": ["a dog barks", "a dog barks", "sun shines"],
    }
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "st"))
    tev = tmp_path / "tev.jsonl"
    with open(tev, "w") as f:
        for q in ("what is a cat", "why rain"):
            idx = [i for i, a in enumerate(rows["anchor"]) if a == q]
            f.write(json.dumps({
                "query_id": "", "query": q,
                "positive_passages": [{"docid": "", "title": "", "text": rows["positive"][i]} for i in idx],
                "negative_passages": [{"docid": "", "title": "", "text": rows["negative"][idx[0]]}],
            }) + "\n")  # fmt: skip
    staged = [stage(src, tmp_path / f"staged_{src.name}") for src in (tmp_path / "st", tev)]
    for out in staged:
        counts = pairs_data.staged_record(out)["counts"]
        assert counts["queries"] == 2 and counts["passages"] == 5, counts
    assert [_beir_texts(out) for out in staged][0] == _beir_texts(staged[1])
    st_qrels, tev_qrels = ((o / "qrels" / "train.tsv").read_text() for o in staged)
    assert st_qrels == tev_qrels and st_qrels.count("\n") == 4  # header + 3 positives
