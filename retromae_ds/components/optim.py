"""AdamW with decoupled weight decay groups, and the warm-up + decay learning-rate schedule
(with an optional heads-only warm-up, ``encoder_frozen_steps``)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and LayerNorm weights)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up steps (0: use warmup_ratio)."""
    warmup_ratio: float = 0.1
    """Warm-up as a share of max_steps when warmup_steps is 0."""
    schedule: str = "linear"
    """Decay after warm-up: linear, cosine or constant."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    decoder_lr_scale: float = 1.0
    """Multiplier on the learning rate of the pre-training decoder's parameters (RetroMAE's
    and SEED-Encoder's decoder, trained from scratch on top of a continued encoder; the
    encoder and its MLM head keep ``lr``). 1.0: one learning rate for every parameter."""
    encoder_frozen_steps: int = 0
    """Heads-only warm-up: the encoder body's learning rate is 0 for the first N steps while
    the heads (MLM transform, decoder) learn, e.g. when continuing from a checkpoint that
    ships without them; afterwards the body follows the schedule over the remaining steps."""

    def __post_init__(self) -> None:
        if not self.decoder_lr_scale > 0:
            raise ValueError(f"optim.decoder_lr_scale must be > 0, not {self.decoder_lr_scale}")
        if self.schedule not in ("linear", "cosine", "constant"):
            raise ValueError(
                f"optim.schedule must be linear, cosine or constant, not {self.schedule!r}"
            )


def lr_lambda(cfg: OptimConfig, max_steps: int):
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * max_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        if cfg.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    return factor


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norms. With ``encoder_frozen_steps`` the encoder
    body's parameters get groups of their own (marked ``body``) for ``build_scheduler``; with
    ``decoder_lr_scale`` != 1 the model's ``decoder`` gets groups of their own at
    ``lr * decoder_lr_scale`` (the schedule scales every group alike)."""
    body = set()
    if cfg.encoder_frozen_steps:
        encoder = getattr(model, "encoder", None)
        if encoder is None or not hasattr(encoder, "base_model"):
            raise ValueError("optim.encoder_frozen_steps needs a model with an encoder body")
        body = {id(p) for p in encoder.base_model.parameters()}
    decoder = set()
    if cfg.decoder_lr_scale != 1.0:
        module = getattr(model, "decoder", None)
        if module is None:
            raise ValueError(
                "optim.decoder_lr_scale needs a model with a decoder (objective retromae or "
                f"seed); this one has none: leave it at 1.0, not {cfg.decoder_lr_scale}"
            )
        decoder = {id(p) for p in module.parameters()}
    groups: dict[tuple[bool, bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decays = not (p.ndim < 2 or "norm" in name.lower())
        groups.setdefault((id(p) in body, id(p) in decoder, decays), []).append(p)
    param_groups = [
        {"params": groups[key], "weight_decay": cfg.weight_decay if key[2] else 0.0}
        | ({"body": True} if key[0] else {})
        | ({"lr": cfg.lr * cfg.decoder_lr_scale} if key[1] else {})
        for key in itertools.product((False, True), (False, True), (True, False))
        if key in groups
    ]
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The warm-up + decay schedule; the encoder body's groups wait ``encoder_frozen_steps``
    at learning rate 0, then run the same schedule over the remaining steps."""
    heads = lr_lambda(cfg, max_steps)
    frozen = cfg.encoder_frozen_steps
    if not frozen:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, heads)
    if frozen >= max_steps:
        raise ValueError(f"optim.encoder_frozen_steps ({frozen}) must be < max_steps ({max_steps})")
    later = lr_lambda(cfg, max_steps - frozen)

    def body(step: int) -> float:
        return 0.0 if step < frozen else later(step - frozen)

    lambdas = [body if g.get("body") else heads for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
