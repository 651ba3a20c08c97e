"""What every index of ``retromae_ds.search`` checks and shares: matrices in (2-D float32 numpy
arrays or torch tensors, with errors that say what is wrong), ``k``, L2 normalisation for the
cosine metric, and the ``Metric`` / ``Backend`` names.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

Metric = Literal["ip", "cosine"]
Backend = Literal["auto", "faiss", "torch"]
Matrix = np.ndarray | torch.Tensor

METRICS = ("ip", "cosine")
BACKENDS = ("auto", "faiss", "torch")


def check_matrix(x: object, name: str, dim: int | None = None) -> Matrix:
    """``x`` as a 2-D float32 numpy array or torch tensor, or a clear error saying what is wrong."""
    if isinstance(x, torch.Tensor):
        dtype_ok, dtype = x.dtype == torch.float32, str(x.dtype)
    elif isinstance(x, np.ndarray):
        dtype_ok, dtype = x.dtype == np.float32, str(x.dtype)
    else:
        raise TypeError(f"{name} must be a numpy array or torch tensor, not {type(x).__name__}")
    if not dtype_ok:
        raise TypeError(f"{name} has dtype {dtype}; expected float32 (convert with .astype)")
    if x.ndim != 2:
        hint = " (use x[None, :] for a single vector)" if x.ndim == 1 else ""
        raise ValueError(f"{name} must be 2-D [rows, dim]; got shape {tuple(x.shape)}{hint}")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"{name} have dimension {x.shape[1]}; the index holds dimension {dim}")
    return x


def check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return int(k)


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be 'ip' or 'cosine', got {metric!r}")


def l2_normalize(x: Matrix) -> Matrix:
    """Rows scaled to unit L2 norm (a copy; all-zero rows stay zero)."""
    if isinstance(x, torch.Tensor):
        return torch.nn.functional.normalize(x, dim=1)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, np.finfo(np.float32).tiny)).astype(np.float32, copy=False)


def to_numpy(x: Matrix) -> np.ndarray:
    """A C-contiguous float32 numpy array of ``x`` (what faiss reads)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)
