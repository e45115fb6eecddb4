"""Finds gradients scaled by a ``GradScaler`` that the preconditioner was not given.

Under ``torch.amp.GradScaler`` the backward runs on ``s · loss``: the capture hooks see
output gradients ``s`` times too large, and ``scaler.unscale_`` divides only the parameters'
gradients. Without ``grad_scaler=`` the output-gradient factors are then ``s²`` too large.
The hooks of the first steps also add up each biased linear layer's raw output-gradient rows,
whose sum is exactly the bias's gradient (the folded bias column of the weight gradient); the
ratio of the two is ``s`` after unscaling (a power of two) and 1 without a scaler. One host
synchronisation on one of the first steps, then never again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dkfac.engine.capture import FactorCapture
from dkfac.engine.layer_state import LayerState

__all__ = ["MAX_CHECKS", "ScalerCheck", "gradient_ratio", "looks_scaled", "warn_if_scaled"]

logger = logging.getLogger(__name__)

MAX_CHECKS = 3
"""Steps on which the check is tried before it is given up (no biased layer had gradients)."""


def gradient_ratio(
    layers: Mapping[str, LayerState], sums: Mapping[str, Tensor], skip: Collection[str] = ()
) -> float | None:
    """``Σ⟨c, b⟩ / Σ⟨b, b⟩`` over the layers of ``sums``: ``c`` the captured column sums,
    ``b`` the bias gradients as ``step()`` sees them; ``None`` when every ``b`` is zero.

    A layer whose gradient is sharded (a ``DTensor``: FSDP2 holds this rank's rows of it
    at the start of ``step()``, the sums hold every row) is left out, and so are the
    layers of ``skip`` (whose full gradient this rank never holds)."""
    dot = torch.zeros((), dtype=torch.float64)
    norm = torch.zeros((), dtype=torch.float64)
    for name, captured in sums.items():
        if name in skip:
            continue
        grad = layers[name].block.weight_grad()
        if grad is None or isinstance(grad, DTensor):
            continue
        bias = grad[:, -1].double()
        dot += (captured.double() * bias).sum().cpu()
        norm += bias.square().sum().cpu()
    if not (norm > 0 and torch.isfinite(dot) and torch.isfinite(norm)):
        return None
    return float(dot / norm)


def looks_scaled(ratio: float, world_size: int) -> bool:
    """Whether ``ratio`` is a loss scale: a power of two >= 2 (one process: the column sums
    and the gradient are the same numbers), or >= 2¹⁰ (several: the gradient is the ranks'
    average, the sums are this rank's)."""
    if ratio >= 2.0**10:
        return True
    if world_size > 1 or ratio < 2.0:
        return False
    return _power_of_two(ratio)


def _power_of_two(ratio: float) -> bool:
    power = math.log2(ratio)
    return abs(power - round(power)) < 0.01


SMALL_SCALE = 2.0**10
"""Below this a power of two is more likely gradient clipping than a loss scale (a
``GradScaler`` starts at 2¹⁶ and halves only on overflows): the warning says both."""


def warn_if_scaled(ratio: float, world_size: int) -> bool:
    """Logs the one warning when ``ratio`` looks like an unannounced loss scale. On one
    process a ratio that is no power of two, or one below :data:`SMALL_SCALE`, may also be
    gradient clipping between the backward and ``step()`` (``clip_grad_norm_`` divides the
    gradients, not the captured sums; the Trainer clips by default), which the warning then
    says."""
    if not looks_scaled(ratio, world_size):
        return False
    reason = None
    if world_size == 1 and not _power_of_two(ratio):
        reason = "the ratio is no power of two"
    elif world_size == 1 and ratio < SMALL_SCALE:
        reason = "a loss scale this small is rare (a GradScaler starts at 2**16)"
    logger.warning(
        "the output gradients the K-FAC hooks captured are %.4g times the parameters' "
        "gradients at step(): a torch.amp.GradScaler (or another loss scale) scales the "
        "backward but was not given to the preconditioner, so the output-gradient factors "
        "are about %.3g times too large; pass grad_scaler=scaler to KFACPreconditioner "
        "(KFACOptimizer.for_model(model, grad_scaler=scaler))%s",
        ratio,
        ratio**2,
        f"; {reason}, so if the gradients were clipped by that factor between the backward "
        "and step() (clip_grad_norm_) and no loss scale is used, nothing is wrong"
        if reason
        else "",
    )
    return True


class ScalerCheck:
    """The check of a preconditioner: on until a step decides it (or :data:`MAX_CHECKS`).

    Args:
        capture: The hooks that record the column sums (:attr:`FactorCapture.checking`).
        enabled: ``False`` when a scaler was given (nothing to find).
    """

    def __init__(self, capture: FactorCapture, enabled: bool) -> None:
        self.capture = capture
        self.tries = 0
        capture.checking = enabled and capture.config.fisher == "empirical"

    def step(
        self,
        layers: Mapping[str, LayerState],
        grad_scaler: Any,
        world_size: int,
        skip: Collection[str] = (),
    ) -> None:
        """At the start of ``step()``: compares this step's sums with the gradients, once
        (``skip``: layers left out, see :func:`gradient_ratio`)."""
        capture = self.capture
        if not (capture.checking and capture.bias_sums):
            return
        if grad_scaler is not None:  # given after construction
            capture.checking = False
            return
        self.tries += 1
        ratio = gradient_ratio(layers, capture.bias_sums, skip)
        if ratio is not None or self.tries >= MAX_CHECKS:
            capture.checking = False
        if ratio is not None:
            warn_if_scaled(ratio, world_size)
