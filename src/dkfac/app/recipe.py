"""SP-NGD's large-batch recipe (Osawa et al.): running mixup, weight rescaling, momentum rule.

Polynomial LR decay, the fourth ingredient, is ``--schedule poly`` (:mod:`dkfac.app.schedules`).

* :class:`RunningMixup`: the current batch is mixed with the previous *mixed* batch,
  ``x̃_t = λ_t x_t + (1 − λ_t) x̃_{t−1}`` and ``ỹ_t = λ_t onehot(y_t) + (1 − λ_t) ỹ_{t−1}``
  with ``λ ~ Beta(α, α)`` then ``λ ← max(λ, 1 − λ)``; the first batch (``t = 0``) is unmixed
  (``x̃_0 = x_0``, ``ỹ_0 = onehot(y_0)``). Targets are soft (a distribution over classes).
* :func:`rescale_weights`: after each optimizer step every ``Linear`` / ``Conv{1,2,3}d`` weight
  ``W`` (shape ``d_out × d_in × kernel...``) is rescaled, per layer, to Frobenius norm
  ``sqrt(2 · d_out)``: ``W ← sqrt(2 · d_out) · W / (‖W‖_F + ε)``. That is the expected norm of
  a He (fan-in) initialisation, whose ``d_out · fan_in`` entries have variance ``2 / fan_in``.
  Biases are not rescaled. It replaces weight decay (the CLI insists on ``--weight-decay 0``).
* :func:`scale_momentum`: momentum follows the learning rate, ``m_t = m_0 · lr_t / lr_0``
  (SP-NGD's rule; ``lr_0`` is the base rate, so ``m_t`` also shrinks during a warm-up).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

RESCALED_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
RESCALE_EPS = 1e-9


def mixing_weight(draw: float) -> float:
    """``max(λ, 1 − λ)`` for a draw ``λ ∈ [0, 1]`` of ``Beta(α, α)``.

    Raises:
        ValueError: If ``draw`` is not in [0, 1].
    """
    if not 0.0 <= draw <= 1.0:
        raise ValueError(f"a mixing draw must be in [0, 1], got {draw}")
    return max(draw, 1.0 - draw)


class RunningMixup:
    """The state of running mixup: the previous mixed inputs and soft targets.

    Args:
        num_classes: Number of classes of the one-hot targets (>= 1).
    """

    def __init__(self, num_classes: int) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be an integer >= 1, got {num_classes!r}")
        self.num_classes = num_classes
        self.inputs: Tensor | None = None
        self.targets: Tensor | None = None

    def mix(self, x: Tensor, y: Tensor, lam: float) -> tuple[Tensor, Tensor]:
        """Mixes batch ``(x, y)`` with the previous mixed batch and remembers the result.

        Args:
            x: Inputs of this batch, ``(N, ...)``.
            y: Integer labels ``(N,)``.
            lam: The weight of this batch, in [0.5, 1] (see :func:`mixing_weight`); ignored
                for the first batch, which is returned unmixed.

        Returns:
            The mixed inputs and soft targets ``(N, num_classes)`` (float32).

        Raises:
            ValueError: For a weight outside [0.5, 1] or a batch whose shape differs from the
                previous one.
        """
        if not 0.5 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0.5, 1] (max(λ, 1 − λ)), got {lam}")
        soft = nn.functional.one_hot(y.long(), self.num_classes).to(torch.float32)
        if self.inputs is None or self.targets is None:
            mixed_x, mixed_y = x, soft
        else:
            if self.inputs.shape != x.shape:
                raise ValueError(
                    f"running mixup needs equal batch shapes; previous {tuple(self.inputs.shape)}"
                    f", now {tuple(x.shape)}"
                )
            prev_x = self.inputs.to(device=x.device, dtype=x.dtype)
            mixed_x = lam * x + (1.0 - lam) * prev_x
            mixed_y = lam * soft + (1.0 - lam) * self.targets.to(soft.device)
        self.inputs, self.targets = mixed_x.detach(), mixed_y.detach()
        return mixed_x, mixed_y

    def state_dict(self) -> dict[str, Any]:
        """The chain's state (CPU tensors or ``None``), for a checkpoint."""
        return {
            "num_classes": self.num_classes,
            "inputs": None if self.inputs is None else self.inputs.cpu(),
            "targets": None if self.targets is None else self.targets.cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`.

        Raises:
            ValueError: If the number of classes differs.
        """
        if int(state["num_classes"]) != self.num_classes:
            raise ValueError(
                f"running mixup state has {state['num_classes']} classes, not {self.num_classes}"
            )
        self.inputs, self.targets = state["inputs"], state["targets"]


def he_norm(weight: Tensor) -> float:
    """``sqrt(2 · d_out)``, the rescaling target of a weight of shape ``(d_out, ...)``."""
    return math.sqrt(2.0 * weight.shape[0])


@torch.no_grad()
def rescale_weights(model: nn.Module) -> int:
    """Rescales every Linear / Conv weight of ``model`` to Frobenius norm ``sqrt(2 · d_out)``.

    Returns:
        The number of weights rescaled.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, RESCALED_TYPES):
            weight = module.weight
            norm = torch.linalg.vector_norm(weight.float())
            weight.mul_((he_norm(weight) / (norm + RESCALE_EPS)).to(weight.dtype))
            count += 1
    return count


def scale_momentum(optimizer: torch.optim.Optimizer, base_momentum: float) -> None:
    """Sets each group's momentum to ``base_momentum · lr / initial_lr``.

    SGD groups get ``momentum``, Adam groups ``betas[0]``. ``initial_lr`` is the base rate an
    LR scheduler records in every group (the group's ``lr`` when there is none).

    Raises:
        ValueError: If ``base_momentum`` is not in [0, 1).
    """
    if not 0.0 <= base_momentum < 1.0:
        raise ValueError(f"base_momentum must be in [0, 1), got {base_momentum}")
    for group in optimizer.param_groups:
        base_lr = float(group.get("initial_lr", group["lr"]))
        ratio = min(float(group["lr"]) / base_lr, 1.0) if base_lr > 0 else 1.0
        momentum = base_momentum * ratio
        if "betas" in group:
            group["betas"] = (momentum, group["betas"][1])
        elif "momentum" in group:
            group["momentum"] = momentum
