"""The distillation losses (``retromae_ds.finetuning.distill``) against each anchor's formula on
fixed tensors: sentence-transformers' own loss classes where installed (they are), and
FlagEmbedding's, Tevatron's and RetroMAE's formulas written out as their code computes them
(those packages are not installed here; the lines they follow are cited)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retromae_ds.finetuning.distill import (
    PRESETS,
    DistillConfig,
    check_teacher_targets,
    distill_loss,
    group_scores,
)
from retromae_ds.finetuning.loss import contrastive_loss

B, G, D = 4, 3, 8
TAU = 0.05


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, D, generator=g), dim=-1).requires_grad_()
    p = F.normalize(torch.randn(B * G, D, generator=g), dim=-1).requires_grad_()
    teacher = torch.randn(B, G, generator=g) * 3  # cross-encoder logits
    return q, p, teacher


def ours(preset: str, q, p, teacher, temperature=TAU):
    """The run's loss with the preset: weight x distill + ce_weight x contrastive."""
    s = DistillConfig(**PRESETS[preset]).resolved(temperature)
    loss = s.weight * distill_loss(group_scores(q, p), teacher, s)
    if s.ce_weight:
        index = torch.arange(B * G)
        positives = (torch.arange(B) * G)[:, None]
        ce, _ = contrastive_loss(q, p, index, positives, temperature=temperature)
        loss = loss + s.ce_weight * ce
    return loss


def in_batch_ce(q, p, temperature):
    """FlagEmbedding's and RetroMAE's in-batch cross-entropy: every passage of the batch, the
    query's own positive (column i * G) the target."""
    scores = q @ p.T / temperature
    return F.cross_entropy(scores, torch.arange(B) * G)


def local(q, p):
    return torch.einsum("bd,bgd->bg", q, p.view(B, G, D))


def grads(loss, q, p):
    return torch.autograd.grad(loss, [q, p])


def test_flagembedding_kl_div_is_its_soft_cross_entropy_less_the_teacher_entropy(tensors):
    """FlagEmbedding ``AbsEmbedderModel``: teacher_targets = softmax(teacher_scores) (no
    temperature), student scores = q.p / temperature of the query's own group,
    ``-mean(sum(log_softmax(student) * teacher_targets))`` plus the in-batch cross-entropy.
    Ours is the KL: the same up to the teacher's entropy, with the same gradients."""
    q, p, teacher = tensors
    targets = torch.softmax(teacher, dim=-1)
    theirs = -torch.mean(torch.sum(torch.log_softmax(local(q, p) / TAU, -1) * targets, -1))
    theirs = theirs + in_batch_ce(q, p, TAU)
    entropy = -(targets * targets.log()).sum(-1).mean()
    mine = ours("flagembedding_kl_div", q, p, teacher)
    assert mine.item() == pytest.approx((theirs - entropy).item(), rel=1e-5)
    for a, b in zip(grads(mine, q, p), grads(theirs, q, p), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tevatron_kl_at_temperature_0_02(tensors):
    """Tevatron ``DistilTevatronTrainer.compute_loss``: the student's scores of each query's
    own group, log_softmax(student / T) against softmax(teacher / T), ``kl_div(...,
    reduction="batchmean")``, T = distil_temperature (0.02 here)."""
    q, p, teacher = tensors
    t = 0.02
    theirs = F.kl_div(
        torch.log_softmax(local(q, p) / t, 1), torch.softmax(teacher / t, 1), reduction="batchmean"
    )
    mine = ours("tevatron", q, p, teacher)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-5)


def test_retromae_kl_mean_plus_1e_4_contrastive(tensors):
    """RetroMAE ``BiEncoderModel.forward`` with ``teacher_score``: ``nn.KLDivLoss(reduction=
    "mean")`` of log_softmax(student / temperature) against softmax(teacher), plus
    ``contrastive_loss_weight`` (1e-4) x the in-batch cross-entropy."""
    q, p, teacher = tensors
    kl = torch.nn.KLDivLoss(reduction="mean")(
        F.log_softmax(local(q, p) / TAU, dim=-1), F.softmax(teacher, dim=-1)
    )
    theirs = kl + 1e-4 * in_batch_ce(q, p, TAU)
    mine = ours("retromae", q, p, teacher)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-5)
    for a, b in zip(grads(mine, q, p), grads(theirs, q, p), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _st_columns(q, p):
    return [q, *p.view(B, G, D).unbind(1)]


def test_sentence_transformers_distill_kl_div_itself(tensors):
    st = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
    q, p, teacher = tensors
    for t in (1.0, 2.0):
        loss = st.DistillKLDivLoss(None, temperature=t)
        theirs = loss.compute_loss_from_embeddings(_st_columns(q, p), teacher)
        cfg = DistillConfig(**PRESETS["st_distill_kl_div"], teacher_temperature=t,
                            student_temperature=t)  # fmt: skip
        mine = distill_loss(group_scores(q, p), teacher, cfg.resolved(TAU))
        assert mine.item() == pytest.approx(theirs.item(), rel=1e-5)
        for a, b in zip(grads(mine, q, p), grads(theirs, q, p), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_sentence_transformers_margin_mse_itself(tensors):
    st = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
    q, p, teacher = tensors
    theirs = st.MarginMSELoss(None).compute_loss_from_embeddings(_st_columns(q, p), teacher)
    mine = ours("st_margin_mse", q, p, teacher)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-5)
    for a, b in zip(grads(mine, q, p), grads(theirs, q, p), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_wrong_student_temperature_is_seen(tensors):
    """The golden tests can fail: Tevatron's formula at T 0.02 differs from ours at 0.05."""
    q, p, teacher = tensors
    theirs = F.kl_div(
        torch.log_softmax(local(q, p) / 0.05, 1), torch.softmax(teacher / 0.02, 1),
        reduction="batchmean",
    )  # fmt: skip
    assert ours("tevatron", q, p, teacher).item() != pytest.approx(theirs.item(), rel=1e-3)


def test_teacher_targets_nan_is_an_error_and_underflow_a_warning():
    with pytest.raises(ValueError, match="NaN"):
        check_teacher_targets(torch.tensor([[1.0, float("nan")]]), 1.0)
    assert check_teacher_targets(torch.tensor([[1.0, 0.0, -1.0]]), 1.0) is None
    warning = check_teacher_targets(torch.tensor([[10.0, -10.0, 0.0]]), 0.02)
    assert "underflows" in warning and "0.2" in warning


@pytest.mark.parametrize(
    "field, value",
    [("loss", "kd"), ("reduction", "sum"), ("scale", "t2"), ("teacher_temperature", 0.0)],
)
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"distill.{field}"):
        DistillConfig(**{"loss": "kl", field: value})


def test_resolved_defaults():
    assert DistillConfig(loss="kl").resolved(0.05).student_temperature == 0.05
    assert DistillConfig(loss="margin_mse").resolved(0.05).student_temperature == 1.0
    assert DistillConfig(loss="kl_ce").resolved(0.05).ce_weight == 1.0
    assert DistillConfig(loss="kl").resolved(0.05).ce_weight == 0.0
