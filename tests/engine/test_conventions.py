"""Conventions of issue 17 item 8: the decomposition precision and what skip_layers matches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dkfac import KFACPreconditioner


def test_float64_model_gets_float64_decompositions_and_the_exact_damped_solve() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(6, 4, bias=False).double()
    x = torch.randn(32, 6, dtype=torch.float64)
    pre = KFACPreconditioner(layer, method="eigen", factor_decay=0.0, kl_clip=None, damping=1e-3)
    layer(x).pow(2).sum().div(x.shape[0]).backward()
    assert layer.weight.grad is not None
    grad = layer.weight.grad.clone()
    pre.step()
    a, g = pre.factors()[""]
    assert pre.layers[""].solver.compute_dtype == torch.float64
    # (A ⊗ G + λI) vec(V) = vec(∇W) with column-major vec: vec(G V A) = (A ⊗ G) vec(V).
    dense = torch.kron(a, g) + 1e-3 * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)
    expected = torch.linalg.solve(dense, grad.T.reshape(-1)).reshape(a.shape[0], g.shape[0]).T
    torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("eigen_dtype", "param_dtype", "expected"),
    [
        (None, torch.float32, torch.float32),
        (None, torch.float64, torch.float64),
        (torch.float64, torch.float32, torch.float64),
        (torch.float32, torch.float64, torch.float32),
    ],
)
def test_eigen_dtype_default_follows_the_factors(
    eigen_dtype: torch.dtype | None, param_dtype: torch.dtype, expected: torch.dtype
) -> None:
    model = nn.Linear(3, 2).to(param_dtype)
    pre = KFACPreconditioner(model, eigen_dtype=eigen_dtype)
    assert pre.layers[""].solver.compute_dtype == expected


@pytest.mark.parametrize(
    ("patterns", "kept"),
    [
        ("^2$", ["0"]),  # anchored: the name "2" only
        ("2", ["0"]),  # re.search: found in the name "2"
        ("ReLU", ["0", "2"]),  # a type name
        ("^Lin", []),  # found in every Linear's type name
    ],
)
def test_skip_layers_searches_names_and_type_names(patterns: str, kept: list[str]) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    if not kept:
        with pytest.raises(ValueError, match="no layer"):
            KFACPreconditioner(model, skip_layers=patterns)
        return
    assert list(KFACPreconditioner(model, skip_layers=patterns).layers) == kept


def test_skip_layers_rejects_a_bad_regex_with_its_pattern() -> None:
    with pytest.raises(ValueError, match=r"skip_layers: '\(' is not a regular expression"):
        KFACPreconditioner(nn.Linear(2, 2), skip_layers="(")
