"""``--compile``: the encoder body and the decoders compile as whole graphs (a graph break is
an error under ``fullgraph=True``), one graph each serves every padded length (no
recompilation over 20 steps at the collator's bucketed lengths), and training losses equal
eager's.

On CPU the graphs are traced by dynamo and run through a counting backend or ``aot_eager``
(forward and backward traced by AOTAutograd, no code generated): what decides graph breaks,
recompiles and numerics of the traced program is the same as with inductor, which generates
kernels (~2 minutes a graph on 2 CPU cores; it runs on the GPU check).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from retromae_ds.data.collate import MaskingConfig, PretrainCollator
from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

from helpers_model import SPECIAL

pytestmark = pytest.mark.slow


def _batches(n: int, seed: int = 0, pack: bool = False):
    """Collated batches of 3 rows whose lengths vary (padded lengths 16 ... 64); ``pack``:
    packed into rows of 64 (``--data.packing``), two documents of 31+ tokens and a short
    one, so 2 or 3 rows of varying width (a batch of a single row would compile once more:
    dynamo specialises a dimension of size 1)."""
    rng = np.random.default_rng(seed)
    collator = PretrainCollator(SPECIAL, MaskingConfig(), 64, seed=seed, pack=pack)
    for step in range(n):
        items = []
        for index in range(3):
            low, high = ((31, 56) if index < 2 else (4, 24)) if pack else (6, 62)
            length = int(rng.integers(low, high))
            ids = rng.integers(5, SPECIAL.vocab_size, length).astype(np.int32)
            starts = (rng.random(length) < 0.6).astype(np.uint8)
            items.append((step * 3 + index, ids, starts))
        yield collator(items)


def _model(objective: str) -> PretrainModel:
    """RetroMAE's decoder on the reference backend: CPU's default (chunked) stays eager under
    compile (``compile_parts``); CUDA's (flex) compiles, on the GPU check."""
    torch.manual_seed(0)
    encoder = build_encoder(EncoderConfig(name="tiny"), SPECIAL.vocab_size, SPECIAL.pad)
    attention = "reference" if objective in ("retromae", "dupmae") else "auto"
    return PretrainModel(encoder, ObjectiveConfig(name=objective, attention=attention))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "objective, pack",
    [
        ("retromae", False),
        ("seed", False),
        ("mlm", False),
        ("retromae", True),
        ("seed", True),
        ("dupmae", True),
    ],
)
def test_each_part_compiles_once_as_one_graph_for_every_length(objective, pack):
    graphs: list[str] = []

    def counting(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    model = _model(objective)
    parts = model.compile_parts(backend=counting)
    assert len(parts) == {"retromae": 2, "dupmae": 2, "seed": 4, "mlm": 1}[objective]
    lengths = set()
    for batch in _batches(20, pack=pack):
        assert ("doc_ids" in batch) == pack
        lengths.add(batch["input_ids"].shape[1])
        out = model(batch)
        out["loss"].backward()
    assert len(lengths) >= 3, lengths  # the steps did see several padded lengths
    # one graph per compiled module (SEED's layers share one code object: they may share it)
    assert 1 <= len(graphs) <= len(parts), len(graphs)
    assert model.state_dict().keys() == _model(objective).state_dict().keys()


def test_a_chunked_decoder_stays_eager_and_the_encoder_still_compiles():
    torch.manual_seed(0)
    encoder = build_encoder(EncoderConfig(name="tiny"), SPECIAL.vocab_size, SPECIAL.pad)
    model = PretrainModel(encoder, ObjectiveConfig(name="retromae", attention="auto"))
    assert model.compile_parts(backend="eager", device_type="cpu") == [encoder.base_model]
    assert len(model.compile_parts(backend="eager", device_type="cuda")) == 2 or not (
        torch.cuda.is_available()
    )


def test_a_graph_break_is_an_error_not_a_silent_split():
    """``fullgraph=True`` is what makes 'no graph break' checkable: a part that breaks fails."""
    model = _model("mlm")
    model.compile_parts(backend="eager")
    body = model.encoder.base_model
    original = type(body.embeddings).forward

    def breaking(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return original(self, *args, **kwargs)

    body.embeddings.forward = breaking.__get__(body.embeddings)
    with pytest.raises(Exception, match="(?i)graph break|graph_break"):
        model(next(_batches(1)))


@pytest.mark.parametrize("objective", ["retromae", "seed", "mlm"])
def test_compiled_training_losses_equal_eager(objective):
    eager = _model(objective)
    compiled = copy.deepcopy(eager)
    compiled.compile_parts(backend="aot_eager")
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        torch.manual_seed(1)  # the same dropout draws on both sides
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[name] = []
        for batch in _batches(10, seed=3):
            out = model(batch)
            out["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(float(out["loss"].detach()))
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-4)
    assert losses["eager"][-1] < losses["eager"][0]  # it trained


def test_pretrain_with_compile_trains_on_the_deepspeed_engine_as_eager_does(
    tmp_path, tokenizer_dir
):
    """``retromae-ds pretrain --compile true`` end to end (one process, DeepSpeed ZeRO-2 on
    CPU): the same logged losses as the eager run, within float tolerance."""
    from helpers_train import metrics, pretrain, synthetic_shards

    shards = synthetic_shards(tmp_path, tokenizer_dir, 80, seed=0)
    common = ["--max_steps", "4", "--log_every", "2", "--model.objective.name", "seed"]
    pretrain(tmp_path / "eager", shards, *common)
    pretrain(tmp_path / "compiled", shards, *common, "--compile", "true",
             "--compile_backend", "aot_eager")  # fmt: skip
    eager, compiled = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert [r["step"] for r in compiled] == [2, 4]
    for a, b in zip(eager, compiled, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
        assert b["decoder_loss"] == pytest.approx(a["decoder_loss"], rel=1e-4), (a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_retromae_compiles_with_inductor_and_flex_on_cuda():
    """On CUDA the decoder's attention is FlexAttention, which compiles with the layer:
    encoder and decoder as Inductor graphs, dynamic lengths, losses equal eager's."""
    torch.manual_seed(0)
    encoder = build_encoder(
        EncoderConfig(name="tiny", dropout=0.0), SPECIAL.vocab_size, SPECIAL.pad
    )
    eager = PretrainModel(encoder, ObjectiveConfig(name="retromae")).cuda()
    compiled = copy.deepcopy(eager)
    assert len(compiled.compile_parts(backend="inductor", device_type="cuda")) == 2
    for batch in _batches(4, seed=5):
        batch = {k: v.cuda() for k, v in batch.items()}
        a, b = eager(batch)["loss"], compiled(batch)["loss"]
        assert float(b) == pytest.approx(float(a), rel=1e-3)
