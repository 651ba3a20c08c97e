"""Distillation of a teacher's scores into the dual encoder (``--distill.loss``).

Per query, the student's scores of its own group (its positive, then its ``n_hard`` hard
negatives: ``s_ij = q_i . p_ij``, cosine with normalised embeddings) are held against the
teacher's scores of the same passages ``t_ij`` (a cross-encoder's logits, read from a file or
scored online):

- ``kl``: KL(softmax(t / T_t) || softmax(s / T_s)), per query, averaged over queries
  (``reduction batchmean``) or over every (query, passage) entry (``mean``, torch's
  ``KLDivLoss(reduction="mean")``); times ``T_s**2`` with ``scale student_t2``.
- ``kl_ce``: ``weight`` x that KL plus ``ce_weight`` x the run's contrastive loss (in-batch and
  cross-rank negatives included).
- ``margin_mse``: the mean over (query, negative) of ``((s_pos - s_neg) / T_s - (t_pos -
  t_neg))**2`` (Hofstaetter et al. 2020).

``T_s`` defaults to the run's contrastive temperature (``kl``, ``kl_ce``) and to 1 for
``margin_mse``; ``T_t`` to 1. With them the anchors' losses are settings of this one
(``PRESETS``; ``tests/test_distill.py`` holds each to its anchor's formula on fixed tensors):

- FlagEmbedding ``kd_loss_type kl_div`` (``AbsEmbedderModel.distill_loss``): ``kl_ce``,
  T_t 1, T_s the run's temperature, batchmean, ``ce_weight`` 1. FlagEmbedding computes the
  soft cross-entropy ``-sum p_t log p_s``, which is this KL plus the teacher's entropy: a
  constant of the teacher, so the gradients are the same and the values differ by it.
- Tevatron (``DistilTevatronTrainer``): ``kl``, T_t = T_s = 0.02, batchmean.
- RetroMAE (``BiEncoderModel`` with ``teacher_score``): ``kl_ce``, T_t 1, T_s the run's
  temperature, reduction ``mean``, ``ce_weight`` 1e-4 (its ``contrastive_loss_weight``).
- sentence-transformers ``DistillKLDivLoss``: ``kl``, ``scale student_t2``.
- sentence-transformers ``MarginMSELoss``: ``margin_mse`` (dot-product scores, T 1).

The first batch's teacher targets are checked as sentence-transformers'
``check_teacher_targets`` does: a NaN is an error; probabilities that underflow to exactly
zero (a row's spread / T_t above about 100 in fp32) are warned about once, with the
temperature that would keep them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

LOSSES = ("none", "kl", "kl_ce", "margin_mse")
REDUCTIONS = ("batchmean", "mean")
SCALES = ("none", "student_t2")


@dataclass(kw_only=True)
class DistillConfig:
    loss: str = "none"
    """none, kl (teacher -> student KL over each query's group), kl_ce (that plus the
    contrastive loss) or margin_mse (the positive-negative margins' squared error)."""
    teacher_temperature: float = 1.0
    """The teacher's scores are divided by it before their softmax (kl, kl_ce)."""
    student_temperature: float | None = None
    """The student's scores are divided by it; none: the run's contrastive temperature (kl,
    kl_ce) or 1 (margin_mse)."""
    weight: float = 1.0
    """Weight of the distillation term."""
    ce_weight: float | None = None
    """Weight of the contrastive term; none: 1 with kl_ce, else 0 (FlagEmbedding's kl_div: 1;
    RetroMAE's: 1e-4)."""
    reduction: str = "batchmean"
    """KL averaged per query (batchmean) or per (query, passage) entry (mean: RetroMAE's)."""
    scale: str = "none"
    """student_t2: the KL times the student temperature squared (sentence-transformers')."""
    scores: str = ""
    """Teacher scores, offline: a file in an anchor's format (retromae_ds.data.teacher_scores:
    RetroMAE's ``qid did score``, Hofstaetter's TSV, SimLM's jsonl, ...) naming the training
    queries' and passages' ids. The queries' negatives become the passages it scores (their
    positives excluded); a run on a pairs file with scores (FlagEmbedding's pos_scores and
    neg_scores, an ST scores column, Tevatron's score) needs no file."""
    scores_format: str = "auto"
    """The format of ``scores`` (auto: detected from the file)."""
    teacher: str = ""
    """Teacher scores, online: a cross-encoder (folder, checkpoint or run folder;
    ``finetune --model.kind cross_encoder`` trains one) that scores every negatives version as
    it is published: BM25's (or the pairs file's) first one and each one a refresher mines
    (``refresher.teacher``; it sets ``refresh.teacher``)."""

    def __post_init__(self) -> None:
        checks = (("loss", LOSSES), ("reduction", REDUCTIONS), ("scale", SCALES))
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"distill.{name} must be one of {', '.join(allowed)}, not "
                    f"{getattr(self, name)!r}"
                )
        for name in ("teacher_temperature", "student_temperature"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"distill.{name} must be > 0, not {value}")
        if self.weight < 0 or (self.ce_weight is not None and self.ce_weight < 0):
            raise ValueError("distill.weight and distill.ce_weight must be >= 0")
        if (self.scores or self.teacher) and not self.enabled:
            raise ValueError(
                "distill.scores and distill.teacher serve a distillation loss: give --distill.loss"
            )
        if self.scores and self.teacher:
            raise ValueError("give one teacher: distill.scores (offline) or distill.teacher")

    @property
    def enabled(self) -> bool:
        return self.loss != "none"

    def resolved(self, temperature: float) -> DistillSettings:
        """The settings a run trains with at contrastive ``temperature``."""
        student = self.student_temperature
        if student is None:
            student = 1.0 if self.loss == "margin_mse" else temperature
        ce = self.ce_weight if self.ce_weight is not None else float(self.loss == "kl_ce")
        return DistillSettings(
            loss=self.loss,
            teacher_temperature=self.teacher_temperature,
            student_temperature=student,
            weight=self.weight,
            ce_weight=ce,
            reduction=self.reduction,
            scale=self.scale,
        )


@dataclass(frozen=True, kw_only=True)
class DistillSettings:
    """A run's resolved distillation settings (``DistillConfig.resolved``)."""

    loss: str
    teacher_temperature: float = 1.0
    student_temperature: float = 1.0
    weight: float = 1.0
    ce_weight: float = 0.0
    reduction: str = "batchmean"
    scale: str = "none"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


PRESETS: dict[str, dict[str, Any]] = {
    "flagembedding_kl_div": {"loss": "kl_ce", "teacher_temperature": 1.0, "ce_weight": 1.0},
    "tevatron": {"loss": "kl", "teacher_temperature": 0.02, "student_temperature": 0.02},
    "retromae": {"loss": "kl_ce", "reduction": "mean", "ce_weight": 1e-4},
    "st_distill_kl_div": {"loss": "kl", "scale": "student_t2"},
    "st_margin_mse": {"loss": "margin_mse"},
}
"""The anchors' losses as ``DistillConfig`` fields (the module docstring says how each is
held to its anchor)."""


def group_scores(q_BD: torch.Tensor, p_PD: torch.Tensor) -> torch.Tensor:
    """``[B, G]``: each query's scores of its own group of ``G = P / B`` passages."""
    batch = q_BD.shape[0]
    p_BGD = p_PD.reshape(batch, -1, p_PD.shape[-1])
    return torch.einsum("bd,bgd->bg", q_BD.float(), p_BGD.float())


def distill_loss(
    student_BG: torch.Tensor, teacher_BG: torch.Tensor, s: DistillSettings
) -> torch.Tensor:
    """The distillation term (before ``weight``) of raw student scores ``student_BG`` against
    the teacher's ``teacher_BG`` (column 0 the positive)."""
    if student_BG.shape != teacher_BG.shape:
        raise ValueError(
            f"teacher scores {tuple(teacher_BG.shape)} for student scores {tuple(student_BG.shape)}"
        )
    student = student_BG.float() / s.student_temperature
    teacher = teacher_BG.detach().float()
    if s.loss == "margin_mse":
        margins = student[:, :1] - student[:, 1:]
        return F.mse_loss(margins, teacher[:, :1] - teacher[:, 1:])
    target = torch.softmax(teacher / s.teacher_temperature, dim=-1)
    kl = F.kl_div(torch.log_softmax(student, dim=-1), target, reduction="sum")
    # batchmean: per query; mean: per entry, torch's deprecated "mean" spelled out
    kl = kl / (target.shape[0] if s.reduction == "batchmean" else target.numel())
    return kl * s.student_temperature**2 if s.scale == "student_t2" else kl


def check_teacher_targets(teacher_BG: torch.Tensor, temperature: float) -> str | None:
    """A warning (one line) when the teacher's softmax at ``temperature`` underflows to zero
    for some candidates, else None; NaN or infinite teacher scores are a ValueError."""
    scores = teacher_BG.detach().float()
    if not torch.isfinite(scores).all():
        raise ValueError(
            "distillation: the teacher scores hold NaN or infinite values; the loss and every "
            "gradient would be NaN"
        )
    probs = torch.softmax(scores / temperature, dim=-1)
    zeros = int((probs == 0).sum())
    if not zeros:
        return None
    spread = float((scores.max(-1).values - scores.min(-1).values).max())
    return (
        f"distillation: teacher_temperature {temperature:g} underflows {zeros} of "
        f"{probs.numel()} teacher probabilities to exactly 0 (the widest group spans "
        f"{spread:.1f}); those candidates carry no gradient: raise --distill."
        f"teacher_temperature above {math.ceil(spread / 100 * 1000) / 1000:g}"
    )
