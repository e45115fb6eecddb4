"""Block for ``nn.Conv2d`` (groups=1): the "expand" convention and the SKFAC reductions.

``ā_{n,t}`` is the im2col patch (bias column appended) at output position ``t`` of image
``n`` (``T`` positions, ``B`` images) and ``g_{n,t}`` the output gradient there. Any kernel,
stride, dilation and padding are honoured, including ``padding='same'`` (possibly asymmetric)
and non-zero ``padding_mode``. Three conventions (``reduction``):

* ``None`` — expand: ``A = (1/(B·T)) Σ_{n,t} ā ā^T`` (``B·T`` rows) and
  ``G = (1/B) Σ_n Σ_t g g^T`` (``B·T`` rows).
* ``"sum"`` — Reduce Sum (SKFAC): one row per image, so the rank is ``B``.
  ``ḡ_n = Σ_t g_{n,t}`` and ``G = (1/B) Σ_n ḡ_n ḡ_n^T``; the patches are summed too, and the
  A factor is divided by ``T²``: ``A = (1/B) Σ_n ā_n ā_n^T`` with ``ā_n = (1/T) Σ_t ā_{n,t}``
  (the block returns that mean as the row). So the bias entry of ``ā_n`` is exactly 1, a 1×1
  output gives exactly the Linear factors, and when the patches of an image do not vary over
  positions the per-image gradient ``Σ_t g_{n,t} ā_{n,t}^T`` equals ``ḡ_n ā_n^T``, so with
  one image ``A ⊗ G`` is then the exact Fisher (the scale of K-FAC-reduce).
* ``"subsample"`` — Spatial Subsampling (SKFAC): ``s`` output positions per image drawn
  uniformly without replacement (``s`` is clamped to ``T``), the *same* positions for A and
  G, and the same on every rank: they are drawn by a CPU generator seeded with
  ``seed + step`` (see :meth:`Conv2dBlock.set_step`) and depend only on ``(seed, step, B, T)``.
  ``A = (1/(B·s)) Σ_n Σ_{t∈S_n} ā ā^T`` and ``G = (T/(B·s)) Σ_n Σ_{t∈S_n} g g^T`` are
  unbiased estimates of the expand factors (equal to them when ``s >= T``); rank ``B·s``.

All three feed the dense solvers as ``rows.T @ rows / normaliser`` and the SMW solver as
``U = rows.T / sqrt(normaliser)``. For the expand convention into a dense accumulator,
:meth:`Conv2dBlock.capture_input` instead adds ``Σ ā ā^T`` from
:mod:`dkfac.blocks.conv_factor` (at stride 1 without unfolding: the same factor, several
times fewer operations).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.blocks import conv_path_choice
from dkfac.blocks.base import (
    GROUP_MAX_ELEMENTS,
    HeldForward,
    Rows,
    StatisticSink,
    append_ones,
)
from dkfac.blocks.conv_factor import conv_input_factor_sum, window_sums
from dkfac.blocks.conv_positions import ConvolutionBlock, gather_patches
from dkfac.blocks.conv_segments import output_size


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution's window as a 2-D one: ``nn.Conv2d``'s own, ``nn.Conv1d``'s as a
    height-1 image (``(1, k)`` kernel, ``(1, s)`` stride, no padding of the height)."""

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    padding: str | tuple[int, int]
    padding_mode: str

    @classmethod
    def of(cls, module: nn.Conv1d | nn.Conv2d) -> ConvGeometry:
        """The 2-D geometry of ``module``."""
        if isinstance(module, nn.Conv2d):
            return cls(
                module.in_channels,
                module.out_channels,
                _pair(module.kernel_size),
                _pair(module.stride),
                _pair(module.dilation),
                module.padding if isinstance(module.padding, str) else _pair(module.padding),
                module.padding_mode,
            )
        pad = module.padding
        return cls(
            module.in_channels,
            module.out_channels,
            (1, int(module.kernel_size[0])),
            (1, int(module.stride[0])),
            (1, int(module.dilation[0])),
            pad if isinstance(pad, str) else (0, int(pad[0])),
            module.padding_mode,
        )


def _pair(values: Any) -> tuple[int, int]:
    return int(values[0]), int(values[1])


def conv_padding(module: ConvGeometry) -> tuple[int, int, int, int]:
    """Explicit (left, right, top, bottom) padding of a convolution, as ``F.pad`` takes it."""
    pads: list[int] = []
    # F.pad lists the last dimension (width) first.
    for dim in (1, 0):
        if isinstance(module.padding, str):
            if module.padding == "valid":
                left = right = 0
            else:  # 'same': the total padding is split with the extra element on the right
                total = module.dilation[dim] * (module.kernel_size[dim] - 1)
                left, right = total // 2, total - total // 2
        else:
            left = right = int(module.padding[dim])
        pads += [left, right]
    return pads[0], pads[1], pads[2], pads[3]


def pad_input(module: ConvGeometry, inputs: Tensor) -> Tensor:
    """``inputs`` padded as the convolution pads them (any ``padding_mode``)."""
    pads = conv_padding(module)
    if any(pads):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        inputs = F.pad(inputs, pads, mode=mode)
    return inputs


def unfold_patches(module: ConvGeometry, inputs: Tensor) -> Tensor:
    """im2col patches of ``inputs`` as a ``(B, C_in·kh·kw, T)`` tensor."""
    return F.unfold(
        pad_input(module, inputs),
        kernel_size=module.kernel_size,
        dilation=module.dilation,
        padding=0,
        stride=module.stride,
    )


class Conv2dBlock(ConvolutionBlock):
    """Kronecker factors of a 2-D convolution with ``groups == 1``.

    Args:
        name: The module's qualified name.
        module: The convolution.
        reduction: ``None`` (expand), ``"sum"`` or ``"subsample"`` (see the module docstring).
        positions: Output positions sampled per image for ``"subsample"`` (>= 1).
        seed: Seed of the position sampling; the positions of step ``k`` use ``seed + k``.
    """

    module: nn.Conv2d
    module_type: ClassVar[type[nn.Module]] = nn.Conv2d
    geometry: ConvGeometry
    cost_kind = "conv2d"
    rows_are_outputs = True
    grouped_block = "GroupedConvBlock"

    @classmethod
    def geometry_of(cls, module: nn.Module) -> ConvGeometry:
        """The window as a 2-D one (:meth:`ConvGeometry.of`)."""
        return ConvGeometry.of(module)  # type: ignore[arg-type]

    @property
    def a_dim(self) -> int:
        """``C_in · kh · kw``, plus one for the bias."""
        kh, kw = self.geometry.kernel_size
        return self.geometry.in_channels * kh * kw + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Output channels."""
        return self.geometry.out_channels

    def capture_input(self, inputs: Tensor, sinks: Mapping[str, StatisticSink]) -> Any:
        """Forward hook: adds A, without unfolding when the sum of outer products will do.

        Under the expand convention a dense accumulator only needs ``Σ ā ā^T``, which
        :func:`~dkfac.blocks.conv_factor.conv_input_factor_sum` builds from the padded input
        (products in the accumulator's ``compute_dtype`` and the sum in its ``dtype``, as
        its ``add`` would; a strided convolution is unfolded there, its bias column summed
        without a column of ones). Other reductions and any other sink (a low-rank side
        keeps the rows themselves; a pending sink decides its sides from the row count)
        get :meth:`a_rows`.
        """
        if "A" not in sinks:
            return None
        sink = sinks["A"]
        if self.reduction is not None or not sink.takes_sums:
            return super().capture_input(inputs, sinks)
        inputs = self.image(inputs)
        module = self.geometry
        zeros = module.padding_mode == "zeros"  # padded inside the sum, never copied whole
        total, count = conv_input_factor_sum(
            inputs if zeros else pad_input(module, inputs),
            module.kernel_size,
            module.stride,
            module.dilation,
            self.has_bias,
            zero_padding=conv_padding(module) if zeros else (0, 0, 0, 0),
            compute_dtype=sink.compute_dtype,
            out_dtype=sink.dtype,
        )
        sink.add_sum(total, count)
        return None

    def a_rows(self, inputs: Tensor) -> Rows:
        """Patch rows under the block's reduction (see the module docstring)."""
        inputs = self.image(inputs)
        if self.reduction == "sum":
            rows = self._patch_means(inputs)  # the factor is ÷ T²
        elif self.reduction == "subsample":
            rows = self._sampled_patches(pad_input(self.geometry, inputs))
        else:
            patches = unfold_patches(self.geometry, inputs)  # (B, D, T)
            rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        if self.has_bias:
            rows = append_ones(rows)
        return Rows(rows, float(rows.shape[0]))

    def _patch_means(self, inputs: Tensor) -> Tensor:
        """``(B, D)`` mean patch of each image (no bias), from window sums (no unfolding)."""
        module = self.geometry
        zeros = module.padding_mode == "zeros"  # zero padding is never materialised
        source = inputs if zeros else pad_input(module, inputs)
        kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
        padding = conv_padding(module) if zeros else (0, 0, 0, 0)
        sums = window_sums(source, kernel, stride, dilation, padding)
        left, right, top, bottom = padding
        out_h = output_size(source.shape[2] + top + bottom, kernel[0], stride[0], dilation[0])
        out_w = output_size(source.shape[3] + left + right, kernel[1], stride[1], dilation[1])
        return sums.flatten(1) / (out_h * out_w)  # F.unfold order: channel, row, column

    def _sampled_patches(self, padded: Tensor) -> Tensor:
        """``(B·s, D)`` patches (no bias) at the sampled positions, gathered, not unfolded."""
        module = self.geometry
        (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
        out_h = output_size(padded.shape[2], kh, sh, dh)
        out_w = output_size(padded.shape[3], kw, sw, dw)
        index = self.subsample_indices(padded.shape[0], out_h * out_w)
        return gather_patches(padded, module.kernel_size, module.stride, module.dilation, index)

    def group_key(
        self, inputs: Tensor, grad_output: Tensor, sinks: Mapping[str, StatisticSink]
    ) -> Hashable | None:
        """Expand-convention convolutions without a bias, zero-padded, of one geometry,
        input and gradient shape and precisions, whose A and G take sums and whose input
        factor :func:`~dkfac.blocks.conv_factor.conv_input_factor_sum` unfolds (inputs and
        gradients of at most :data:`~dkfac.blocks.base.GROUP_MAX_ELEMENTS` entries)."""
        a_sink, g_sink = sinks.get("A"), sinks.get("G")
        module = self.geometry
        if self.reduction is not None or self.has_bias or module.padding_mode != "zeros":
            return None
        if a_sink is None or g_sink is None or len(sinks) != 2:
            return None
        if not (a_sink.takes_sums and g_sink.takes_sums):
            return None
        if inputs.dim() != 4 or grad_output.dim() != 4:
            return None
        if max(inputs.numel(), grad_output.numel()) > GROUP_MAX_ELEMENTS:
            return None
        padding = conv_padding(module)
        left, right, top, bottom = padding
        batch, channels, height, width = inputs.shape
        shape = (batch, channels, height + top + bottom, width + left + right)
        compute = a_sink.compute_dtype or inputs.dtype
        geometry = (module.kernel_size, module.stride, module.dilation, padding)
        path = conv_path_choice.auto_path(shape, *geometry, inputs.device.type, compute.itemsize)
        if path != "unfold":
            return None
        return (
            type(self),
            geometry,
            (tuple(inputs.shape), inputs.dtype, tuple(grad_output.shape), grad_output.dtype),
            inputs.device,
            (a_sink.compute_dtype, a_sink.dtype, g_sink.compute_dtype, g_sink.dtype),
        )

    @classmethod
    def capture_group(cls, members: Sequence[HeldForward]) -> None:
        """A and G of the group's layers from their stacked inputs and output gradients:
        one unfold and one batched product for the A's, one batched product for the G's
        (:func:`grouped_input_sums`, :func:`grouped_grad_sums`), each layer's a view of
        the result, in chunks of at most :data:`~dkfac.blocks.conv_path_choice.UNFOLD_MAX_BYTES`
        of unfolded rows."""
        first = members[0]
        if len(members) < 2 or len({held.scale for held in members}) > 1:
            super().capture_group(members)
            return
        block = first.block
        assert isinstance(block, Conv2dBlock)
        module = block.geometry
        a_sink, g_sink = first.sinks["A"], first.sinks["G"]
        compute = a_sink.compute_dtype or first.inputs.dtype
        batch, _, out_h, out_w = first.grad.shape
        entries = batch * out_h * out_w * first.block.a_dim
        chunk = max(1, conv_path_choice.UNFOLD_MAX_BYTES // (entries * compute.itemsize))
        count = float(batch * out_h * out_w)
        for start in range(0, len(members), chunk):
            part = members[start : start + chunk]
            inputs = torch.stack([held.inputs for held in part])
            grads = torch.stack([held.grad for held in part])
            a_sums = grouped_input_sums(inputs, module, compute, a_sink.dtype)
            g_sums = grouped_grad_sums(grads, g_sink.compute_dtype, g_sink.dtype)
            if first.scale != 1.0:
                g_sums.mul_(first.scale)
            for held, a_sum, g_sum in zip(part, a_sums.unbind(0), g_sums.unbind(0), strict=True):
                held.sinks["A"].add_sum(a_sum, count)
                held.sinks["G"].add_sum(g_sum, float(batch))


def grouped_input_sums(
    inputs: Tensor, module: ConvGeometry, compute: torch.dtype, out_dtype: torch.dtype | None
) -> Tensor:
    """``Σ ā āᵀ`` of each of ``L`` layers of one geometry (``module``'s, zero padding, no
    bias) from their stacked inputs ``(L, N, C, H, W)``: one unfold of all of them and one
    batched product of their position-major rows, ``(L, D, D)`` in ``out_dtype`` (default:
    the input's), as :func:`~dkfac.blocks.conv_factor.conv_input_factor_sum` unfolds one."""
    layers, batch = inputs.shape[0], inputs.shape[1]
    with torch.autocast(inputs.device.type, enabled=False):
        source = inputs.flatten(0, 1).to(compute)
        padding = conv_padding(module)
        padded = F.pad(source, padding) if any(padding) else source
        patches = F.unfold(
            padded, module.kernel_size, dilation=module.dilation, stride=module.stride
        )  # (L·N, D, T)
        dim = patches.shape[1]
        rows = patches.unflatten(0, (layers, batch)).transpose(2, 3).reshape(layers, -1, dim)
        return torch.bmm(rows.mT, rows).to(out_dtype or inputs.dtype)


def grouped_grad_sums(
    grads: Tensor, compute: torch.dtype | None, out_dtype: torch.dtype | None
) -> Tensor:
    """``Σ_n g_n g_nᵀ`` of each of ``L`` layers from their stacked output gradients
    ``(L, N, C, H, W)`` (each image's ``(C, T)`` slice as it lies): one batched product,
    summed over the images in ``out_dtype``; ``(L, C, C)``."""
    layers, batch, channels = grads.shape[0], grads.shape[1], grads.shape[2]
    if compute is not None:
        grads = grads.to(compute)
    per_image = grads.reshape(layers * batch, channels, -1)
    products = torch.bmm(per_image, per_image.transpose(1, 2))
    return products.view(layers, batch, channels, channels).sum(dim=1, dtype=out_dtype)
