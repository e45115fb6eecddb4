"""docs/adding-a-block.md, tried with a throwaway block: nothing outside blocks/ changes.

The module stores its weight input × output (as HuggingFace's Conv1D does) and is called
functionally; its block must give exactly the update nn.Linear gets for the transposed weight.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dkfac import KFACPreconditioner, register_block
from dkfac.blocks import Block, Rows
from dkfac.blocks.registry import _REGISTRY
from dkfac.costmodel import extract_layers


class InOutLinear(nn.Module):
    """``y = x @ W`` with ``W`` of shape (in, out)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight


class InOutLinearBlock(Block):
    """The recipe's block: dimensions, rows, and the gradient in the g × a convention."""

    cost_kind = "linear"

    @property
    def a_dim(self) -> int:
        return int(self.module.weight.shape[0])

    @property
    def g_dim(self) -> int:
        return int(self.module.weight.shape[1])

    def a_rows(self, inputs: Tensor) -> Rows:
        rows = inputs.reshape(-1, self.a_dim)
        return Rows(rows, float(rows.shape[0]))

    def g_rows(self, grad_output: Tensor) -> Rows:
        rows = grad_output.reshape(-1, self.g_dim)
        return Rows(rows, float(rows.shape[0]))

    def weight_grad(self) -> Tensor | None:
        grad = self.module.weight.grad
        return None if grad is None else grad.T

    def grad_writes(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        grad = self.module.weight.grad
        assert grad is not None
        return [(grad, matrix.T)]


class SelfWritingBlock(InOutLinearBlock):
    """A block written before ``grad_writes``: it overrides ``set_weight_grad`` instead."""

    def grad_writes(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        raise AssertionError("the engine must call this block's own set_weight_grad")

    def set_weight_grad(self, matrix: Tensor) -> None:
        self.module.weight.grad.copy_(matrix.T)  # type: ignore[union-attr]


def _step(model: nn.Module, x: Tensor, method: str, kl_clip: float | None = None) -> None:
    pre = KFACPreconditioner(
        model, method=method, factor_decay=0.0, kl_clip=kl_clip, lr=0.1, damping=0.1
    )
    model(x).pow(2).sum().div(x.shape[0]).backward()
    pre.step()
    pre.remove_hooks()


@pytest.mark.parametrize("block", [InOutLinearBlock, SelfWritingBlock])
@pytest.mark.parametrize("kl_clip", [None, 1e-8])
def test_a_registered_block_is_preconditioned_like_its_twin(
    block: type[Block], kl_clip: float | None
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(5, 3, dtype=torch.float64)
    x = torch.randn(16, 5, dtype=torch.float64)
    saved = dict(_REGISTRY)
    try:
        register_block(InOutLinear, block)
        for method in ("eigen", "cholesky"):
            ours = InOutLinear(weight)
            twin = nn.Linear(5, 3, bias=False).double()
            twin.weight.data.copy_(weight.T)
            _step(ours, x, method, kl_clip)
            _step(twin, x, method, kl_clip)
            assert ours.weight.grad is not None and twin.weight.grad is not None
            torch.testing.assert_close(ours.weight.grad.T, twin.weight.grad, rtol=1e-10, atol=0)
        spec = extract_layers(nn.Sequential(InOutLinear(weight)))
        assert [(layer.kind, layer.a_dim, layer.g_dim) for layer in spec.layers] == [
            ("linear", 5, 3)
        ]
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)
