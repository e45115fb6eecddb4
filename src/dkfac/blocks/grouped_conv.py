"""Block for grouped and depthwise convolutions: a unit-wise Fisher per output channel.

A convolution with ``groups = G > 1`` (depthwise: ``G = C_in``; MobileNet, EfficientNet,
ConvNeXt's 7×7 depthwise, ResNeXt) has a block-diagonal weight, which one Kronecker pair
describes wrongly. Each output channel ``o`` is instead a unit, as a BatchNorm channel is
for SP-NGD: its ``d = (C_in/G)·k`` weights (``k`` the kernel's entries) plus its bias, and
its Fisher is the exact (empirical) one of those ``d`` parameters,

    F_o = mean_n g_{n,o} g_{n,o}ᵀ,

``g_{n,o}`` the gradient of sample ``n``'s loss with respect to unit ``o``'s parameters
(the output gradient multiplied by the batch, as every block's: the per-sample Fisher
scale), statistic ``"F"`` of shape ``(C_out, d, d)``. No Kronecker approximation is made;
what is dropped is only the curvature between output channels. Under a method with Adam's
scale (the default's ``"eigen_adam"``) the update is Adam's in the eigenbasis of each unit's
Fisher (:class:`~dkfac.solvers.unitwise_adam.UnitwiseAdamSolver`), as the Kronecker layers'
is in theirs; under another method it is ``(F_o + λ I)^{-1} ∇_o`` per unit
(:class:`~dkfac.solvers.unitwise.UnitwiseSolver`), with the layers' ``damping`` (not
``bn_damping``: the units are a weight layer's rows, on the scale of the Kronecker layers'
factors).

The per-sample gradients come from the convolution's own weight gradient with the batch
folded into the groups (:func:`per_sample_weight_grads`, ``N·G`` groups): no unfolded copy
of the input. Any kernel, stride, dilation and padding (``'same'`` included, and non-zero
padding modes) of ``nn.Conv1d`` and ``nn.Conv2d`` are honoured; a ``Conv1d`` is a height-1
image; a grouped ``nn.Conv3d`` is :class:`~dkfac.blocks.conv3d.GroupedConv3dBlock`, this
block on volumes. The ``reduction`` options of the dense convolution blocks do not apply.

Declined (left to the inner optimizer, with the reason): units of more than
:data:`MAX_UNIT_DIM` parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.grad import conv2d_weight

from dkfac.blocks.base import Block, BlockCost, CostKind, Rows, StatisticSink
from dkfac.blocks.conv2d import ConvGeometry, conv_padding, pad_input

__all__ = ["MAX_UNIT_DIM", "GroupedConvBlock", "per_sample_weight_grads"]

MAX_UNIT_DIM = 256
"""The most parameters per output channel (``(C_in/G)·k``, plus the bias) a grouped
convolution is preconditioned with. The statistic is ``d`` times the weight
(``C_out·d²`` entries), a refresh a ``d × d`` factorisation per unit (an ``eigh`` under
``eigen_adam``, a Cholesky one under another method: ``C_out·d³`` flops to within a
constant) and each step a few ``C_out·d²`` products, against ``6·N·T·C_out·d`` for the
layer's own training step: at ``d = 256`` the statistic of a 512-channel layer is 32M
entries (128 MiB in float32), about the A factor of a dense ``3×3`` convolution with 640
input channels, and its solve is a quarter of the layer's step below 16 output positions
per sample at batch 32.
Depthwise (``d = k + 1``: 10 for 3×3, 50 for ConvNeXt's 7×7) and ResNeXt's groups of up to
16 channels of 3×3 (``d = 145``) fit; 32 channels of 3×3 (``d = 289``) do not."""


def per_sample_weight_grads(
    geometry: ConvGeometry, groups: int, inputs: Tensor, grad_output: Tensor
) -> Tensor:
    """Each sample's weight gradient of a grouped convolution, ``(N, C_out, (C_in/G)·kh·kw)``.

    The batch is folded into the groups: the ``(1, N·C_in, H, W)`` input and ``(1,
    N·C_out, H_out, W_out)`` output gradient make one convolution weight gradient with
    ``N·G`` groups, whose group ``n·G + j`` is sample ``n``'s group ``j``.

    Args:
        geometry: The window (a ``Conv1d``'s as a height-1 image).
        groups: ``G``.
        inputs: The forward input as images ``(N, C_in, H, W)``.
        grad_output: The output gradient as images ``(N, C_out, H_out, W_out)``.
    """
    batch = inputs.shape[0]
    left, right, top, bottom = conv_padding(geometry)
    if geometry.padding_mode == "zeros" and left == right and top == bottom:
        padding = (top, left)
    else:  # asymmetric ('same' with an even window) or another mode: padded here
        inputs, padding = pad_input(geometry, inputs), (0, 0)
    kh, kw = geometry.kernel_size
    per_group = geometry.in_channels // groups
    size = (batch * geometry.out_channels, per_group, kh, kw)
    weights = conv2d_weight(
        inputs.reshape(1, -1, *inputs.shape[2:]),
        size,
        grad_output.reshape(1, -1, *grad_output.shape[2:]),
        stride=geometry.stride,
        padding=padding,
        dilation=geometry.dilation,
        groups=batch * groups,
    )
    return weights.reshape(batch, geometry.out_channels, per_group * kh * kw)


class GroupedConvBlock(Block):
    """Unit-wise Fisher of an ``nn.Conv1d`` or ``nn.Conv2d`` with ``groups > 1`` (module
    notes).

    Args:
        name: The module's qualified name.
        module: The convolution.

    Raises:
        TypeError: For another module type.
        ValueError: For ``groups == 1`` or units wider than :data:`MAX_UNIT_DIM`.
    """

    solver_name: ClassVar[str | None] = "unitwise"
    adam_solver_name: ClassVar[str | None] = "unitwise_adam"
    grad_statistics: ClassVar[tuple[str, ...]] = ("F",)
    damping_key: ClassVar[str] = "damping"
    cost_kind: ClassVar[str | None] = "grouped_conv"
    module_types: ClassVar[tuple[type[nn.Module], ...]] = (nn.Conv1d, nn.Conv2d)
    """The convolution classes the block takes (a subclass for other dimensions sets its
    own, with :meth:`geometry_of`, :meth:`image` and :meth:`sample_weight_grads`)."""
    module: nn.Conv1d | nn.Conv2d

    @classmethod
    def type_names(cls) -> str:
        """The classes of :attr:`module_types` as a message names them."""
        return " or ".join(f"nn.{klass.__name__}" for klass in cls.module_types)

    @classmethod
    def declines(cls, module: nn.Module, **options: Any) -> str | None:
        """Units of more than :data:`MAX_UNIT_DIM` parameters; a module that is no
        grouped convolution of :attr:`module_types` (not this block's)."""
        del options
        if not isinstance(module, cls.module_types):
            return f"{type(module).__name__} is not an {cls.type_names()}"
        groups = int(getattr(module, "groups", 1))
        if groups == 1:
            return "groups=1 (a Kronecker block's)"
        dim = unit_dim(module)
        if dim > MAX_UNIT_DIM:
            return (
                f"grouped convolution (groups={groups}) with {dim} parameters per output "
                f"channel: its unit-wise Fisher takes at most {MAX_UNIT_DIM}"
            )
        return None

    def __init__(self, name: str, module: nn.Module) -> None:
        if not isinstance(module, self.module_types):
            raise TypeError(f"{name}: module must be an {self.type_names()}")
        reason = self.declines(module)
        if reason is not None:
            raise ValueError(f"{name}: {reason}")
        super().__init__(name, module)
        self.geometry = self.geometry_of(module)
        self.groups = int(getattr(module, "groups", 1))

    @classmethod
    def geometry_of(cls, module: nn.Module) -> Any:
        """The window as a 2-D one (:class:`~dkfac.blocks.conv2d.ConvGeometry`; a
        ``Conv1d``'s as a height-1 image)."""
        assert isinstance(module, (nn.Conv1d, nn.Conv2d))
        return ConvGeometry.of(module)

    @property
    def a_dim(self) -> int:
        """``d``: the parameters of one output channel (reported in ``describe()``)."""
        return unit_dim(self.module)

    @property
    def g_dim(self) -> int:
        """Output channels: the units."""
        return int(self.module.out_channels)

    def cost_description(self) -> BlockCost:
        """A unit-wise ``d × d`` block per output channel, and the layer's forward products."""
        return BlockCost(self.cost_kind, self.a_dim, self.g_dim, unitwise=True)

    def placement_cost(self, kind: CostKind = "compute") -> float:
        """``C_out·d³`` (a factorisation per unit) or ``C_out·d²`` (memory)."""
        power = 3 if kind == "compute" else 2
        return float(self.g_dim * self.a_dim**power)

    def a_rows(self, inputs: Tensor) -> Rows:
        """Not a Kronecker block."""
        raise TypeError("GroupedConvBlock has no Kronecker rows")

    def g_rows(self, grad_output: Tensor) -> Rows:
        """Not a Kronecker block."""
        raise TypeError("GroupedConvBlock has no Kronecker rows")

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"F": (C_out, d, d)}``."""
        return {"F": (self.g_dim, self.a_dim, self.a_dim)}

    def image(self, tensor: Tensor) -> Tensor:
        """A forward input or output gradient as a batch of images ``(N, C, H, W)``: an
        unbatched one as a batch of one, a ``Conv1d``'s with a height of 1."""
        line = isinstance(self.module, nn.Conv1d)
        if tensor.dim() == (2 if line else 3):
            tensor = tensor.unsqueeze(0)
        return tensor.unsqueeze(-2) if line else tensor

    def batch_size(self, inputs: Tensor) -> int:
        """Samples in a forward input (1 for an unbatched one)."""
        return int(self.image(inputs).shape[0])

    def output_positions(self, output: Tensor) -> int:
        """Output positions per sample (``H_out·W_out``, or ``L_out``)."""
        return math.prod(int(size) for size in self.image(output).shape[2:])

    def capture_input(self, inputs: Tensor, sinks: Mapping[str, StatisticSink]) -> Any:
        """The input, kept by reference for the backward hook (autograd keeps it for the
        layer's own backward); ``None`` when ``"F"`` is not due."""
        return inputs if "F" in sinks else None

    def capture_grad(
        self, context: Any, grad_output: Tensor, sinks: Mapping[str, StatisticSink], scale: float
    ) -> None:
        """Adds ``Σ_n g_{n,o} g_{n,o}ᵀ`` per output channel to ``"F"`` (products in the
        sink's ``compute_dtype``, the sum in its ``dtype``)."""
        if context is None or "F" not in sinks:
            return
        sink = sinks["F"]
        grads = self.per_sample_grads(context, grad_output, sink.compute_dtype)
        units = grads.transpose(0, 1)  # (C_out, N, d)
        total = torch.bmm(units.mT, units)
        if sink.dtype is not None:
            total = total.to(sink.dtype)
        sink.add_sum(total, float(units.shape[1]), scale)

    def per_sample_grads(
        self, inputs: Tensor, grad_output: Tensor, dtype: torch.dtype | None = None
    ) -> Tensor:
        """``g_{n,o}``: ``(N, C_out, d)``, the weights' entries in the weight's order, then
        the bias (the gradient matrix's columns), in ``dtype`` (default: the gradient's)."""
        dtype = dtype or grad_output.dtype
        with torch.autocast(grad_output.device.type, enabled=False):
            x = self.image(inputs.detach()).to(dtype)
            delta = self.image(grad_output).to(dtype)
            grads = self.sample_weight_grads(x, delta)
            if self.has_bias:
                grads = torch.cat([grads, delta.flatten(2).sum(dim=2, keepdim=True)], dim=2)
        return grads

    def sample_weight_grads(self, inputs: Tensor, grad_output: Tensor) -> Tensor:
        """``(N, C_out, (C_in/G)·k)`` weight gradients of the samples of :meth:`image`
        batches (:func:`per_sample_weight_grads`)."""
        return per_sample_weight_grads(self.geometry, self.groups, inputs, grad_output)


def unit_dim(module: nn.Module) -> int:
    """``(C_in/G)·k`` plus one for a bias: one output channel's parameters."""
    weight = module.weight
    assert isinstance(weight, Tensor)
    return math.prod(weight.shape[1:]) + int(getattr(module, "bias", None) is not None)
