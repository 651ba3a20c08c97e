"""GradCache (Gao et al. 2021): a contrastive step over a large batch in the memory of a chunk.

``--grad_cache.query_chunk N --grad_cache.passage_chunk M`` (0 = off). One micro-batch is
stepped in three passes instead of one forward and one backward:

1. every query chunk and every passage chunk is embedded without a graph, the random-number
   state (CPU, and CUDA when the batch is there) saved before each chunk's forward;
2. on the whole micro-batch's embeddings, the fine-tuning loss (hard negatives, in-batch
   negatives gathered from every rank) and its gradient with respect to each embedding are
   computed (``DualEncoder.loss_grads``; in one piece, or ``loss_chunk`` queries at a time so
   that the scores held at once are ``[loss_chunk, W*P]``), and the gradients kept;
3. each chunk is embedded again, with a graph and its random-number state restored (the same
   dropout masks), and ``engine.backward`` runs through ``(embeddings * cached gradient).sum()``,
   so the parameter gradients accumulate to those of one backward through the whole batch.

Under DeepSpeed the chunks' backward passes are one micro-batch (``components.engine.
backward_parts``): only the last may close the gradient-accumulation boundary, so ZeRO 0-3
reduce exactly what the plain step reduces. The gathered loss's backward all-reduces the
embeddings' gradients in pass 2, so each rank's chunks get the gradient of every rank's loss.
The random-number state ends where pass 1 left it, so a checkpoint's saved state (and exact
resume) does not depend on how many chunks there were beyond what pass 1 drew. The logged
loss and accuracy are pass 2's: the micro-batch's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from retromae_ds.components import engine as eng


@dataclass(kw_only=True)
class GradCacheConfig:
    query_chunk: int = 0
    """Queries embedded per chunk (0: GradCache off unless passage_chunk is set; then the
    queries are one chunk)."""
    passage_chunk: int = 0
    """Passages embedded per chunk (0: off unless query_chunk is set; then one chunk)."""
    loss_chunk: int = 0
    """Queries scored at once in the second pass (0: the whole micro-batch, the plain step's
    own arithmetic). N holds the score matrix to ``[N, all passages of all ranks]`` at large
    batches; the gradients then differ from the plain step's by fp32 rounding of the
    regrouped matrix products (up to about 1e-3 of the largest in the tests)."""

    def __post_init__(self) -> None:
        for name in ("query_chunk", "passage_chunk", "loss_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"grad_cache.{name} must be >= 0 (0: off), not {getattr(self, name)}"
                )

    @property
    def enabled(self) -> bool:
        return self.query_chunk > 0 or self.passage_chunk > 0


RngState = tuple[torch.Tensor, torch.Tensor | None]


def rng_state(device: torch.device) -> RngState:
    """The CPU generator's state, and the CUDA one of ``device`` when it is a GPU."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


@dataclass(frozen=True)
class Chunk:
    tower: str
    """``query`` or ``passage``: what ``DualEncoder.forward(embed=...)`` embeds."""
    inputs: dict[str, torch.Tensor]
    """``ids``, ``mask``: the chunk's rows."""


def chunks(batch: dict[str, torch.Tensor], query_chunk: int, passage_chunk: int) -> list[Chunk]:
    """The batch's queries then passages in chunks of the given sizes (0: one chunk; the last
    chunk of each holds what is left)."""
    out = []
    for tower, prefix, size in (("query", "q", query_chunk), ("passage", "p", passage_chunk)):
        ids, mask = batch[f"{prefix}_ids"], batch[f"{prefix}_mask"]
        size = size or ids.shape[0]
        for start in range(0, ids.shape[0], size):
            part = {"ids": ids[start : start + size], "mask": mask[start : start + size]}
            out.append(Chunk(tower, part))
    return out


class GradCache:
    """The fine-tuning step of ``training.loop.Hooks.forward_backward``: ``__call__(engine,
    batch, autocast)`` runs the three passes and returns ``{"loss", "accuracy"}`` (detached).
    ``loss_grads(q_BD, p_PD, batch, chunk)`` is the model's loss with its gradients to the
    embeddings (``DualEncoder.loss_grads``)."""

    def __init__(
        self,
        cfg: GradCacheConfig,
        loss_grads: Callable[..., tuple[torch.Tensor, ...]],
    ) -> None:
        if not cfg.enabled:
            raise ValueError("grad_cache: set query_chunk or passage_chunk to a size > 0")
        self.cfg, self.loss_grads = cfg, loss_grads

    def __call__(
        self, engine: Any, batch: dict[str, torch.Tensor], autocast: torch.autocast
    ) -> dict[str, torch.Tensor]:
        device = batch["q_ids"].device
        parts = chunks(batch, self.cfg.query_chunk, self.cfg.passage_chunk)
        states, reps = [], []
        with torch.no_grad():
            for part in parts:
                states.append(rng_state(device))
                with autocast:
                    reps.append(engine(part.inputs, embed=part.tower))
        after = rng_state(device)
        grads, loss, accuracy = self._cached_gradients(parts, reps, batch, autocast)

        def part_loss(i: int) -> torch.Tensor:
            set_rng_state(states[i], device)
            with autocast:
                rep = engine(parts[i].inputs, embed=parts[i].tower)
            return (rep * grads[i]).sum()

        eng.backward_parts(engine, len(parts), part_loss)
        set_rng_state(after, device)
        return {"loss": loss.detach(), "accuracy": accuracy}

    def _cached_gradients(
        self,
        parts: list[Chunk],
        reps: list[torch.Tensor],
        batch: dict[str, torch.Tensor],
        autocast: torch.autocast,
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(d loss / d each chunk's embeddings, the loss, the accuracy): pass 2."""
        towers = [part.tower for part in parts]
        q_BD = torch.cat([r for r, t in zip(reps, towers, strict=True) if t == "query"])
        p_PD = torch.cat([r for r, t in zip(reps, towers, strict=True) if t == "passage"])
        chunk = self.cfg.loss_chunk or q_BD.shape[0]
        with autocast:
            loss, accuracy, grad_q, grad_p = self.loss_grads(q_BD, p_PD, batch, chunk)
        sizes = [r.shape[0] for r in reps]
        n_query = towers.count("query")
        grads = [*grad_q.split(sizes[:n_query]), *grad_p.split(sizes[n_query:])]
        return grads, loss, accuracy
