"""An encoder's own pooling, normalisation and length, read from its sentence-transformers
files (all-MiniLM-L6-v2 for real, and hand-written folders for every error), the explicit
override, and a fine-tuning run that trains and saves with them: its checkpoint and its
export load in sentence-transformers with that pooling and agree with our encoder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from retromae_ds.components import checkpoint as ckpt
from retromae_ds.hf import sbert

from helpers_ance import ENV, REPO, write_synthetic_beir, write_tiny_encoder


def test_minilm_pooling_is_read_from_its_files_and_can_be_overridden(minilm_dir):
    spec = sbert.read_spec(minilm_dir)
    assert (spec.pooling, spec.normalize, spec.max_length) == ("mean", True, 256)
    assert spec.source == str(minilm_dir / "1_Pooling" / "config.json")
    assert sbert.resolve(minilm_dir) == spec
    over = sbert.resolve(minilm_dir, "cls", False)
    assert (over.pooling, over.normalize, over.max_length) == ("cls", False, 256)
    assert sbert.resolve(minilm_dir, normalize=False).pooling == "mean"


def _folder(tmp_path: Path, modules: list[dict] | None, pooling: dict | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


ST = "sentence_transformers.models."
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}


def test_folders_without_files_default_to_cls_and_unsupported_modules_are_named(tmp_path):
    assert sbert.read_spec(_folder(tmp_path, None, None)) == sbert.EmbeddingSpec(
        "cls", False, None, "default"
    )
    cls_only = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    spec = sbert.read_spec(_folder(tmp_path, [TRANSFORMER, POOLING], cls_only))
    assert (spec.pooling, spec.normalize) == ("cls", False)

    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": ST + "Dense"}
    folder = _folder(tmp_path, [TRANSFORMER, POOLING, dense], cls_only)
    with pytest.raises(ValueError, match=r"modules\.json: module 2 .*Dense.* not supported"):
        sbert.read_spec(folder)
    folder = _folder(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match=r"config\.json: pooling_mode_max_tokens"):
        sbert.read_spec(folder)
    both = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}
    with pytest.raises(ValueError, match="exactly one"):
        sbert.read_spec(_folder(tmp_path, [TRANSFORMER, POOLING], both))
    with pytest.raises(ValueError, match="no sentence_transformers.models.Pooling"):
        sbert.read_spec(_folder(tmp_path, [TRANSFORMER], cls_only))
    (folder / "modules.json").write_text("[{")
    with pytest.raises(ValueError, match=r"modules\.json: not readable JSON"):
        sbert.read_spec(folder)
    # a fine-tuning run's own record wins over the sentence-transformers files
    (folder / "dual_encoder.json").write_text(json.dumps({"pooling": "mean", "normalize": True}))
    assert sbert.read_spec(folder).source.endswith("dual_encoder.json")
    with pytest.raises(ValueError, match="pooling"):
        sbert.resolve(folder, "max")


def _finetune(
    run: Path, beir: Path, init: Path, *extra: str, ds: tuple[str, str] = ("zero0", "fp32")
) -> str:
    args = [
        "--run_dir", str(run), "--progress", "false",
        "--data.beir", str(beir), "--model.init", str(init),
        "--data.q_max_len", "16", "--data.p_max_len", "32",
        "--micro_batch_size", "4", "--negatives.n_hard", "1", "--refresh.mining.num_negatives", "3",
        "--max_steps", "2", "--log_every", "1", "--optim.lr", "1e-3",
        "--deepspeed.config", json.dumps([f"ds_configs/{name}.json" for name in ds]), *extra,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "retromae_ds.finetune", *args]
    result = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.slow
def test_finetuning_trains_and_saves_with_the_inits_pooling(tmp_path, tokenizer_dir):
    from sentence_transformers import SentenceTransformer

    from retromae_ds.export import export_encoder
    from retromae_ds.retrieval.encode import HFEncoder

    beir = write_synthetic_beir(tmp_path / "beir", num_docs=60, num_queries=16)
    init = write_tiny_encoder(tmp_path / "init", tokenizer_dir)
    sbert.write_files(init, 32, "mean", 48, normalize=True)  # a mean-pooled, normalised init

    log = _finetune(tmp_path / "auto", beir, init, ds=("zero2", "bf16"))
    assert f"mean pooling, normalize true (pooling from {init / '1_Pooling'}" in log, log[-2000:]
    encoder = ckpt.latest_complete(tmp_path / "auto" / "checkpoints") / "encoder"
    saved = json.loads((encoder / "dual_encoder.json").read_text())
    assert saved | {"temperature": round(saved["temperature"], 6)} == {
        "pooling": "mean",
        "normalize": True,
        "temperature": 0.05,
        "shared": True,
        "q_max_len": 16,
        "p_max_len": 32,
    }
    # a bf16 run saves its fp32 master weights (not their bf16 copies) and says so
    from safetensors.torch import load_file

    weights = load_file(str(encoder / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.float32}
    assert json.loads((encoder / "config.json").read_text())["dtype"] == "float32"
    moved = [v for k, v in weights.items() if k.endswith("query.weight")]
    assert moved and any((v.bfloat16().float() != v).any() for v in moved)
    # what the init reads texts up to (48) outlives training on 32-token passages
    assert sbert.read_spec(encoder) == sbert.EmbeddingSpec(
        "mean", True, 48, str(encoder / "dual_encoder.json")
    )

    # the export carries the pooling, the normalisation and the length to sentence-transformers
    out = export_encoder(tmp_path / "auto", tmp_path / "exported")
    assert json.loads((out / "export.json").read_text())["pooling"] == "mean"
    texts = ["claims about proteins", "a much longer passage " * 30, "x"]
    st = SentenceTransformer(str(out), device="cpu")
    assert st.max_seq_length == 48
    ours = HFEncoder.from_dir(out, pooling="mean", normalize=True, max_length=48, progress=False)
    got = st.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(got, torch.from_numpy(ours(texts)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(texts)))

    # the explicit settings override the init's own
    log = _finetune(
        tmp_path / "cls", beir, init, "--model.pooling", "cls", "--model.normalize", "false"
    )
    assert "cls pooling, normalize false" in log and "temperature 1" in log, log[-2000:]
    encoder = ckpt.latest_complete(tmp_path / "cls" / "checkpoints") / "encoder"
    spec = sbert.read_spec(encoder)
    assert (spec.pooling, spec.normalize) == ("cls", False)
    modules = json.loads((encoder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling"]
