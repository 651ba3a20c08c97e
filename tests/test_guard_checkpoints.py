"""Checkpoints as sources (issue 27): nothing is ever exported into a run; every consumer of a
checkpoint (``eval``, ``finetune --model.init``, continued pre-training, ``export``) checks it
against its completion record; an export survives the run pruning its checkpoint mid-copy;
``eval`` records the length it used; a full disk during an export is one line and keeps the
previous export.

One real pre-training run (tiny encoder, 4 steps, checkpoints at steps 2 and 4) serves every
test; each test works on its own copy of it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_train import ENV, REPO, pretrain
from helpers_train import synthetic_shards as make_shards

from retromae_ds import export as export_mod
from retromae_ds.cli import main
from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import step_tag

from helpers_ance import write_synthetic_beir

STEP2, STEP4 = step_tag(2), step_tag(4)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_dir) -> Path:
    return make_shards(tmp_path_factory.mktemp("guard_shards"), tokenizer_dir, 300, seed=27)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shards) -> Path:
    """A real run folder: complete checkpoints at steps 2 and 4 (records with file lists)."""
    run = tmp_path_factory.mktemp("guard_run") / "run"
    pretrain(
        run, shards, "--max_steps", "4", "--log_every", "1",
        "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "0",
    )  # fmt: skip
    assert [p.name for p in ckpt.complete_checkpoints(run / "checkpoints")] == [STEP2, STEP4]
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """This test's own copy of the trained run."""
    return Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))


@pytest.fixture(scope="module")
def beir(tmp_path_factory) -> Path:
    folder = write_synthetic_beir(tmp_path_factory.mktemp("guard_beir") / "beir", 30, 8)
    shutil.copy(folder / "qrels" / "train.tsv", folder / "qrels" / "test.tsv")
    return folder


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


# --- defects 1 and 2: nothing inside a run is an export target --------------------------------


def test_export_never_writes_inside_a_run_or_a_checkpoint(run, tmp_path, capsys):
    """The reported cases: exporting another run into this run's newest checkpoint or its
    TensorBoard folder, ``--overwrite`` or not."""
    (run / "tensorboard").mkdir(exist_ok=True)
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"events")
    source = Path(shutil.copytree(run, tmp_path / "source"))
    partial = run / "checkpoints" / "step_00000006.partial"
    partial.mkdir()
    before = tree(run)
    step4 = run / "checkpoints" / STEP4
    targets = [
        step4 / "encoder",  # the newest checkpoint's own encoder
        step4 / "encoder" / "new",
        step4 / "exported",
        run / "tensorboard",  # the run's TensorBoard events
        run / "tensorboard" / "new",
        run / "exported",
        run / "checkpoints" / "exported",
        partial / "encoder",  # a checkpoint being written
    ]
    for out in targets:
        for overwrite in (["--overwrite"], []):
            assert main(["export", str(source), str(out), *overwrite]) == 2, out
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1, err
            assert err.startswith(f"retromae-ds export: error: {out}: ") and "inside" in err, err
    assert tree(run) == before
    ckpt.verify(step4)
    # a symlink into the run is no way round it
    link = tmp_path / "link"
    link.symlink_to(run / "tensorboard")
    assert main(["export", str(source), str(link / "x"), "--overwrite"]) == 2
    assert "inside" in capsys.readouterr().err
    assert main(["export", str(source), str(tmp_path / "fine")]) == 0  # outside: fine
    assert tree(run) == before


# --- defect 3: every consumer verifies the checkpoint it resolves -----------------------------


def test_resolve_verifies_falls_back_and_hashes_a_folder_once(run, monkeypatch, capsys):
    calls: list[str] = []
    real = ckpt.sha256_file

    def counting(path):
        calls.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(ckpt, "sha256_file", counting)
    step2, step4 = run / "checkpoints" / STEP2, run / "checkpoints" / STEP4
    assert ckpt.resolve_encoder(run) == step4 / "encoder"
    hashed = calls.count("model.safetensors")
    assert hashed == 1
    for named in (run, step4, step4 / "encoder", run / "checkpoints"):
        ckpt.resolve_encoder(named)
    assert calls.count("model.safetensors") == 1  # verified once per process
    flip_bit(step4 / "encoder" / "model.safetensors")
    # a changed file is hashed again: an explicit checkpoint is refused naming the file
    for named in (step4, step4 / "encoder"):
        with pytest.raises(
            ckpt.CheckpointCorrupt, match=r"step_00000004/encoder/model\.safetensors"
        ):
            ckpt.resolve_encoder(named)
    capsys.readouterr()
    assert ckpt.resolve_encoder(run) == step2 / "encoder"  # a run falls back, saying so
    err = capsys.readouterr().err
    assert STEP4 in err and "model.safetensors" in err and STEP2 in err, err
    assert ckpt.resolve_checkpoint(run) == step2
    # only the parts a consumer reads are checked: a damaged optimizer file is no reason
    # to refuse the encoder
    (run / "checkpoints" / STEP2 / "rank_00000.pt").write_bytes(b"damaged")
    assert ckpt.resolve_encoder(step2) == step2 / "encoder"
    flip_bit(step2 / "encoder" / "config.json")
    with pytest.raises(ckpt.CheckpointCorrupt, match=f"{run}: no complete checkpoint verifies"):
        ckpt.resolve_encoder(run)


def test_eval_verifies_the_checkpoint_it_scores(run, beir, tmp_path, capsys):
    step2, step4 = run / "checkpoints" / STEP2, run / "checkpoints" / STEP4
    common = ["--beir", str(beir), "--split", "test", "--progress", "false", "--device", "cpu"]
    assert main(["eval", "--model", str(step2), *common, "--out", str(tmp_path / "2.json")]) == 0
    flip_bit(step4 / "encoder" / "model.safetensors")
    capsys.readouterr()
    for named in (step4, step4 / "encoder"):
        assert main(["eval", "--model", str(named), *common]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert f"{step4 / 'encoder' / 'model.safetensors'}: sha256" in err, err
    assert main(["eval", "--model", str(run), *common, "--out", str(tmp_path / "run.json")]) == 0
    err = capsys.readouterr().err
    assert STEP4 in err and STEP2 in err and "model.safetensors" in err, err
    via_run = json.loads((tmp_path / "run.json").read_text())
    direct = json.loads((tmp_path / "2.json").read_text())
    assert via_run["encoder_dir"] == str(step2 / "encoder")
    assert via_run["metrics"] == direct["metrics"]


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, "--progress", "false", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_finetune_verifies_its_init_checkpoint(run, beir, tmp_path):
    step4 = run / "checkpoints" / STEP4
    flip_bit(step4 / "encoder" / "model.safetensors")
    common = [
        "--data.beir", str(beir), "--data.split", "train", "--data.q_max_len", "16",
        "--data.p_max_len", "32", "--micro_batch_size", "2", "--negatives.n_hard", "1",
        "--refresh.mining.num_negatives", "2", "--max_steps", "1", "--log_every", "1",
    ]  # fmt: skip
    bad = _cli("retromae_ds.finetune", "--run_dir", str(tmp_path / "ft_bad"),
               "--model.init", str(step4), *common)  # fmt: skip
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr and len(error_lines(bad.stderr)) == 1, bad.stderr
    assert f"{step4 / 'encoder' / 'model.safetensors'}: sha256" in bad.stderr, bad.stderr
    good = _cli("retromae_ds.finetune", "--run_dir", str(tmp_path / "ft"),
                "--model.init", str(run), *common)  # fmt: skip
    assert good.returncode == 0, good.stderr[-3000:]
    fallback = [line for line in good.stderr.splitlines() if "verifies" in line]
    assert fallback and STEP2 in fallback[-1], good.stderr[-3000:]
    assert (tmp_path / "ft" / "checkpoints" / step_tag(1) / "COMPLETE").is_file()


def test_continued_pretraining_verifies_its_start_checkpoint(run, shards, tmp_path):
    step4 = run / "checkpoints" / STEP4
    flip_bit(step4 / "encoder" / "model.safetensors")
    bad = pretrain(tmp_path / "bad", shards, "--max_steps", "1",
                   "--model.encoder.name", str(step4), check=False)  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert f"{step4 / 'encoder' / 'model.safetensors'}: sha256" in bad.stderr, bad.stderr[-2000:]
    assert len(error_lines(bad.stderr)) == 1, bad.stderr[-2000:]
    good = pretrain(tmp_path / "good", shards, "--max_steps", "1", "--checkpoint.every_steps",
                    "1", "--model.encoder.name", str(run))  # fmt: skip
    fallback = [line for line in good.stderr.splitlines() if "verifies" in line]
    assert len(fallback) == 1 and STEP2 in fallback[0], good.stderr[-3000:]  # said once


# --- defect 8: the run prunes the checkpoint while it is being exported -----------------------


def _prune_during_export(monkeypatch, run: Path) -> list[int]:
    """Make the run publish step 6 and prune (keep_last 1) right when the export starts
    reading its checkpoint: the deletion happens between resolving and copying, every time
    (no timing race)."""
    real = export_mod._write_export
    calls: list[int] = []

    def pruned_first(staging, source, resolved, *args, **kwargs):
        calls.append(ckpt.read_marker(resolved)["step"] if resolved.exists() else -1)
        root = run / "checkpoints"
        if len(calls) == 1:
            newest = ckpt.latest_complete(root)
            step6 = root / step_tag(6)
            shutil.copytree(newest, step6)
            marker = {**ckpt.read_marker(step6), "step": 6}
            (step6 / "COMPLETE").write_text(json.dumps(marker))
            ckpt.prune(root, 1)  # what the run's keep_last does after its next save
        return real(staging, source, resolved, *args, **kwargs)

    monkeypatch.setattr(export_mod, "_write_export", pruned_first)
    return calls


def test_export_retries_on_the_newest_when_the_run_prunes_its_checkpoint(
    run, tmp_path, monkeypatch, capsys
):
    calls = _prune_during_export(monkeypatch, run)
    out = export_mod.export_encoder(run, tmp_path / "out")
    assert calls == [4, 6]
    assert json.loads((out / "export.json").read_text())["step"] == 6
    err = capsys.readouterr().err
    assert STEP4 in err and "removed" in err and step_tag(6) in err, err
    from transformers import AutoModel

    AutoModel.from_pretrained(out)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_export_of_a_pruned_named_checkpoint_says_so(run, tmp_path, monkeypatch, capsys):
    _prune_during_export(monkeypatch, run)
    step4 = run / "checkpoints" / STEP4
    assert main(["export", str(step4), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"retromae-ds export: error: {step4}: ") and "removed" in err, err
    assert "retry" in err and "Repo id" not in err and "tokenizer" not in err, err
    assert not (tmp_path / "out").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


# --- defect 13: eval records the length it used -----------------------------------------------


def test_eval_records_the_capped_max_length(run, beir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    args = [
        "eval",
        "--model",
        str(run),
        "--beir",
        str(beir),
        "--progress",
        "false",
        "--device",
        "cpu",
    ]
    assert main([*args, "--max_length", "2048", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    capped = [line for line in err.splitlines() if "capped" in line]
    assert len(capped) == 1 and "64" in capped[0], err  # the tiny run has 64 positions
    settings = json.loads(out.read_text())["settings"]
    assert settings["max_length"] == 64 and settings["max_length_requested"] == 2048
    assert main([*args, "--max_length", "32", "--out", str(out)]) == 0
    assert "capped" not in capsys.readouterr().err
    assert json.loads(out.read_text())["settings"]["max_length"] == 32


# --- a full disk during an export --------------------------------------------------------------


def test_a_full_disk_during_export_is_one_line_and_keeps_the_previous_export(run, capsys):
    from helpers_disk import fill, free_bytes, small_disk
    from transformers import AutoModel

    step2, step4 = run / "checkpoints" / STEP2, run / "checkpoints" / STEP4
    with small_disk("16m") as disk:
        out = disk / "exported"
        assert main(["export", str(step2), str(out)]) == 0
        before = tree(out)
        ballast = fill(disk, leave=256 * 1024)
        capsys.readouterr()
        assert main(["export", str(step4), str(out)]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"retromae-ds export: error: {out}: no space left on device"), err
        assert "needs about" in err and "MB free" in err, err
        assert sorted(p.name for p in disk.iterdir()) == ["BALLAST", "exported"]  # no staging
        assert tree(out) == before
        assert json.loads((out / "export.json").read_text())["step"] == 2
        AutoModel.from_pretrained(out)
        ballast.unlink()
        assert free_bytes(disk) > 4 * 2**20
        assert main(["export", str(step4), str(out)]) == 0
        assert json.loads((out / "export.json").read_text())["step"] == 4
        AutoModel.from_pretrained(out)
