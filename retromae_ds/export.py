"""Export a pre-trained encoder as a Hugging Face model folder.

``retromae-ds export CKPT OUT``: CKPT is a complete checkpoint folder or a run folder (its
newest complete checkpoint is used). OUT gets the encoder body (safetensors), its config and
tokenizer, loadable with ``AutoModel.from_pretrained``, plus the sentence-transformers files,
so ``SentenceTransformer(OUT)`` gives the training-time sentence embedding: the encoder's own
pooling, normalisation and length (``retromae_ds.sbert``: a fine-tuned encoder's
``dual_encoder.json``, else its sentence-transformers files, else CLS pooling -- the last-layer
hidden state at position 0 -- unnormalised), or ``--pooling`` / ``--normalize`` given. The
MLM head is left out; the complete masked-LM model (for continued pre-training) stays in the
checkpoint's ``encoder/`` folder.

OUT also gets ``export.json`` (the source checkpoint and its step), which marks it as an
export: only such a folder, an empty one or a missing path is replaced; any other non-empty
folder needs ``overwrite=True`` (``--overwrite``); a folder holding a run or a checkpoint
(``checkpoints/``, a ``COMPLETE`` record or ``metrics.jsonl``, at any depth) and a folder
that is, holds or lies inside the source are never replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import torch

from retromae_ds import checkpoint as ckpt
from retromae_ds import sbert
from retromae_ds.fsutil import chmod_tree_as_created
from retromae_ds.hfutil import load_pretrained, load_tokenizer_checked, quiet_transformers
from retromae_ds.layout import COMPLETE, ENCODER, RunLayout
from retromae_ds.modeling.positions import usable_positions

EXPORT_MARKER = "export.json"
"""Written into every export; a folder carrying it may be replaced by a new export."""
RUN_ENTRIES = (RunLayout(".").checkpoints.name, COMPLETE, RunLayout(".").metrics.name)
"""Names that make a folder (or any folder below it) a run or a checkpoint: never replaced."""


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
    overwrite: bool = False,
) -> Path:
    """Write the encoder of ``checkpoint`` to ``out`` (atomically: staged, then renamed).

    ``out`` must be missing, empty or a previous export (it holds ``export.json``); another
    non-empty folder is replaced only with ``overwrite``; a run, a checkpoint or a folder that
    is, holds or lies inside the source never is (``ValueError``, nothing deleted).
    """
    if pooling not in ("auto", "cls", "mean"):
        raise ValueError(f"pooling must be auto, cls or mean, not {pooling!r}")
    resolved = ckpt.resolve_checkpoint(checkpoint)
    ckpt.verify(resolved, under=f"{ENCODER}/")  # a corrupt encoder is an error naming the file
    newer = [
        p.name
        for p in sorted(resolved.parent.glob("step_*"))
        if p.name > resolved.name and p.is_dir() and not ckpt.is_checkpoint(p)
    ]
    if newer:  # never silently older: say which newer folders were passed over
        print(
            f"export: using {resolved.name}; newer {', '.join(newer)} not complete "
            "(no completion record: still being written, or damaged)",
            file=sys.stderr,
        )
    source = resolved / ENCODER
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}: the checkpoint holds no encoder folder")
    out = Path(out)
    check_export_target(out, [Path(checkpoint), resolved], overwrite)
    tokenizer = load_tokenizer_checked(source)
    spec = sbert.resolve(source, pooling, normalize)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _fresh_sibling(out, ".partial")
    try:
        _write_export(staging, source, resolved, spec, tokenizer)
        chmod_tree_as_created(staging)  # readable by a serving job under another user
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


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
    staging: Path, source: Path, resolved: Path, spec: sbert.EmbeddingSpec, tokenizer
) -> None:
    """The export's files into ``staging``: body, tokenizer, sentence-transformers files and
    the ``export.json`` marker."""
    from transformers import AutoModel, AutoModelForMaskedLM

    mlm = load_pretrained(AutoModelForMaskedLM, source)
    torch.manual_seed(0)  # the (unused, untrained) pooler gets a fixed initialisation
    with quiet_transformers():
        body = AutoModel.from_config(mlm.config)
        missing, unexpected = body.load_state_dict(mlm.base_model.state_dict(), strict=False)
        if unexpected or any(not k.startswith("pooler.") for k in missing):
            raise RuntimeError(f"encoder body mismatch: missing {missing}, unexpected {unexpected}")
        body.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
    if (source / sbert.DUAL_ENCODER_FILE).is_file():  # a fine-tuned encoder's own record
        shutil.copy2(source / sbert.DUAL_ENCODER_FILE, staging / sbert.DUAL_ENCODER_FILE)
    sbert.write_files(
        staging,
        mlm.config.hidden_size,
        spec.pooling,
        spec.max_length or usable_positions(mlm),
        normalize=spec.normalize,
    )
    marker = {
        "source": str(resolved.resolve()),
        "step": _checkpoint_step(resolved),
        "pooling": spec.pooling,
        "normalize": spec.normalize,
    }
    (staging / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
