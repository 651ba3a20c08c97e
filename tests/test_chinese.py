"""Chinese: segmenter word starts (jieba whole-word masking), the BERT-Chinese tokenizer from
its bare vocab.txt, language-aware BM25, and the end-to-end path on CSL (../shared/data)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers_train import ENV, REPO, metrics, pretrain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retromae_ds.base.special_tokens import IGNORE, SpecialIds
from retromae_ds.data import segment
from retromae_ds.data.collate import MaskingConfig, PretrainCollator
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
from retromae_ds.data.rows import make_backend, tokenize_documents
from retromae_ds.data.tokenizer import backend_json, fingerprint, make_wordpiece, train_wordpiece

jieba = pytest.importorskip("jieba", reason="the chinese extra (jieba) is not installed")

MIXED = [
    "采用修正的Rodrigues参数(MRP),建立了飞行器姿态控制系统的数学模型",
    "我在2019年买了一件T恤和一台iPhone手机，去唱卡拉OK。",
    "BERT模型在C-MTEB上的检索结果 38.76% 高于 2.87%",
    "unbelievable tokenization 和 中文分词 mixed together",
]


@pytest.fixture(scope="module")
def zh_tokenizer(shared_data, tmp_path_factory):
    return make_wordpiece(
        shared_data / "chinese" / "vocab.txt", tmp_path_factory.mktemp("zh") / "tok", chinese=True
    )


@pytest.fixture(scope="module")
def seg():
    return segment.Segmenter(segment.SegmenterSpec())


def _groups(text, backend, docs):
    """Masking units of one document: (char start, char end, token count) per word."""
    enc = backend.encode(text, add_special_tokens=False)
    out = []
    for i, (s, e) in enumerate(enc.offsets):
        if docs.word_starts[i]:
            out.append([s, e, 1])
        else:
            out[-1][1:] = [e, out[-1][2] + 1]
    return [tuple(g) for g in out]


def _check_word_starts(text, backend, seg):
    plain = tokenize_documents(backend, [text])
    docs = tokenize_documents(backend, [text], segmenter=seg)
    assert np.array_equal(plain.ids, docs.ids)
    enc = backend.encode(text, add_special_tokens=False)
    inside = seg.inside_words(text)
    for i, (s, _) in enumerate(enc.offsets):
        if i == 0:
            assert docs.word_starts[i] == 1
        elif inside[s]:  # continues a jieba word with a Han character
            assert docs.word_starts[i] == 0, (text, i)
        else:  # everything else keeps the tokenizer's word boundaries (Latin, numbers)
            assert docs.word_starts[i] == plain.word_starts[i], (text, i)
    # every masking unit with a Han character is exactly one jieba word
    spans = {(s, e) for w, s, e in seg.words(text)}
    for s, e, _ in _groups(text, backend, docs):
        if segment.HAN.search(text[s:e]):
            assert (s, e) in spans, (text, text[s:e])
    return docs


def test_word_starts_follow_jieba_words_and_keep_latin_words(zh_tokenizer, seg):
    backend = make_backend(backend_json(zh_tokenizer))
    for text in MIXED:
        _check_word_starts(text, backend, seg)
    docs = tokenize_documents(backend, [MIXED[0]], segmenter=seg)
    units = [MIXED[0][s:e] for s, e, _ in _groups(MIXED[0], backend, docs)]
    assert "飞行器" in units and "数学模型" in units and "Rodrigues" in units
    units = _units(MIXED[1], backend, seg)
    assert "T恤" in units and "iPhone" in units and "2019" in units  # jieba: T恤 is one word
    # without the segmenter every Han character is its own "word"
    plain = tokenize_documents(backend, [MIXED[0]])
    assert "飞行器" not in [MIXED[0][s:e] for s, e, _ in _groups(MIXED[0], backend, plain)]


def _units(text, backend, seg):
    docs = tokenize_documents(backend, [text], segmenter=seg)
    return [text[s:e] for s, e, _ in _groups(text, backend, docs)]


_ALPHABET = st.sampled_from(
    list(
        "的一是在了不和有大这中人上为们地个用工时要动国产以我到他会作来分生对于学下级就年阶义发成部民可出能方进同行面说种过命度革而多子后自社加小机也经力线本电高量长党得实家定深法表着水理化争现所二起政三好十战无农使性前等反体合斗路图把结第里正新开论之物从当两些还天资事队批如应形想制心样干都向变关点育重其思与间内去因件日利相由压员气业代全组数果期导平各基或月毛然问比展那它最及外没看治提五解系林者米群头意只明四道马认次文通但条较克又公孔领军流入接席位情运器并飞"
    )
    + list("abcXYZ0123456789 ,.，。、%-")
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(_ALPHABET, min_size=1, max_size=40).map("".join))
def test_word_start_property_on_random_mixed_text(zh_tokenizer, seg, text):
    _check_word_starts(text, make_backend(backend_json(zh_tokenizer)), seg)


def test_whole_word_masking_masks_whole_jieba_words_at_the_exact_ratio(
    zh_tokenizer, seg, shared_data
):
    backend = make_backend(backend_json(zh_tokenizer))
    texts = [
        json.loads(line)["text"]
        for line in (shared_data / "csl" / "corpus.jsonl").read_text().splitlines()[:16]
    ]
    items = []
    for i, text in enumerate(texts):
        docs = tokenize_documents(backend, [text[:90]], segmenter=seg)
        items.append((i, docs.ids, docs.word_starts))
    special = SpecialIds.from_fingerprint(fingerprint(zh_tokenizer))
    for ratio in (0.15, 0.3):
        coll = PretrainCollator(special, MaskingConfig(encoder_ratio=ratio), 128, seed=3)
        batch = coll(items)
        labels = batch["labels"].numpy()
        for row, (_, ids, starts) in enumerate(items):
            chosen = labels[row, 1 : len(ids) + 1] != IGNORE
            word = np.cumsum(starts) - 1
            per_word = np.bincount(word, weights=chosen, minlength=word[-1] + 1)
            size = np.bincount(word, minlength=word[-1] + 1)
            assert np.all((per_word == 0) | (per_word == size)), "a word was masked in part"
            candidates = sum(
                1 for w in range(word[-1] + 1) if not np.isin(ids[word == w], special.all).any()
            )
            assert (per_word > 0).sum() == int(np.floor(ratio * candidates + 0.5))
        # multi-character Chinese words are masked as units
        assert any(
            (labels[r, 1:] != IGNORE).sum() > 0 and (np.diff(np.flatnonzero(items[r][2])) > 1).any()
            for r in range(len(items))
        )


def _preprocess(inputs, out, tok_dir, **kw):
    cfg = dict(max_length=64, progress=False, shard_size=2**16)
    return run_preprocess(
        PreprocessConfig(
            inputs=[str(i) for i in inputs], out=str(out), tokenizer=str(tok_dir), **{**cfg, **kw}
        )
    )


@pytest.fixture(scope="module")
def csl_small(shared_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("csl_small")
    lines = (shared_data / "csl" / "corpus.jsonl").read_text().splitlines()[:300]
    (folder / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    titles = (shared_data / "csl" / "train_titles.txt").read_text().splitlines()[:1500]
    (folder / "titles.txt").write_text("\n".join(titles) + "\n")
    return [folder / "corpus.jsonl", folder / "titles.txt"]


def test_segmented_shards_are_byte_identical_for_any_workers_and_task_split(
    zh_tokenizer, csl_small, tmp_path
):
    tok = tmp_path / "tok"
    zh_tokenizer.save_pretrained(str(tok))
    one = _preprocess(csl_small, tmp_path / "w1", tok, segmenter="jieba", workers=1)
    two = _preprocess(csl_small, tmp_path / "w2", tok, segmenter="auto", workers=2)
    for task in (0, 1):
        _preprocess(csl_small, tmp_path / "t", tok, segmenter="jieba", num_tasks=2, task_index=task)
    split = run_preprocess(PreprocessConfig(out=str(tmp_path / "t"), merge=True, progress=False))
    assert len(one["shards"]) >= 3
    assert one["segmenter"]["name"] == "jieba" and one["segmenter"]["dictionary_sha256"]
    assert one["shards"] == two["shards"] == split["shards"]
    for s in one["shards"]:
        data = (tmp_path / "w1" / s["file"]).read_bytes()
        assert data == (tmp_path / "w2" / s["file"]).read_bytes()
        assert data == (tmp_path / "t" / s["file"]).read_bytes()
    plain = _preprocess(csl_small, tmp_path / "plain", tok)
    assert plain["segmenter"] is None
    starts = lambda m, d: sum(  # noqa: E731
        pa.compute.sum(
            pa.compute.list_flatten(
                pa.ipc.open_file(str(d / s["file"])).read_all().column("word_starts")
            )
        ).as_py()
        for s in m["shards"]
    )
    # jieba words: far fewer word starts than one per Han character
    assert starts(one, tmp_path / "w1") < 0.75 * starts(plain, tmp_path / "plain")


def test_another_dictionary_is_another_dataset(zh_tokenizer, csl_small, tmp_path):
    tok = tmp_path / "tok"
    zh_tokenizer.save_pretrained(str(tok))
    out = tmp_path / "shards"
    first = _preprocess(csl_small, out, tok, segmenter="jieba")
    own = Path(jieba.__file__).parent / "dict.txt"
    other = tmp_path / "dict.txt"
    other.write_text(own.read_text(encoding="utf-8") + "飞行器姿态 3 n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"segmenter \(jieba .*dictionary"):
        _preprocess(csl_small, out, tok, segmenter="jieba", segmenter_dict=str(other))
    with pytest.raises(ValueError, match=r"segmenter \(jieba .* -> none\)"):
        _preprocess(csl_small, out, tok)
    again = _preprocess(csl_small, out, tok, segmenter="jieba")  # the same: resumes, keeps all
    assert again["shards"] == first["shards"]
    custom = _preprocess(
        csl_small, tmp_path / "custom", tok, segmenter="jieba", segmenter_dict=str(other)
    )
    assert custom["segmenter"]["dictionary_sha256"] != first["segmenter"]["dictionary_sha256"]
    assert custom["shards"] != first["shards"]  # the new word changes some word starts
    with pytest.raises(FileNotFoundError, match="segmenter dictionary not found"):
        _preprocess(
            csl_small,
            tmp_path / "x",
            tok,
            segmenter="jieba",
            segmenter_dict=str(tmp_path / "no.txt"),
        )


def test_auto_segments_only_han_inputs(zh_tokenizer, tmp_path):
    english = tmp_path / "en.txt"
    english.write_text("plain english text only\nanother line\n")
    escaped = tmp_path / "zh.jsonl"
    escaped.write_text(json.dumps({"text": "飞行器姿态控制"}) + "\n")  # ensure_ascii: \u98de...
    assert "\\u" in escaped.read_text()
    assert not segment.inputs_have_han([str(english)])
    assert segment.inputs_have_han([str(english), str(escaped)])
    assert segment.resolve("auto", [str(english)]) is None
    assert segment.resolve("auto", [str(escaped)]).name == "jieba"


def test_missing_jieba_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jieba", None)  # as if not installed
    with pytest.raises(ImportError, match=r"retromae-ds\[chinese\]"):
        segment.resolve("jieba", [])


def test_make_tokenizer_from_the_chinese_vocab(shared_data, tmp_path):
    out = tmp_path / "tok"
    result = subprocess.run(
        [sys.executable, "-m", "retromae_ds.cli", "make-tokenizer", "--vocab",
         str(shared_data / "chinese" / "vocab.txt"), "--out", str(out), "--chinese"],
        capture_output=True, text=True, env=ENV, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    from retromae_ds.data.tokenizer import load_tokenizer

    tok = load_tokenizer(out)
    assert len(tok) == 21128
    fp = fingerprint(tok)["special_token_ids"]
    assert fp == {"cls": 101, "sep": 102, "pad": 0, "mask": 103, "unk": 100}
    pieces = tok.tokenize("飞行器Attitude控制2019年")
    assert pieces[:3] == ["飞", "行", "器"] and "2019" in pieces and tok.unk_token not in pieces
    english = tmp_path / "en_vocab.txt"
    english.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "##s"]))
    with pytest.raises(ValueError, match=r"en_vocab.txt: only 0 single Han characters"):
        make_wordpiece(english, tmp_path / "bad", chinese=True)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="not a BERT WordPiece vocabulary"):
        make_wordpiece(shared_data / "csl" / "train_titles.txt", tmp_path / "bad")


def test_train_tokenizer_on_chinese_splits_han_characters(shared_data, tmp_path):
    titles = (shared_data / "csl" / "train_titles.txt").read_text().splitlines()[:3000]
    tok = train_wordpiece(titles + ["mixed English words and 中文"] * 3, 3000, tmp_path / "tok")
    vocab = tok.get_vocab()
    multi_han = [t for t in vocab if sum(1 for c in t if segment.HAN.match(c)) > 1]
    assert not multi_han, multi_han[:5]  # Han characters are split as BERT does
    assert sum(1 for t in vocab if len(t) == 1 and segment.HAN.match(t)) > 1000
    assert tok.tokenize("飞行器姿态") == ["飞", "行", "器", "姿", "态"]


def test_bm25_tokenizes_chinese_with_jieba_or_characters(shared_data):
    from retromae_ds.retrieval.lexical import analyze, choose_analyzer, evaluate_bm25

    assert choose_analyzer(["some english"]) == "english"
    assert choose_analyzer(["中文 text"]) == "jieba"
    assert analyze(["飞行器姿态, BERT模型"], "chars") == [
        ["飞", "行", "器", "姿", "态", "bert", "模", "型"]
    ]
    assert analyze(["飞行器姿态控制, BERT模型"], "jieba") == [
        ["飞行器", "姿态控制", "bert", "模型"]
    ]
    jieba_res = evaluate_bm25(shared_data / "csl", "test", ["ndcg@10"])
    chars_res = evaluate_bm25(shared_data / "csl", "test", ["ndcg@10"], analyzer="chars")
    assert jieba_res["analyzer"] == "jieba"
    # the data README: 0.988 (jieba words), 0.989 (characters); an English regex: far lower
    assert jieba_res["metrics"]["ndcg@10"] == pytest.approx(0.988, abs=0.01)
    assert chars_res["metrics"]["ndcg@10"] == pytest.approx(0.989, abs=0.01)
    english = evaluate_bm25(shared_data / "csl", "test", ["ndcg@10"], analyzer="english")
    assert english["metrics"]["ndcg@10"] < jieba_res["metrics"]["ndcg@10"] - 0.2


def test_chinese_end_to_end_preprocess_pretrain_eval_rerank(shared_data, zh_tokenizer, tmp_path):
    """make-tokenizer -> preprocess --segmenter auto -> RetroMAE pre-training -> eval --rerank
    on CSL test, each as a user runs it."""
    tok = tmp_path / "tok"
    zh_tokenizer.save_pretrained(str(tok))
    csl = shared_data / "csl"
    cli = [sys.executable, "-m", "retromae_ds.cli"]
    shards = tmp_path / "shards"
    r = subprocess.run(
        [*cli, "preprocess", str(csl / "corpus.jsonl"), str(csl / "train_titles.txt"),
         "--tokenizer", str(tok), "--out", str(shards), "--segmenter", "auto",
         "--max_length", "64", "--workers", "2", "--progress", "false"],
        capture_output=True, text=True, env=ENV, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["segmenter"]["name"] == "jieba"
    run = tmp_path / "run"
    pretrain(run, shards, "--model.objective.name", "retromae", "--max_steps", "30",
             "--checkpoint.every_steps", "30")  # fmt: skip
    rows = [r for r in metrics(run) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"]
    out = tmp_path / "eval.json"
    r = subprocess.run(
        [*cli, "eval", "--model", str(run), "--beir", str(csl), "--split", "test",
         "--max_length", "64", "--rerank", "--out", str(out), "--progress", "false"],
        capture_output=True, text=True, env=ENV, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["num_queries"] == 500 and res["rerank"]["num_queries"] == 500
    assert 0.0 <= res["rerank"]["metrics"]["map"] <= 1.0
    assert "reranking 500 candidate lists" in r.stdout
    shutil.rmtree(run)
