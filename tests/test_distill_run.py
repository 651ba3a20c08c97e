"""Distillation in a fine-tuning run (``--distill.loss``): the teacher-scored first version,
every drawn negative with its teacher score, GradCache's gradients with the distillation term,
exact resume, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_finetune import finetune, metrics

from retromae_ds.data.pairs import Example, Passage, write_examples
from retromae_ds.finetune import DualModelConfig, FinetuneConfig, FinetuneDataConfig
from retromae_ds.finetuning import data as ance_data
from retromae_ds.finetuning import handoff
from retromae_ds.finetuning.batches import BatchBuilder
from retromae_ds.finetuning.distill import DistillConfig
from retromae_ds.finetuning.model import DualEncoder, load_body

from helpers_ance import write_synthetic_beir, write_tiny_encoder


def _scored_fe_file(beir: Path, path: Path) -> dict[tuple[str, str], float]:
    """An FE jsonl of the synthetic set (texts) with pos_scores and neg_scores: positive
    d{3q}, negatives d{3q+5}, d{3q+7}, d{3q+11}; returns (query text, passage text) -> score."""
    docs = {json.loads(x)["_id"]: json.loads(x)["text"]
            for x in (beir / "corpus.jsonl").read_text().splitlines()}  # fmt: skip
    queries = {json.loads(x)["_id"]: json.loads(x)["text"]
               for x in (beir / "queries.jsonl").read_text().splitlines()}  # fmt: skip
    examples, scores = [], {}
    for q in range(len(queries)):
        query, pos = queries[f"q{q}"], docs[f"d{3 * q}"]
        negs = [docs[f"d{3 * q + k}"] for k in (5, 7, 11) if f"d{3 * q + k}" in docs]
        negs = [t for t in dict.fromkeys(negs) if t and t != pos]
        if not query or not pos or not negs:
            continue
        pos_score = 5.0 + q % 3
        neg_scores = [1.0 - 0.5 * i + 0.1 * q for i in range(len(negs))]
        scores[(query, pos)] = pos_score
        scores.update({(query, t): s for t, s in zip(negs, neg_scores, strict=True)})
        examples.append(
            Example(
                query=query,
                positives=(Passage(text=pos, score=pos_score),),
                negatives=tuple(Passage(text=t, score=s)
                                for t, s in zip(negs, neg_scores, strict=True)),
            )
        )  # fmt: skip
    write_examples(examples, path, "flagembedding")
    return scores


def _common(tmp_path: Path, tokenizer_dir: Path) -> tuple[list[str], dict]:
    beir = write_synthetic_beir(tmp_path / "beir", num_docs=90, num_queries=28)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    fe = tmp_path / "fe.jsonl"
    scores = _scored_fe_file(beir, fe)
    return [
        "--data.pairs", str(fe), "--model.init", str(encoder),
        "--data.q_max_len", "16", "--data.p_max_len", "32", "--micro_batch_size", "4",
        "--negatives.n_hard", "2", "--max_steps", "4", "--log_every", "1",
        "--optim.lr", "1e-3", "--optim.warmup_steps", "1",
        "--distill.loss", "kl_ce", "--distill.teacher_temperature", "2.0",
        "--deepspeed.config", '["ds_configs/zero2.json", "ds_configs/fp32.json"]',
    ], scores  # fmt: skip


@pytest.mark.slow
def test_distillation_run_draws_only_scored_negatives_and_resumes_exactly(tmp_path, tokenizer_dir):
    common, scores = _common(tmp_path, tokenizer_dir)
    finetune(tmp_path / "straight", *common)
    straight = metrics(tmp_path / "straight")
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    run = tmp_path / "resumed"
    finetune(run, *common, "--stop_at_step", "2")
    finetune(run, *common)
    resumed = metrics(run)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]

    # v0 is the file's scored passages with their scores; every batch the run draws carries
    # the file's teacher score for each of its passages (counted over the run's 4 steps)
    manifest = json.loads(handoff.manifest_file(run / "negatives", 0).read_text())
    assert manifest["source"] == "teacher_scores" and manifest["teacher_scores"] is True
    ts = ance_data.load(run / "data")
    neg = handoff.load_version(run / "negatives", 0)
    docs = {json.loads(x)["_id"]: json.loads(x)["text"]
            for x in (run / "data_pairs" / "corpus.jsonl").read_text().splitlines()}  # fmt: skip
    qtext = {json.loads(x)["_id"]: json.loads(x)["text"]
             for x in (run / "data_pairs" / "queries.jsonl").read_text().splitlines()}  # fmt: skip
    pid = ts.passage_ids.to_pylist()
    build = BatchBuilder(ts, 2, seed=0, teacher=True)
    checked = 0
    for start in range(0, 16, 4):
        queries = np.arange(start, start + 4) % ts.num_queries
        batch = build(queries, 0, neg)
        p_index = batch["p_index"].view(4, 3)
        for row, q in enumerate(queries.tolist()):
            for col in range(3):
                key = (qtext[ts.query_ids[q]], docs[pid[int(p_index[row, col])]])
                assert batch["teacher"][row, col].item() == pytest.approx(scores[key])
                checked += 1
    assert checked == 48


@pytest.mark.slow
def test_an_edited_scores_file_and_a_refresher_are_refused(tmp_path, tokenizer_dir):
    common, _ = _common(tmp_path, tokenizer_dir)
    run = tmp_path / "run"
    finetune(run, *common, "--stop_at_step", "1")
    fe = Path(common[common.index("--data.pairs") + 1])
    fe.write_text(fe.read_text().replace('"neg_scores": [', '"neg_scores": [9.5, ', 1)
                  .replace('"neg": [', '"neg": ["an edited negative", ', 1))  # fmt: skip
    result = finetune(run, *common, check=False)
    assert result.returncode == 2
    assert "fe.jsonl" in result.stderr.strip().splitlines()[-1]
    with pytest.raises(ValueError, match="only from an online teacher"):
        FinetuneConfig(data=FinetuneDataConfig(pairs=str(fe)), model=DualModelConfig(init="x"),
                       refresher="local", distill=DistillConfig(loss="kl"))  # fmt: skip
    with pytest.raises(ValueError, match="needs teacher scores"):
        FinetuneConfig(data=FinetuneDataConfig(beir="b"), model=DualModelConfig(init="x"),
                       distill=DistillConfig(loss="kl"))  # fmt: skip


@pytest.mark.parametrize("loss", ["kl_ce", "margin_mse"])
def test_grad_cache_gradients_include_the_distillation_term(tmp_path, tokenizer_dir, loss):
    """``loss_grads`` (GradCache's second pass) equals autograd through ``loss``, chunked."""
    encoder = load_body(write_tiny_encoder(tmp_path / "encoder", tokenizer_dir))
    settings = DistillConfig(loss=loss, teacher_temperature=2.0).resolved(0.05)
    model = DualEncoder(encoder, normalize=True, temperature=0.05, distill=settings)
    g = torch.Generator().manual_seed(0)
    B, G, D = 6, 3, 16
    q = torch.nn.functional.normalize(torch.randn(B, D, generator=g), dim=-1).requires_grad_()
    p = torch.nn.functional.normalize(torch.randn(B * G, D, generator=g), dim=-1)
    p.requires_grad_()
    batch = {
        "p_index": torch.arange(B * G),
        "positives": (torch.arange(B) * G)[:, None],
        "teacher": torch.randn(B, G, generator=g) * 3,
    }
    loss_value, _ = model.loss(q, p, batch)
    want_q, want_p = torch.autograd.grad(loss_value, [q, p])
    got, _, grad_q, grad_p = model.loss_grads(q, p, batch, chunk=4)
    assert got.item() == pytest.approx(loss_value.item(), rel=1e-5)
    torch.testing.assert_close(grad_q, want_q, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_p, want_p, rtol=1e-4, atol=1e-6)


def _retromae_scores(beir: Path, path: Path, *, skip_query: str | None = None) -> dict:
    """RetroMAE-format teacher scores (``qid did score``) for the synthetic set's training
    queries: their positives d{3q}, d{3q+1} and the passages d{3q+2}, d{3q+5}, d{3q+7}."""
    from retromae_ds.data.teacher_scores import write_teacher_scores

    docs = {json.loads(x)["_id"]: json.loads(x)["text"]
            for x in (beir / "corpus.jsonl").read_text().splitlines()}  # fmt: skip
    queries = {json.loads(x)["_id"]: json.loads(x)["text"]
               for x in (beir / "queries.jsonl").read_text().splitlines()}  # fmt: skip
    scores = {}
    for qid, text in queries.items():
        q = int(qid[1:])
        if not text or qid == skip_query or not (docs[f"d{3 * q}"] or docs[f"d{3 * q + 1}"]):
            continue
        ids = [f"d{3 * q + k}" for k in (0, 1, 2, 5, 7) if docs.get(f"d{3 * q + k}")]
        scores[qid] = {d: float(10 - i) + q / 100 for i, d in enumerate(ids)}
    write_teacher_scores(path, scores, format="retromae")
    return scores


@pytest.mark.slow
def test_a_scores_file_beside_a_beir_folder_is_the_first_version(tmp_path, tokenizer_dir):
    beir = write_synthetic_beir(tmp_path / "beir", num_docs=90, num_queries=28)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    teacher = tmp_path / "teacher.tsv"
    scores = _retromae_scores(beir, teacher)
    common = [
        "--data.beir", str(beir), "--model.init", str(encoder), "--micro_batch_size", "4",
        "--data.q_max_len", "16", "--data.p_max_len", "32", "--negatives.n_hard", "1",
        "--max_steps", "2", "--log_every", "1", "--distill.loss", "kl",
        "--distill.scores", str(teacher),
        "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]',
    ]  # fmt: skip
    run = tmp_path / "run"
    finetune(run, *common)
    assert [r["step"] for r in metrics(run)] == [1, 2]
    ts = ance_data.load(run / "data")
    neg = handoff.load_version(run / "negatives", 0)
    assert neg.manifest["teacher_format"] == "retromae"
    pid = ts.passage_ids.to_pylist()
    for q, qid in enumerate(ts.query_ids):
        positives = {pid[i] for i in ts.positives[q]}
        want = sorted((d for d in scores[qid] if d not in positives), key=lambda d: -scores[qid][d])
        assert [pid[i] for i in neg.of(q)] == want
        assert neg.scores_of(q).tolist() == pytest.approx([scores[qid][d] for d in want])
        assert neg.positive_scores_of(q).tolist() == pytest.approx(
            [scores[qid][pid[i]] for i in ts.positives[q]]
        )
    # a training query the file does not score: refused in one line naming the file
    _retromae_scores(beir, teacher, skip_query=ts.query_ids[3])
    result = finetune(tmp_path / "other", *common, check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "teacher.tsv" in last and "have no teacher scores" in last, last


def _tiny_cross_encoder(folder: Path, tokenizer_dir: Path) -> Path:
    """A randomly initialised 2-layer one-label BERT sequence classifier (a teacher whose
    scores are arbitrary but fixed: what the test needs)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from helpers_ance import NO_DROPOUT, small_config

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(7)
    config = BertConfig(
        **small_config(len(tok), max_position_embeddings=128, pad_token_id=tok.pad_token_id),
        **NO_DROPOUT, num_labels=1,
    )  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


@pytest.mark.slow
def test_online_teacher_scores_every_negative_the_trainer_draws(tmp_path, tokenizer_dir):
    """``--distill.teacher CE`` with a local refresher: BM25's v0 and the refresher's version
    carry the cross-encoder's scores; replaying the run's batches (its sampler, the version
    each step logged) counts every (query, passage) the trainer drew and finds each teacher
    score equal to the cross-encoder's own score of that pair's texts."""
    from retromae_ds.data.sampler import ResumableDistributedSampler
    from retromae_ds.retrieval.beir import load_corpus, load_queries
    from retromae_ds.retrieval.cross_encoder import CrossEncoderScorer

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=90, num_queries=28)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    ce = _tiny_cross_encoder(tmp_path / "ce", tokenizer_dir)
    run = tmp_path / "run"
    finetune(run, "--data.beir", str(beir), "--model.init", str(encoder),
             "--data.q_max_len", "16", "--data.p_max_len", "32", "--micro_batch_size", "4",
             "--negatives.n_hard", "2", "--refresh.mining.num_negatives", "3",
             "--max_steps", "4", "--log_every", "1", "--negatives.mine_first", "true",
             "--refresher", "local", "--refresh.device", "cpu", "--refresh.poll_s", "0.2",
             "--refresh.progress", "false", "--refresh.threads", "1",
             "--refresh.max_versions", "1",
             "--distill.loss", "kl_ce", "--distill.teacher", str(ce),
             "--deepspeed.config", '["ds_configs/zero0.json", "ds_configs/fp32.json"]')  # fmt: skip
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    ts = ance_data.load(run / "data")
    versions = {v: handoff.load_version(run / "negatives", v)
                for v in handoff.published_versions(run / "negatives")}  # fmt: skip
    assert sorted(versions) == [0, 1] and all(n.scored for n in versions.values())
    first = versions[1].manifest
    assert first["source"] == "model" and first["teacher"]["version_pairs"] > 0
    # replay the batches as batch_stream drew them
    sampler = ResumableDistributedSampler(ts.num_queries, 1, 0, seed=0)
    build = BatchBuilder(ts, 2, seed=0, teacher=True)
    doc_ids, texts = load_corpus(beir / "corpus.jsonl")
    text_of = dict(zip(doc_ids, texts, strict=True))
    queries = load_queries(beir / "queries.jsonl")
    pid = ts.passage_ids.to_pylist()
    q_texts, p_texts, got = [], [], []
    for row in rows:
        if sampler.consumed + 4 > len(sampler):
            sampler.advance(len(sampler) - sampler.consumed)
        chosen = sampler.indices(sampler.consumed, sampler.consumed + 4)
        batch = build(chosen, sampler.epoch, versions[row["negatives_version"]])
        sampler.advance(4)
        for i, q in enumerate(chosen.tolist()):
            for j in range(3):
                q_texts.append(queries[ts.query_ids[q]])
                p_texts.append(text_of[pid[int(batch["p_index"][i * 3 + j])]])
                got.append(batch["teacher"][i, j].item())
    want = CrossEncoderScorer.from_dir(ce, device="cpu")(q_texts, p_texts)
    assert len(got) == 4 * 4 * 3  # every drawn positive and negative of the 4 steps
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # refresh.teacher_bf16 reaches the online teacher's scorer (this run's scored in fp32)
    from retromae_ds.refresher.config import RefreshConfig
    from retromae_ds.refresher.teacher import teacher_for

    assert first["teacher"]["bf16"] is False
    low = teacher_for(RefreshConfig(teacher=str(ce), teacher_bf16=True), ts, device="cpu")
    assert low is not None and low.scorer.record()["bf16"] is True
