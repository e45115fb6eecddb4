"""HuggingFace transformers' Conv1D (weight stored in x out): a Linear with a transposed
weight. Checked on a twin nn.Linear and on a tiny randomly initialised GPT-2 (no download)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dkfac import KFACPreconditioner
from tests.blocks.twins import train_with_kfac

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


@pytest.mark.parametrize("method", ["eigen", "cholesky"])
def test_conv1d_update_equals_twin_linear(method: str) -> None:
    torch.manual_seed(0)
    conv = Conv1D(5, 4).double()
    with torch.no_grad():
        conv.bias.normal_()
    net = nn.Sequential(conv, nn.Tanh(), nn.Linear(5, 3)).double()
    linear = nn.Linear(4, 5).double()
    with torch.no_grad():
        linear.weight.copy_(conv.weight.T)
        linear.bias.copy_(conv.bias)
    twin = nn.Sequential(linear, nn.Tanh(), nn.Linear(5, 3)).double()
    twin[2].load_state_dict(net[2].state_dict())
    data = [
        (torch.randn(6, 7, 4, dtype=torch.float64), torch.randint(0, 3, (6, 7))) for _ in range(3)
    ]
    data = [(x, y.reshape(-1)) for x, y in data]

    def flat(model: nn.Module) -> nn.Module:
        return nn.Sequential(model, nn.Flatten(0, 1))

    pre = train_with_kfac(flat(net), method, data)
    twin_pre = train_with_kfac(flat(twin), method, data)
    assert pre.describe()[0]["block"] == "HFConv1DBlock"
    torch.testing.assert_close(conv.weight.T, linear.weight, rtol=0, atol=1e-10)
    torch.testing.assert_close(conv.bias, linear.bias, rtol=0, atol=1e-10)
    for name, (a, g) in pre.factors().items():
        torch.testing.assert_close(a, twin_pre.factors()[name][0], rtol=0, atol=1e-10)
        torch.testing.assert_close(g, twin_pre.factors()[name][1], rtol=0, atol=1e-10)


def test_every_conv1d_of_a_tiny_gpt2_gets_factors(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    with caplog.at_level(logging.WARNING):
        pre = KFACPreconditioner(model)
    convs = [name for name, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(convs) == 8  # c_attn, c_proj, mlp.c_fc, mlp.c_proj per layer
    ids = torch.randint(0, 64, (2, 16))
    model(ids, labels=ids).loss.backward()
    pre.step()
    factors = pre.factors()
    assert set(convs) <= set(factors)
    assert set(factors) == set(pre.layers)
    # The tied embedding and head: preconditioned once, by the head (the last user).
    assert "lm_head" in pre.layers and "transformer.wte" not in pre.layers
    rows = {row["name"]: row for row in pre.describe()}
    assert rows["lm_head"]["parameters"] == ["transformer.wte.weight", "lm_head.weight"]
    assert "transformer.wte.weight" not in rows
    assert "shared by transformer.wte and lm_head" in caplog.text
    assert "to the inner optimizer" not in caplog.text  # only LayerNorms are left out
    inner = [row["name"] for row in rows.values() if row["block"] == "inner optimizer"]
    assert all(".ln_" in name for name in inner) and len(inner) == 10
