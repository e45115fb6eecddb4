"""Blocks for ``nn.Conv3d``: Kronecker factors (groups=1) and unit-wise (groups > 1).

A 3-D convolution (video, volumetric and medical CNNs) is a 2-D one with a third spatial
axis: ``ā_{n,t}`` is the patch (bias column appended) of volume ``n`` read by the window at
output position ``t`` of the ``T = D_out·H_out·W_out`` ones, ``C_in·kd·kh·kw`` entries in
the order of the weight's flattening (channel, kernel depth, row, column), and ``g_{n,t}``
the output gradient there. The factors follow :class:`~dkfac.blocks.conv2d.Conv2dBlock`'s
conventions exactly (``reduction``):

* ``None`` — expand: ``A = (1/(B·T)) Σ_{n,t} ā āᵀ``, ``G = (1/B) Σ_{n,t} g gᵀ``;
* ``"sum"`` — SKFAC's Reduce Sum: ``A = (1/B) Σ_n ā_n ā_nᵀ`` with the mean patch
  ``ā_n = (1/T) Σ_t ā_{n,t}`` and ``G = (1/B) Σ_n ḡ_n ḡ_nᵀ`` with ``ḡ_n = Σ_t g_{n,t}``;
* ``"subsample"`` — SKFAC's Spatial Subsampling: ``s`` output positions per volume, drawn
  as the 2-D block draws them (seeded, the same for A and G and on every rank; positions
  numbered depth, then row, then column), ``A = (1/(B·s)) Σ ā āᵀ`` and
  ``G = (T/(B·s)) Σ g gᵀ``.

A 1×1×1 output is a Linear layer's factors; a kernel of depth 1 on inputs of depth 1 is the
2-D block's on the squeezed tensors. Any kernel, stride, dilation and padding are honoured,
``'same'`` (possibly asymmetric: the extra element after, as torch pads) and the non-zero
padding modes included; an unbatched ``(C, D, H, W)`` input is a batch of one. The patches
are unfolded (``F.pad`` then :meth:`torch.Tensor.unfold` along the three axes): a copy of
up to ``kd·kh·kw`` times the input, no fast path; the expand convention into a dense
accumulator unfolds a group of volumes at a time (:data:`ROWS_MAX_BYTES`).

A grouped or depthwise 3-D convolution gets :class:`GroupedConv3dBlock`: the unit-wise
Fisher per output channel of :class:`~dkfac.blocks.grouped_conv.GroupedConvBlock`, its
per-sample gradients from ``conv3d_weight`` with the batch folded into the groups.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.grad import conv3d_weight

from dkfac.blocks.base import Rows, StatisticSink, append_ones
from dkfac.blocks.conv_positions import ConvolutionBlock
from dkfac.blocks.grouped_conv import GroupedConvBlock

__all__ = ["Conv3dBlock", "GroupedConv3dBlock", "VolumeGeometry"]

Triple = tuple[int, int, int]

ROWS_MAX_BYTES = 64 * 2**20
"""The most bytes of unfolded patch rows (an upper bound: the input's entries times the
kernel's, as at stride 1) the expand capture into a dense accumulator holds at once; it
sums the outer products over groups of volumes that fit (one volume at the least)."""


def _triple(values: Any) -> Triple:
    return int(values[0]), int(values[1]), int(values[2])


@dataclass(frozen=True)
class VolumeGeometry:
    """A 3-D convolution's window; every triple is ``(depth, height, width)``."""

    in_channels: int
    out_channels: int
    kernel_size: Triple
    stride: Triple
    dilation: Triple
    padding: str | Triple
    padding_mode: str

    @classmethod
    def of(cls, module: nn.Conv3d) -> VolumeGeometry:
        """The window of ``module``."""
        pad = module.padding
        return cls(
            int(module.in_channels),
            int(module.out_channels),
            _triple(module.kernel_size),
            _triple(module.stride),
            _triple(module.dilation),
            pad if isinstance(pad, str) else _triple(pad),
            module.padding_mode,
        )

    def pads(self) -> tuple[int, ...]:
        """The padding as ``F.pad`` takes it: (before, after) of the width, the height,
        then the depth; ``'same'`` puts an odd total's extra element after."""
        pads: list[int] = []
        for axis in (2, 1, 0):  # F.pad lists the last dimension first
            if isinstance(self.padding, str):
                total = 0 if self.padding == "valid" else self.span(axis) - 1
                pads += [total // 2, total - total // 2]
            else:
                pads += [self.padding[axis]] * 2
        return tuple(pads)

    def span(self, axis: int) -> int:
        """Input entries one window covers along ``axis``: ``d·(k − 1) + 1``."""
        return self.dilation[axis] * (self.kernel_size[axis] - 1) + 1

    def pad(self, volumes: Tensor) -> Tensor:
        """``(B, C, D, H, W)`` volumes padded as the convolution pads them."""
        pads = self.pads()
        if not any(pads):
            return volumes
        mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
        return F.pad(volumes, pads, mode=mode)

    def patches(self, volumes: Tensor) -> Tensor:
        """``(B, T, C_in·kd·kh·kw)`` patches of ``(B, C, D, H, W)`` volumes at the output
        positions (depth, row, column order), entries in the weight's flattening order."""
        windows = self.pad(volumes)
        for axis in range(3):  # each unfold appends one window axis at the end
            windows = windows.unfold(2 + axis, self.span(axis), self.stride[axis])
            windows = windows[..., :: self.dilation[axis]]
        # (B, C, Do, Ho, Wo, kd, kh, kw) -> (B, Do, Ho, Wo, C, kd, kh, kw)
        batch, positions = windows.shape[0], math.prod(windows.shape[2:5])
        return windows.permute(0, 2, 3, 4, 1, 5, 6, 7).reshape(batch, positions, -1)


def as_volumes(tensor: Tensor) -> Tensor:
    """A forward input or output gradient as a batch of volumes ``(B, C, D, H, W)`` (an
    unbatched ``(C, D, H, W)`` one as a batch of one)."""
    return tensor.unsqueeze(0) if tensor.dim() == 4 else tensor


class Conv3dBlock(ConvolutionBlock):
    """Kronecker factors of a 3-D convolution with ``groups == 1`` (module notes).

    Args: as :class:`~dkfac.blocks.conv2d.Conv2dBlock`'s, ``module`` an ``nn.Conv3d``
        (``positions``: output positions sampled per volume for ``"subsample"``).
    """

    module: nn.Conv3d
    module_type: ClassVar[type[nn.Module]] = nn.Conv3d
    geometry: VolumeGeometry
    cost_kind = "conv3d"
    rows_are_outputs = True
    spatial_dims = 3
    grouped_block = "GroupedConv3dBlock"

    @classmethod
    def geometry_of(cls, module: nn.Module) -> VolumeGeometry:
        """The window (:meth:`VolumeGeometry.of`)."""
        assert isinstance(module, nn.Conv3d)
        return VolumeGeometry.of(module)

    @property
    def a_dim(self) -> int:
        """``C_in · kd · kh · kw``, plus one for the bias."""
        return self.geometry.in_channels * math.prod(self.geometry.kernel_size) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Output channels."""
        return self.geometry.out_channels

    def a_rows(self, inputs: Tensor) -> Rows:
        """Patch rows under the block's reduction (module notes), from unfolded patches."""
        patches = self.geometry.patches(self.image(inputs))  # (B, T, D)
        batch, total, dim = patches.shape
        if self.reduction == "sum":
            rows = patches.mean(dim=1)  # the factor is ÷ T²
        elif self.reduction == "subsample":
            index = self.subsample_indices(batch, total).to(patches.device)
            picked = patches.gather(1, index.unsqueeze(-1).expand(-1, -1, dim))
            rows = picked.reshape(-1, dim)
        else:
            rows = patches.reshape(-1, dim)
        if self.has_bias:
            rows = append_ones(rows)
        return Rows(rows, float(rows.shape[0]))

    def capture_input(self, inputs: Tensor, sinks: Mapping[str, StatisticSink]) -> Any:
        """Forward hook: adds A; under the expand convention into a dense accumulator,
        ``Σ ā āᵀ`` summed over groups of volumes whose unfolded rows hold at most
        :data:`ROWS_MAX_BYTES` (the patches of a video batch are ``kd·kh·kw`` times its
        input), products in the sink's ``compute_dtype`` and the sum in its ``dtype`` as
        its ``add`` would. Other reductions and sinks get :meth:`a_rows`."""
        sink = sinks.get("A")
        if sink is None or self.reduction is not None or not sink.takes_sums:
            return super().capture_input(inputs, sinks)
        volumes = self.image(inputs)
        compute = sink.compute_dtype or volumes.dtype
        per_volume = volumes[0].numel() * math.prod(self.geometry.kernel_size) * compute.itemsize
        total: Tensor | None = None
        count = 0
        with torch.autocast(volumes.device.type, enabled=False):
            for part in volumes.split(max(1, ROWS_MAX_BYTES // max(1, per_volume))):
                rows = self.a_rows(part).rows.to(compute)
                product = (rows.T @ rows).to(sink.dtype or rows.dtype)
                total = product if total is None else total.add_(product)
                count += rows.shape[0]
        assert total is not None
        sink.add_sum(total, float(count))
        return None


class GroupedConv3dBlock(GroupedConvBlock):
    """Unit-wise Fisher of an ``nn.Conv3d`` with ``groups > 1``: each output channel's
    ``(C_in/G)·kd·kh·kw`` weights and bias a unit, as
    :class:`~dkfac.blocks.grouped_conv.GroupedConvBlock`'s (its notes and limits)."""

    module_types: ClassVar[tuple[type[nn.Module], ...]] = (nn.Conv3d,)
    module: nn.Conv3d  # type: ignore[assignment]
    geometry: VolumeGeometry

    @classmethod
    def geometry_of(cls, module: nn.Module) -> VolumeGeometry:
        """The window (:meth:`VolumeGeometry.of`)."""
        assert isinstance(module, nn.Conv3d)
        return VolumeGeometry.of(module)

    def image(self, tensor: Tensor) -> Tensor:
        """A forward input or output gradient as volumes (:func:`as_volumes`)."""
        return as_volumes(tensor)

    def sample_weight_grads(self, inputs: Tensor, grad_output: Tensor) -> Tensor:
        """``(N, C_out, (C_in/G)·kd·kh·kw)``: one ``conv3d_weight`` of the padded input
        with the batch folded into the groups (``N·G`` groups)."""
        module = self.geometry
        padded = module.pad(inputs)
        batch = padded.shape[0]
        per_group = module.in_channels // self.groups
        size = (batch * module.out_channels, per_group, *module.kernel_size)
        weights = conv3d_weight(
            padded.reshape(1, -1, *padded.shape[2:]),
            size,
            grad_output.reshape(1, -1, *grad_output.shape[2:]),
            stride=module.stride,
            padding=0,
            dilation=module.dilation,
            groups=batch * self.groups,
        )
        return weights.reshape(batch, module.out_channels, -1)
