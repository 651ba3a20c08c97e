"""``retromae-ds mine --cross_encoder``: a cross-encoder's score for every positive and mined
negative (NAME.teacher.tsv, what ``finetune --distill.scores`` reads), denoising by its scores
(drop, relabel, drop the query), the threshold fitted on held-out positives, and the chain
mine -> distil."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_distill_run import _tiny_cross_encoder
from test_mine import _mine, _qrels, setup  # noqa: F401  (the module's fixture)

from retromae_ds.data.teacher_scores import read_teacher_scores


def _texts(beir: Path) -> tuple[dict[str, str], dict[str, str]]:
    docs = {json.loads(x)["_id"]: json.loads(x)["text"]
            for x in (beir / "corpus.jsonl").read_text().splitlines()}  # fmt: skip
    queries = {json.loads(x)["_id"]: json.loads(x)["text"]
               for x in (beir / "queries.jsonl").read_text().splitlines()}  # fmt: skip
    return docs, queries


@pytest.fixture(scope="module")
def ce(tmp_path_factory, tokenizer_dir):
    return _tiny_cross_encoder(tmp_path_factory.mktemp("ce") / "ce", tokenizer_dir)


def test_denoise_drop_writes_the_teacher_scores_and_leaves_out_false_negatives(
    setup,  # noqa: F811
    ce,
    tmp_path,
):
    from retromae_ds.retrieval.cross_encoder import CrossEncoderScorer

    beir, model = setup
    plain, plain_rows = _mine(tmp_path / "plain", model, "--beir", str(beir),
                              "--num_negatives", "6")  # fmt: skip
    manifest, rows = _mine(
        tmp_path, model, "--beir", str(beir), "--num_negatives", "6",
        "--cross_encoder", str(ce), "--denoise", "margin",
    )  # fmt: skip
    teacher = read_teacher_scores(tmp_path / "negatives.teacher.tsv")
    assert manifest["cross_encoder"]["teacher_file"] == "negatives.teacher.tsv"
    assert manifest["cross_encoder"]["pairs_per_s"] > 0
    docs, queries = _texts(beir)
    scorer = CrossEncoderScorer.from_dir(ce, device="cpu")
    flagged = 0
    for before, after in zip(plain_rows, rows, strict=True):
        qid = after["query_id"]
        kept = [n["id"] for n in after["negatives"]]
        gone = [n["id"] for n in before["negatives"] if n["id"] not in kept]
        # every written passage has the CE's score; a dropped one scored above the threshold
        ids = [p["id"] for p in after["positives"]] + kept
        assert set(teacher[qid]) == set(ids)
        want = scorer([queries[qid]] * len(ids + gone), [docs[d] for d in ids + gone])
        np.testing.assert_allclose([teacher[qid][d] for d in ids], want[: len(ids)], rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
        weakest = min(want[: len(ids) - len(kept)])  # margin 0: above the weakest positive
        assert all(s <= weakest for s in want[len(ids) - len(kept) : len(ids)])
        assert all(s > weakest for s in want[len(ids) :])
        flagged += len(gone)
    assert manifest["denoise"]["denoised"] == flagged == manifest["denoise"]["flagged"] > 0
    assert manifest["negatives"] == plain["negatives"] - flagged


def test_relabel_and_drop_query(setup, ce, tmp_path):  # noqa: F811
    beir, model = setup
    common = ["--beir", str(beir), "--num_negatives", "6", "--cross_encoder", str(ce),
              "--denoise", "margin"]  # fmt: skip
    m_rel, rel = _mine(tmp_path / "rel", model, *common, "--denoise_action", "relabel")
    qrels = _qrels(beir)
    extra = sum(len({p["id"] for p in r["positives"]} - qrels[r["query_id"]]) for r in rel)
    assert extra == m_rel["denoise"]["relabelled"] == m_rel["denoise"]["flagged"] > 0
    m_q, dropq = _mine(
        tmp_path / "q", model, *common, "--denoise_action", "drop_query", "--ce_bf16"
    )
    assert (m_rel["cross_encoder"]["bf16"], m_q["cross_encoder"]["bf16"]) == (
        False,
        True,
    )
    assert len(dropq) == 80 - m_q["denoise"]["queries_flagged"] == 80 - m_q["denoise"][
        "queries_dropped"]  # fmt: skip
    assert m_q["denoise"]["queries_dropped"] > 0


def test_fit_on_held_out_positives_reports_precision_and_recall(setup, ce, tmp_path):  # noqa: F811
    beir, model = setup
    manifest, _ = _mine(
        tmp_path, model, "--beir", str(beir), "--num_negatives", "10", "--holdout_positive",
        "--cross_encoder", str(ce), "--denoise", "margin", "--denoise_fit",
    )  # fmt: skip
    d = manifest["denoise"]
    fitted, found = d["fitted"], d["holdout_detection"]
    assert d["value"] == fitted["value"]
    for key in ("flagged", "hits", "labelled", "precision", "recall"):
        assert found[key] == fitted[key], key
    assert found["labelled"] == manifest["holdout"]["mined"] > 0


def test_denoise_needs_a_cross_encoder_and_fit_a_holdout(setup):  # noqa: F811
    from retromae_ds.mine import MineConfig

    with pytest.raises(ValueError, match="--cross_encoder"):
        MineConfig(model="m", out="o", beir="b", denoise="threshold")
    with pytest.raises(ValueError, match="holdout_positive"):
        MineConfig(model="m", out="o", beir="b", denoise="margin", cross_encoder="c",
                   denoise_fit=True)  # fmt: skip


@pytest.mark.slow
def test_mine_then_distil_from_its_teacher_file(setup, ce, tmp_path, tokenizer_dir):  # noqa: F811
    from test_finetune import finetune, metrics

    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.finetuning import handoff

    beir, model = setup
    _mine(tmp_path, model, "--beir", str(beir), "--num_negatives", "4",
          "--cross_encoder", str(ce))  # fmt: skip
    teacher = read_teacher_scores(tmp_path / "negatives.teacher.tsv")
    run = tmp_path / "run"
    finetune(run, "--data.beir", str(beir), "--model.init", str(model), "--max_steps", "2",
             "--log_every", "1", "--micro_batch_size", "4", "--negatives.n_hard", "2",
             "--data.q_max_len", "16", "--data.p_max_len", "32",
             "--distill.loss", "kl", "--distill.scores", str(tmp_path / "negatives.teacher.tsv"),
             "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]')  # fmt: skip
    assert [r["step"] for r in metrics(run)] == [1, 2]
    ts = ance_data.load(run / "data")
    neg = handoff.load_version(run / "negatives", 0)
    pid = ts.passage_ids.to_pylist()
    for q, qid in enumerate(ts.query_ids):
        got = {pid[i]: s for i, s in zip(neg.of(q), neg.scores_of(q).tolist(), strict=True)}
        want = {d: s for d, s in teacher[qid].items() if d not in {pid[i] for i in ts.positives[q]}}
        assert got.keys() == want.keys()
        assert all(abs(got[d] - want[d]) < 1e-5 for d in got)
