"""Block for ``nn.Linear`` with any number of leading dimensions.

Rows run over batch × leading dimensions: ``A = mean_r ā ā^T``, ``G = mean_r g g^T``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import Tensor, nn

from dkfac.blocks.base import (
    GROUP_MAX_ELEMENTS,
    Block,
    HeldForward,
    Rows,
    StatisticSink,
    append_ones,
)


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

    def group_key(
        self, inputs: Tensor, grad_output: Tensor, sinks: Mapping[str, StatisticSink]
    ) -> Hashable | None:
        """Layers of one block type (whose rows are :class:`LinearBlock`'s), bias, input
        and gradient shape and precisions, whose A and G take sums (inputs and gradients
        of at most :data:`~dkfac.blocks.base.GROUP_MAX_ELEMENTS` entries)."""
        kind = type(self)
        own = (kind.a_rows, kind.g_rows, kind.capture_input, kind.capture_grad)
        if own != (LinearBlock.a_rows, LinearBlock.g_rows, Block.capture_input, Block.capture_grad):
            return None
        a_sink, g_sink = sinks.get("A"), sinks.get("G")
        if a_sink is None or g_sink is None or len(sinks) != 2:
            return None
        if not (a_sink.takes_sums and g_sink.takes_sums):
            return None
        if inputs.shape[-1] != self.in_features or grad_output.shape[-1] != self.out_features:
            return None
        if max(inputs.numel(), grad_output.numel()) > GROUP_MAX_ELEMENTS:
            return None
        return (
            kind,
            self.has_bias,
            (tuple(inputs.shape), inputs.dtype, tuple(grad_output.shape), grad_output.dtype),
            inputs.device,
            (a_sink.compute_dtype, a_sink.dtype, g_sink.compute_dtype, g_sink.dtype),
        )

    @classmethod
    def capture_group(cls, members: Sequence[HeldForward]) -> None:
        """A and G of the group's layers as two batched products of their stacked rows
        (:func:`grouped_row_sums`), each layer's a view of the result."""
        first = members[0]
        if len(members) < 2 or len({held.scale for held in members}) > 1:
            super().capture_group(members)
            return
        a_sink, g_sink = first.sinks["A"], first.sinks["G"]
        block = first.block
        assert isinstance(block, LinearBlock)
        inputs = torch.stack([held.inputs for held in members])
        grads = torch.stack([held.grad for held in members])
        a_rows = inputs.reshape(len(members), -1, block.in_features)
        if block.has_bias:
            a_rows = torch.cat([a_rows, a_rows.new_ones(*a_rows.shape[:2], 1)], dim=2)
        g_rows = grads.reshape(len(members), -1, block.out_features)
        a_sums = grouped_row_sums(a_rows, a_sink.compute_dtype, a_sink.dtype)
        g_sums = grouped_row_sums(g_rows, g_sink.compute_dtype, g_sink.dtype)
        if first.scale != 1.0:
            g_sums.mul_(first.scale)
        count = float(a_rows.shape[1])
        for held, a_sum, g_sum in zip(members, a_sums.unbind(0), g_sums.unbind(0), strict=True):
            held.sinks["A"].add_sum(a_sum, count)
            held.sinks["G"].add_sum(g_sum, float(g_rows.shape[1]))


def grouped_row_sums(
    rows: Tensor, compute: torch.dtype | None, out_dtype: torch.dtype | None
) -> Tensor:
    """``RᵀR`` of each of ``L`` row matrices stacked as ``(L, r, d)``: one batched product
    of the rows in ``compute`` (default: as they come), in ``out_dtype``; ``(L, d, d)``."""
    if compute is not None:
        rows = rows.to(compute)
    products = torch.bmm(rows.mT, rows)
    return products if out_dtype is None else products.to(out_dtype)
