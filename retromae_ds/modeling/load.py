"""Loading a Hugging Face model folder the way every reader here does: offline, quiet about
the expected differences (``hfutil.quiet_transformers``), loud about unexpected missing
weights, and on the broadcast padding mask (``long_attention``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from retromae_ds.hf.util import quiet_transformers
from retromae_ds.modeling.long_attention import use_broadcast_mask
from retromae_ds.modeling.mask_form import takes_4d_mask


def load_pretrained(
    auto_class: Any, folder: str | Path, *, may_miss: tuple[str, ...] = ("pooler.",), **kwargs: Any
) -> Any:
    """``auto_class.from_pretrained(folder, local_files_only=True, **kwargs)`` under
    ``hfutil.quiet_transformers()``. Weights missing from the checkpoint (newly initialised) whose
    names do not start with one of ``may_miss`` (default: the pooler, which CLS and mean
    pooling never use) are named in one line on stderr instead of transformers' table.
    A model on ``sdpa`` attention is switched to its broadcast padding mask
    (``modeling.long_attention``: same outputs, no L×L mask)."""
    check_weight_files(folder)
    with quiet_transformers():
        model, info = auto_class.from_pretrained(
            str(folder), local_files_only=True, output_loading_info=True, **kwargs
        )
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(may_miss))
    if missing:
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        print(
            f"{folder}: {len(missing)} weight(s) not in the checkpoint, newly initialised: {shown}",
            file=sys.stderr,
            flush=True,
        )
    use_broadcast_mask(model)
    takes_4d_mask(model)  # the mask form, chosen now rather than at the first step
    return model


def check_weight_files(folder: str | Path) -> None:
    """Every ``*.safetensors`` file of ``folder`` has a whole header whose tensors the file
    covers (safetensors checks that on opening, reading the header only): a truncated or
    damaged weights file is a ``ValueError`` naming it, not a traceback from deep inside
    transformers."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"{path}: not a readable safetensors file ({e}); truncated or damaged: "
                "copy or export the model again"
            ) from e


HEAD_PREFIXES = ("cls.", "lm_head.")
"""Weight names of the MLM heads of the BERT (``cls``) and RoBERTa / XLM-R (``lm_head``) models."""


def load_with_head(folder: str | Path) -> Any:
    """The masked-LM model of a local folder, its MLM head included: DupMAE's poolings need it.
    A folder without the head (an encoder body, e.g. an export made for CLS or mean pooling)
    is a ``ValueError`` saying where one is found, never a head newly initialised."""
    from transformers import AutoModelForMaskedLM

    check_weight_files(folder)
    with quiet_transformers():
        model, info = AutoModelForMaskedLM.from_pretrained(
            str(folder), local_files_only=True, output_loading_info=True
        )
    missing = sorted(k for k in info.get("missing_keys", ()) if k.startswith(HEAD_PREFIXES))
    if missing:
        raise ValueError(
            f"{folder}: no MLM head in its weights ({missing[0]} missing); the DupMAE poolings "
            "need it: use the pre-training run or checkpoint, or an export made with "
            "--pooling dupmae / dupmae_bow"
        )
    use_broadcast_mask(model)
    takes_4d_mask(model)  # the mask form, chosen now rather than at the first step
    return model
