"""The preprocessing tool end to end on real files: formats, chunking, determinism across
worker counts and tasks, resume after a kill, and every bad-input case."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from retromae_ds.base import faults
from retromae_ds.data.dataset import ShardDataset
from retromae_ds.data.preprocess import PreprocessConfig, run_preprocess
from retromae_ds.data.sources import InputError, SourceOptions

from synthetic import synthetic_texts

REPO = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, texts: list[str], with_title: bool = False) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            record = {"_id": f"doc{i}", "text": text}
            if with_title:
                record["title"] = f"title {i}"
            f.write(json.dumps(record) + "\n")
    return path


def preprocess(inputs, out, tokenizer_dir, **kw) -> dict:
    source = kw.pop("source", SourceOptions())
    cfg = PreprocessConfig(
        inputs=[str(p) for p in inputs],
        out=str(out),
        tokenizer=str(tokenizer_dir),
        progress=False,
        source=source,
        **kw,
    )
    return run_preprocess(cfg)


def output_files(out: Path) -> dict[str, bytes]:
    """Every file that makes up the dataset (shards, completion records, manifest, rejects)."""
    files = {p.relative_to(out).as_posix(): p.read_bytes() for p in (out / "shards").iterdir()}
    for name in ("manifest.json", "rejects.jsonl", "plan.json"):
        if (out / name).exists():
            files[name] = (out / name).read_bytes()
    return files


def rows_by_document(out: Path) -> dict[str, list[tuple[int, list[int], list[int]]]]:
    ds = ShardDataset(out)
    rows: dict[str, list] = {}
    for i in range(len(ds)):
        ((doc_id, chunk),) = ds.source(i)
        sample = ds[i]
        rows.setdefault(doc_id, []).append(
            (chunk, sample.input_ids.tolist(), sample.word_starts.tolist())
        )
    return rows


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "retromae_ds.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        timeout=300,
    )


# ---------------------------------------------------------------------- chunking and schema
def test_chunks_concatenate_to_the_full_tokenization(tmp_path, tokenizer_dir, tokenizer):
    texts = synthetic_texts(120, seed=5, max_words=80)
    src = write_jsonl(tmp_path / "docs.jsonl", texts)
    manifest = preprocess([src], tmp_path / "out", tokenizer_dir, max_length=24, shard_size=2000)
    limit = manifest["max_tokens_per_row"]
    assert limit == 22  # [CLS] ... [SEP]
    rows = rows_by_document(tmp_path / "out")
    for i, text in enumerate(texts):
        enc = tokenizer(text, add_special_tokens=False)
        chunks = sorted(rows.get(f"doc{i}", []))
        assert [c for c, _, _ in chunks] == list(range(len(chunks)))
        assert all(0 < len(ids) <= limit for _, ids, _ in chunks)
        assert [t for _, ids, _ in chunks for t in ids] == enc["input_ids"]
        words = enc.word_ids()
        flags = [1 if j == 0 or w != words[j - 1] else 0 for j, w in enumerate(words)]
        assert [f for _, _, ws in chunks for f in ws] == flags
    counts = manifest["counts"]
    assert counts["documents"] == len(texts)
    assert counts["empty_documents"] == sum(1 for t in texts if not t.strip()) > 0
    assert (
        counts["rows"]
        == sum(len(v) for v in rows.values())
        > len(texts) - counts["empty_documents"]
    )
    assert len(manifest["shards"]) > 1


def test_manifest_describes_shards_and_tokenizer(tmp_path, tokenizer_dir, tokenizer):
    from retromae_ds.data.preprocess import sha256_file
    from retromae_ds.data.tokenizer import fingerprint

    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(60))
    manifest = preprocess([src], tmp_path / "out", tokenizer_dir, max_length=32, shard_size=1500)
    assert manifest == json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["max_length"] == 32
    assert manifest["tokenizer"] == fingerprint(tokenizer)
    assert set(manifest["tokenizer"]["special_token_ids"]) >= {"cls", "sep", "pad", "mask", "unk"}
    total_rows = total_tokens = 0
    for shard in manifest["shards"]:
        path = tmp_path / "out" / shard["file"]
        assert path.stat().st_size == shard["bytes"] and sha256_file(path) == shard["sha256"]
        with pa.memory_map(str(path)) as f:
            table = pa.ipc.open_file(f).read_all()
        assert table.num_rows == shard["rows"]
        assert sum(len(x) for x in table.column("input_ids").to_pylist()) == shard["tokens"]
        total_rows += shard["rows"]
        total_tokens += shard["tokens"]
    assert (total_rows, total_tokens) == (manifest["counts"]["rows"], manifest["counts"]["tokens"])
    # the tokenizer travels with the shards
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").exists()


def test_packing_fills_samples_up_to_the_limit(tmp_path, tokenizer_dir):
    texts = [t for t in synthetic_texts(200, seed=6, max_words=10) if t]
    src = write_jsonl(tmp_path / "docs.jsonl", texts)
    plain = preprocess([src], tmp_path / "plain", tokenizer_dir, max_length=40)
    packed = preprocess([src], tmp_path / "packed", tokenizer_dir, max_length=40, pack=True)
    assert packed["packed"] and packed["counts"]["packs"] < plain["counts"]["rows"] / 2
    ds_plain, ds_packed = ShardDataset(tmp_path / "plain"), ShardDataset(tmp_path / "packed")
    assert len(ds_packed) == packed["counts"]["packs"]
    stream = np.concatenate([ds_packed[i].input_ids for i in range(len(ds_packed))])
    assert np.array_equal(
        stream, np.concatenate([ds_plain[i].input_ids for i in range(len(ds_plain))])
    )
    for i in range(len(ds_packed)):
        sample = ds_packed[i]
        assert len(sample.input_ids) <= 38 and sample.segment_lengths.sum() == len(sample.input_ids)


# ---------------------------------------------------------------------- input formats
def test_every_input_format(tmp_path, tokenizer_dir):
    import datasets
    import pyarrow.parquet as pq

    texts = ["alpha encoder", "", "beta decoder query", "gamma token"]
    jsonl = write_jsonl(tmp_path / "a.jsonl", texts, with_title=True)
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    txt_lines = tmp_path / "c.txt"
    txt_lines.write_text("one line doc\nsecond line doc\n\nfourth\n")
    beir = tmp_path / "beir"
    beir.mkdir()
    write_jsonl(beir / "corpus.jsonl", texts, with_title=True)
    parquet = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"id": ["p0", "p1"], "body": ["parquet doc one", "parquet doc two"]}), parquet
    )
    hf = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": ["hf doc one", "hf doc two", "hf doc three"]}).save_to_disk(
        str(hf)
    )

    def docs(inputs, **source):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        m = preprocess(inputs, out, tokenizer_dir, source=SourceOptions(**source))
        ds = ShardDataset(out)
        return m["counts"], [ds.source(i)[0][0] for i in range(len(ds))]

    counts, ids = docs([jsonl])
    assert (
        counts["documents"] == 4
        and counts["empty_documents"] == 1
        and ids == ["doc0", "doc2", "doc3"]
    )
    assert docs([gz]) == (counts, ids)
    # a BEIR folder joins title and text: the title adds rows' tokens, and the empty text keeps its title
    beir_counts, beir_ids = docs([beir])
    assert beir_ids == ["doc0", "doc1", "doc2", "doc3"] and beir_counts["tokens"] > counts["tokens"]
    counts, ids = docs([txt_lines])
    assert (
        counts["documents"] == 4
        and counts["empty_documents"] == 1
        and ids == ["c.txt:1", "c.txt:2", "c.txt:4"]
    )
    counts, ids = docs([txt_lines], txt_mode="paragraph")
    assert counts["documents"] == 2 and ids == ["c.txt:1", "c.txt:4"]
    counts, ids = docs([parquet], text_field="body")
    assert ids == ["p0", "p1"]
    counts, ids = docs([hf])
    assert counts["documents"] == 3 and ids == ["hf:0", "hf:1", "hf:2"]


def test_real_wikitext_and_scifact_are_identical_for_one_and_two_workers(
    tmp_path, shared_data, tokenizer_dir
):
    inputs = [shared_data / "scifact" / "corpus.jsonl"]
    wiki = shared_data / "wikitext2" / "wiki.test.raw"
    # WikiText's .raw is plain text with one paragraph (or heading) per line
    kw = dict(max_length=128, shard_size=512 * 1024)
    m1 = preprocess([*inputs, wiki], tmp_path / "w1", tokenizer_dir, workers=1, **kw)
    preprocess([*inputs, wiki], tmp_path / "w2", tokenizer_dir, workers=2, **kw)
    assert m1["counts"]["documents"] == 5183 + 2891 and len(m1["shards"]) >= 4
    assert output_files(tmp_path / "w1") == output_files(tmp_path / "w2")


def test_identical_across_worker_counts_and_runs(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(300, seed=8))
    outs = []
    for name, workers in (("a", 1), ("b", 2), ("c", 2)):
        preprocess(
            [src], tmp_path / name, tokenizer_dir, workers=workers, shard_size=3000, max_length=32
        )
        outs.append(output_files(tmp_path / name))
    assert len([k for k in outs[0] if k.endswith(".arrow")]) > 3
    assert outs[0] == outs[1] == outs[2]


def test_tasks_then_merge_equal_one_local_run(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(300, seed=9))
    kw = dict(shard_size=3000, max_length=32)
    preprocess([src], tmp_path / "local", tokenizer_dir, **kw)
    for task in (2, 0):  # any order
        summary = preprocess(
            [src], tmp_path / "tasks", tokenizer_dir, num_tasks=3, task_index=task, **kw
        )
        assert summary["units"] and all(u % 3 == task for u in summary["units"])
    assert not (tmp_path / "tasks" / "manifest.json").exists()
    with pytest.raises(RuntimeError, match="not complete"):
        run_preprocess(PreprocessConfig(out=str(tmp_path / "tasks"), merge=True, progress=False))
    preprocess([src], tmp_path / "tasks", tokenizer_dir, num_tasks=3, task_index=1, **kw)
    run_preprocess(PreprocessConfig(out=str(tmp_path / "tasks"), merge=True, progress=False))
    assert output_files(tmp_path / "tasks") == output_files(tmp_path / "local")


def test_rerun_with_other_settings_into_the_same_folder_is_refused(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(20))
    preprocess([src], tmp_path / "out", tokenizer_dir, max_length=32)
    with pytest.raises(ValueError, match="max_length"):
        preprocess([src], tmp_path / "out", tokenizer_dir, max_length=64)


# ---------------------------------------------------------------------- resume after a kill
def _slow_preprocess(src: Path, out: Path, tokenizer_dir: Path, *extra: str):
    """(the running ``retromae-ds preprocess`` of ``src`` into 2 KB shards, each held half
    a second before its rename so that a kill can land mid-shard; its arguments)."""
    args = ["preprocess", str(src), "--out", str(out), "--tokenizer", str(tokenizer_dir),
            "--shard_size", "2KB", "--max_length", "32", "--progress", "false", *extra]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "retromae_ds.cli", *args],
        cwd=REPO,
        env={**os.environ, **faults.env(sleep_before_shard_rename_s=0.5)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return proc, args


def test_killed_run_resumes_keeping_complete_shards(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(400, seed=10))
    proc, args = _slow_preprocess(src, tmp_path / "out", tokenizer_dir)
    shard_dir = tmp_path / "out" / "shards"
    deadline = time.monotonic() + 120
    # kill it while a shard is half-way (temporary file present) after some shards completed
    while time.monotonic() < deadline:
        done = list(shard_dir.glob("*.json")) if shard_dir.exists() else []
        if len(done) >= 2 and list(shard_dir.glob("*.tmp")):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert list(shard_dir.glob("*.tmp")), "the kill landed mid-shard"
    complete = {p.name: p.stat().st_mtime_ns for p in shard_dir.glob("*.arrow")}
    with pytest.raises(FileNotFoundError):
        ShardDataset(tmp_path / "out")

    result = cli(*args)
    assert result.returncode == 0, result.stderr
    assert f"({len(complete)} kept from an earlier run)" in result.stdout or len(complete) > len(
        list(shard_dir.glob("*.json"))
    )
    for name, mtime in complete.items():  # complete shards were kept, not rewritten
        if (shard_dir / name).with_suffix(".json").exists():
            assert (shard_dir / name).stat().st_mtime_ns == mtime
    assert not list(shard_dir.glob("*.tmp"))
    clean = tmp_path / "clean"
    cli(*[a if a != str(tmp_path / "out") else str(clean) for a in args])
    assert output_files(tmp_path / "out") == output_files(clean)


def test_a_worker_killed_mid_shard_fails_the_run_instead_of_hanging(tmp_path, tokenizer_dir):
    import psutil

    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(400, seed=11))
    proc, args = _slow_preprocess(src, tmp_path / "out", tokenizer_dir, "--workers", "2")
    shard_dir = tmp_path / "out" / "shards"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        shard_dir.exists() and list(shard_dir.glob("*.tmp"))
    ):
        time.sleep(0.05)
    workers = [
        c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())
    ]
    assert workers, "no worker process found"
    workers[0].send_signal(signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run hung after one of its workers was killed")
    assert proc.returncode != 0
    assert "worker died" in err.decode()
    assert not (tmp_path / "out" / "manifest.json").exists()
    result = cli(*args)  # rerunning finishes the job
    assert result.returncode == 0, result.stderr
    ShardDataset(tmp_path / "out", verify=True)


# ---------------------------------------------------------------------- bad input
BAD_LINES = {
    "malformed": (b'{"_id": "x", "text": "fine"}\n{"_id": "y", "text": \n', 2, "malformed JSON"),
    "missing_field": (
        b'{"_id": "x", "text": "fine"}\n{"_id": "y", "body": "no text"}\n',
        2,
        "missing text field 'text'",
    ),
    "bad_utf8": (
        b'{"_id": "x", "text": "fine"}\n{"_id": "y", "text": "caf\xe9"}\n',
        2,
        "invalid UTF-8",
    ),
    "not_object": (b'{"_id": "x", "text": "fine"}\n["a list"]\n', 2, "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_record_stops_with_file_and_line(tmp_path, tokenizer_dir, case):
    content, line, reason = BAD_LINES[case]
    good = write_jsonl(tmp_path / "good.jsonl", synthetic_texts(30))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    result = cli(
        "preprocess",
        str(good),
        str(bad),
        "--out",
        str(tmp_path / "out"),
        "--tokenizer",
        str(tokenizer_dir),
        "--progress",
        "false",
    )
    assert result.returncode != 0
    assert f"{bad}:{line}: {reason}" in result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
    # the unit holding the bad line left no shard behind, complete or partial
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    bad_unit = next(u["index"] for u in plan["units"] if u["path"] == str(bad))
    assert not list((tmp_path / "out" / "shards").glob(f"part-{bad_unit:06d}*"))


def test_skip_mode_logs_every_rejected_line(tmp_path, tokenizer_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(c for c, _, _ in BAD_LINES.values()))
    missing = tmp_path / "gone.jsonl"
    broken_gz = tmp_path / "broken.jsonl.gz"
    broken_gz.write_bytes(b"this is not gzip data")
    missing.symlink_to(tmp_path / "nowhere.jsonl")  # an unreadable input
    result = cli(
        "preprocess",
        str(bad),
        str(missing),
        str(broken_gz),
        "--out",
        str(tmp_path / "out"),
        "--tokenizer",
        str(tokenizer_dir),
        "--on_error",
        "skip",
        "--progress",
        "false",
    )
    assert result.returncode == 0, result.stderr
    rejects = [
        json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()
    ]
    in_bad = [(r["line"], r["reason"]) for r in rejects if r["file"] == str(bad)]
    expected = [
        (2, "malformed JSON"),
        (4, "missing text field 'text'"),
        (6, "invalid UTF-8"),
        (8, "expected a JSON object"),
    ]
    assert len(in_bad) == len(expected)
    for (line, reason), (want_line, want_reason) in zip(in_bad, expected, strict=True):
        assert line == want_line and reason.startswith(want_reason)
    unreadable = {r["file"] for r in rejects if r["line"] is None}
    assert unreadable == {str(missing), str(broken_gz)}
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["counts"]["rejected"] == len(rejects) == 6
    assert manifest["counts"]["documents"] == 4
    assert "6 rejected" in result.stdout


def test_unreadable_and_unsupported_inputs_have_clear_errors(tmp_path, tokenizer_dir):
    def run(*inputs):
        return cli(
            "preprocess",
            *map(str, inputs),
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            str(tokenizer_dir),
            "--progress",
            "false",
        )

    (tmp_path / "doc.pdf").write_bytes(b"%PDF")
    result = run(tmp_path / "doc.pdf")
    assert result.returncode != 0 and "doc.pdf: unsupported input format" in result.stderr
    result = run(tmp_path / "*.jsonl")
    assert result.returncode != 0 and "no file matches" in result.stderr
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    result = run(tmp_path / "broken.jsonl.gz")
    assert result.returncode != 0 and "broken.jsonl.gz: cannot read file" in result.stderr
    (tmp_path / "folder").mkdir()
    result = run(tmp_path / "folder")
    assert result.returncode != 0 and "neither a datasets folder nor BEIR" in result.stderr


def test_missing_tokenizer_and_conflicting_options(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", ["a doc"])
    with pytest.raises(FileNotFoundError, match="tokenizer folder not found"):
        preprocess([src], tmp_path / "out", tmp_path / "no-such-tokenizer")
    with pytest.raises(ValueError, match="exactly one"):
        PreprocessConfig(inputs=["x"], out=str(tmp_path))
    with pytest.raises(ValueError, match="train it once first"):
        PreprocessConfig(inputs=["x"], out=str(tmp_path), train_tokenizer=100, num_tasks=2)


def test_train_tokenizer_and_input_error_type(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(100, seed=11))
    cfg = PreprocessConfig(
        inputs=[str(src)], out=str(tmp_path / "out"), train_tokenizer=150, progress=False
    )
    manifest = run_preprocess(cfg)
    assert manifest["tokenizer"]["vocab_size"] <= 150
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").exists()
    again = run_preprocess(cfg)  # resumed: same tokenizer, nothing redone
    assert again == manifest
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n{oops\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: malformed JSON"):
        run_preprocess(
            PreprocessConfig(
                inputs=[str(bad)], out=str(tmp_path / "o2"), train_tokenizer=50, progress=False
            )
        )


def test_trained_tokenizer_and_output_are_identical_across_runs(tmp_path):
    # The Rust WordPiece trainer alone gives a different vocabulary from run to run (hash-map
    # order); ours must not, or "byte-identical for any run" would fail for --train-tokenizer.
    src = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(300, seed=12, max_words=120))
    outs = []
    for name in ("a", "b", "c"):
        cfg = PreprocessConfig(
            inputs=[str(src)],
            out=str(tmp_path / name),
            train_tokenizer=180,
            progress=False,
            max_length=64,
        )
        run_preprocess(cfg)
        outs.append(
            (
                output_files(tmp_path / name),
                (tmp_path / name / "tokenizer" / "tokenizer.json").read_bytes(),
            )
        )
    assert outs[0] == outs[1] == outs[2]
