"""Poolings: how an encoder's last hidden states become one sentence embedding, defined once.

A ``Pooling`` holds everything the library needs to know about one: its name, whether it
needs the encoder's MLM head (DupMAE's do), the size of the embedding it gives for an encoder
of hidden size H and vocabulary V, the function that pools a batch, and how the
sentence-transformers ``Pooling`` module names it (``1_Pooling/config.json``). ``POOLINGS``
is the one registry of them: evaluation (``eval.encode.HFEncoder``), the evaluation during
pre-training, fine-tuning (``finetuning.model.DualEncoder``), the refresher (``refresher.stages``),
export and the sentence-transformers files (``hf.sbert``) all look a pooling up there, so the
option lists (``--pooling``, ``--model.pooling``, ``--eval.poolings``) are its names.

The library's poolings, in registration (and report) order:

- ``cls``: the first token's state (RetroMAE's sentence embedding), D = H;
- ``mean``: the attention-mask-weighted mean of the states (sentence-transformers models),
  D = H;
- ``dupmae_bow``: DupMAE's ordinary-token vector, the MLM head over every ordinary token,
  max-pooled, its top-k entries kept (``modeling.bow.bow_vectors`` computes it, the caller
  hands it in), D = V;
- ``dupmae``: [CLS] and that vector concatenated (the paper's representation), D = H + V.

Another package adds a pooling without touching this one: a ``Pooling`` object named under
the ``retromae_ds.poolings`` entry-point group of its ``pyproject.toml``
(``max = "mypkg.poolings:MAX"``), loaded the first time a name is not found; or, in process,
``register_pooling(Pooling(...))``. This module imports no torch (the report tools read the
names); the pooling functions use the tensors' own methods, and torch only when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from retromae_ds.base.registry import Registry

if TYPE_CHECKING:
    import torch

PoolFunction = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor | None"], "torch.Tensor"]
"""``(hidden_BLH, attention_mask_BL, vocab_BV or None) -> embeddings [B, D]``."""


def hidden_size_dim(hidden_size: int, vocab_size: int) -> int:
    """D = H: a pooling of the hidden states."""
    return hidden_size


@dataclass(frozen=True)
class Pooling:
    """One sentence embedding (see the module doc); call it on a batch:
    ``pooling(hidden_BLH, attention_mask_BL, vocab_BV)``."""

    name: str
    """Its name in every option and file (lower case, a word)."""
    function: PoolFunction
    """``(hidden_BLH, attention_mask_BL, vocab_BV) -> [B, D]``: the last hidden states, the
    mask (1 = a token), and, for a pooling that ``needs_head``, the batch's vocabulary vectors
    (``modeling.bow.bow_vectors``: the MLM head's logits max-pooled over the ordinary tokens,
    top-k kept); None otherwise."""
    needs_head: bool = False
    """It reads the MLM head: the encoder is loaded (and exported) as a masked-LM model."""
    dim: Callable[[int, int], int] = hidden_size_dim
    """(hidden size H, vocabulary size V) -> entries of one embedding."""
    st_mode: str | None = None
    """The ``1_Pooling/config.json`` flag that sentence-transformers computes it with
    (``pooling_mode_cls_token``); None: sentence-transformers cannot (a folder then records
    it in ``dupmae_pooling.json`` and its sentence-transformers files name CLS:
    ``hf.sbert.write_files``)."""

    def __call__(
        self,
        hidden_BLH: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        vocab_BV: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.needs_head and vocab_BV is None:
            raise ValueError(
                f"pooling {self.name!r} needs the encoder's MLM head and the token ids: encode "
                "with HFEncoder (a masked-LM model) or modeling.bow.bow_vectors"
            )
        return self.function(hidden_BLH, attention_mask_BL, vocab_BV)


POOLINGS: Registry[Pooling] = Registry("pooling", "retromae_ds.poolings")
"""The registry: name -> ``Pooling``; other packages add theirs through its entry-point group,
``retromae_ds.poolings``."""
DEFAULT_POOLING = "cls"
"""What a folder without embedding settings is read with: RetroMAE's sentence embedding."""
AUTO = "auto"
"""The option value meaning: the encoder folder's own pooling (``hf.sbert.read_spec``)."""


def register_pooling(pooling: Pooling) -> Pooling:
    """Make ``pooling`` known under its name everywhere a pooling is named; returns it. A name
    is registered once: another pooling under it is a ``ValueError``."""
    if not isinstance(pooling, Pooling):
        raise ValueError(f"register_pooling: expected a Pooling, got {pooling!r}")
    return POOLINGS.register(pooling.name, pooling)


def get_pooling(name: str | Pooling, where: str = "pooling") -> Pooling:
    """The pooling named ``name`` (a ``Pooling`` is returned as it is); one line naming
    ``where`` (the option or file) and the registered names for an unknown one."""
    if isinstance(name, Pooling):
        return name
    entry = POOLINGS.get(str(name), where)
    if not isinstance(entry, Pooling):
        raise ValueError(
            f"{where}: pooling {name!r} is registered as {entry!r}, not a "
            "retromae_ds.hf.pooling.Pooling"
        )
    return entry


def check_pooling(name: str, where: str = "pooling", auto: bool = True) -> str:
    """``name``'s canonical spelling (``auto`` stays ``auto`` where allowed); one line naming
    ``where`` and the choices for anything else."""
    if isinstance(name, str) and auto and name.strip().lower() == AUTO:
        return AUTO
    if isinstance(name, str) and name in POOLINGS:  # a miss loads the installed packages'
        return get_pooling(name, where).name
    either = f"{AUTO} or " if auto else ""
    raise ValueError(
        f"{where}: unknown pooling {name!r}; expected {either}one of "
        f"{', '.join(pooling_names())} (or a package's {POOLINGS.group!r} entry point)"
    )


def pooling_names() -> tuple[str, ...]:
    """Every pooling's name, the installed packages' included, in registration order."""
    return POOLINGS.names(installed=True)


def head_pooling_names() -> tuple[str, ...]:
    """The names of the poolings that need the MLM head, the installed packages' included."""
    return tuple(name for name in pooling_names() if get_pooling(name).needs_head)


def registered() -> tuple[Pooling, ...]:
    """The poolings registered so far (the library's first; installed packages' entry points
    once some lookup has loaded them)."""
    return tuple(get_pooling(name) for name in POOLINGS.names())


def for_st_mode(flag: str) -> Pooling | None:
    """The pooling that the sentence-transformers flag ``flag`` (``pooling_mode_mean_tokens``)
    computes, the installed packages' included; None when none does."""
    for pooling in registered():
        if pooling.st_mode == flag:
            return pooling
    pooling_names()  # not the library's: load the installed packages' too
    return next((p for p in registered() if p.st_mode == flag), None)


class Choices:
    """``auto`` and the registered names, as an option's ``choices`` (``base.config.flag``):
    read when the line is parsed and ``--help`` shown, so an installed package's pooling is a
    choice too."""

    def __init__(self, auto: bool = True) -> None:
        self.auto = auto

    def _all(self) -> tuple[str, ...]:
        return ((AUTO,) if self.auto else ()) + pooling_names()

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (
            (self.auto and name.strip().lower() == AUTO) or name in POOLINGS
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"({', '.join(self._all())})"


def pool(
    hidden_BLH: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    pooling: str | Pooling,
    vocab_BV: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sentence embeddings ``[B, D]`` of a batch with the pooling named ``pooling``."""
    return get_pooling(pooling)(hidden_BLH, attention_mask_BL, vocab_BV)


# --------------------------------------------------------------------------- the library's
def _cls(hidden_BLH, attention_mask_BL, vocab_BV):
    return hidden_BLH[:, 0]


def _mean(hidden_BLH, attention_mask_BL, vocab_BV):
    mask_BL1 = attention_mask_BL.unsqueeze(-1).to(hidden_BLH.dtype)
    return (hidden_BLH * mask_BL1).sum(1) / mask_BL1.sum(1).clamp(min=1)


def _dupmae_bow(hidden_BLH, attention_mask_BL, vocab_BV):
    return vocab_BV


def _dupmae(hidden_BLH, attention_mask_BL, vocab_BV):
    import torch

    return torch.cat([hidden_BLH[:, 0].to(vocab_BV.dtype), vocab_BV], dim=-1)


CLS = register_pooling(Pooling(name="cls", function=_cls, st_mode="pooling_mode_cls_token"))
MEAN = register_pooling(Pooling(name="mean", function=_mean, st_mode="pooling_mode_mean_tokens"))


def _vocab_dim(hidden_size: int, vocab_size: int) -> int:
    return vocab_size


def _hidden_and_vocab_dim(hidden_size: int, vocab_size: int) -> int:
    return hidden_size + vocab_size


# module-level functions only: a Pooling pickles (a model holding one can be copied to workers)
DUPMAE_BOW = register_pooling(
    Pooling(name="dupmae_bow", function=_dupmae_bow, needs_head=True, dim=_vocab_dim)
)
DUPMAE = register_pooling(
    Pooling(name="dupmae", function=_dupmae, needs_head=True, dim=_hidden_and_vocab_dim)
)
