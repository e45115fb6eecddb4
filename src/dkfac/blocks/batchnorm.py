"""Block for BatchNorm layers: SP-NGD's unit-wise (2×2 per channel) Fisher over (γ, β).

In training mode (batch statistics) the forward hook keeps ``x̂``, the normalised input,
computed from the layer's input exactly as the layer does (never by dividing the output by
``γ``, which may be 0). The backward hook turns ``x̂`` and the output gradient ``δ`` into the
per-sample gradients ``gγ_n = Σ_spatial δ_n x̂_n`` and ``gβ_n = Σ_spatial δ_n`` and adds
``Σ_n [gγ, gβ][gγ, gβ]ᵀ`` per channel to the statistic ``"F"`` (``(C, 2, 2)``), averaged over
samples. The gradient matrix is ``(C, 2)`` = ``[∇γ, ∇β]``, preconditioned by
:class:`~dkfac.solvers.unitwise.UnitwiseSolver`. Layers in eval mode, or without batch
statistics, capture nothing. Works for ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` (whose
``x̂`` uses global statistics: there the per-sample gradients treat the local batch moments
as an approximation, as SP-NGD does).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from dkfac.blocks.base import (
    GROUP_MAX_ELEMENTS,
    Block,
    BlockCost,
    CostKind,
    HeldForward,
    Rows,
    StatisticSink,
    gradient_write,
)
from dkfac.blocks.unitwise_stats import (
    batch_moments,
    grouped_unit_fisher,
    per_sample_grads,
    unit_fisher,
)


class BatchNormBlock(Block):
    """Unit-wise Fisher of an affine BatchNorm layer."""

    solver_name: ClassVar[str | None] = "unitwise"
    grad_statistics: ClassVar[tuple[str, ...]] = ("F",)
    damping_key: ClassVar[str] = "bn_damping"
    cost_kind: ClassVar[str] = "batchnorm"
    module: _BatchNorm

    @classmethod
    def declines(cls, module: nn.Module, *, unitwise: bool = True, **options: Any) -> str | None:
        """Without affine parameters there is nothing to train; ``unitwise=False``
        (``KFACConfig.unitwise_bn``) leaves BatchNorm to the inner optimizer."""
        del options
        if not getattr(module, "affine", False):
            return "no affine parameters"
        return None if unitwise else "unitwise_bn=False"

    def cost_description(self) -> BlockCost:
        """A unit-wise 2×2 block per channel."""
        return BlockCost(self.cost_kind, 2, self.channels, unitwise=True, forward_flops=False)

    def __init__(self, name: str, module: nn.Module) -> None:
        if not isinstance(module, _BatchNorm):
            raise TypeError(f"{name}: BatchNormBlock needs a BatchNorm module")
        if not module.affine:
            raise ValueError(f"{name}: BatchNorm without affine parameters has nothing to train")
        super().__init__(name, module)

    @property
    def channels(self) -> int:
        """Number of channels ``C``."""
        return int(self.module.num_features)

    @property
    def a_dim(self) -> int:
        """2: the unit ``(γ_c, β_c)`` (reported in ``describe()``)."""
        return 2

    @property
    def g_dim(self) -> int:
        """Channels ``C``."""
        return self.channels

    def a_rows(self, inputs: Tensor) -> Rows:
        """Not a Kronecker block."""
        raise TypeError("BatchNormBlock has no Kronecker rows")

    def g_rows(self, grad_output: Tensor) -> Rows:
        """Not a Kronecker block."""
        raise TypeError("BatchNormBlock has no Kronecker rows")

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"F": (C, 2, 2)}``."""
        return {"F": (self.channels, 2, 2)}

    def capture_input(self, inputs: Tensor, sinks: Mapping[str, StatisticSink]) -> Any:
        """The input and its batch moments (``None`` when the layer uses running statistics).

        The input is kept by reference (autograd keeps it for the layer's own backward;
        the capture reads it without gradients); ``x̂`` is never materialised.
        """
        module = self.module
        if "F" not in sinks or (not module.training and module.track_running_stats):
            return None
        if inputs.dim() < 2 or inputs.shape[0] < 2:
            return None  # a single sample has no batch statistics
        mean, inv_std = batch_moments(inputs, module.eps)
        return inputs, mean, inv_std

    def capture_grad(
        self, context: Any, grad_output: Tensor, sinks: Mapping[str, StatisticSink], scale: float
    ) -> None:
        """Adds the per-channel sum of per-sample outer products to ``"F"``."""
        if context is None:
            return
        inputs, mean, inv_std = context
        g_gamma, g_beta = per_sample_grads(
            inputs, mean.to(grad_output.dtype), inv_std.to(grad_output.dtype), grad_output
        )
        sinks["F"].add_sum(unit_fisher(g_gamma, g_beta), float(grad_output.shape[0]), scale)

    def group_key(
        self, inputs: Tensor, grad_output: Tensor, sinks: Mapping[str, StatisticSink]
    ) -> Hashable | None:
        """BatchNorm layers with batch statistics, of one input shape, dtype and ``eps``
        (inputs of at most :data:`GROUP_MAX_ELEMENTS` entries), whose ``"F"`` takes sums
        of one precision."""
        module = self.module
        sink = sinks.get("F")
        if sink is None or not sink.takes_sums or len(sinks) != 1:
            return None
        if not module.training and module.track_running_stats:
            return None
        if inputs.dim() < 2 or inputs.shape[0] < 2 or inputs.shape != grad_output.shape:
            return None
        if inputs.dtype != grad_output.dtype or inputs.numel() > GROUP_MAX_ELEMENTS:
            return None
        shape = tuple(inputs.shape)
        return (type(self), shape, inputs.dtype, inputs.device, float(module.eps), sink.dtype)

    @classmethod
    def capture_group(cls, members: Sequence[HeldForward]) -> None:
        """The unit-wise sums of the group's layers from their stacked inputs and output
        gradients (:func:`~dkfac.blocks.unitwise_stats.grouped_unit_fisher`), scaled once,
        and handed to each sink as a view of the result."""
        first = members[0]
        if len(members) < 2 or len({held.scale for held in members}) > 1:
            super().capture_group(members)
            return
        module = first.block.module
        assert isinstance(module, _BatchNorm)
        inputs = torch.stack([held.inputs for held in members])
        grads = torch.stack([held.grad for held in members])
        fishers = grouped_unit_fisher(inputs, grads, float(module.eps))
        dtype = first.sinks["F"].dtype
        if dtype is not None:
            fishers = fishers.to(dtype)
        if first.scale != 1.0:
            fishers.mul_(first.scale)
        batch = float(first.grad.shape[0])
        for held, part in zip(members, fishers.unbind(0), strict=True):
            held.sinks["F"].add_sum(part, batch)

    def placement_cost(self, kind: CostKind = "compute") -> float:
        """A closed-form 2×2 solve per channel: ``8C`` (compute) or ``4C`` (memory)."""
        return float((8 if kind == "compute" else 4) * self.channels)

    def weight_grad(self) -> Tensor | None:
        """``[∇γ, ∇β]`` as a ``(C, 2)`` matrix, or ``None`` without a gradient."""
        weight, bias = self.module.weight, self.module.bias
        if weight.grad is None and bias.grad is None:
            return None
        gamma = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        beta = bias.grad if bias.grad is not None else torch.zeros_like(bias)
        return torch.stack([gamma, beta], dim=1)

    def grad_sources(self) -> list[Tensor] | None:
        """``γ.grad`` and ``β.grad`` (``None`` where one is missing)."""
        grads = [self.module.weight.grad, self.module.bias.grad]
        return None if any(grad is None for grad in grads) else grads  # type: ignore[return-value]

    def grad_shape(self) -> tuple[int, int]:
        """``(C, 2)``."""
        return (self.channels, 2)

    def grad_layout(self, matrix: Tensor) -> list[Tensor]:
        """The two columns of a ``(C, 2)`` matrix."""
        return list(matrix.unbind(1))

    def grad_writes(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        """A ``(C, 2)`` matrix's columns into ``γ.grad`` and ``β.grad`` (each created as
        zeros where missing, none for a frozen one: :func:`~dkfac.blocks.base.gradient_write`)."""
        params = (self.module.weight, self.module.bias)
        return [
            write
            for param, column in zip(params, matrix.unbind(1), strict=True)
            for write in gradient_write(param, column)
        ]

    def parameters(self) -> list[Tensor]:
        """``γ`` and ``β``."""
        return [self.module.weight, self.module.bias]
