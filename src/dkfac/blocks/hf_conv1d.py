"""Block for HuggingFace ``transformers``' ``Conv1D`` (GPT-2's projections and MLP).

``Conv1D(nf, nx)`` computes ``y = x W + b`` with the weight stored ``nx × nf`` (in × out),
the transpose of ``nn.Linear``'s: the factors are a Linear's (rows over batch × sequence),
and the gradient matrix in the library's ``d_out × d_in`` convention is ``∇Wᵀ``. The
registry recognises the class by its qualified name ``transformers.pytorch_utils.Conv1D``,
so ``transformers`` is never imported by the library.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dkfac.blocks.base import gradient_write
from dkfac.blocks.linear import LinearBlock

QUALIFIED_NAME = "transformers.pytorch_utils.Conv1D"


class HFConv1DBlock(LinearBlock):
    """Kronecker factors of a ``transformers`` ``Conv1D`` (a Linear with a transposed weight)."""

    rows_are_outputs = False  # the stored weight's rows are its inputs

    @property
    def in_features(self) -> int:
        """``nx``: rows of the stored weight."""
        return int(self.module.weight.shape[0])

    @property
    def out_features(self) -> int:
        """``nf``: columns of the stored weight."""
        return int(self.module.weight.shape[1])

    def weight_grad(self) -> Tensor | None:
        """``[∇Wᵀ, ∇b]`` as a ``nf × (nx + 1)`` matrix, or ``None`` before a backward."""
        weight = self.module.weight
        if weight.grad is None:
            return None
        grad = weight.grad.T
        if self.has_bias:
            bias = self.module.bias
            bias_grad = bias.grad if bias.grad is not None else torch.zeros_like(bias)
            grad = torch.cat([grad, bias_grad.reshape(-1, 1)], dim=1)
        return grad

    def grad_writes(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        """A ``nf × (nx + 1)`` matrix back as the ``nx × nf`` weight's gradient and the
        bias's (:func:`~dkfac.blocks.base.gradient_write`)."""
        weight = self.module.weight
        assert weight.grad is not None
        writes = []
        if self.has_bias:
            writes += gradient_write(self.module.bias, matrix[:, -1])
            matrix = matrix[:, :-1]
        writes.append((weight.grad, matrix.T))
        return writes
