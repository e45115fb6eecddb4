"""Block for ``nn.Conv2d`` (groups=1) under the "expand" convention of DESIGN.md.

``ā_{n,t}`` is the im2col patch (bias column appended) at output position ``t`` of image ``n``;
``A = mean_{n,t} ā ā^T`` and ``G = (1/B) Σ_n Σ_t g g^T``. With a 1×1 output this is exactly
the Linear block. Any kernel, stride, dilation and padding are honoured, including
``padding='same'`` (possibly asymmetric) and non-zero ``padding_mode``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.blocks.base import Block, Rows, append_ones


def conv_padding(module: nn.Conv2d) -> tuple[int, int, int, int]:
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


def unfold_patches(module: nn.Conv2d, inputs: Tensor) -> Tensor:
    """im2col patches of ``inputs`` as a ``(B, C_in·kh·kw, T)`` tensor."""
    pads = conv_padding(module)
    if any(pads):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        inputs = F.pad(inputs, pads, mode=mode)
    return F.unfold(
        inputs,
        kernel_size=module.kernel_size,
        dilation=module.dilation,
        padding=0,
        stride=module.stride,
    )


class Conv2dBlock(Block):
    """Kronecker factors of a 2-D convolution with ``groups == 1``."""

    module: nn.Conv2d

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        assert isinstance(module, nn.Conv2d)
        if module.groups != 1:
            raise ValueError(f"{name}: Conv2dBlock supports groups=1 only, got {module.groups}")

    def batch_size(self, inputs: Tensor) -> int:
        """Images in a forward input (1 for an unbatched ``(C, H, W)`` input)."""
        return int(inputs.shape[0]) if inputs.dim() == 4 else 1

    @property
    def a_dim(self) -> int:
        """``C_in · kh · kw``, plus one for the bias."""
        kh, kw = self.module.kernel_size
        return self.module.in_channels * kh * kw + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Output channels."""
        return self.module.out_channels

    def a_rows(self, inputs: Tensor) -> Rows:
        """All ``B·T`` patches, averaged over images and positions."""
        if inputs.dim() == 3:  # unbatched input
            inputs = inputs.unsqueeze(0)
        patches = unfold_patches(self.module, inputs)  # (B, D, T)
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        if self.has_bias:
            rows = append_ones(rows)
        return Rows(rows, float(rows.shape[0]))

    def g_rows(self, grad_output: Tensor) -> Rows:
        """All ``B·T`` output gradients, summed over positions and averaged over images."""
        if grad_output.dim() == 3:
            grad_output = grad_output.unsqueeze(0)
        batch = grad_output.shape[0]
        rows = grad_output.permute(0, 2, 3, 1).reshape(-1, self.module.out_channels)
        return Rows(rows, float(batch))
