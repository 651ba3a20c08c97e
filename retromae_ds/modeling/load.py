"""Loading a Hugging Face model folder the way every reader here does: offline, quiet about
the expected differences (``hfutil.quiet_transformers``), loud about unexpected missing
weights, and on the broadcast padding mask (``long_attention``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from retromae_ds.hfutil import quiet_transformers
from retromae_ds.modeling.long_attention import use_broadcast_mask


def load_pretrained(
    auto_class: Any, folder: str | Path, *, may_miss: tuple[str, ...] = ("pooler.",), **kwargs: Any
) -> Any:
    """``auto_class.from_pretrained(folder, local_files_only=True, **kwargs)`` under
    ``hfutil.quiet_transformers()``. Weights missing from the checkpoint (newly initialised) whose
    names do not start with one of ``may_miss`` (default: the pooler, which CLS and mean
    pooling never use) are named in one line on stderr instead of transformers' table.
    A model on ``sdpa`` attention is switched to its broadcast padding mask
    (``modeling.long_attention``: same outputs, no L×L mask)."""
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
    return model
