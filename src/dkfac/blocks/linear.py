"""Block for ``nn.Linear`` with any number of leading dimensions.

Rows run over batch × leading dimensions: ``A = mean_r ā ā^T``, ``G = mean_r g g^T``.
"""

from __future__ import annotations

from torch import Tensor, nn

from dkfac.blocks.base import Block, Rows, append_ones


class LinearBlock(Block):
    """Kronecker factors of a fully connected layer."""

    module: nn.Linear
    cost_kind = "linear"
    rows_are_outputs = True

    @property
    def in_features(self) -> int:
        """Input features of the layer (bias column not counted)."""
        return int(self.module.in_features)

    @property
    def out_features(self) -> int:
        """Output features of the layer."""
        return int(self.module.out_features)

    def output_positions(self, output: Tensor) -> int:
        """Every leading dimension but the batch is a position (a sequence's length)."""
        return max(1, int(output.numel() // (output.shape[0] * output.shape[-1])))

    @property
    def a_dim(self) -> int:
        """Input features, plus one for the bias."""
        return self.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Output features."""
        return self.out_features

    def a_rows(self, inputs: Tensor) -> Rows:
        """Every input row ``ā`` (bias column appended), averaged over all rows."""
        rows = inputs.reshape(-1, self.in_features)
        if self.has_bias:
            rows = append_ones(rows)
        return Rows(rows, float(rows.shape[0]))

    def g_rows(self, grad_output: Tensor) -> Rows:
        """Every output-gradient row ``g``, averaged over all rows."""
        rows = grad_output.reshape(-1, self.out_features)
        return Rows(rows, float(rows.shape[0]))
