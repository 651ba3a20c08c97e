"""Count the device -> host reads a training run makes, per optimizer step; run as its own
process by tests/test_host_reads.py.

``python tests/host_reads.py OUT.json JOB ARGS...`` runs ``retromae_ds.JOB.main(ARGS)``
(``pretrain`` or ``finetune``) with every tensor method that hands a value back to Python
(``item``, ``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__float__``, ``__int__``,
``__index__``) wrapped, and with a dispatch mode counting the operators whose output size
depends on device data (``nonzero``, ``masked_select``, ``unique``, ...: boolean indexing
is one) or that copy a value to the host (``_local_scalar_dense``). On a GPU each such call
waits for the device to finish the work queued so far. A read is counted when it happens inside ``Trainer.fit``, outside the batch
iterator (the collator builds batches on the host before they reach the device), and is
attributed to the optimizer step being computed. Reads whose caller is the optimizer's
own code (``torch/optim``: its ``step`` counters are host tensors unless the optimizer is
fused or capturable) are left out, as they are no device reads on a GPU either.
Writes ``{"reads": [[step, op, "file:line"], ...], "steps": N}``.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from retromae_ds.training import loop

STATE = {"active": False, "step": 0}
READS: list[tuple[int, str, str]] = []
OPS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
HOST_SIDE = ("/torch/optim/",)


def _caller() -> str:
    """The innermost frame outside this file and torch's tensor wrappers; ``HOST_SIDE`` when
    the optimizer's code is on the stack (its wrappers hide it from the innermost frame)."""
    stack = traceback.extract_stack()[:-2]
    if any(part in frame.filename for frame in stack for part in HOST_SIDE):
        return HOST_SIDE[0]
    for frame in reversed(stack):  # torch's own wrappers say nothing of who asked
        if frame.filename.endswith("host_reads.py") or "/torch/" in frame.filename:
            continue
        return f"{frame.filename}:{frame.lineno}"
    return "?"


def _wrap(name: str) -> None:
    original = getattr(torch.Tensor, name)

    def counted(self, *args, **kwargs):
        if STATE["active"]:
            where = _caller()
            if not any(part in where for part in HOST_SIDE):
                READS.append((STATE["step"], name, where))
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, counted)


SYNC_OPS = ("nonzero", "masked_select", "_local_scalar_dense", "unique", "_unique2")
BOOL_INDEXING = ("index", "index_put", "_index_put_impl")


class _SyncOps(TorchDispatchMode):
    """Counts operators that make a GPU wait for its queue, wherever they are called from."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in BOOL_INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ())
        ):
            name = "nonzero"  # indexing by a boolean mask runs nonzero inside the kernel
        if STATE["active"] and name in SYNC_OPS:
            where = _caller()
            if not any(part in where for part in HOST_SIDE):
                READS.append((STATE["step"], f"aten.{name}", where))
        return func(*args, **(kwargs or {}))


class _Paused:
    """The batch iterator, with counting paused while it builds a batch."""

    def __init__(self, batches, trainer) -> None:
        self.batches, self.trainer = batches, trainer

    def __iter__(self):
        return self

    def __next__(self):
        STATE["active"] = False
        try:
            return next(self.batches)
        finally:
            STATE["step"] = self.trainer.step + 1  # the step this batch belongs to
            STATE["active"] = True


def main(argv: list[str]) -> int:
    out, job, args = Path(argv[0]), argv[1], argv[2:]
    for name in OPS:
        _wrap(name)
    fit = loop.Trainer.fit

    def counted_fit(self, batches, hooks):
        STATE["step"] = self.step
        STATE["active"] = True
        try:
            with _SyncOps():
                return fit(self, _Paused(batches, self), hooks)
        finally:
            STATE["active"] = False
            out.write_text(json.dumps({"reads": READS, "steps": self.step}))

    loop.Trainer.fit = counted_fit
    return importlib.import_module(f"retromae_ds.{job}").main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
