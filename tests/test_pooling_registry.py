"""One definition of each pooling (``retromae_ds.hf.pooling.POOLINGS``), used by every job.

(a) The evaluation encoder, the fine-tuning model (``finetuning.model.DualEncoder``), the
refresher's encoder (``refresher.stages.encode_rows``' pooling) and an export give, for every
built-in pooling, the vectors of the pooling arithmetic written out here: CLS the first
state, mean the mask-weighted mean, DupMAE's the ordinary-token vector (``modeling.bow``) and
[CLS] concatenated with it.
(b) A pooling registered by an installed package (its ``retromae_ds.poolings`` entry point)
is a choice of ``retromae-ds eval --pooling``, of ``--model.pooling`` and of export, without
the library naming it.
(c) An unknown pooling is one line naming the option and the registered poolings.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_plugins import install_package

from retromae_ds.base.options import build_config
from retromae_ds.cli import main as cli_main
from retromae_ds.eval.periodic import PeriodicEvalConfig
from retromae_ds.export import export_encoder
from retromae_ds.finetune import FinetuneConfig
from retromae_ds.finetuning.model import DualEncoder, load_tower
from retromae_ds.hf import pooling as pooling_module
from retromae_ds.hf import sbert
from retromae_ds.modeling.bow import bow_vectors
from retromae_ds.retrieval import metrics
from retromae_ds.retrieval.encode import HFEncoder

from helpers_ance import fake_checkpoint
from helpers_model import small_config
from synthetic import synthetic_texts

BUILT_IN = ("cls", "mean", "dupmae_bow", "dupmae")
TOPK = 7
MAX_LENGTH = 64
"""The tiny model's positions: what an export's sentence-transformers files read texts to."""
TEXTS = sorted((t for t in synthetic_texts(12, seed=3) if t.strip()), key=len, reverse=True)
"""Longest first: the order the encoder batches them in, so one batch is the texts' own."""


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A random tiny masked-LM BERT (64 positions, seed 0) with its tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    out = tmp_path_factory.mktemp("tiny_mlm")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**small_config(len(tokenizer), max_position_embeddings=64)))\
        .save_pretrained(out)  # fmt: skip
    return out


@pytest.fixture
def registry(monkeypatch):
    """The pooling registry as it is, restored after the test (registrations do not leak)."""
    monkeypatch.setattr(pooling_module, "POOLINGS", pooling_module.POOLINGS.copy())
    return pooling_module.POOLINGS


def direct(name: str, hidden_BLH, mask_BL, vocab_BV) -> torch.Tensor:
    """Each built-in pooling written out, as the code before the registry computed it."""
    if name == "cls":
        return hidden_BLH[:, 0]
    if name == "mean":
        weights_BL1 = mask_BL.unsqueeze(-1).to(hidden_BLH.dtype)
        return (hidden_BLH * weights_BL1).sum(1) / weights_BL1.sum(1).clamp(min=1)
    if name == "dupmae_bow":
        return vocab_BV
    return torch.cat([hidden_BLH[:, 0].to(vocab_BV.dtype), vocab_BV], dim=-1)


def reference(mlm_dir: Path, texts: list[str], name: str) -> np.ndarray:
    """``name``'s vectors of ``texts``: the masked-LM model's states of one padded batch."""
    from transformers import AutoTokenizer, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(mlm_dir, local_files_only=True)
    model = BertForMaskedLM.from_pretrained(mlm_dir, local_files_only=True).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH,
                      return_tensors="pt")  # fmt: skip
    with torch.inference_mode():
        hidden = model.base_model(**batch).last_hidden_state
        special = torch.tensor(sorted(set(tokenizer.all_special_ids)))
        vocab = bow_vectors(model, hidden, batch["input_ids"], batch["attention_mask"], special,
                            TOPK)  # fmt: skip
        return direct(name, hidden, batch["attention_mask"], vocab).float().numpy()


def test_the_registry_holds_the_library_poolings_and_their_sizes():
    assert pooling_module.POOLINGS.names() == BUILT_IN
    assert sbert.POOLINGS == BUILT_IN and sbert.HEAD_POOLINGS == ("dupmae_bow", "dupmae")
    sizes = {name: sbert.embedding_dim(name, 16, 100) for name in BUILT_IN}
    assert sizes == {"cls": 16, "mean": 16, "dupmae_bow": 100, "dupmae": 116}


@pytest.mark.parametrize("name", BUILT_IN)
def test_eval_finetuning_and_export_give_the_pooling_written_out(name, mlm_dir, tmp_path):
    want = reference(mlm_dir, TEXTS, name)
    settings = dict(max_length=MAX_LENGTH, batch_size=64, device="cpu", progress=False)
    # the evaluation encoder (retromae-ds eval, the evaluation during pre-training)
    encoder = HFEncoder.from_dir(mlm_dir, pooling=name, bow_topk=TOPK, **settings)
    assert np.array_equal(encoder(TEXTS), want)
    assert np.array_equal(encoder.encode_pools(TEXTS, [name, "cls"])[name], want)
    # the fine-tuning model (and the refresher, which pools with the same definition)
    tokenizer = encoder.tokenizer
    head = pooling_module.get_pooling(name).needs_head
    model = DualEncoder(load_tower(mlm_dir, head=head).eval(), pooling=name, bow_topk=TOPK,
                        special_ids=tuple(tokenizer.all_special_ids))  # fmt: skip
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=MAX_LENGTH,
                      return_tensors="pt")  # fmt: skip
    with torch.inference_mode():
        got = model.embed(batch["input_ids"], batch["attention_mask"], query=False)
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=1e-5)
    # an export: its files name the pooling, and what reads them gives the same vectors
    checkpoint = fake_checkpoint(tmp_path / "run", 3, mlm_dir)
    out = export_encoder(checkpoint, tmp_path / "out", pooling=name, bow_topk=TOPK)
    spec = sbert.read_spec(out)
    assert spec.pooling == name and (spec.bow_topk == TOPK or not head)
    exported = HFEncoder.from_dir(out, pooling=spec.pooling, **settings)
    assert np.array_equal(exported(TEXTS), want)
    st = pytest.importorskip("sentence_transformers")
    # sentence-transformers computes CLS and mean itself (DupMAE's: the [CLS] part only)
    theirs = st.SentenceTransformer(str(out), device="cpu").encode(TEXTS, batch_size=64)
    first = want if name in ("cls", "mean") else reference(mlm_dir, TEXTS, "cls")
    np.testing.assert_allclose(theirs, first, rtol=0, atol=1e-5)


MAX_SOURCE = """
from retromae_ds.hf.pooling import Pooling


def max_over_tokens(hidden_BLH, attention_mask_BL, vocab_BV):
    padding_BL1 = attention_mask_BL.unsqueeze(-1) == 0
    return hidden_BLH.masked_fill(padding_BL1, float("-inf")).max(dim=1).values


MAX = Pooling(name="max", function=max_over_tokens, st_mode="pooling_mode_max_tokens")
"""


def install_max(tmp_path: Path, monkeypatch) -> None:
    site = install_package(tmp_path / "site", "extra_poolings", MAX_SOURCE,
                           {"retromae_ds.poolings": {"max": "extra_poolings:MAX"}})  # fmt: skip
    monkeypatch.syspath_prepend(str(site))


def write_beir(folder: Path) -> Path:
    """Eight documents and three queries of synthetic text, each query with a judgment."""
    texts = synthetic_texts(14, seed=5)
    texts = [t for t in texts if t.strip()][:11]
    (folder / "qrels").mkdir(parents=True)
    corpus = [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(texts[:8])]
    queries = [{"_id": f"q{i}", "text": t[:60]} for i, t in enumerate(texts[8:])]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
    qrels = ["query-id\tcorpus-id\tscore", "q0\td0\t1", "q1\td3\t2", "q1\td5\t1", "q2\td7\t1"]
    (folder / "qrels" / "test.tsv").write_text("\n".join(qrels) + "\n")
    return folder


def max_vectors(mlm_dir: Path, texts: list[str]) -> np.ndarray:
    """The maximum of each hidden dimension over a text's tokens, written out text by text."""
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(mlm_dir, local_files_only=True)
    body = BertModel.from_pretrained(mlm_dir, local_files_only=True).eval()
    rows = []
    with torch.inference_mode():
        for text in texts:
            one = tokenizer([text], truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
            rows.append(body(**one).last_hidden_state[0].max(dim=0).values.numpy())
    return np.stack(rows)


def test_a_package_adds_a_pooling_that_eval_finetuning_and_export_accept(
    registry, monkeypatch, mlm_dir, tmp_path
):
    from transformers import AutoTokenizer

    install_max(tmp_path, monkeypatch)
    assert "max" not in registry.names()  # nothing registered it yet: the entry point will
    beir = write_beir(tmp_path / "ds")
    out = tmp_path / "result.json"
    argv = ["eval", "--model", str(mlm_dir), "--beir", str(beir), "--pooling", "max",
            "--max_length", str(MAX_LENGTH), "--device", "cpu", "--progress", "false",
            "--measures", "ndcg@3", "mrr@10", "--out", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    result = json.loads(out.read_text())
    corpus = [json.loads(x) for x in (beir / "corpus.jsonl").read_text().splitlines()]
    queries = [json.loads(x) for x in (beir / "queries.jsonl").read_text().splitlines()]
    scores_QN = (
        max_vectors(mlm_dir, [q["text"] for q in queries])
        @ max_vectors(mlm_dir, [d["text"] for d in corpus]).T
    )
    run = {q["_id"]: {d["_id"]: float(s) for d, s in zip(corpus, row, strict=True)}
           for q, row in zip(queries, scores_QN, strict=True)}  # fmt: skip
    qrels = {"q0": {"d0": 1}, "q1": {"d3": 2, "d5": 1}, "q2": {"d7": 1}}
    mean, _ = metrics.evaluate_run(qrels, run, ["ndcg@3", "mrr@10"])
    for measure, value in mean.items():
        assert result["metrics"][measure] == pytest.approx(value, abs=1e-6), measure

    # the fine-tuning config and model
    cfg = build_config(FinetuneConfig, None, ["--data.beir", str(beir), "--model.init",
                                              str(mlm_dir), "--model.pooling", "max"])  # fmt: skip
    spec, _ = cfg.model.resolve(mlm_dir)
    assert spec.pooling == "max"
    model = DualEncoder(load_tower(mlm_dir, head=False).eval(), pooling=spec.pooling)
    tokenizer = AutoTokenizer.from_pretrained(mlm_dir, local_files_only=True)
    with torch.inference_mode():
        for i, text in enumerate(TEXTS[:3]):
            one = tokenizer([text], truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
            got = model.embed(one["input_ids"], one["attention_mask"], query=True)[0]
            np.testing.assert_allclose(got.numpy(), max_vectors(mlm_dir, TEXTS[:3])[i], atol=1e-5)
    assert PeriodicEvalConfig(poolings=["cls", "max"]).poolings == ["cls", "max"]

    # export: sentence-transformers' own max pooling, read back as this pooling
    exported = export_encoder(fake_checkpoint(tmp_path / "run", 1, mlm_dir), tmp_path / "out",
                              pooling="max")  # fmt: skip
    config = json.loads((exported / sbert.POOLING_DIR / "config.json").read_text())
    assert config["pooling_mode_max_tokens"] and not config["pooling_mode_cls_token"]
    assert sbert.read_spec(exported).pooling == "max"
    assert not (exported / sbert.DUPMAE_FILE).exists()


def test_an_unknown_pooling_is_one_line_naming_the_option_and_the_poolings(
    registry, monkeypatch, tmp_path, capsys
):
    install_max(tmp_path, monkeypatch)
    missing = tmp_path / "no_model"  # never opened: the pooling is refused first
    for argv in (
        ["eval", "--model", str(missing), "--beir", str(tmp_path), "--pooling", "maxx"],
        ["export", str(missing), str(tmp_path / "out"), "--pooling", "maxx"],
        ["finetune", "--data.beir", str(tmp_path), "--model.init", str(missing),
         "--model.pooling", "maxx"],
    ):  # fmt: skip
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        option = next(a for a in argv if a.endswith("pooling"))
        assert err.startswith(f"retromae-ds {argv[0]}: error: ") and option.lstrip("-") in err
        assert "'maxx'" in err and all(name in err for name in (*BUILT_IN, "max")), err
    with pytest.raises(ValueError, match=r"^eval\.poolings: unknown pooling 'maxx'; .*dupmae, max"):
        PeriodicEvalConfig(poolings=["cls", "maxx"])
    with pytest.raises(ValueError, match=r"^model\.pooling: unknown pooling 'maxx'; expected auto"):
        build_config(FinetuneConfig, None, ["--data.beir", "b", "--model.init", "m",
                                            "--model.pooling", "maxx"])  # fmt: skip
