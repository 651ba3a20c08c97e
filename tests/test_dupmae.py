"""DupMAE (RetroMAE v2): the bag-of-words loss against a plain loop written here, gradients
through each task, training and exact resume on the DeepSpeed engine, and the dual
representation read back the same by eval, by an export and by fine-tuning."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_train import metrics, pretrain
from helpers_train import synthetic_shards as make_shards

from retromae_ds.components import checkpoint as ckpt
from retromae_ds.data.collate import MaskingConfig, PretrainCollator
from retromae_ds.hf import sbert
from retromae_ds.modeling.bow import max_pooled_logits, max_pooled_logits_plain
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

from helpers_ance import ENV, REPO, fake_checkpoint, prepared_set, write_synthetic_beir
from helpers_model import SPECIAL, batch_of

UNK = 1  # in SPECIAL.all: an [UNK] inside a text is no ordinary token


def _encoder():
    torch.manual_seed(0)
    return build_encoder(
        EncoderConfig(name="tiny", max_position_embeddings=64, dropout=0.0),
        SPECIAL.vocab_size,
        SPECIAL.pad,
    )


def _hand_made_items() -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Repeated tokens, an [UNK] inside a text, a text with no token at all, a long one."""
    rng = np.random.default_rng(3)
    texts = [
        [5, 6, 5, 7, 5, 6],
        [8, UNK, 9, 9],
        [],
        list(rng.integers(5, SPECIAL.vocab_size, 40)),
        [UNK],
    ]
    return [
        (i, np.asarray(t, dtype=np.int32), np.ones(len(t), dtype=np.uint8))
        for i, t in enumerate(texts)
    ]


def reference_bow_loss(model: PretrainModel, batch: dict[str, torch.Tensor]) -> float:
    """The loss of ``modeling.bow`` spelled out per document (unpacked batches): the MLM head
    at each ordinary position of the masked input's final hidden states, the entry-wise
    maximum, then -(1/n) Σ over the distinct tokens of log softmax; the mean over documents
    with at least one ordinary token."""
    enc = model.encoder
    hidden = enc.bert(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    per_doc = []
    for b in range(hidden.shape[0]):
        original = batch["original_ids"][b].tolist()
        length = int(batch["lengths"][b])
        ordinary = [i for i in range(length) if original[i] not in SPECIAL.all]
        if not ordinary:
            continue
        vector = None
        for i in ordinary:
            logits = enc.cls(hidden[b, i][None])[0]
            vector = logits if vector is None else torch.maximum(vector, logits)
        log_p = torch.log_softmax(vector, -1)
        tokens = [original[i] for i in ordinary]
        per_doc.append(-sum(log_p[t] for t in set(tokens)) / len(tokens))
    return float(sum(per_doc) / len(per_doc))


@pytest.mark.parametrize("head", ["chunked", "plain"])
@pytest.mark.parametrize("pack", [False, True])
def test_bow_loss_equals_a_plain_loop_on_a_hand_made_batch(head, pack):
    items = _hand_made_items()
    plain = PretrainCollator(SPECIAL, MaskingConfig(), 64)(items)
    batch = PretrainCollator(SPECIAL, MaskingConfig(), 64, pack=pack)(items)
    assert ("doc_ids" in batch) == pack
    assert batch["input_ids"].shape[0] == (1 if pack else 5)  # packed: all in one row
    torch.manual_seed(1)
    model = PretrainModel(_encoder(), ObjectiveConfig(name="dupmae", head=head, head_chunk=7))
    model.eval()
    with torch.no_grad():
        out = model(batch)
        expected = reference_bow_loss(model, plain)
    assert float(out["bow_loss"]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    total = float(out["mlm_loss"]) + float(out["decoder_loss"]) + 0.1 * float(out["bow_loss"])
    assert float(out["loss"]) == pytest.approx(total, rel=1e-6)
    assert 0.0 <= float(out["bow_recall"]) <= 1.0


def test_dupmae_is_retromae_plus_the_weighted_bow_loss():
    batch = batch_of([9, 30, 14])
    losses = {}
    for name, weight in (("retromae", 0.1), ("dupmae", 0.1), ("dupmae", 2.0)):
        torch.manual_seed(1)
        model = PretrainModel(_encoder(), ObjectiveConfig(name=name, bow_weight=weight)).eval()
        with torch.no_grad():
            losses[name, weight] = model(batch)
    retro, dup, heavy = losses["retromae", 0.1], losses["dupmae", 0.1], losses["dupmae", 2.0]
    assert "bow_loss" not in retro
    for key in ("mlm_loss", "decoder_loss"):  # the RetroMAE path, exactly
        assert torch.equal(dup[key], retro[key])
    assert float(heavy["loss"]) == pytest.approx(
        float(retro["loss"]) + 2.0 * float(dup["bow_loss"]), rel=1e-6
    )
    # the same parameters as RetroMAE: a DupMAE checkpoint is a RetroMAE one
    torch.manual_seed(1)
    a = PretrainModel(_encoder(), ObjectiveConfig(name="dupmae")).state_dict().keys()
    b = PretrainModel(_encoder(), ObjectiveConfig(name="retromae")).state_dict().keys()
    assert a == b


@pytest.mark.parametrize(
    "weights, decoder_moves",
    [
        ({"mlm_weight": 0.0, "bow_weight": 0.0}, True),
        ({"mlm_weight": 0.0, "decoder_weight": 0.0}, False),
    ],
    ids=["decoder-only", "bow-only"],
)
def test_gradients_reach_the_encoder_through_each_task_alone(weights, decoder_moves):
    torch.manual_seed(1)
    model = PretrainModel(_encoder(), ObjectiveConfig(name="dupmae", **weights))
    model(batch_of([12, 9, 30]))["loss"].backward()
    layers = model.encoder.bert.encoder.layer
    for param in (layers[-1].output.dense.weight, layers[0].attention.self.query.weight):
        assert param.grad is not None and param.grad.abs().sum() > 0
    head = model.encoder.cls.predictions.transform.dense.weight.grad
    assert head is not None and head.abs().sum() > 0
    decoder = [p.grad for p in model.decoder.parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in decoder) == decoder_moves


def test_chunked_max_pool_equals_the_plain_one_with_ties_and_empty_groups():
    torch.manual_seed(0)
    x = torch.randn(23, 6, requires_grad=True)
    w = torch.randn(11, 6)
    w[0] = 0.0  # a zero row ([PAD]'s embedding): every row ties on entry 0
    w.requires_grad_()
    b = torch.randn(11, requires_grad=True)
    group = torch.tensor([0, 2, 2, 0, 3] * 4 + [3, 0, 2])  # group 1 has no row
    up = torch.randn(4, 11)
    results = []
    for pooled in (
        lambda: max_pooled_logits(x, w, b, group, 4, chunk=5),
        lambda: max_pooled_logits_plain(x @ w.t() + b, group, 4),
    ):
        x.grad = w.grad = b.grad = None
        out = pooled()
        (out * up).sum().backward()
        results.append((out.detach(), x.grad.clone(), w.grad.clone(), b.grad.clone()))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(results[0][0][1], torch.zeros(11))  # the empty group: zeros
    for g in (0, 2, 3):  # a straightforward maximum over each group's rows
        rows = (x @ w.t() + b)[group == g]
        torch.testing.assert_close(results[0][0][g], rows.max(0).values.detach())


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("blocks", ["texts", "positions"])
def test_bow_vectors_without_gradient_equal_the_differentiable_path(family, blocks, monkeypatch):
    """Evaluation's masked dense maximum (no gradient wanted) gives the vectors the
    differentiable max-pool gives, with padding, special tokens, a text with no ordinary token,
    under bf16 autocast too, and whether a block holds several texts or part of one."""
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    from retromae_ds.modeling import bow

    torch.manual_seed(0)
    if family == "bert":
        model = BertForMaskedLM(
            BertConfig(
                vocab_size=97,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
            )
        )
    else:
        model = RobertaForMaskedLM(RobertaConfig(vocab_size=97, hidden_size=16,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 intermediate_size=32))  # fmt: skip
    model.eval()
    # a block of 3 texts of 9 positions, or (positions) 4 positions of one text at a time
    monkeypatch.setattr(bow, "CHUNK_ELEMENTS", 97 * (27 if blocks == "texts" else 4))
    ids = torch.randint(5, 97, (7, 9))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[4, 2:] = 0
    ids[4, :2] = 2  # text 4: specials only
    ids[2, 3] = 3
    special = torch.tensor([0, 1, 2, 3, 4])
    hidden = torch.randn(7, 9, 16)
    for dtype in (None, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            with torch.no_grad():
                fast = bow.bow_vectors(model, hidden, ids, mask, special, topk=0)
            slow = bow.bow_vectors(model, hidden.requires_grad_(), ids, mask, special, topk=0)
            hidden = hidden.detach()
        assert slow.requires_grad and not fast.requires_grad
        torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(fast[4], torch.zeros(97))
        sparse = bow.sparsify(fast, 5)
        assert int((sparse != 0).sum(-1).max()) == 5


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_dir) -> Path:
    return make_shards(tmp_path_factory.mktemp("dupmae_shards"), tokenizer_dir, 600, seed=21)


COMMON = ["--max_steps", "8", "--log_every", "1", "--model.objective.name", "dupmae"]


@pytest.fixture(scope="module")
def dupmae_run(tmp_path_factory, shards) -> Path:
    run = tmp_path_factory.mktemp("dupmae") / "straight"
    pretrain(run, shards, *COMMON)
    return run


@pytest.mark.slow
def test_dupmae_trains_and_resumes_exactly(tmp_path, shards, dupmae_run):
    straight = metrics(dupmae_run)
    assert [r["step"] for r in straight] == list(range(1, 9))
    first, last = straight[0], straight[-1]
    assert last["bow_loss"] < first["bow_loss"] - 0.5 and last["loss"] < first["loss"]
    assert last["bow_recall"] > first["bow_recall"]
    marker = ckpt.read_marker(ckpt.latest_complete(dupmae_run / "checkpoints"))
    assert marker["objective"] == "dupmae" and marker["step"] == 8

    resumed = tmp_path / "resumed"
    pretrain(resumed, shards, *COMMON, "--stop_at_step", "3")
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3]
    pretrain(resumed, shards, *COMMON)
    keys = ("loss", "mlm_loss", "decoder_loss", "bow_loss", "bow_recall", "lr")
    rows = metrics(resumed)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for a, b in zip(straight, rows, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("zero, precision", [("zero3", "fp32"), ("zero1", "bf16")])
def test_dupmae_runs_on_zero3_and_the_bf16_engine(tmp_path, shards, dupmae_run, zero, precision):
    """ZeRO-3 gathers the head's projection the chunked max-pool reads outside the head's
    forward (``external_parameters``): fp32 ZeRO-3 computes ZeRO-2's losses; DeepSpeed's
    bf16 engine (bf16 weights) runs the same path in bf16."""
    run = tmp_path / zero
    config = f'["ds_configs/{zero}.json", "ds_configs/{precision}.json"]'
    pretrain(run, shards, *COMMON[2:], "--max_steps", "3", "--deepspeed.config", config)
    rows, zero2 = metrics(run), metrics(dupmae_run)[:3]
    assert len(rows) == 3 and all(np.isfinite(r["bow_loss"]) for r in rows)
    if precision == "fp32":
        for a, b in zip(zero2, rows, strict=True):
            for key in ("loss", "bow_loss"):
                assert b[key] == pytest.approx(a[key], rel=1e-4), (key, a, b)
    else:
        assert rows[0]["bow_loss"] == pytest.approx(zero2[0]["bow_loss"], rel=0.05)


def _texts() -> list[str]:
    from synthetic import synthetic_texts

    return [t or "retrieval" for t in synthetic_texts(12, seed=4, max_words=30)]


def _reference_vectors(run: Path, texts: list[str], topk: int) -> np.ndarray:
    """The DupMAE vectors of ``texts`` from the checkpoint's training-time module state,
    computed here with a loop: [CLS] state, then each text's max over its ordinary
    positions of the MLM head, its ``topk`` largest entries kept."""
    from retromae_ds.data.tokenizer import load_tokenizer

    final = ckpt.latest_complete(run / "checkpoints")
    state = torch.load(final / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    tokenizer = load_tokenizer(final / "encoder")
    model = PretrainModel(
        build_encoder(EncoderConfig(name="tiny", max_position_embeddings=64), len(tokenizer), 0),
        ObjectiveConfig(name="dupmae"),
    )
    model.load_state_dict(state)
    model.eval()
    special = set(tokenizer.all_special_ids)
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=64, return_tensors="pt")
            hidden = model.encoder.bert(**ids).last_hidden_state[0]
            ordinary = [i for i, t in enumerate(ids["input_ids"][0].tolist()) if t not in special]
            vector = model.encoder.cls(hidden[ordinary]).max(0).values
            keep = vector.topk(topk).indices
            sparse = torch.zeros_like(vector)
            sparse[keep] = vector[keep]
            rows.append(torch.cat([hidden[0], sparse]).numpy())
    return np.stack(rows)


@pytest.mark.slow
def test_eval_export_and_the_training_state_give_the_same_dupmae_vectors(tmp_path, dupmae_run):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from retromae_ds.export import EXPORT_MARKER, export_encoder
    from retromae_ds.modeling.load import load_with_head
    from retromae_ds.retrieval.encode import HFEncoder

    texts = _texts()
    want = _reference_vectors(dupmae_run, texts, topk=16)
    hidden = 128  # the tiny preset
    run_enc = HFEncoder.from_dir(dupmae_run, pooling="dupmae", bow_topk=16, max_length=64)
    pools = run_enc.encode_pools(texts, ["cls", "dupmae_bow", "dupmae"])
    np.testing.assert_allclose(pools["dupmae"], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(pools["dupmae"][:, :hidden], pools["cls"])
    np.testing.assert_array_equal(pools["dupmae"][:, hidden:], pools["dupmae_bow"])
    assert ((pools["dupmae_bow"] != 0).sum(1) == 16).all()

    out = export_encoder(dupmae_run, tmp_path / "export", pooling="dupmae", bow_topk=16)
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["pooling"] == "dupmae" and marker["bow_topk"] == 16
    spec = sbert.read_spec(out)
    assert (spec.pooling, spec.bow_topk, Path(spec.source).name) == (
        "dupmae",
        16,
        sbert.DUPMAE_FILE,
    )
    # the folder's own pooling (auto) and top-k: the same vectors as from the run
    exported = HFEncoder.from_dir(out, pooling=spec.pooling, max_length=64)
    np.testing.assert_allclose(exported(texts), pools["dupmae"], rtol=1e-5, atol=1e-5)
    # what the module doc says of the plain loaders: AutoModel gives the body, and a plain
    # SentenceTransformer the [CLS] vector (the first H entries of dupmae)
    body = AutoModel.from_pretrained(str(out), local_files_only=True)
    assert type(body).__name__ == "BertModel"
    st = SentenceTransformer(str(out), device="cpu")
    np.testing.assert_allclose(st.encode(texts), pools["cls"], rtol=1e-4, atol=1e-4)

    # an export for CLS pooling keeps no head: the DupMAE poolings refuse it, saying why
    cls_out = export_encoder(dupmae_run, tmp_path / "cls_export")
    assert not (cls_out / sbert.DUPMAE_FILE).exists()
    with pytest.raises(ValueError, match="no MLM head"):
        HFEncoder.from_dir(cls_out, pooling="dupmae")
    with pytest.raises(ValueError, match="no MLM head"):
        load_with_head(cls_out)  # what export and fine-tuning load a DupMAE encoder with


@pytest.mark.slow
def test_retromae_ds_eval_scores_each_pooling(tmp_path, dupmae_run):
    from retromae_ds.eval.run import evaluate_beir

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=40, num_queries=8)
    (beir / "qrels" / "test.tsv").write_text((beir / "qrels" / "train.tsv").read_text())
    dims = {}
    for pooling in ("cls", "dupmae_bow", "dupmae"):
        result = evaluate_beir(
            dupmae_run, beir, pooling=pooling, device="cpu", progress=False, verbose=False
        )
        assert result["settings"]["pooling"] == pooling
        assert 0.0 <= result["metrics"]["ndcg@10"] <= 1.0
        dims[pooling] = result["settings"]["dim"]
    assert dims["dupmae"] == dims["cls"] + dims["dupmae_bow"] and dims["dupmae_bow"] > 100


def finetune(run_dir: Path, *overrides: str, check: bool = True):
    args = ["--run_dir", str(run_dir), "--progress", "false", *overrides]
    result = subprocess.run(
        [sys.executable, "-m", "retromae_ds.finetune", *args],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_finetuning_with_the_dupmae_pooling_trains_its_head_and_saves_it(tmp_path, dupmae_run):
    from retromae_ds.retrieval.encode import HFEncoder

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=60, num_queries=16)
    run = tmp_path / "ft"
    finetune(
        run, "--data.beir", str(beir), "--model.init", str(dupmae_run),
        "--model.pooling", "dupmae", "--model.bow_topk", "32",
        "--data.q_max_len", "16", "--data.p_max_len", "32", "--micro_batch_size", "4",
        "--negatives.n_hard", "1", "--refresh.mining.num_negatives", "3",
        "--max_steps", "2", "--log_every", "1",
        "--optim.lr", "1e-3", "--optim.warmup_steps", "1",
    )  # fmt: skip
    rows = metrics(run)
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    encoder_dir = ckpt.latest_complete(run / "checkpoints") / "encoder"
    spec = sbert.read_spec(encoder_dir)
    assert (spec.pooling, spec.bow_topk) == ("dupmae", 32)
    settings = json.loads((encoder_dir / sbert.DUAL_ENCODER_FILE).read_text())
    assert settings["pooling"] == "dupmae" and settings["bow_topk"] == 32
    # the head was trained and saved: its transform moved away from the pre-trained one
    from safetensors.torch import load_file

    tuned = load_file(str(encoder_dir / "model.safetensors"))
    start = ckpt.latest_complete(dupmae_run / "checkpoints") / "encoder" / "model.safetensors"
    name = "cls.predictions.transform.dense.weight"
    assert not torch.equal(tuned[name], load_file(str(start))[name])
    vectors = HFEncoder.from_dir(encoder_dir, pooling=spec.pooling)(_texts()[:3])
    assert vectors.shape[1] > 128 and ((vectors[:, 128:] != 0).sum(1) == 32).all()


# --------------------------------------------------------------------------- config errors


def test_config_errors_name_the_setting(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer, BertConfig, BertModel

    from retromae_ds.eval.periodic import PeriodicEvalConfig
    from retromae_ds.finetune import DualModelConfig
    from retromae_ds.retrieval.encode import HFEncoder, pool

    with pytest.raises(ValueError, match="objective.bow_weight"):
        ObjectiveConfig(name="dupmae", bow_weight=-1.0)
    with pytest.raises(ValueError, match="objective.name"):
        ObjectiveConfig(name="dupmae2")
    with pytest.raises(ValueError, match="eval.poolings"):
        PeriodicEvalConfig(poolings=["cls", "max"])
    with pytest.raises(ValueError, match="eval.bow_topk"):
        PeriodicEvalConfig(bow_topk=-1)
    with pytest.raises(ValueError, match="model.pooling"):
        DualModelConfig(init="x", pooling="bow")
    with pytest.raises(ValueError, match="model.bow_topk"):
        DualModelConfig(init="x", bow_topk=-2)
    with pytest.raises(ValueError, match="dupmae_bow"):
        sbert.resolve(tmp_path, "sparse")
    # the refresher's pooling call without the head: a clear error, not a wrong vector
    with pytest.raises(ValueError, match="MLM head"):
        pool(torch.zeros(2, 3, 4), torch.ones(2, 3), "dupmae")
    # an encoder body has no head to pool with
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    body = BertModel(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=32))  # fmt: skip
    with pytest.raises(ValueError, match="MLM head"):
        HFEncoder(body, tok, pooling="dupmae_bow")
    with pytest.raises(ValueError, match="MLM head"):
        HFEncoder(body, tok).encode_pools(["a text"], ["cls", "dupmae"])
    # a dupmae record with a bad top-k is named
    (tmp_path / sbert.DUPMAE_FILE).write_text(json.dumps({"pooling": "dupmae", "bow_topk": -3}))
    with pytest.raises(ValueError, match="bow_topk"):
        sbert.read_spec(tmp_path)


def _plain_dupmae_vectors(encoder: Path, ds, rows, special, topk: int) -> np.ndarray:
    """The DupMAE vectors of shard rows (``[CLS] row [SEP]``), one text at a time: the
    masked-LM model's [CLS] state, then the max over the ordinary positions of its MLM head,
    the ``topk`` largest entries kept (normalised when the folder says so)."""
    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.modeling.load import load_with_head

    model = load_with_head(encoder).eval()
    out = []
    with torch.no_grad():
        for row in rows:
            ids, mask = ance_data.token_batch(ds, np.asarray([row]), special)
            hidden = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state[0]
            ordinary = [i for i, t in enumerate(ids[0].tolist()) if t not in special.all]
            vector = model.cls(hidden[ordinary]).max(0).values
            keep = vector.topk(topk).indices
            sparse = torch.zeros_like(vector)
            sparse[keep] = vector[keep]
            out.append(torch.cat([hidden[0], sparse]))
    vectors = torch.stack(out)
    if sbert.read_spec(encoder).normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    return vectors.numpy()


@pytest.mark.slow
def test_the_refresher_mines_with_the_dupmae_pooling_across_shards(
    tmp_path, dupmae_run, tokenizer_dir, monkeypatch
):
    """A checkpoint pooled with ``dupmae``: the refresher loads its head, encodes with the
    folder's pooling and top-k in shards cut to ``stages.SHARD_BYTES`` (here 15 passages of
    H + |V| entries), and mines exactly the negatives of a ranking by plain per-text vectors
    (strategy ``top``: the best non-positives)."""
    from retromae_ds.components.layout import RunLayout
    from retromae_ds.export import export_encoder
    from retromae_ds.finetuning import data as ance_data
    from retromae_ds.finetuning import handoff
    from retromae_ds.refresher import process as refresher
    from retromae_ds.refresher import stages
    from retromae_ds.refresher.bm25 import publish_bm25
    from retromae_ds.refresher.config import MiningConfig, RefreshConfig

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=40, num_queries=8)
    ts = ance_data.load(prepared_set(tmp_path / "data", beir, tokenizer_dir))
    encoder = export_encoder(dupmae_run, tmp_path / "export", pooling="dupmae", bow_topk=16)
    run = tmp_path / "run"
    cfg = RefreshConfig(
        run_dir=str(run), data_dir=str(tmp_path / "data"), batch_size=8, device="cpu",
        progress=False, mining=MiningConfig(top_k=10, num_negatives=3, strategy="top"),
    )  # fmt: skip
    publish_bm25(cfg, ts, RunLayout(run).negatives)
    checkpoint = fake_checkpoint(run, 4, encoder)
    dim = 128 + ts.special.vocab_size  # the tiny preset's H, then |V|
    monkeypatch.setattr(stages, "SHARD_BYTES", 4 * dim * 15)
    manifest = refresher.refresh_once(cfg, ts, checkpoint, 1, stages.Group(60))
    shards = manifest["embedding_shards"]
    assert (shards["shards"], shards["shard_rows"], shards["dim"]) == (3, 15, dim)

    passages = _plain_dupmae_vectors(encoder, ts.corpus, ts.passage_rows, ts.special, 16)
    queries = _plain_dupmae_vectors(encoder, ts.queries, ts.query_rows, ts.special, 16)
    assert passages.shape == (ts.num_passages, dim)
    scores = queries @ passages.T
    mined = handoff.load_version(RunLayout(run).negatives, 1)
    for q in range(ts.num_queries):
        ranked = [int(p) for p in np.argsort(-scores[q], kind="stable")[:10]]
        want = [p for p in ranked if p not in set(ts.positives[q].tolist())][:3]
        assert sorted(mined.of(q).tolist()) == sorted(want), q


@pytest.mark.slow
def test_finetuning_with_a_dupmae_pooling_mines_ance_negatives_with_it(tmp_path, dupmae_run):
    """``--refresher local`` with ``--model.pooling dupmae_bow``: the refresher mines v1
    from the step-0 checkpoint with that pooling (|V| entries a vector) before step 1, and
    training goes on to its last step."""
    from retromae_ds.components.layout import RunLayout
    from retromae_ds.finetuning import handoff

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=30, num_queries=8)
    run = tmp_path / "ft"
    finetune(
        run, "--data.beir", str(beir), "--model.init", str(dupmae_run),
        "--model.pooling", "dupmae_bow", "--model.bow_topk", "32", "--refresher", "local",
        "--negatives.mine_first", "true", "--negatives.refresh_every", "1",
        "--data.q_max_len", "16", "--data.p_max_len", "32", "--micro_batch_size", "4",
        "--negatives.n_hard", "1", "--refresh.mining.num_negatives", "3",
        "--refresh.mining.top_k", "10", "--max_steps", "2", "--log_every", "1",
    )  # fmt: skip
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["negatives_version"] >= 1 for r in rows)  # never BM25's v0
    v1 = json.loads(handoff.manifest_file(RunLayout(run).negatives, 1).read_text())
    assert (v1["source"], v1["step"]) == ("model", 0)
    encoder = ckpt.latest_complete(run / "checkpoints") / "encoder"
    vocab = json.loads((encoder / "config.json").read_text())["vocab_size"]
    assert v1["embedding_shards"]["dim"] == vocab


def test_periodic_eval_scores_the_dupmae_poolings_of_the_training_model(tmp_path, tokenizer_dir):
    from retromae_ds.eval.periodic import PeriodicEval, PeriodicEvalConfig

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=30, num_queries=6)
    (beir / "qrels" / "test.tsv").write_text((beir / "qrels" / "train.tsv").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    model = PretrainModel(
        build_encoder(EncoderConfig(name="tiny", max_position_embeddings=64), len(tok), 0),
        ObjectiveConfig(name="dupmae"),
    )
    before = copy.deepcopy(model.state_dict())
    row = PeriodicEval(PeriodicEvalConfig(beir=str(beir), poolings=["cls", "dupmae"], bow_topk=8))(
        model.encoder, tok
    )
    assert {"eval/beir/cls/ndcg@10", "eval/beir/dupmae/ndcg@10"} <= row.keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
