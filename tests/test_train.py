"""Pre-training for real: DeepSpeed engines on CPU (gloo), one process and two ranks under
torchrun; the loss falls; exact resume; a crash while saving; export round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_train import ENV, REPO, TINY, free_port, launch_cmd, metrics, pretrain, run_logged
from helpers_train import synthetic_shards as make_shards

from retromae_ds.base import faults
from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import step_tag
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess

from synthetic import synthetic_texts


@pytest.fixture(scope="module")
def synthetic_shards(tmp_path_factory, tokenizer_dir) -> Path:
    return make_shards(tmp_path_factory.mktemp("synthetic_shards"), tokenizer_dir, 600, seed=21)


@pytest.fixture(scope="module")
def wiki_shards(tmp_path_factory) -> Path:
    from helpers_data import SHARED_DATA

    wiki = SHARED_DATA / "wikitext2" / "wiki.test.raw"
    if not wiki.is_file():
        pytest.skip(f"{wiki} is absent (real WikiText-2 data)")
    root = tmp_path_factory.mktemp("wiki")
    run_preprocess(
        PreprocessConfig(
            inputs=[str(wiki)],
            out=str(root / "shards"),
            train_tokenizer=2000,
            max_length=64,
            workers=2,
            progress=False,
        )
    )
    return root / "shards"


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_rank_loss_falls_on_wikitext(tmp_path, wiki_shards, zero):
    run = tmp_path / zero
    pretrain(
        run,
        wiki_shards,
        "--max_steps",
        "40",
        "--log_every",
        "5",
        "--deepspeed.config",
        f'["ds_configs/{zero}.json", "ds_configs/fp32.json"]',
        ranks=2,
    )
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(5, 41, 5))
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, rows
    assert (
        rows[-1]["decoder_loss"] < rows[0]["decoder_loss"]
        and rows[-1]["mlm_loss"] < rows[0]["mlm_loss"]
    )
    final = ckpt.latest_complete(run / "checkpoints")
    assert final is not None and ckpt.read_marker(final) | {"files": None} == {
        "files": None,
        "step": 40,
        "world_size": 2,
        "objective": "retromae",
    }
    assert {p.name for p in final.glob("rank_*.pt")} == {"rank_00000.pt", "rank_00001.pt"}
    assert list((run / "tensorboard").glob("events.out.tfevents.*")), "TensorBoard log missing"
    resolved = json.loads((run / "ds_config.json").read_text())
    assert resolved["train_batch_size"] == 16 and resolved["zero_optimization"]["stage"] == int(
        zero[-1]
    )


@pytest.mark.slow
@pytest.mark.parametrize("grouping,packing", [(0, "false"), (2, "false"), (0, "true")])
def test_exact_resume_two_ranks(tmp_path, synthetic_shards, grouping, packing):
    common = [
        "--max_steps",
        "10",
        "--log_every",
        "1",
        "--deepspeed.config",
        '["ds_configs/zero2.json", "ds_configs/fp32.json"]',
        "--data.length_grouping",
        str(grouping),
        "--data.packing",
        packing,
    ]
    pretrain(tmp_path / "straight", synthetic_shards, *common, ranks=2)
    pretrain(tmp_path / "resumed", synthetic_shards, *common, "--stop_at_step", "4", ranks=2)
    first = metrics(tmp_path / "resumed")
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert ckpt.read_marker(ckpt.latest_complete(tmp_path / "resumed" / "checkpoints"))["step"] == 4
    pretrain(tmp_path / "resumed", synthetic_shards, *common, ranks=2)
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 11))
    keys = ("loss", "mlm_loss", "decoder_loss", "mlm_accuracy", "lr")
    for a, b in zip(straight, resumed, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (a, b)


@pytest.mark.slow
def test_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path, synthetic_shards):
    run = tmp_path / "run"
    common = [
        "--max_steps",
        "6",
        "--log_every",
        "1",
        "--checkpoint.every_steps",
        "2",
        "--checkpoint.keep_last",
        "2",
    ]
    result = pretrain(
        run, synthetic_shards, *common, env=faults.env(crash_in_save_at_step=4), check=False
    )
    assert result.returncode == 17, result.stderr[-3000:]
    root = run / "checkpoints"
    assert (root / "step_00000004.partial").is_dir() and not (root / "step_00000004").exists()
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002"]
    assert ckpt.resolve_resume("auto", run).name == "step_00000002"
    pretrain(run, synthetic_shards, *common)  # --checkpoint.resume auto (the default)
    rows = metrics(run)
    # steps 1-4 before the crash (4 was logged, then its save died); resuming from step 2
    # moves rows 3-4 aside and logs them again: the replayed steps reproduce the lost ones
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    lost = [json.loads(x) for x in (run / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lost] == [3, 4]
    assert [r["loss"] for r in lost] == [rows[2]["loss"], rows[3]["loss"]]
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000004", "step_00000006"]
    assert not list(root.glob("*.partial"))
    # a straight run agrees with the one that crashed and resumed from step 2
    pretrain(tmp_path / "straight", synthetic_shards, *common)
    assert metrics(tmp_path / "straight")[-1]["loss"] == rows[-1]["loss"]


@pytest.mark.slow
def test_export_round_trip_matches_training_time_embeddings(tmp_path, synthetic_shards):
    from transformers import AutoModel

    from retromae_ds.base.special_tokens import SpecialIds
    from retromae_ds.data.collate import IndexedSamples, MaskingConfig, PretrainCollator
    from retromae_ds.data.dataset import ShardDataset
    from retromae_ds.export import export_encoder
    from retromae_ds.modeling.encoder import EncoderConfig, build_encoder
    from retromae_ds.modeling.objectives import ObjectiveConfig, PretrainModel

    run = tmp_path / "run"
    pretrain(run, synthetic_shards, "--max_steps", "3")
    out = export_encoder(run, tmp_path / "exported")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    ds = ShardDataset(synthetic_shards)
    special = SpecialIds.from_fingerprint(ds.manifest["tokenizer"])
    batch = PretrainCollator(special, MaskingConfig(encoder_ratio=0.0), 64)(
        [IndexedSamples(ds)[i] for i in range(6)]
    )
    # the training-time sentence embedding, from the DeepSpeed module state of the checkpoint
    final = ckpt.latest_complete(run / "checkpoints")
    state = torch.load(final / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    model = PretrainModel(
        build_encoder(
            EncoderConfig(name="tiny", max_position_embeddings=64), special.vocab_size, special.pad
        ),
        ObjectiveConfig(),
    )
    model.load_state_dict(state)
    model.eval()
    exported = AutoModel.from_pretrained(str(out), local_files_only=True).eval()
    with torch.no_grad():
        expected = model.sentence_embedding(batch["input_ids"], batch["attention_mask"])
        got = exported(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, torch.zeros_like(expected))

    # sentence-transformers loads the folder with CLS pooling and agrees with AutoModel
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    texts = ["retrieval encoder checkpoint", "masked auto encoder decoder sentence embedding"]
    st = SentenceTransformer(str(out), device="cpu")
    tok = AutoTokenizer.from_pretrained(str(out))
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        cls = exported(**enc).last_hidden_state[:, 0]
    torch.testing.assert_close(st.encode(texts, convert_to_tensor=True), cls, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_deepspeed_launcher_and_torchrun_agree(tmp_path, synthetic_shards):
    common = ["--max_steps", "3", "--log_every", "1"]
    pretrain(tmp_path / "torchrun", synthetic_shards, *common, ranks=2)
    pretrain(tmp_path / "deepspeed", synthetic_shards, *common, ranks=2, launcher="deepspeed")
    a, b = metrics(tmp_path / "torchrun"), metrics(tmp_path / "deepspeed")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 3
    final = ckpt.latest_complete(tmp_path / "deepspeed" / "checkpoints")
    assert ckpt.read_marker(final)["world_size"] == 2


def test_the_old_spellings_train_exactly_as_the_new(tmp_path, synthetic_shards):
    """Issue 47: ``python -m retromae_ds.pretrain`` with the spellings before the one spelling
    (kebab-case, ``--no-progress``, ``--resume``) runs the same training as the new spelling,
    loss for loss, and says each old name once."""
    new = ["--max_steps", "2", "--log_every", "1", "--checkpoint.resume", "none"]
    pretrain(tmp_path / "new", synthetic_shards, *new)
    old = [
        "--data.shards", str(synthetic_shards), "--run-dir", str(tmp_path / "old"),
        "--no-progress", "--model.encoder.name", "tiny",
        "--model.encoder.max-position-embeddings", "64", "--micro-batch-size", "8",
        "--optim.lr", "1e-3", "--optim.warmup-steps", "2", "--max-steps", "2",
        "--log-every", "1", "--resume", "none",
    ]  # fmt: skip
    result = run_logged(launch_cmd("retromae_ds.pretrain", old), tmp_path / "old.log", env=ENV,
                        timeout=600)  # fmt: skip
    a, b = metrics(tmp_path / "new"), metrics(tmp_path / "old")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 2
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert "note: --run-dir is now --run_dir (the old name still works)" in notes
    assert "note: --resume is now --checkpoint.resume (the old name still works)" in notes
    assert len(notes) == len(set(notes)) == 8, notes  # one per old name


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_losses(tmp_path, synthetic_shards):
    common = ["--max_steps", "3", "--log_every", "1"]
    pretrain(tmp_path / "plain", synthetic_shards, *common)
    pretrain(
        tmp_path / "ckpt",
        synthetic_shards,
        *common,
        "--model.encoder.gradient_checkpointing",
        "true",
    )
    plain, recomputed = metrics(tmp_path / "plain"), metrics(tmp_path / "ckpt")
    for a, b in zip(plain, recomputed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model"]["encoder"]["gradient_checkpointing"] is True


@pytest.mark.slow
def test_packed_batches_train_as_the_padded_ones(tmp_path, synthetic_shards):
    """``--data.packing``: without dropout the same losses step by step (to float rounding
    that compounds over steps), on fewer padded positions."""
    common = ["--max_steps", "5", "--log_every", "1", "--model.encoder.dropout", "0"]
    pretrain(tmp_path / "padded", synthetic_shards, *common)
    pretrain(tmp_path / "packed", synthetic_shards, *common, "--data.packing", "true")
    padded, packed = metrics(tmp_path / "padded"), metrics(tmp_path / "packed")
    for a, b in zip(padded, packed, strict=True):
        for key in ("loss", "mlm_loss", "decoder_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (key, a, b)
        assert b["tokens_seen"] == a["tokens_seen"] and b["slots_seen"] < a["slots_seen"]
        assert b["pad_fraction"] < a["pad_fraction"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("zero", "precision"), [("zero0", "fp32"), ("zero1", "bf16"), ("zero3_offload", "fp32")]
)
def test_other_stages_and_bf16_run_on_cpu(tmp_path, synthetic_shards, zero, precision):
    run = tmp_path / f"{zero}-{precision}"
    pretrain(
        run,
        synthetic_shards,
        "--max_steps",
        "4",
        "--log_every",
        "1",
        "--deepspeed.config",
        f'["ds_configs/{zero}.json", "ds_configs/{precision}.json"]',
    )
    rows = metrics(run)
    assert len(rows) == 4 and all(r["loss"] == r["loss"] and r["loss"] < 100 for r in rows)
    resolved = json.loads((run / "ds_config.json").read_text())
    assert resolved["zero_optimization"]["stage"] == int(zero[4])
    assert resolved["bf16"]["enabled"] is (precision == "bf16")
    assert ckpt.read_marker(ckpt.latest_complete(run / "checkpoints"))["step"] == 4


@pytest.mark.slow
def test_two_rank_seed_encoder_loss_falls_on_wikitext(tmp_path, wiki_shards):
    run = tmp_path / "seed"
    pretrain(
        run,
        wiki_shards,
        "--max_steps",
        "40",
        "--log_every",
        "5",
        "--model.objective.name",
        "seed",
        ranks=2,
    )
    rows = metrics(run)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, rows
    assert rows[-1]["decoder_loss"] < rows[0]["decoder_loss"]
    assert ckpt.read_marker(ckpt.latest_complete(run / "checkpoints"))["objective"] == "seed"
    config = json.loads((run / "config.json").read_text())
    assert (
        config["model"]["objective"]["decoder_layers"] == 3
        and config["model"]["objective"]["window"] == 2
    )


@pytest.mark.slow
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, synthetic_shards):
    """Two ranks started the way srun starts them (RANK / WORLD_SIZE in the environment); a
    SIGUSR1 reaches rank 1 only. Both ranks stop after the same step, the checkpoint of that
    step is complete (its save needs both ranks), and both exit with EXIT_REQUEUE."""
    import signal
    import time

    from retromae_ds.components.signals import EXIT_REQUEUE

    run = tmp_path / "run"
    args = [
        sys.executable, "-m", "retromae_ds.pretrain", "--data.shards", str(synthetic_shards),
        "--run_dir", str(run), *TINY, "--micro_batch_size", "8", "--max_steps", "30",
        "--log_every", "1", "--deepspeed.timeout_s", "60",
    ]  # fmt: skip
    common = {
        **ENV,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        **faults.env(sleep_after_step_s=0.3),  # time to signal mid-run
    }
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in (0, 1)]  # noqa: SIM115
    ranks = [
        subprocess.Popen(
            args,
            cwd=REPO,
            env={**common, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() or len(metrics(run)) < 2:
            assert time.monotonic() < deadline and ranks[0].poll() is None, "no step 2"
            time.sleep(0.1)
        ranks[1].send_signal(signal.SIGUSR1)
        codes = [p.wait(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    rank0 = (tmp_path / "rank0.log").read_text()
    assert codes == [EXIT_REQUEUE, EXIT_REQUEUE], rank0[-3000:]
    step = metrics(run)[-1]["step"]
    assert 2 <= step < 30
    assert f"stop signal: checkpoint of step {step} complete" in rank0
    last = ckpt.latest_complete(run / "checkpoints")
    assert ckpt.read_marker(last) | {"files": None} == {
        "step": step,
        "world_size": 2,
        "objective": "retromae",
        "files": None,
    }
    for r in (0, 1):  # each rank's sampler stopped after the same number of samples
        state = ckpt.read_rank_state(last, r)["sampler"]
        assert state == {**state, "consumed": step * 8}, state


def test_stop_signals_are_validated(synthetic_shards):
    from retromae_ds.base.options import build_config
    from retromae_ds.components.signals import signal_number
    from retromae_ds.pretrain import PretrainConfig

    assert signal_number("USR1") == signal_number("SIGUSR1")
    base = ["--data.shards", str(synthetic_shards), "--max_steps", "1"]
    cfg = build_config(PretrainConfig, None, [*base, "--stop_signals", "SIGUSR2,TERM"])
    assert cfg.stop_signals == ["SIGUSR2", "TERM"]
    assert build_config(PretrainConfig, None, [*base, "--stop_signals", ""]).stop_signals == []
    for bad in ("SIGKILL", "SIGNOPE"):
        with pytest.raises(ValueError, match="stop_signals"):
            build_config(PretrainConfig, None, [*base, "--stop_signals", bad])


def test_after_a_stop_further_stop_signals_are_ignored():
    """When the first rank exits with 85, srun (--kill-on-bad-exit) and the deepspeed launcher
    send SIGTERM to the others: a process that stopped must not die of it (143) on its way out;
    a process that did not stop gets its previous handlers back."""
    import signal

    from retromae_ds.components.signals import StopRequested, StopSignals

    previous = signal.getsignal(signal.SIGUSR2)
    try:
        with StopSignals(["SIGUSR2"]) as stop:
            signal.raise_signal(signal.SIGUSR2)
            assert stop.received == "SIGUSR2"
        assert signal.getsignal(signal.SIGUSR2) is previous
        with pytest.raises(StopRequested), StopSignals(["SIGUSR2"]):
            raise StopRequested(3)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        signal.raise_signal(signal.SIGUSR2)  # ignored: the test process lives on
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_encoder_frozen_steps_train_only_the_heads_first(tmp_path, synthetic_shards):
    """Heads-only warm-up on the real engine (ZeRO-2): the encoder body stays bit-identical
    for the first N steps while the MLM head and the decoder move; then the body trains too."""
    run = tmp_path / "run"
    pretrain(
        run, synthetic_shards, "--max_steps", "4", "--optim.encoder_frozen_steps", "2",
        "--checkpoint.every_steps", "1", "--checkpoint.keep_last", "10",
        "--deepspeed.config", '["ds_configs/zero2.json", "ds_configs/fp32.json"]',
    )  # fmt: skip

    def state(step: int) -> dict[str, torch.Tensor]:
        path = run / "checkpoints" / step_tag(step) / "mp_rank_00_model_states.pt"
        return torch.load(path, weights_only=False)["module"]

    s1, s2, s3 = state(1), state(2), state(3)
    body = [k for k in s1 if k.startswith("encoder.bert.")]
    heads = [k for k in s1 if k.startswith(("decoder.", "encoder.cls.predictions.transform"))]
    assert body and heads
    assert all(torch.equal(s1[k], s2[k]) for k in body)
    assert any(not torch.equal(s1[k], s2[k]) for k in heads)
    assert any(not torch.equal(s2[k], s3[k]) for k in body)
    with pytest.raises(ValueError, match="encoder_frozen_steps"):
        from retromae_ds.components.optim import build_scheduler
        from retromae_ds.training.config import OptimConfig

        opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(1))], "body": True}])
        build_scheduler(opt, OptimConfig(encoder_frozen_steps=4), 4)


def test_decoder_lr_scale_moves_only_the_decoder_faster(tmp_path, synthetic_shards):
    """``optim.decoder_lr_scale`` on the real engine (ZeRO-2): after one step from the same
    seed (a run at lr 0 gives the initial weights), the encoder (body and MLM head) moved
    bit-identically with and without the scale, and every decoder tensor moved ``scale``× as
    far (Adam's first update depends on the gradient only, times the group's lr); the
    checkpointed optimizer holds the decoder's groups at lr × scale. A model without a decoder
    (MLM) refuses the setting. Without clipping: DeepSpeed 0.19.8 sums the global gradient
    norm group by group, so the scale's extra groups change the clip factor's last bit and
    every encoder tensor by an ulp (seen: up to 7e-9 on updates of 1e-3)."""
    states = {}
    for name, lr, scale in (("init", "0", "1"), ("one", "1e-3", "1"), ("ten", "1e-3", "10")):
        run = tmp_path / name
        pretrain(
            run, synthetic_shards, "--max_steps", "1", "--optim.lr", lr,
            "--optim.decoder_lr_scale", scale, "--optim.grad_clip", "0",
            "--deepspeed.config", '["ds_configs/zero2.json", "ds_configs/fp32.json"]',
        )  # fmt: skip
        final = ckpt.latest_complete(run / "checkpoints")
        states[name] = torch.load(final / "mp_rank_00_model_states.pt", weights_only=False)
    init, one, ten = (states[k]["module"] for k in ("init", "one", "ten"))
    decoder = [k for k in one if k.startswith("decoder.")]
    encoder = [k for k in one if k.startswith("encoder.")]
    assert decoder and encoder
    assert all(torch.equal(one[k], ten[k]) for k in encoder)
    assert any(not torch.equal(init[k], one[k]) for k in encoder)
    for k in decoder:
        torch.testing.assert_close(ten[k] - init[k], 10 * (one[k] - init[k]), rtol=1e-3, atol=2e-7)
    assert all(not torch.equal(init[k], one[k]) for k in decoder if k.endswith("weight"))

    (optim_file,) = ckpt.latest_complete(tmp_path / "ten" / "checkpoints").glob("*optim_states.pt")
    state = torch.load(optim_file, weights_only=False)["optimizer_state_dict"]
    lrs = {g["lr"] for g in state["base_optimizer_state"]["param_groups"]}
    assert len(lrs) == 2 and max(lrs) == pytest.approx(10 * min(lrs))

    failed = pretrain(
        tmp_path / "mlm", synthetic_shards, "--max_steps", "1",
        "--model.objective.name", "mlm", "--optim.decoder_lr_scale", "10", check=False,
    )  # fmt: skip
    assert failed.returncode != 0 and "decoder_lr_scale" in failed.stderr


# --- reliability: checkpoints are verified and never lose to a bad one ---------------------------


@pytest.mark.slow
def test_corrupt_checkpoint_file_falls_back_to_the_previous_verified_one(
    tmp_path, synthetic_shards
):
    """Fault injection: one flipped byte in a random file of the newest checkpoint. `--checkpoint.resume
    auto` says so, falls back to the previous checkpoint that verifies, and the losses after
    it equal an uninterrupted run's; the new checkpoint of that step replaces the bad one."""
    import random

    common = ["--max_steps", "8", "--log_every", "1", "--checkpoint.every_steps", "2",
              "--checkpoint.keep_last", "0"]  # fmt: skip
    pretrain(tmp_path / "whole", synthetic_shards, *common)
    whole = metrics(tmp_path / "whole")
    run = tmp_path / "run"
    pretrain(run, synthetic_shards, *common, "--stop_at_step", "6")
    step6 = run / "checkpoints" / step_tag(6)
    files = sorted(ckpt.read_marker(step6)["files"])
    victim = step6 / random.Random(len(files)).choice(files)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointCorrupt, match=victim.name):
        ckpt.verify(step6)
    result = pretrain(run, synthetic_shards, *common)
    assert "falling back to step_00000004" in result.stderr and victim.name in result.stderr
    # rows 1-4 of the first run, then 5-8 after the fallback (its rows 5-6 moved aside)
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))
    resumed = metrics(run)[4:]
    for a, b in zip(whole[4:], resumed, strict=True):
        assert (a["step"], a["loss"], a["decoder_loss"]) == (
            b["step"],
            b["loss"],
            b["decoder_loss"],
        )
    ckpt.verify(step6)  # replaced by the new, complete one
    # naming the corrupt checkpoint explicitly is a one-line error naming the file
    data = bytearray(victim.read_bytes())
    victim.write_bytes(bytes(data[: len(data) // 2]))
    bad = pretrain(run, synthetic_shards, *common, "--checkpoint.resume", str(step6), check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"{victim}: " in bad.stderr and "bytes" in bad.stderr
    # export checks the encoder's files against the record too
    from retromae_ds.export import export_encoder

    weights = step6 / "encoder" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointCorrupt, match="model.safetensors"):
        export_encoder(step6, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


@pytest.mark.slow
def test_a_step_folder_without_its_record_loses_to_the_new_checkpoint(
    tmp_path, synthetic_shards, capfd
):
    """The newest checkpoint lost its COMPLETE record: the rerun resumes from the one before,
    and its new checkpoint of that step is kept (it used to be thrown away, so every rerun
    repeated the same steps)."""
    run = tmp_path / "run"
    common = ["--max_steps", "4", "--log_every", "1", "--checkpoint.every_steps", "2"]
    pretrain(run, synthetic_shards, *common)
    step4 = run / "checkpoints" / step_tag(4)
    (step4 / ckpt.COMPLETE).unlink()
    from retromae_ds.export import export_encoder

    export_encoder(run, tmp_path / "exported")  # step 2, and it says why not step 4
    assert "using step_00000002; newer step_00000004 not complete" in capfd.readouterr().err
    again = pretrain(run, synthetic_shards, *common)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]  # 3-4 again, never twice
    assert "2 row(s) logged after step 2" in again.stderr
    assert ckpt.read_marker(step4)["step"] == 4
    ckpt.verify(step4)


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_without_saving(tmp_path, synthetic_shards):
    run = tmp_path / "run"
    result = pretrain(
        run, synthetic_shards, "--max_steps", "6", "--log_every", "1",
        "--checkpoint.every_steps", "1", "--optim.lr", "1e30", "--optim.warmup_steps", "1",
        check=False,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = [x for x in result.stderr.splitlines() if "error:" in x][-1]
    assert "non-finite loss at step" in line
    bad_step = int(line.split("non-finite loss at step ")[1].split()[0])
    steps = [int(p.name[5:]) for p in ckpt.complete_checkpoints(run / "checkpoints")]
    assert steps and max(steps) == bad_step - 1  # nothing saved from the non-finite state
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < float("inf") for r in metrics(run))


def test_config_errors_are_one_line(tmp_path, synthetic_shards):
    cmd = [sys.executable, "-m", "retromae_ds.pretrain", "--data.shards", str(synthetic_shards),
           "--run_dir", str(tmp_path / "r"), "--max_steps", "2", "--optim.lrr", "1"]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "retromae-ds pretrain: error: unknown config field(s): optim.lrr"
    ]
    debug = subprocess.run(cmd, cwd=REPO, env={**ENV, "RETROMAE_DS_DEBUG": "1"},
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.mark.slow
def test_resume_refuses_settings_that_change_its_meaning(tmp_path, synthetic_shards):
    run = tmp_path / "run"
    pretrain(run, synthetic_shards, "--max_steps", "2", "--log_every", "1")
    saved = (run / "config.json").read_text()
    for override, field in (
        (["--micro_batch_size", "4"], "micro_batch_size (8 -> 4)"),
        (["--model.objective.name", "mlm"], "model.objective.name ('retromae' -> 'mlm')"),
    ):
        bad = pretrain(run, synthetic_shards, "--max_steps", "4", *override, check=False)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
        assert field in bad.stderr and "config.json" in bad.stderr
        assert (run / "config.json").read_text() == saved  # the run's config is kept
    # how long it runs may change
    pretrain(run, synthetic_shards, "--max_steps", "3", "--log_every", "1")
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def test_a_model_folder_with_another_vocabulary_is_refused(tmp_path, synthetic_shards):
    """Shards made with one tokenizer never train a model folder made for another: its
    tokenizer's fingerprint, or without one its vocabulary size, must be the shards'."""
    from transformers import BertConfig, BertForMaskedLM

    from retromae_ds.data.tokenizer import train_wordpiece

    other = train_wordpiece(synthetic_texts(300, seed=7), 300, tmp_path / "other_tok")
    config = BertConfig(vocab_size=len(other), hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)  # fmt: skip
    with_tok, without_tok = tmp_path / "with_tok", tmp_path / "without_tok"
    for folder in (with_tok, without_tok):
        BertForMaskedLM(config).save_pretrained(folder)
    other.save_pretrained(with_tok)
    for folder, words in ((with_tok, "different tokenizers"), (without_tok, "no tokenizer")):
        result = pretrain(tmp_path / f"run_{folder.name}", synthetic_shards, "--max_steps", "1",
                          "--model.encoder.name", str(folder), check=False)  # fmt: skip
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert words in result.stderr and str(folder) in result.stderr
        assert str(synthetic_shards) in result.stderr
        assert not (tmp_path / f"run_{folder.name}" / "checkpoints").exists()


@pytest.mark.slow
def test_one_writer_per_run_folder(tmp_path, synthetic_shards):
    """A second run into a folder that a live run writes to fails at once naming the holder;
    the first finishes untouched. A lock left by a killed run is taken over."""
    import time

    run = tmp_path / "run"
    args = ["--data.shards", str(synthetic_shards), "--run_dir", str(run), "--progress", "false",
            "--model.encoder.name", "tiny", "--model.encoder.max_position_embeddings", "64",
            "--micro_batch_size", "8", "--optim.lr", "1e-3", "--optim.warmup_steps", "2",
            "--log_every", "1", "--max_steps", "6"]  # fmt: skip
    first = subprocess.Popen(
        [sys.executable, "-m", "retromae_ds.pretrain", *args],
        cwd=REPO,
        env={**ENV, **faults.env(sleep_after_step_s=1.0)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)  # the first run is training (it holds the lock before writing)
        second = pretrain(run, synthetic_shards, "--max_steps", "6", "--log_every", "1",
                          check=False)  # fmt: skip
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
        assert "another run is writing into this folder" in second.stderr
        assert f"pid {first.pid}" in second.stderr
        assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]  # one writer's rows only
    # a killed run's lock names a dead holder: the next run takes over and says so
    (run / ".lock").write_text(json.dumps({"pid": 999999, "host": "gone", "since": 0}))
    again = pretrain(run, synthetic_shards, "--max_steps", "7", "--log_every", "1")
    assert "taking over from pid 999999 on gone" in again.stderr


def test_continued_pretraining_from_a_run_keeps_the_mlm_head(tmp_path, synthetic_shards):
    """``--model.encoder.name RUN_DIR`` starts from the run's newest checkpoint with its MLM
    head (nothing newly initialised); an exported encoder is the body only, and says so."""
    from safetensors.torch import load_file

    from retromae_ds.export import export_encoder

    base = tmp_path / "base"
    pretrain(base, synthetic_shards, "--max_steps", "2", "--model.objective.name", "mlm")
    head = {
        k: v
        for k, v in load_file(
            str(base / "checkpoints" / "step_00000002" / "encoder" / "model.safetensors")
        ).items()
        if k.startswith("cls.")
    }
    assert head  # the checkpoint's encoder is the whole masked-LM model
    more = tmp_path / "more"
    result = pretrain(
        more, synthetic_shards, "--max_steps", "1", "--model.encoder.name", str(base),
        "--optim.lr", "0",
    )  # fmt: skip
    assert "newly initialised" not in result.stderr
    after = load_file(str(more / "checkpoints" / "step_00000001" / "encoder" / "model.safetensors"))
    for name, value in head.items():  # lr 0: the head came through unchanged
        assert torch.equal(after[name], value), name
    exported = export_encoder(base, tmp_path / "exported")
    from_export = pretrain(
        tmp_path / "from_export", synthetic_shards, "--max_steps", "1",
        "--model.encoder.name", str(exported),
    )  # fmt: skip
    assert "newly initialised" in from_export.stderr
