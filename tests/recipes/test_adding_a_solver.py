"""docs/adding-a-solver.md, tried with a throwaway solver: nothing outside solvers/ changes.

A diagonal solver, ``V = ∇W ⊘ (diag(G) diag(A)ᵀ + λ)``, is registered by name; the config
accepts it, the engine applies it, checkpoints carry it and the cost model prices it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from dkfac import KFACPreconditioner
from dkfac.costmodel import KFACLayer, element_counts
from dkfac.solvers import _REGISTERED as REGISTERED
from dkfac.solvers import SOLVERS, Solver, SolverState, register_solver


class DiagonalSolver(Solver):
    """The recipe's solver: a pure compute/apply pair and its state's size."""

    name = "diagonal"

    @classmethod
    def state_elements(cls, a_dim: int, g_dim: int) -> int:
        return a_dim + g_dim

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        return self.with_retry(lambda dtype: {"da": a.diagonal().to(dtype), "dg": g.diagonal()})

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        da, dg = state["da"].to(grad.dtype), state["dg"].to(grad.dtype)
        return grad / (torch.outer(dg, da) + damping)


@pytest.fixture
def diagonal() -> Iterator[None]:
    register_solver(DiagonalSolver)
    try:
        yield
    finally:
        SOLVERS.pop("diagonal")
        REGISTERED.remove("diagonal")


def test_a_registered_solver_runs_checkpoints_and_is_priced(diagonal: None) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    x = torch.randn(20, 4, dtype=torch.float64)
    pre = KFACPreconditioner(layer, method="diagonal", factor_decay=0.0, kl_clip=None, damping=0.1)
    layer(x).pow(2).sum().div(20).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)  # type: ignore[index]
    pre.step()
    a, g = pre.factors()[""]
    expected = grad / (torch.outer(g.diagonal(), a.diagonal()) + 0.1)
    torch.testing.assert_close(layer.weight.grad, expected[:, :-1], rtol=1e-12, atol=0)

    state = pre.state_dict(include_inverses=True)
    pre.remove_hooks()
    again = KFACPreconditioner(layer, method="diagonal", kl_clip=None)
    again.load_state_dict(state)
    torch.testing.assert_close(again.layers[""].solver_state, pre.layers[""].solver_state)

    counts = element_counts(KFACLayer(name="fc", a_dim=5, g_dim=3), "diagonal", packed=False)
    assert counts["inverse"] == 8


def test_an_unregistered_name_is_refused() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        KFACPreconditioner(nn.Linear(2, 2), method="diagonal")


def test_orthogonal_layers_on_a_solver_without_moments_is_refused(diagonal: None) -> None:
    """The config cannot tell a registered method's kind; registration can, and says so."""
    with pytest.raises(ValueError, match="picks '', whose method 'diagonal' has no eigenbasis"):
        KFACPreconditioner(nn.Linear(2, 2), method="diagonal", orthogonal_layers=("Linear",))
