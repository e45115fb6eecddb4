"""Blocks for ``nn.ConvTranspose2d`` and ``nn.ConvTranspose1d`` (groups=1).

**The adjoint view.** A transposed convolution with kernel ``K = kh·kw``, stride ``s``,
dilation ``d``, padding ``p`` and output padding ``o`` is the adjoint of the convolution
with that kernel, stride, dilation and padding: input position ``u`` (of ``T = H_in·W_in``)
writes ``W[:, :, i, j]ᵀ x_u`` to output position ``u·s + (i, j)·d − p`` (when it lies in the
output). So the gradient of the weight, stored ``(C_in, C_out, kh, kw)``, is

    ∇W[c, (o, i, j)] = Σ_n Σ_u x_{n,u}[c] · δ_n[o, u·s + (i, j)·d − p],

a sum over *input* positions of the outer product of the input vector
``a_{n,u} = x_{n,u} ∈ R^{C_in}`` with the *unfolded output gradient* ``g_{n,u} ∈
R^{C_out·kh·kw}``: the im2col patch of ``δ`` that the forward convolution (the adjoint of
this layer, which is also what computes the input's gradient) reads at position ``u``
(``F.unfold(δ, kernel, dilation=d, padding=p, stride=s)``, its output padding cut off so
the windows fall on the ``T`` input positions exactly). The matrix the solvers precondition
is therefore ``g × a = (C_out·kh·kw) × C_in``, entries in ``F.unfold`` order (channel, kernel
row, kernel column) down and input channels across:

    M = ∇W.reshape(C_in, C_out·kh·kw)ᵀ = Σ_{n,u} g_{n,u} a_{n,u}ᵀ,

and the factors are those of :class:`~dkfac.blocks.conv2d.Conv2dBlock` with the roles of
input and output gradient exchanged, over the ``T`` input positions, under the same three
conventions (``reduction``):

* ``None`` — expand: ``A = (1/(B·T)) Σ_{n,u} a aᵀ`` (``C_in × C_in``),
  ``G = (1/B) Σ_{n,u} g gᵀ`` (``C_out·kh·kw`` square).
* ``"sum"`` — Reduce Sum: one row per image, ``ā_n = (1/T) Σ_u a_{n,u}`` and
  ``ḡ_n = Σ_u g_{n,u}``; ``A = (1/B) Σ ā āᵀ``, ``G = (1/B) Σ ḡ ḡᵀ``.
* ``"subsample"`` — ``s`` input positions per image, seeded as the convolutions'
  (:class:`~dkfac.blocks.conv_positions.ConvolutionBlock`), the same for A and G:
  ``A = (1/(B·s)) Σ a aᵀ``, ``G = (T/(B·s)) Σ g gᵀ``.

With one input position (a ``1×1`` input, as the first layer of a generator sees) the
per-sample gradient is the single product ``g aᵀ``, so with one sample ``A ⊗ G`` is the
exact Fisher; a ``1×1`` kernel at stride 1 is a Linear layer on every position's channels.

**The bias** is not a column of this pair. It is added once to every *output* position,
``∇b[o] = Σ_n Σ_q δ_n[o, q]``, while a column of ones in ``a`` would pair with
``Σ_u g_{n,u}``, which counts each output position once per (input position, kernel offset)
that writes it: from zero times (output padding past the kernel's reach) to ``K`` times.
No entry of the ``g × a`` product is the bias's gradient, so the block preconditions the
weight alone and the bias goes to the inner optimizer (``describe()`` says so; the default
optimizer gives it Adam's direction, as every parameter without a block).

The expand convention into dense accumulators builds its sums without the row copies:
``A`` by one batched product over each image's ``(C_in, T)`` slice, ``G`` by
:func:`~dkfac.blocks.conv_factor.conv_input_factor_sum` on the output gradient (the input
factor of the adjoint convolution; at stride 1 without unfolding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.blocks.base import Rows, StatisticSink
from dkfac.blocks.conv_factor import conv_input_factor_sum, window_sums
from dkfac.blocks.conv_positions import (
    ConvolutionBlock,
    LineImages,
    channel_gram,
    gather_patches,
)

__all__ = ["ConvTranspose1dBlock", "ConvTranspose2dBlock", "TransposedGeometry"]

Padding4 = tuple[int, int, int, int]


@dataclass(frozen=True)
class TransposedGeometry:
    """A transposed convolution's window as a 2-D one (``nn.ConvTranspose1d``'s as a
    height-1 image): every pair is ``(height, width)``."""

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int]

    @classmethod
    def of(cls, module: nn.ConvTranspose1d | nn.ConvTranspose2d) -> TransposedGeometry:
        """The 2-D geometry of ``module``."""

        def pair(values: Any, low: int) -> tuple[int, int]:
            ints = [int(v) for v in values]
            return (ints[0], ints[1]) if len(ints) == 2 else (low, ints[0])

        return cls(
            int(module.in_channels),
            int(module.out_channels),
            pair(module.kernel_size, 1),
            pair(module.stride, 1),
            pair(module.dilation, 1),
            pair(module.padding, 0),  # never a string for a transposed convolution
        )

    def reach(self, positions: int, axis: int) -> int:
        """Padded output length the windows of ``positions`` input positions read along
        ``axis``: ``(positions − 1)·s + (k − 1)·d + 1``."""
        kernel, stride, dilation = (
            self.kernel_size[axis],
            self.stride[axis],
            self.dilation[axis],
        )
        return (positions - 1) * stride + (kernel - 1) * dilation + 1

    def adjoint_source(self, grad: Tensor, inputs: tuple[int, int]) -> tuple[Tensor, Padding4]:
        """The output gradient ``(B, C_out, H_out, W_out)`` and the zero padding around it
        (``F.pad`` order: left, right, top, bottom) whose windows of the adjoint convolution
        are exactly the ``inputs = (H_in, W_in)`` input positions.

        The padded gradient starts with ``p`` zeros (output position ``q`` at padded index
        ``q + p``) and ends where the last window does: the output padding (and any output
        position past the last window) is cut off, or fewer zeros are added on that side.
        """
        pads: list[int] = []
        cut: list[int] = []
        for axis in (1, 0):  # F.pad lists the width first
            size = grad.shape[2 + axis]
            extra = size + 2 * self.padding[axis] - self.reach(inputs[axis], axis)
            if extra < 0:
                raise ValueError(
                    f"an output of size {size} along axis {axis} is smaller than "
                    f"{inputs[axis]} input positions write"
                )
            pads += [self.padding[axis], max(self.padding[axis] - extra, 0)]
            cut.append(size - max(extra - self.padding[axis], 0))
        if cut != [grad.shape[3], grad.shape[2]]:
            grad = grad[:, :, : cut[1], : cut[0]]
        return grad, (pads[0], pads[1], pads[2], pads[3])

    def inputs_of(self, grad: Tensor, output_padding: tuple[int, int]) -> tuple[int, int]:
        """Input positions ``(H_in, W_in)`` of an output gradient, from the output size and
        the module's ``output_padding`` (``forward(output_size=...)`` may choose another:
        the one below the stride that fits)."""
        found = []
        for axis in (0, 1):
            stride = self.stride[axis]
            span = grad.shape[2 + axis] + 2 * self.padding[axis] - self.reach(1, axis)
            extra = output_padding[axis]
            if (span - extra) % stride or span < extra:
                extra = span % stride
            found.append((span - extra) // stride + 1)
        return found[0], found[1]


class ConvTranspose2dBlock(ConvolutionBlock):
    """Kronecker factors of a transposed 2-D convolution with ``groups == 1`` (module notes).

    Args:
        name: The module's qualified name.
        module: The transposed convolution.
        reduction: ``None`` (expand), ``"sum"`` or ``"subsample"`` (see the module notes).
        positions: Input positions sampled per image for ``"subsample"`` (>= 1).
        seed: Seed of the position sampling; the positions of step ``k`` use ``seed + k``.
    """

    module: nn.ConvTranspose2d
    module_type: ClassVar[type[nn.Module]] = nn.ConvTranspose2d
    geometry: TransposedGeometry
    cost_kind = "conv_transpose2d"
    rows_are_outputs = False  # dim 0 of the stored weight is the input channels (the A side)
    left_out_reason = (
        "the bias of a transposed convolution is added at every output position, which is "
        "not a column of its input-position Kronecker pair"
    )

    @classmethod
    def declines(cls, module: nn.Module, **options: Any) -> str | None:
        """Grouped transposed convolutions: their weight is block-diagonal over the groups,
        which one Kronecker pair describes wrongly."""
        del options
        groups = getattr(module, "groups", 1)
        if groups == 1:
            return None
        return f"grouped transposed convolution (groups={groups}) is not supported"

    @classmethod
    def geometry_of(cls, module: nn.Module) -> TransposedGeometry:
        """The window as a 2-D one (:meth:`TransposedGeometry.of`)."""
        return TransposedGeometry.of(module)  # type: ignore[arg-type]

    def forward_rows(self, inputs: Tensor | None, output: Tensor) -> int:
        """Images × *input* positions: each input vector meets the ``C_out · kh · kw``
        unfolded weight once, and the factors are summed over the input positions (module
        notes); the output's rows of ``g`` entries would be ``stride² / (kh · kw)`` of them."""
        if inputs is None:
            return super().forward_rows(inputs, output)
        return max(1, inputs.numel() // self.a_dim)

    @property
    def output_padding(self) -> tuple[int, int]:
        """The module's output padding as ``(height, width)``."""
        pad = tuple(int(v) for v in self.module.output_padding)
        return (pad[0], pad[1]) if len(pad) == 2 else (0, pad[0])

    @property
    def kernel_numel(self) -> int:
        """``kh · kw``."""
        return self.geometry.kernel_size[0] * self.geometry.kernel_size[1]

    @property
    def input_row_bias(self) -> bool:
        """False: the bias is not a column of ``A`` (module notes)."""
        return False

    @property
    def a_dim(self) -> int:
        """Input channels (the bias is not a column: see the module notes)."""
        return self.geometry.in_channels

    @property
    def g_dim(self) -> int:
        """``C_out · kh · kw``: the unfolded output gradient."""
        return self.geometry.out_channels * self.kernel_numel

    def a_rows(self, inputs: Tensor) -> Rows:
        """Input vectors at the input positions, under the block's reduction."""
        images = self.image(inputs)
        batch, channels = images.shape[0], images.shape[1]
        flat = images.reshape(batch, channels, -1)  # (B, C_in, T)
        if self.reduction == "sum":
            return Rows(flat.mean(dim=2), float(batch))
        if self.reduction == "subsample":
            index = self.subsample_indices(batch, flat.shape[2]).to(flat.device)
            count = index.shape[1]
            picked = flat.gather(2, index.unsqueeze(1).expand(batch, channels, count))
            rows = picked.transpose(1, 2).reshape(-1, channels)
        else:
            rows = flat.transpose(1, 2).reshape(-1, channels)
        return Rows(rows, float(rows.shape[0]))

    def g_rows(self, grad_output: Tensor, inputs: tuple[int, int] | None = None) -> Rows:
        """Unfolded output-gradient patches at the input positions, under the block's
        reduction.

        Args:
            grad_output: The (batch-size scaled) gradient of the layer's output.
            inputs: The forward input's ``(H_in, W_in)``; ``None``: read off the output
                size and the module's ``output_padding``.
        """
        grads = self.image(grad_output)
        module = self.geometry
        size = inputs or module.inputs_of(grads, self.output_padding)
        source, padding = module.adjoint_source(grads, size)
        batch, total = grads.shape[0], size[0] * size[1]
        kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
        if self.reduction == "sum":
            sums = window_sums(source, kernel, stride, dilation, padding)
            return Rows(sums.reshape(batch, -1), float(batch))
        padded = F.pad(source, padding) if any(padding) else source
        if self.reduction == "subsample":
            index = self.subsample_indices(batch, total)
            rows = gather_patches(padded, kernel, stride, dilation, index)
            return Rows(rows, batch * index.shape[1] / total)
        patches = F.unfold(padded, kernel, dilation=dilation, stride=stride)  # (B, D, T)
        return Rows(patches.transpose(1, 2).reshape(-1, patches.shape[1]), float(batch))

    def capture_input(self, inputs: Tensor, sinks: Mapping[str, StatisticSink]) -> Any:
        """Forward hook: adds A; returns the input's ``(H_in, W_in)`` for the backward.

        Under the expand convention a dense accumulator gets ``Σ_{n,u} a aᵀ`` as one
        batched product over the images' ``(C_in, T)`` slices, without the rows' copy.
        """
        images = self.image(inputs)
        size = (int(images.shape[2]), int(images.shape[3]))
        sink = sinks.get("A")
        if sink is None:
            return size
        if self.reduction is not None or not sink.takes_sums:
            sink.add(self.a_rows(inputs))
            return size
        total = channel_gram(images, sink.compute_dtype, sink.dtype)
        sink.add_sum(total, float(images.shape[0] * size[0] * size[1]))
        return size

    def capture_grad(
        self, context: Any, grad_output: Tensor, sinks: Mapping[str, StatisticSink], scale: float
    ) -> None:
        """Backward hook: adds G at the input positions the forward saw (``context``).

        Under the expand convention a dense accumulator gets ``Σ g gᵀ`` from
        :func:`~dkfac.blocks.conv_factor.conv_input_factor_sum` on the output gradient
        (the input factor of the adjoint convolution), without unfolding at stride 1.
        """
        sink = sinks.get("G")
        if sink is None:
            return
        size = context if isinstance(context, tuple) else None
        if self.reduction is not None or not sink.takes_sums:
            sink.add(self.g_rows(grad_output, size), scale)
            return
        grads = self.image(grad_output)
        module = self.geometry
        source, padding = module.adjoint_source(
            grads, size or module.inputs_of(grads, self.output_padding)
        )
        total, _ = conv_input_factor_sum(
            source,
            module.kernel_size,
            module.stride,
            module.dilation,
            False,
            zero_padding=padding,
            compute_dtype=sink.compute_dtype,
            out_dtype=sink.dtype,
        )
        sink.add_sum(total, float(grads.shape[0]), scale)

    def parameters(self) -> list[Tensor]:
        """The weight (the bias is left to the inner optimizer: see the module notes)."""
        return [self.module.weight]

    def grad_shape(self) -> tuple[int, int]:
        """``(C_out·kh·kw, C_in)``."""
        return (self.g_dim, self.a_dim)

    def weight_grad(self) -> Tensor | None:
        """``∇W.reshape(C_in, C_out·kh·kw)ᵀ``, or ``None`` before a backward."""
        grad = self.module.weight.grad
        return None if grad is None else grad.reshape(self.a_dim, self.g_dim).T

    def grad_sources(self) -> list[Tensor] | None:
        """The weight's ``.grad`` (``None`` before a backward)."""
        grad = self.module.weight.grad
        return None if grad is None else [grad]

    def grad_layout(self, matrix: Tensor) -> list[Tensor]:
        """The ``(C_out·kh·kw, C_in)`` matrix viewed as the ``(C_in, C_out, kh, kw)``
        weight."""
        return [matrix.T.view(self.module.weight.shape)]

    def grad_writes(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The matrix back as the weight's gradient."""
        grad = self.module.weight.grad
        assert grad is not None
        return [(grad, matrix.T.reshape(grad.shape))]


class ConvTranspose1dBlock(LineImages, ConvTranspose2dBlock):
    """Kronecker factors of a transposed 1-D convolution with ``groups == 1``: the 2-D
    block on height-1 images (kernel ``(1, k)``, stride ``(1, s)``, padding ``(0, p)``);
    its weight ``(C_in, C_out, k)`` flattens to the same ``(C_out·k) × C_in`` matrix.

    Args: as :class:`ConvTranspose2dBlock`'s, ``module`` an ``nn.ConvTranspose1d``.
    """

    module: nn.ConvTranspose1d  # type: ignore[assignment]
    module_type = nn.ConvTranspose1d
    cost_kind = "conv_transpose1d"
