"""Export a pre-trained encoder as a Hugging Face model folder.

``retromae-ds export CKPT OUT``: CKPT is a complete checkpoint folder or a run folder (its
newest complete checkpoint is used). OUT gets the encoder body (safetensors), its config and
tokenizer, loadable with ``AutoModel.from_pretrained``, plus the sentence-transformers files,
so ``SentenceTransformer(OUT)`` gives the training-time sentence embedding: the encoder's own
pooling, normalisation and length (``retromae_ds.hf.sbert``: a fine-tuned encoder's
``dual_encoder.json``, else its sentence-transformers files, else CLS pooling -- the last-layer
hidden state at position 0 -- unnormalised), or ``--pooling`` / ``--normalize`` given. The
MLM head is left out; the complete masked-LM model (for continued pre-training) stays in the
checkpoint's ``encoder/`` folder.

DupMAE's poolings (``--pooling dupmae`` / ``dupmae_bow``, ``retromae_ds.modeling.bow``) need
the MLM head: for them OUT gets the masked-LM model (body and head, the head's projection
tied to the word embeddings as trained) and ``dupmae_pooling.json`` (pooling, normalisation,
``--bow_topk``). ``AutoModel.from_pretrained(OUT)`` still loads the body (the head's weights
are left aside), ``AutoModelForMaskedLM`` the whole, and ``HFEncoder.from_dir(OUT)`` /
``retromae-ds eval --model OUT`` give the DupMAE vectors, the same as evaluating the
checkpoint. sentence-transformers cannot express this pooling with its own modules: the
folder's sentence-transformers files name CLS pooling, so ``SentenceTransformer(OUT)`` gives
the [CLS] vector only (the first H entries of ``dupmae``; not ``dupmae_bow`` at all).

A fine-tuning checkpoint with separate towers (``--model.shared false``: ``encoder/`` and
``query_encoder/``) exports both: the passage tower at OUT's root (what
``AutoModel.from_pretrained(OUT)`` loads) and the query tower, complete with its tokenizer and
sentence-transformers files, in ``OUT/query_encoder``; OUT's ``modules.json`` starts with a
sentence-transformers ``Router`` (sentence-transformers 5 and later) sending queries to that
folder and documents to the root, so ``SentenceTransformer(OUT).encode_query`` and
``encode_document`` use the right tower, and ``retromae-ds eval --model OUT`` scores it as it
scores the run. One line says where each tower is (and, when the installed
sentence-transformers has no Router, to load the two folders as two models).

A cross-encoder's checkpoint (``finetune --model.kind cross_encoder``) is exported as it was
saved, a folder sentence-transformers' ``CrossEncoder`` loads (``finetuning.cross_encoder``);
``--pooling``, ``--normalize`` and ``--bow_topk`` are refused for it.

OUT also gets ``export.json`` (the source checkpoint and its step), which marks it as an
export: only such a folder, an empty one or a missing path is replaced; any other non-empty
folder needs ``overwrite=True`` (``--overwrite``); a folder holding a run or a checkpoint
(``checkpoints/``, a ``COMPLETE`` record or ``metrics.jsonl``, at any depth), a folder inside
a run or a checkpoint (its ``encoder/``, its ``tensorboard/``...) and a folder that is, holds
or lies inside the source are never replaced.

The checkpoint is checked against its record first (``checkpoint.resolve_checkpoint``). A
live run may prune it (keep-last) while it is being read: every file is read whole or not at
all, and the export is kept only if the checkpoint was still all there once read; otherwise a
run folder is exported again from its newest checkpoint, and a checkpoint named explicitly is
an error saying it was removed. A full disk is one error naming OUT and the space needed; the
staging folder is removed and a previous export at OUT is left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from retromae_ds.base.config import flag
from retromae_ds.base.errors import disk_full_error
from retromae_ds.base.fsutil import chmod_tree_as_created
from retromae_ds.components import checkpoint as ckpt
from retromae_ds.components.layout import (
    COMPLETE,
    ENCODER,
    PARTIAL_DIR,
    QUERY_ENCODER,
    STEP_DIR,
    RunLayout,
)
from retromae_ds.eval.towers import still_there
from retromae_ds.hf import sbert
from retromae_ds.hf.pooling import Choices, check_pooling, get_pooling
from retromae_ds.hf.util import load_tokenizer_checked, quiet_transformers
from retromae_ds.modeling.load import HEAD_PREFIXES, load_pretrained, load_with_head
from retromae_ds.modeling.positions import usable_positions
from retromae_ds.retrieval.cross_encoder import is_cross_encoder

EXPORT_MARKER = "export.json"
"""Written into every export; a folder carrying it may be replaced by a new export."""
RUN_ENTRIES = (RunLayout(".").checkpoints.name, COMPLETE, RunLayout(".").metrics.name)
"""Names that make a folder (or any folder below it) a run or a checkpoint: never replaced."""
RUN_FILES = (RunLayout(".").metrics.name, RunLayout(".").ds_config.name)
"""Files only a run folder holds (with ``checkpoints/``): nothing inside it is a target."""
ATTEMPTS = 3
"""Exports of a run folder tried while a live run keeps pruning the checkpoint being read."""


def check_export_target(out: Path, sources: list[Path], overwrite: bool) -> None:
    """Raise (naming ``out`` and what it holds) unless ``out`` may be replaced by an export of
    ``sources`` (the path given and the checkpoint it resolves to). Deletes nothing."""
    resolved = out.resolve()
    for source in sources:
        source = source.resolve()
        if resolved == source or resolved.is_relative_to(source):
            raise ValueError(f"{out}: the export would be written into its source {source}")
        if source.is_relative_to(resolved):
            raise ValueError(f"{out}: holds the source checkpoint {source}; refusing to replace")
    for folder in resolved.parents:  # nothing inside a run or a checkpoint, ever
        held = _run_or_checkpoint(folder)
        if held is not None:
            raise ValueError(
                f"{out}: inside the run or checkpoint {folder} ({held}); an export is never "
                "written into a run, not even with --overwrite: choose a folder outside it"
            )
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"{out}: exists and is not a folder; refusing to replace it")
    if not out.exists():
        return
    held = _run_entry(out)
    if held is not None:
        raise ValueError(
            f"{out}: holds a run or a checkpoint ({held}); an export never replaces it, "
            "not even with --overwrite"
        )
    entries = sorted(p.name for p in out.iterdir())
    if entries and EXPORT_MARKER not in entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(
            f"{out}: not empty ({shown}) and not a previous export (no {EXPORT_MARKER}); "
            "pass --overwrite (overwrite=True) to replace it"
        )


def _run_or_checkpoint(folder: Path) -> str | None:
    """What makes ``folder`` a run or a checkpoint (being written or not), or None."""
    try:
        if (folder / COMPLETE).is_file():
            return f"a checkpoint: it holds {COMPLETE}"
        if folder.parent.name == RunLayout(".").checkpoints.name and (
            STEP_DIR.match(folder.name) or PARTIAL_DIR.match(folder.name)
        ):
            return "a checkpoint folder of a run"
        if (folder / RunLayout(".").checkpoints.name).is_dir():
            return f"a run: it holds {RunLayout('.').checkpoints.name}/"
        for name in RUN_FILES:
            if (folder / name).is_file():
                return f"a run: it holds {name}"
    except OSError:  # a folder we may not look into is not known to be a run
        return None
    return None


def _run_entry(folder: Path) -> Path | None:
    """The first path below ``folder`` named like a run's or checkpoint's entry, or None."""
    for root, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            if name in RUN_ENTRIES:
                return Path(root) / name
    return None


def export_encoder(
    checkpoint: str | Path,
    out: str | Path,
    pooling: str = "auto",
    *,
    normalize: bool | None = None,
    bow_topk: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the encoder of ``checkpoint`` to ``out`` (atomically: staged, then renamed).

    ``out`` must be missing, empty or a previous export (it holds ``export.json``); another
    non-empty folder is replaced only with ``overwrite``; a run, a checkpoint, a folder inside
    either, or a folder that is, holds or lies inside the source never is (``ValueError``,
    nothing deleted). A checkpoint that fails its record is a ``CheckpointCorrupt`` naming the
    file (a run folder falls back to its newest checkpoint that verifies); a full disk a
    ``DiskFull`` naming ``out``; a named checkpoint pruned while being read a
    ``FileNotFoundError`` saying so (a run folder is exported again from its newest).
    """
    pooling = sbert.check_pooling(pooling)
    if bow_topk is not None and bow_topk < 0:
        raise ValueError(f"bow_topk must be >= 0, not {bow_topk}")
    out = Path(out)
    named_run = not ckpt.is_checkpoint(Path(checkpoint))
    gone: Path | None = None
    for _ in range(ATTEMPTS):
        resolved = ckpt.resolve_checkpoint(checkpoint, under=ckpt.MODEL_FILES)
        check_export_target(out, [Path(checkpoint), resolved], overwrite)
        if gone is not None:
            print(
                f"export: {gone.name} was removed (the run's keep_last pruning) while it was "
                f"being exported; exporting {resolved.name}, now the newest",
                file=sys.stderr,
            )
        else:
            _note_newer_incomplete(resolved)
        if _export_once(resolved, out, pooling, normalize, bow_topk):
            if (out / QUERY_ENCODER).is_dir():
                print(_towers_note(out), file=sys.stderr, flush=True)
            return out
        gone = resolved
        if not named_run:
            break
    hint = (
        f"retry (pruned {ATTEMPTS} times in a row: keep more checkpoints, or export after the run)"
        if named_run
        else "retry with a newer checkpoint, or name the run folder to export its newest"
    )
    raise FileNotFoundError(
        f"{gone}: checkpoint {gone.name} was removed (a live run's keep_last pruning) while "
        f"it was being exported; {hint}"
    )


def _towers_note(out: Path) -> str:
    """Where an export of separate towers put each, and how to load them."""
    from importlib.metadata import PackageNotFoundError, version

    note = (
        f"export: separate towers: the query tower is {out / QUERY_ENCODER}, the passage tower "
        f"{out} (a sentence-transformers Router: encode_query / encode_document; "
        "retromae-ds eval uses both)"
    )
    try:
        installed = version("sentence-transformers")
    except PackageNotFoundError:
        return note
    if int(installed.split(".")[0]) < 5:  # the Router came with sentence-transformers 5
        note += (
            f"; the installed sentence-transformers {installed} has no Router: load "
            f"{out / QUERY_ENCODER} (queries) and {out} (passages) as two models"
        )
    return note


def _note_newer_incomplete(resolved: Path) -> None:
    """Never silently older: say which newer step folders were passed over."""
    newer = [
        p.name
        for p in sorted(resolved.parent.glob("step_*"))
        if p.name > resolved.name and p.is_dir() and not ckpt.is_checkpoint(p)
    ]
    if newer:
        print(
            f"export: using {resolved.name}; newer {', '.join(newer)} not complete "
            "(no completion record: still being written, or damaged)",
            file=sys.stderr,
        )


def _export_once(
    resolved: Path, out: Path, pooling: str, normalize: bool | None, bow_topk: int | None
) -> bool:
    """Export ``resolved``'s encoder (or cross-encoder: copied) to ``out``; False (nothing written) when the checkpoint
    was removed, even in part, before everything was read from it."""
    source = resolved / ENCODER
    query_source = resolved / QUERY_ENCODER if (resolved / QUERY_ENCODER).is_dir() else None
    staging = None
    try:
        if not (source / "config.json").is_file():
            if not still_there(resolved):
                return False
            raise FileNotFoundError(f"{source}: the checkpoint holds no encoder folder")
        cross = is_cross_encoder(source)
        if cross and (pooling, normalize, bow_topk) != ("auto", None, None):
            raise ValueError(
                f"{resolved}: a cross-encoder (finetune --model.kind cross_encoder) has no "
                "pooling, normalisation or bag-of-words vector: leave --pooling, --normalize "
                "and --bow_topk out"
            )
        spec = None if cross else sbert.resolve(source, pooling, normalize, bow_topk)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = _fresh_sibling(out, ".partial")
        if spec is None:
            _write_cross_encoder(staging, source, resolved)
        else:
            _write_export(staging, source, resolved, spec, query_source)
        # files are only ever deleted: all still there now means every read saw a whole file
        if not still_there(resolved):
            shutil.rmtree(staging, ignore_errors=True)
            return False
        chmod_tree_as_created(staging)  # readable by a serving job under another user
        _replace(staging, out)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        if not still_there(resolved):  # the loaders' messages would blame the folder
            return False
        size = _folder_bytes(source) + (_folder_bytes(query_source) if query_source else 0)
        full = disk_full_error(exc, out, "the export", size)
        if full is not None:
            raise full from exc
        raise
    return True


def _folder_bytes(folder: Path) -> int:
    """About what an export of ``folder`` writes: the size of its files."""
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def _replace(staging: Path, out: Path) -> None:
    """Move ``staging`` to ``out``; an existing ``out`` is moved aside first and deleted only
    once the new folder is in place (put back if the rename fails)."""
    if not out.exists():
        os.replace(staging, out)
        return
    aside = _fresh_sibling(out, ".old")
    os.replace(out, aside / out.name)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(aside / out.name, out)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _fresh_sibling(out: Path, suffix: str) -> Path:
    """A new empty folder next to ``out`` under a unique name, so that no existing folder
    (say, one that happens to be called ``OUT.partial``) is ever reused or deleted."""
    folder = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{suffix}"
    folder.mkdir()
    return folder


def _checkpoint_step(checkpoint: Path) -> int | None:
    try:
        step = ckpt.read_marker(checkpoint).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _write_export(
    staging: Path,
    source: Path,
    resolved: Path,
    spec: sbert.EmbeddingSpec,
    query_source: Path | None = None,
) -> None:
    """The export's files into ``staging``: body, tokenizer, sentence-transformers files and
    the ``export.json`` marker; with ``query_source`` the query tower in ``query_encoder/``
    and the Router sending queries there (see the module doc)."""
    with_head = get_pooling(spec.pooling).needs_head
    files = {"pooling": spec.pooling, "normalize": spec.normalize, "bow_topk": spec.bow_topk}
    if query_source is not None:
        query_dir = staging / QUERY_ENCODER
        query_dir.mkdir()
        dim, length = _write_tower(query_dir, query_source, with_head)
        sbert.write_files(query_dir, dim, max_length=spec.max_length or length, **files)
    dim, length = _write_tower(staging, source, with_head)
    sbert.write_files(
        staging,
        dim,
        max_length=spec.max_length or length,
        query_tower=None if query_source is None else QUERY_ENCODER,
        **files,
    )
    marker = {
        "source": str(resolved.resolve()),
        "step": _checkpoint_step(resolved),
        "pooling": spec.pooling,
        "normalize": spec.normalize,
        "query_encoder": None if query_source is None else QUERY_ENCODER,
        **({"bow_topk": spec.bow_topk} if with_head else {}),
    }
    (staging / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _write_cross_encoder(staging: Path, source: Path, resolved: Path) -> None:
    """A cross-encoder's folder is written loadable by sentence-transformers'
    ``CrossEncoder`` already (``finetuning.cross_encoder``): its files, and the marker."""
    for path in source.iterdir():
        if path.is_file():
            shutil.copy2(path, staging / path.name)
    marker = {"source": str(resolved.resolve()), "step": _checkpoint_step(resolved)}
    marker["kind"] = "cross_encoder"
    (staging / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _write_tower(folder: Path, source: Path, with_head: bool) -> tuple[int, int]:
    """One tower of ``source`` into ``folder``: the body (or, for DupMAE's poolings, the
    masked-LM model with its head), its tokenizer and a fine-tuned encoder's
    ``dual_encoder.json``; returns (hidden size, usable positions)."""
    from transformers import AutoModel, AutoModelForMaskedLM

    tokenizer = load_tokenizer_checked(source)
    if with_head:
        mlm = load_with_head(source)
    else:  # the head is dropped: a fine-tuned encoder without one is no news
        mlm = load_pretrained(AutoModelForMaskedLM, source, may_miss=("pooler.", *HEAD_PREFIXES))
    torch.manual_seed(0)  # the (unused, untrained) pooler gets a fixed initialisation
    with quiet_transformers():
        if with_head:  # DupMAE's poolings: the head stays (see the module doc)
            mlm.save_pretrained(str(folder), safe_serialization=True)
        else:
            body = AutoModel.from_config(mlm.config)
            missing, unexpected = body.load_state_dict(mlm.base_model.state_dict(), strict=False)
            if unexpected or any(not k.startswith("pooler.") for k in missing):
                raise RuntimeError(
                    f"encoder body mismatch: missing {missing}, unexpected {unexpected}"
                )
            body.save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
    if (source / sbert.DUAL_ENCODER_FILE).is_file():  # a fine-tuned encoder's own record
        shutil.copy2(source / sbert.DUAL_ENCODER_FILE, folder / sbert.DUAL_ENCODER_FILE)
    return mlm.config.hidden_size, usable_positions(mlm)


@dataclass(kw_only=True)
class ExportConfig:
    """``retromae-ds export``: the encoder of a checkpoint as a Hugging Face folder."""

    checkpoint: str = flag(positional=True)
    """A complete checkpoint folder, or a run folder (its newest)."""
    out: str = flag(positional=True)
    """The Hugging Face folder to write."""
    pooling: str = flag("auto", choices=Choices())
    """Sentence embedding: auto (the encoder's own, else cls) or a registered pooling
    (retromae_ds.hf.pooling); one that needs the MLM head (dupmae / dupmae_bow) keeps it in OUT
    (see the module doc)."""
    normalize: bool | None = None
    """L2-normalise embeddings (none: the encoder's own, else no)."""
    bow_topk: int | None = None
    """DupMAE poolings: entries of the bag-of-words vector kept (none: the encoder's own,
    else 256; 0 keeps all)."""
    overwrite: bool = False
    """Replace a non-empty OUT that is not a previous export (never a run or checkpoint)."""

    def __post_init__(self) -> None:
        self.pooling = check_pooling(self.pooling, "--pooling")


def export_command(cfg: ExportConfig) -> int:
    out = export_encoder(
        cfg.checkpoint,
        cfg.out,
        pooling=cfg.pooling,
        normalize=cfg.normalize,
        bow_topk=cfg.bow_topk,
        overwrite=cfg.overwrite,
    )
    print(f"export: encoder -> {out}")
    return 0
