"""Targets for the Fisher: empirical (true labels) or Monte-Carlo (sampled from the model).

The Monte-Carlo ("true") Fisher samples ``y ~ p(y | x)`` from the model's predictive
distribution and back-propagates the negative log-likelihood of that sample. Supported
predictive distributions:

* ``"cross_entropy"``: categorical over the last dimension of the logits;
* ``"mse"``: unit-variance Gaussian centred on the output, so the per-sample gradient of
  ``½‖y − f‖²`` with respect to ``f`` is ``−ε`` with ``ε ~ N(0, I)``.

The sampled loss is a *sum* over every element divided by the batch size (the first
dimension), matching the "mean over B samples" convention the factors are scaled for, or,
with ``per_position``, by the number of rows (every dimension but the last: ``B·T`` for a
sequence), matching ``loss_average="positions"``.

The sampled backward is a ``torch.autograd.grad``, which a segment of
``torch.utils.checkpoint`` run with ``use_reentrant=True`` refuses (it supports only
``.backward()``); :func:`through_reentrant_checkpoint` tells that refusal apart.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import CheckpointFunction

MCLoss = Literal["cross_entropy", "mse"]
MC_LOSSES: tuple[str, ...] = ("cross_entropy", "mse")

REENTRANT_CHECKPOINT = (
    'fisher="mc" cannot run its sampled backward through torch.utils.checkpoint(..., '
    "use_reentrant=True): sample_fisher() runs torch.autograd.grad, which a reentrant "
    "checkpoint does not support (only .backward()). Checkpoint with use_reentrant=False "
    "(transformers: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    '{"use_reentrant": False})), or use fisher="empirical"'
)


def through_reentrant_checkpoint(tensor: Tensor) -> bool:
    """Whether the graph behind ``tensor`` holds a segment of ``torch.utils.checkpoint`` run
    with ``use_reentrant=True`` (walked only once a sampled backward has failed)."""
    seen: set[object] = set()
    stack: list[object] = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)  # held, so each node keeps one Python object while walked
        if getattr(node, "_forward_cls", None) is CheckpointFunction:
            return True
        stack.extend(edge[0] for edge in getattr(node, "next_functions", ()))
    return False


def mc_sample_loss(
    outputs: Tensor, loss: str, generator: torch.Generator | None, *, per_position: bool = False
) -> Tensor:
    """The negative log-likelihood of targets sampled from the model's own predictions.

    Args:
        outputs: Model outputs (logits for ``"cross_entropy"``), batch first.
        loss: ``"cross_entropy"`` or ``"mse"``.
        generator: Random generator on ``outputs.device`` (or ``None`` for the global one).
        per_position: Divide by the rows (``B·T``) instead of the batch size ``B``.

    Returns:
        A scalar whose gradient with respect to ``outputs`` is the sampled per-sample (or
        per-position) gradient divided by the batch size (or the rows).
    """
    if loss not in MC_LOSSES:
        raise ValueError(f"loss must be one of {MC_LOSSES}, got {loss!r}")
    if outputs.dim() == 0:
        raise ValueError("outputs must have a batch dimension")
    batch = outputs.shape[0] if outputs.dim() > 1 else 1
    if per_position and outputs.dim() > 1:
        batch = outputs.numel() // outputs.shape[-1]
    if loss == "cross_entropy":
        logits = outputs.reshape(-1, outputs.shape[-1])
        with torch.no_grad():
            probs = torch.softmax(logits.detach().float(), dim=-1)
            targets = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        return F.cross_entropy(logits.float(), targets, reduction="sum") / batch
    with torch.no_grad():
        noise = torch.randn(
            outputs.shape, generator=generator, device=outputs.device, dtype=torch.float32
        )
        targets = outputs.detach().float() + noise
    return 0.5 * (outputs.float() - targets).pow(2).sum() / batch
