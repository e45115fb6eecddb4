"""Block for ``nn.Conv1d`` (groups=1): a 2-D convolution over a height-1 image.

A 1-D convolution with kernel ``k``, stride ``s``, dilation ``d`` and padding ``p`` computes
exactly what a 2-D one with kernel ``(1, k)``, stride ``(1, s)``, dilation ``(1, d)`` and
padding ``(0, p)`` computes on its input with a height of 1 inserted, and its weight
flattens to the same ``C_out × C_in·k`` matrix. So the block is
:class:`~dkfac.blocks.conv2d.Conv2dBlock` on that view (its window as
:class:`~dkfac.blocks.conv2d.ConvGeometry`, its tensors through :meth:`Conv1dBlock.image`):
the factors, the three conventions (expand, SKFAC's ``"sum"`` and ``"subsample"``) and the
output positions ``T = L_out`` are the 2-D block's on the viewed tensors.
"""

from __future__ import annotations

from torch import Tensor, nn

from dkfac.blocks.conv2d import Conv2dBlock

__all__ = ["Conv1dBlock"]


class Conv1dBlock(Conv2dBlock):
    """Kronecker factors of a 1-D convolution with ``groups == 1`` (module notes).

    Args: as :class:`~dkfac.blocks.conv2d.Conv2dBlock`'s, ``module`` an ``nn.Conv1d``.
    """

    module: nn.Conv1d  # type: ignore[assignment]
    module_type = nn.Conv1d
    cost_kind = "conv1d"

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
