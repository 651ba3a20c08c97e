"""The cross-encoder kind of fine-tuning (``finetune --model.kind cross_encoder``): its pairs
are the tokenizer's, it trains and resumes exactly through the one Trainer (1 rank, and 2
gloo ranks under ZeRO-3), its export is a folder sentence-transformers' ``CrossEncoder`` loads
and scores as ``retrieval.cross_encoder.score_pairs`` does, and what makes no sense for it is
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_train import launch_cmd, run_logged

from retromae_ds.base.options import build_config
from retromae_ds.base.special_tokens import SpecialIds
from retromae_ds.data.tokenizer import fingerprint
from retromae_ds.finetune import FinetuneConfig
from retromae_ds.finetuning.cross_encoder import check_pair_template, pair_batch
from retromae_ds.retrieval.cross_encoder import CrossEncoderScorer, score_pairs

from helpers_ance import ENV, write_synthetic_beir, write_tiny_encoder

QUERIES = ["masked auto encoder", "what is a query", "gradient", "corpus shard manifest"]
PASSAGES = [
    "the decoder reads the sentence embedding and position",
    "a query retrieves passages",
    "optimizer steps follow each gradient of the contrastive loss",
    "checkpoint",
]


def dual_batch(tokenizer, queries: list[str], passages: list[str]) -> dict[str, torch.Tensor]:
    """``q_ids``/``p_ids`` as ``finetuning.data.token_batch`` makes them: ``[CLS] ids [SEP]``,
    right-padded, from ids tokenized without special tokens."""

    def rows(texts):
        bodies = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(len(b) for b in bodies) + 2
        ids = torch.full((len(texts), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(texts), width), dtype=torch.long)
        for i, body in enumerate(bodies):
            row = [tokenizer.cls_token_id, *body, tokenizer.sep_token_id]
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return ids, mask

    q_ids, q_mask = rows(queries)
    p_ids, p_mask = rows(passages)
    return {"q_ids": q_ids, "q_mask": q_mask, "p_ids": p_ids, "p_mask": p_mask}


@pytest.mark.parametrize("which", ["test_wordpiece", "minilm"])
def test_pairs_built_from_tokenized_rows_are_the_tokenizers_pairs(which, request):
    from transformers import AutoTokenizer

    folder = request.getfixturevalue("tokenizer_dir" if which != "minilm" else "minilm_dir")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    special = SpecialIds.from_fingerprint(fingerprint(tokenizer))
    check_pair_template(tokenizer, special, folder)  # passes: BERT's template
    group = 2  # queries 0, 0, 1, 1 (each with two passages)
    batch = pair_batch(dual_batch(tokenizer, QUERIES[:2], PASSAGES), group, special.pad)
    expected = tokenizer(
        [QUERIES[i // group] for i in range(4)], PASSAGES, padding=True, return_tensors="pt"
    )
    assert torch.equal(batch["ids"], expected["input_ids"])
    assert torch.equal(batch["mask"], expected["attention_mask"])
    # the test tokenizer makes no token types (the model then reads zeros); MiniLM's does
    assert ("token_type_ids" in expected) == (which == "minilm")
    if "token_type_ids" in expected:
        assert torch.equal(batch["types"], expected["token_type_ids"])


def finetune(run_dir: Path, *overrides: str, ranks: int = 1):
    args = ["--run_dir", str(run_dir), "--progress", "false", *overrides]
    log = run_dir.parent / f"{run_dir.name}.log"
    return run_logged(launch_cmd("retromae_ds.finetune", args, ranks), log, env=ENV, timeout=600)


def ce_task(tmp_path: Path, tokenizer_dir: Path, *, steps: int, zero: int) -> list[str]:
    """A cross-encoder run of a tiny BERT on a synthetic set (85 passages, 28 queries):
    4 queries of 1 positive + 3 BM25 negatives per step, one log row per step."""
    beir = write_synthetic_beir(tmp_path / "beir", num_docs=90, num_queries=28)
    encoder = write_tiny_encoder(tmp_path / "encoder", tokenizer_dir)
    ds = f'["ds_configs/zero{zero}.json", "ds_configs/fp32.json"]'
    return [
        "--model.kind", "cross_encoder", "--data.beir", str(beir), "--model.init", str(encoder),
        "--data.q_max_len", "16", "--data.p_max_len", "32", "--micro_batch_size", "4",
        "--negatives.n_hard", "3", "--refresh.mining.num_negatives", "5",
        "--max_steps", str(steps), "--log_every", "1", "--optim.lr", "3e-3",
        "--optim.warmup_steps", "1", "--deepspeed.config", ds,
    ]  # fmt: skip


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def some_pairs(beir: Path, n: int = 30) -> tuple[list[str], list[str]]:
    docs = [json.loads(line)["text"] for line in (beir / "corpus.jsonl").read_text().splitlines()]
    queries = [
        json.loads(line)["text"] for line in (beir / "queries.jsonl").read_text().splitlines()
    ]
    # long passages too: the pair is then cut to max_length, as sentence-transformers cuts it
    return [queries[i % len(queries)] for i in range(n)], [docs[i] for i in range(n)]


@pytest.mark.slow
def test_cross_encoder_learns_resumes_exactly_and_exports_for_sentence_transformers(
    tmp_path, tokenizer_dir
):
    from sentence_transformers import CrossEncoder

    from retromae_ds.export import export_encoder

    common = ce_task(tmp_path, tokenizer_dir, steps=40, zero=0)
    finetune(tmp_path / "straight", *common)
    straight = rows(tmp_path / "straight")
    assert [r["step"] for r in straight] == list(range(1, 41))
    first, last = (np.mean([r["loss"] for r in straight[s]]) for s in (slice(0, 10), slice(30, 40)))
    assert first == pytest.approx(np.log(4), abs=0.01)  # 4 passages, near-equal scores
    assert last < first - 0.05, (first, last)  # it learns to rank the positive first

    run = tmp_path / "resumed"
    finetune(run, *common, "--stop_at_step", "20")
    finetune(run, *common)
    resumed = rows(run)
    assert [r["step"] for r in resumed] == list(range(1, 41))
    assert [(r["loss"], r["accuracy"], r["lr"]) for r in resumed] == [
        (r["loss"], r["accuracy"], r["lr"]) for r in straight
    ]

    out = export_encoder(run, tmp_path / "export")
    assert json.loads((out / "export.json").read_text())["kind"] == "cross_encoder"
    assert json.loads((out / "cross_encoder.json").read_text())["max_length"] == 16 + 32 - 1
    queries, passages = some_pairs(tmp_path / "beir")
    scorer = CrossEncoderScorer.from_dir(run, device="cpu", batch_size=7)  # the run folder
    ours = scorer(queries, passages)
    st = CrossEncoder(str(out), device="cpu")
    assert st.num_labels == 1 and st.max_seq_length == scorer.max_length == 47
    # sentence-transformers applies a sigmoid to a one-label model's logit by default
    assert isinstance(st.activation_fn, torch.nn.Sigmoid)
    pairs = list(zip(queries, passages, strict=True))
    np.testing.assert_allclose(st.predict(pairs, batch_size=4), 1 / (1 + np.exp(-ours)), atol=1e-5)
    logits = st.predict(pairs, batch_size=4, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(logits, ours, atol=1e-5)
    assert np.ptp(ours) > 0.1  # a trained scorer, not a constant


@pytest.mark.slow
def test_cross_encoder_under_two_ranks_and_zero3_saves_the_trained_weights(tmp_path, tokenizer_dir):
    from retromae_ds.components import checkpoint as ckpt
    from retromae_ds.finetuning.cross_encoder import load_model

    common = ce_task(tmp_path, tokenizer_dir, steps=3, zero=3)
    finetune(tmp_path / "run", *common, ranks=2)
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3]
    final = ckpt.latest_complete(tmp_path / "run" / "checkpoints")
    assert ckpt.read_marker(final)["model_kind"] == "cross_encoder"
    # the consolidated ZeRO-3 weights: every tensor whole, the body moved off its init
    trained = load_model(final / "encoder").state_dict()
    init = load_model(tmp_path / "encoder").state_dict()
    body = [k for k in trained if not k.startswith(("classifier.", "bert.pooler."))]
    assert all(trained[k].shape == init[k].shape for k in body)
    assert any(not torch.equal(trained[k], init[k]) for k in body)
    queries, passages = some_pairs(tmp_path / "beir", 8)
    model = load_model(final / "encoder").eval()
    scorer = CrossEncoderScorer.from_dir(final, device="cpu")
    direct = score_pairs(model, scorer.tokenizer, queries, passages, max_length=47)
    np.testing.assert_allclose(scorer(queries, passages), direct, atol=1e-6)


REFUSED = [
    (["--model.pooling", "mean"], "model.pooling: not for model.kind cross_encoder"),
    (["--model.temperature", "0.05", "--model.normalize"], "model.normalize, model.temperature"),
    (["--model.shared", "false"], "model.shared false: not for model.kind cross_encoder"),
    (["--grad_cache.query_chunk", "2"], "grad_cache: not for"),
    (["--refresher", "local"], "refresher local: a refresher mines negatives with the model"),
    (["--refresher", "external"], "refresher external: a refresher mines"),
    (["--negatives.n_hard", "0"], "negatives.n_hard 0: model.kind cross_encoder ranks"),
    (["--model.kind", "colbert"], "model.kind must be one of dual_encoder, cross_encoder"),
]


@pytest.mark.parametrize(("extra", "message"), REFUSED)
def test_settings_a_cross_encoder_cannot_have_are_refused_at_config_time(extra, message):
    base = ["--model.kind", "cross_encoder", "--model.init", "x", "--data.beir", "y"]
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as info:
        build_config(FinetuneConfig, None, [*base, *extra])
    assert "\n" not in str(info.value)


def test_a_tokenizer_with_another_pair_template_is_refused(tmp_path):
    """A RoBERTa tokenizer reads a pair as ``<s> q </s></s> p </s>``: refused, naming it."""
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing
    from transformers import PreTrainedTokenizerFast

    from synthetic import synthetic_texts

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        synthetic_texts(100, seed=3), vocab_size=300,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", cls_token="<s>",
        sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
    )  # fmt: skip
    tokenizer.backend_tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    special = SpecialIds.from_fingerprint(fingerprint(tokenizer))
    with pytest.raises(ValueError, match=r"not \[CLS\] query \[SEP\] passage \[SEP\]"):
        check_pair_template(tokenizer, special, tmp_path)
