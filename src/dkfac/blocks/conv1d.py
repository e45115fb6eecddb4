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

from torch import nn

from dkfac.blocks.conv2d import Conv2dBlock
from dkfac.blocks.conv_positions import LineImages

__all__ = ["Conv1dBlock"]


class Conv1dBlock(LineImages, Conv2dBlock):
    """Kronecker factors of a 1-D convolution with ``groups == 1`` (module notes).

    Args: as :class:`~dkfac.blocks.conv2d.Conv2dBlock`'s, ``module`` an ``nn.Conv1d``.
    """

    module: nn.Conv1d  # type: ignore[assignment]
    module_type = nn.Conv1d
    cost_kind = "conv1d"
