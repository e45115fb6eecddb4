"""The G scale of sequence models: ``loss_average`` says what the loss is a mean over.

Oracles: for a linear layer on ``(N, T, d)`` inputs and the token-mean loss
``mean_{n,t} ½‖W x_{nt} − y_{nt}‖²``, the per-token output gradient is
``r_{nt} = W x_{nt} − y_{nt}``, so on the scale of one term (a token) ``G = mean r rᵀ``; with
``"samples"`` the factors are on the scale of a sequence-mean, ``T²`` smaller. Under the
model's own unit Gaussian the exact Fisher of one token is ``A ⊗ I``: the Monte-Carlo G is I.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dkfac import KFACPreconditioner

N, T, D_IN, D_OUT = 8, 6, 5, 3


def _data() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.Linear(D_IN, D_OUT, bias=False).double()
    return layer, torch.randn(N, T, D_IN, dtype=torch.float64), torch.randn(N, T, D_OUT).double()


@pytest.mark.parametrize(("loss_average", "divisor"), [("positions", 1), ("samples", T**2)])
def test_empirical_g_is_on_the_scale_of_one_loss_term(loss_average: str, divisor: int) -> None:
    layer, x, y = _data()
    pre = KFACPreconditioner(layer, loss_average=loss_average, factor_decay=0.0, kl_clip=None)
    out = layer(x)
    (0.5 * (out - y).pow(2).sum(-1)).mean().backward()
    pre.step()
    a, g = pre.factors()[""]
    r = (out - y).detach().reshape(-1, D_OUT)
    rows = x.reshape(-1, D_IN)
    torch.testing.assert_close(a, rows.T @ rows / (N * T), rtol=1e-12, atol=0)
    torch.testing.assert_close(g, r.T @ r / (N * T) / divisor, rtol=1e-12, atol=0)


def test_monte_carlo_g_matches_the_exact_per_token_fisher() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(D_IN, D_OUT).double()
    x = torch.randn(64, 64, D_IN, dtype=torch.float64)
    pre = KFACPreconditioner(
        layer, loss_average="positions", fisher="mc", factor_decay=0.0, kl_clip=None
    )
    out = layer(x)
    pre.sample_fisher(out, "mse")
    out.pow(2).mean().backward()
    pre.step()
    _, g = pre.factors()[""]
    # 4096 unit Gaussian draws: the mean of ε εᵀ is I within a few 1/sqrt(4096).
    torch.testing.assert_close(g, torch.eye(D_OUT, dtype=torch.float64), rtol=0, atol=0.1)


def test_embedding_positions_scale_like_a_linear_on_one_hot_inputs() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(7, D_OUT).double()
    twin = nn.Linear(7, D_OUT, bias=False).double()
    twin.weight.data.copy_(emb.weight.data.T)
    idx = torch.randint(0, 7, (N, T))
    target = torch.randn(N, T, D_OUT, dtype=torch.float64)
    factors = []
    for model, inputs in ((emb, idx), (twin, nn.functional.one_hot(idx, 7).double())):
        pre = KFACPreconditioner(model, loss_average="positions", factor_decay=0.0)
        (0.5 * (model(inputs) - target).pow(2).sum(-1)).mean().backward()
        pre.step()
        factors.append(pre.factors()[""][1])
        pre.remove_hooks()
    torch.testing.assert_close(factors[0], factors[1], rtol=1e-12, atol=1e-15)
