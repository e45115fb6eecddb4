"""What the convolution blocks share: their options and seeded spatial subsampling
(:class:`ConvolutionBlock`), gathered patches and per-image channel products.

A convolution block's rows run over images × positions (output positions of a
convolution, input positions of a transposed one). Its ``reduction`` keeps them all
(``None``, expand), sums them per image (``"sum"``) or keeps ``positions`` of them per
image drawn at random (``"subsample"``): the draw depends only on ``(seed + step, B, T)``,
so the forward and backward hooks of one step, and every rank, pick the same positions.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from dkfac.blocks.base import Block, Rows, StatisticSink

__all__ = [
    "CONV_REDUCTIONS",
    "ConvolutionBlock",
    "LineImages",
    "channel_gram",
    "check_convolution",
    "gather_patches",
]

CONV_REDUCTIONS = (None, "sum", "subsample")


def check_convolution(name: str, module: nn.Module, module_type: type, block: str) -> None:
    """Checks that ``module`` is a ``module_type`` with ``groups == 1`` (what ``block``, the
    block class's name, takes).

    Raises:
        TypeError: If it is another type.
        ValueError: If it is grouped.
    """
    if not isinstance(module, module_type):
        raise TypeError(
            f"{name}: module must be an nn.{module_type.__name__}, got {type(module).__name__}"
        )
    groups = getattr(module, "groups", 1)
    if groups != 1:
        raise ValueError(f"{name}: {block} supports groups=1 only, got {groups}")


class LineImages:
    """A 1-D layer's tensors ``(B, C, L)`` as height-1 images ``(B, C, 1, L)``: the methods
    a 1-D convolution block takes over from its 2-D one."""

    def image(self, tensor: Tensor) -> Tensor:
        """A forward input or output gradient ``(B, C, L)`` (or unbatched ``(C, L)``) as
        images ``(B, C, 1, L)``."""
        return (tensor.unsqueeze(0) if tensor.dim() == 2 else tensor).unsqueeze(-2)

    def batch_size(self, inputs: Tensor) -> int:
        """Sequences in a forward input (1 for an unbatched ``(C, L)`` input)."""
        return int(inputs.shape[0]) if inputs.dim() == 3 else 1

    def output_positions(self, output: Tensor) -> int:
        """``L_out``."""
        return int(output.shape[-1])


class ConvolutionBlock(Block):
    """What a convolution block (groups=1) holds besides its factors: its window
    (:attr:`geometry`) and its ``reduction`` options with their seeded draw of positions
    (:meth:`subsample_indices`).

    Args:
        name: The module's qualified name.
        module: The convolution (an instance of :attr:`module_type`, ``groups == 1``).
        reduction: ``None`` (expand), ``"sum"`` or ``"subsample"``.
        positions: Positions sampled per image for ``"subsample"`` (>= 1).
        seed: Seed of the position sampling; the positions of step ``k`` use ``seed + k``.

    Raises:
        TypeError: For another module type, or a ``seed`` that is not an int.
        ValueError: For a grouped module, an unknown reduction or a positions count below 1.
    """

    module_type: ClassVar[type[nn.Module]]
    """The convolution class the block takes."""
    geometry: Any
    """The window (:meth:`geometry_of` the module)."""
    spatial_dims: ClassVar[int] = 2
    """The spatial axes of the module's tensors ``(B, C, *spatial)`` (a 1-D block views
    its tensors as height-1 images: :class:`LineImages`)."""
    grouped_block: ClassVar[str | None] = None
    """The block the registry gives the module type's grouped modules (:meth:`declines`
    names it); ``None``: a block of its own says why it declines them."""

    @classmethod
    @abstractmethod
    def geometry_of(cls, module: nn.Module) -> Any:
        """The window of ``module`` as the block reads it."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        reduction: str | None = None,
        positions: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(name, module)
        check_convolution(name, module, self.module_type, type(self).__name__)
        if reduction not in CONV_REDUCTIONS:
            raise ValueError(f"reduction must be one of {CONV_REDUCTIONS}, got {reduction!r}")
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
            raise ValueError(f"positions must be an integer >= 1, got {positions!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.geometry = self.geometry_of(module)
        self.reduction = reduction
        self.positions = positions
        self.seed = seed
        self.step = 0
        self._drawn: tuple[tuple[int, int, int], Tensor] | None = None

    @classmethod
    def declines(cls, module: nn.Module, **options: Any) -> str | None:
        """Grouped convolutions: one Kronecker pair would describe their block-diagonal
        weight wrongly (the registry gives them :attr:`grouped_block`)."""
        del options
        groups = getattr(module, "groups", 1)
        if groups == 1:
            return None
        return f"grouped convolution (groups={groups}): {cls.grouped_block}'s, not a Kronecker pair"

    def image(self, tensor: Tensor) -> Tensor:
        """A forward input or output gradient as a batch ``(B, C, *spatial)`` (an unbatched
        ``(C, *spatial)`` one as a batch of one)."""
        return tensor.unsqueeze(0) if tensor.dim() == self.spatial_dims + 1 else tensor

    def batch_size(self, inputs: Tensor) -> int:
        """Samples in a forward input (1 for an unbatched ``(C, *spatial)`` input)."""
        return int(inputs.shape[0]) if inputs.dim() == self.spatial_dims + 2 else 1

    def output_positions(self, output: Tensor) -> int:
        """The output's positions per sample: the product of its spatial sizes."""
        return math.prod(int(size) for size in output.shape[-self.spatial_dims :])

    def g_rows(self, grad_output: Tensor) -> Rows:
        """Output-gradient rows at the output positions, under the block's reduction:
        expand, ``B·T`` rows over ``B``; ``"sum"``, ``ḡ_n = Σ_t g_{n,t}`` over ``B``;
        ``"subsample"``, the drawn positions over ``B·s/T`` (an unbiased estimate of the
        expand factor). A transposed convolution, whose G lies at its input positions,
        has its own."""
        grad_output = self.image(grad_output)
        batch, channels = grad_output.shape[0], grad_output.shape[1]
        flat = grad_output.reshape(batch, channels, -1)  # (B, C, T)
        total = flat.shape[2]
        if self.reduction == "sum":
            return Rows(flat.sum(dim=2), float(batch))
        if self.reduction == "subsample":
            index = self.subsample_indices(batch, total).to(flat.device)
            count = index.shape[1]
            picked = flat.gather(2, index.unsqueeze(1).expand(batch, channels, count))
            rows = picked.transpose(1, 2).reshape(-1, channels)
            return Rows(rows, batch * count / total)
        rows = flat.transpose(1, 2).reshape(-1, channels)
        return Rows(rows, float(batch))

    def capture_grad(
        self, context: Any, grad_output: Tensor, sinks: Mapping[str, StatisticSink], scale: float
    ) -> None:
        """Backward hook: adds G; under the expand convention without the row transpose.

        ``Σ_{n,t} g g^T`` of a dense accumulator is ``Σ_n g_n g_n^T`` over the per-image
        ``(C, T)`` slices that the gradient already holds contiguously: one batched product,
        where :meth:`g_rows` would first copy every gradient into position-major rows.
        """
        sink = sinks.get("G")
        if sink is None or self.reduction is not None or not sink.takes_sums:
            super().capture_grad(context, grad_output, sinks, scale)
            return
        grad_output = self.image(grad_output)
        total = channel_gram(grad_output, sink.compute_dtype, sink.dtype)
        sink.add_sum(total, float(grad_output.shape[0]), scale)

    def set_step(self, step: int) -> None:
        """Sets the step whose seed (``seed + step``) picks the subsampled positions."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        self.step = step

    def subsample_indices(self, batch: int, total: int) -> Tensor:
        """The ``(batch, min(positions, total))`` positions sampled at this step.

        A function of ``(seed, step, batch, total)`` only, drawn on the CPU, so the forward
        and backward hooks and every rank agree.
        """
        key = (self.seed + self.step, batch, total)
        if self._drawn is not None and self._drawn[0] == key:
            return self._drawn[1]  # the backward hook reuses the forward hook's draw
        count = min(self.positions, total)
        generator = torch.Generator(device="cpu")
        generator.manual_seed((self.seed + self.step) % 2**63)
        keys = torch.rand(batch, total, generator=generator)
        indices = keys.topk(count, dim=1, largest=False, sorted=True).indices
        self._drawn = (key, indices)
        return indices


def gather_patches(
    padded: Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    index: Tensor,
) -> Tensor:
    """``(B·s, C·kh·kw)`` im2col patches of a padded ``(B, C, H, W)`` input at the window
    positions ``index`` ``(B, s)`` (row-major over the windows), gathered, not unfolded;
    entries in ``F.unfold`` order (channel, kernel row, kernel column)."""
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    out_w = (padded.shape[3] - dw * (kw - 1) - 1) // sw + 1
    batch = padded.shape[0]
    index = index.to(padded.device)
    offsets_h = torch.arange(kh, device=padded.device) * dh
    offsets_w = torch.arange(kw, device=padded.device) * dw
    rows = (index // out_w * sh).unsqueeze(-1) + offsets_h  # (B, s, kh)
    cols = (index % out_w * sw).unsqueeze(-1) + offsets_w  # (B, s, kw)
    images = torch.arange(batch, device=padded.device).view(batch, 1, 1, 1)
    picked = padded.permute(0, 2, 3, 1)[images, rows.unsqueeze(-1), cols.unsqueeze(-2)]
    # (B, s, kh, kw, C) -> rows in F.unfold order (channel, kernel row, kernel column).
    return picked.permute(0, 1, 4, 2, 3).reshape(-1, padded.shape[1] * kh * kw)


def channel_gram(
    images: Tensor, compute: torch.dtype | None, out_dtype: torch.dtype | None
) -> Tensor:
    """``Σ_n X_n X_nᵀ`` over the per-image ``(C, positions)`` slices of ``(B, C, ...)``
    images as they lie (no position-major copy): one batched product in ``compute``
    (default: as they come), summed over the images in ``out_dtype``; ``(C, C)``."""
    if compute is not None:
        images = images.to(compute)
    per_image = images.reshape(images.shape[0], images.shape[1], -1)
    products = torch.bmm(per_image, per_image.transpose(1, 2))
    return products.sum(dim=0, dtype=out_dtype)
