"""nn.MultiheadAttention: its forward with hookable projections equals torch's, and K-FAC
gives it exactly the update of the same attention written with four nn.Linear layers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACPreconditioner
from dkfac.blocks.attention import shared_forward
from tests.blocks.twins import TwinAttention, assert_same_attention, train_with_kfac

E, H, N, L, S = 8, 2, 3, 4, 5


def _inputs(batch_first: bool, kdim: int, vdim: int) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(N, L, E, dtype=torch.float64)
    k = torch.randn(N, S, kdim, dtype=torch.float64)
    v = k if kdim == vdim else torch.randn(N, S, vdim, dtype=torch.float64)
    if not batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    return q, k, v


MASK_CASES = {
    "plain": lambda: {},
    "bool_attn_mask": lambda: {"attn_mask": torch.rand(L, S) < 0.3},
    "padding_no_weights": lambda: {
        "key_padding_mask": torch.rand(N, S) < 0.3,
        "need_weights": False,
    },
    "float_3d_per_head": lambda: {
        "attn_mask": torch.randn(N * H, L, S, dtype=torch.float64),
        "average_attn_weights": False,
    },
    "causal_hint": lambda: {
        "attn_mask": torch.triu(torch.full((L, S), -math.inf, dtype=torch.float64), 1),
        "is_causal": True,
        "need_weights": False,
    },
    "both_masks": lambda: {
        "attn_mask": torch.rand(L, S) < 0.3,
        "key_padding_mask": torch.rand(N, S) < 0.3,
    },
}


@pytest.mark.parametrize(
    ("batch_first", "bias", "kvdim", "bias_kv", "zero_attn", "dropout"),
    [
        (True, True, (E, E), False, False, 0.0),
        (False, False, (6, 5), False, False, 0.0),
        (True, True, (6, 6), True, True, 0.0),
        (False, True, (E, E), True, False, 0.3),
        (True, False, (E, E), False, True, 0.3),
    ],
)
def test_explicit_forward_equals_torch(
    batch_first: bool,
    bias: bool,
    kvdim: tuple[int, int],
    bias_kv: bool,
    zero_attn: bool,
    dropout: float,
) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(
        E,
        H,
        bias=bias,
        kdim=kvdim[0],
        vdim=kvdim[1],
        add_bias_kv=bias_kv,
        add_zero_attn=zero_attn,
        batch_first=batch_first,
        dropout=dropout,
    ).double()
    q, k, v = _inputs(batch_first, *kvdim)
    for case, make in MASK_CASES.items():
        kwargs = make()
        torch.manual_seed(1)  # dropout draws the same mask in both forwards
        expected = mha(q, k, v, **kwargs)
        handle = shared_forward(mha).acquire()
        torch.manual_seed(1)
        got = mha(q, k, v, **kwargs)
        handle.remove()
        assert "forward" not in mha.__dict__, "the module's own forward is restored"
        for want, have in zip(expected, got, strict=True):
            if want is None:
                assert have is None, case
            else:
                torch.testing.assert_close(have, want, rtol=0, atol=1e-12, msg=case)


def test_unbatched_and_errors_match_torch() -> None:
    mha = nn.MultiheadAttention(E, H).double()
    x = torch.randn(L, E, dtype=torch.float64)
    expected = mha(x, x, x, key_padding_mask=torch.tensor([False, True, False, False]))
    handle = shared_forward(mha).acquire()
    got = mha(x, x, x, key_padding_mask=torch.tensor([False, True, False, False]))
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        mha(x, x, x, is_causal=True)
    with pytest.raises(RuntimeError, match="The shape of the 2D attn_mask"):
        mha(x, x, x, attn_mask=torch.zeros(L, L + 1, dtype=torch.bool))
    handle.remove()


def test_projections_run_only_in_training_with_grad() -> None:
    mha = nn.MultiheadAttention(E, H, batch_first=True).double()
    forward = shared_forward(mha)
    calls: list[str] = []
    for role, projection in forward.projections.items():
        projection.register_forward_hook(lambda *_, role=role: calls.append(role))
    handle = forward.acquire()
    x = torch.randn(N, L, E, dtype=torch.float64)
    mha(x, x, x)
    assert calls == ["q", "k", "v"]
    calls.clear()
    with torch.no_grad():
        mha(x, x, x)
    mha.eval()
    mha(x, x, x)
    assert calls == []
    handle.remove()


# ------------------------------------------------------------------ the twin oracle
class AttentionNet(nn.Module):
    """Self- or cross-attention followed by a Linear head; the loss reaches every weight."""

    def __init__(self, attention: nn.Module, cross: bool, batch_first: bool) -> None:
        super().__init__()
        self.attention, self.cross, self.batch_first = attention, cross, batch_first
        self.head = nn.Linear(E, 3).double()

    def forward(self, x: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        k, v = (keys, values) if self.cross else (x, x)
        if not self.batch_first:
            x, k, v = x.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        y = self.attention(x, k, v)[0]
        y = y if self.batch_first else y.transpose(0, 1)
        return self.head(y).mean(dim=1)


def _twin_pair(
    cross: bool, kdim: int, vdim: int, bias: bool, batch_first: bool
) -> tuple[AttentionNet, AttentionNet]:
    mha = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    mha = mha.double()
    if bias:  # torch starts the biases at zero; make them matter
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    twin = AttentionNet(TwinAttention(mha), cross, batch_first)
    net = AttentionNet(mha, cross, batch_first)
    twin.head.load_state_dict(net.head.state_dict())
    return net, twin


@pytest.mark.parametrize("method", ["eigen", "cholesky"])
@pytest.mark.parametrize(
    ("cross", "kdim", "vdim", "bias", "batch_first"),
    [
        (False, E, E, True, True),
        (False, E, E, False, False),
        (True, E, E, True, False),
        (True, 6, 5, True, True),
        (True, 6, 6, False, False),
    ],
)
def test_attention_update_equals_separate_linears_twin(
    method: str, cross: bool, kdim: int, vdim: int, bias: bool, batch_first: bool
) -> None:
    torch.manual_seed(0)
    net, twin = _twin_pair(cross, kdim, vdim, bias, batch_first)
    data = [
        (
            torch.randn(N, L, E, dtype=torch.float64),
            torch.randn(N, S, kdim, dtype=torch.float64),
            torch.randn(N, S, vdim, dtype=torch.float64),
            torch.randint(0, 3, (N,)),
        )
        for _ in range(3)
    ]
    pre = train_with_kfac(net, method, data)
    twin_pre = train_with_kfac(twin, method, data)
    assert list(pre.layers) == [
        "attention.q_proj",
        "attention.k_proj",
        "attention.v_proj",
        "attention.out_proj",
        "head",
    ]
    assert [row["a_dim"] for row in pre.describe()[:4]] == [
        row["a_dim"] for row in twin_pre.describe()[:4]
    ]
    assert isinstance(net.attention, nn.MultiheadAttention)
    assert isinstance(twin.attention, TwinAttention)
    assert_same_attention(net.attention, twin.attention)
    for name, (a, g) in pre.factors().items():
        a_twin, g_twin = twin_pre.factors()[name]
        torch.testing.assert_close(a, a_twin, rtol=0, atol=1e-10, msg=name)
        torch.testing.assert_close(g, g_twin, rtol=0, atol=1e-10, msg=name)


def test_describe_lists_rows_of_in_proj_and_remove_hooks_restores_forward() -> None:
    torch.manual_seed(0)
    net, _ = _twin_pair(False, E, E, True, True)
    pre = KFACPreconditioner(net)
    rows = {row["name"]: row for row in pre.describe()}
    assert rows["attention.k_proj"]["parameters"] == [
        f"attention.in_proj_weight[{E}:{2 * E}]",
        f"attention.in_proj_bias[{E}:{2 * E}]",
    ]
    assert rows["attention.out_proj"]["parameters"] == [
        "attention.out_proj.weight",
        "attention.out_proj.bias",
    ]
    assert "forward" in net.attention.__dict__
    x = torch.randn(N, L, E, dtype=torch.float64)
    F.cross_entropy(net(x, x, x), torch.zeros(N, dtype=torch.long)).backward()
    pre.step()
    assert set(pre.factors()) == set(pre.layers)
    second = KFACPreconditioner(net)  # takes the module over: the first one is retired
    with pytest.raises(RuntimeError, match="took over"):
        pre.step()
    assert "forward" in net.attention.__dict__  # the second one's replacement
    F.cross_entropy(net(x, x, x), torch.zeros(N, dtype=torch.long)).backward()
    second.step()
    assert set(second.factors()) == set(second.layers)
    second.remove_hooks()
    assert "forward" not in net.attention.__dict__
    third = KFACPreconditioner(net)  # the model is free again
    assert "forward" in net.attention.__dict__
    third.remove_hooks()
    assert "forward" not in net.attention.__dict__


def test_frozen_in_projection_leaves_out_proj_registered() -> None:
    torch.manual_seed(0)
    net, _ = _twin_pair(False, E, E, True, True)
    net.attention.in_proj_weight.requires_grad_(False)
    pre = KFACPreconditioner(net)
    assert list(pre.layers) == ["attention.out_proj", "head"]
    x = torch.randn(N, L, E, dtype=torch.float64)
    F.cross_entropy(net(x, x, x), torch.zeros(N, dtype=torch.long)).backward()
    pre.step()
    assert set(pre.factors()) == {"attention.out_proj", "head"}
    rows = {row["name"]: row for row in pre.describe()}
    assert rows["attention.in_proj_bias"]["block"] == "inner optimizer"


def test_skipping_the_attention_skips_its_out_proj() -> None:
    torch.manual_seed(0)
    net, _ = _twin_pair(False, E, E, True, True)
    pre = KFACPreconditioner(net, skip_layers=["MultiheadAttention"])
    assert list(pre.layers) == ["head"]
    reasons = {row["name"]: row.get("reason") for row in pre.describe()}
    assert reasons["attention.out_proj.weight"] == "skip_layers pattern 'MultiheadAttention'"
    assert "forward" not in net.attention.__dict__


def test_every_projection_gets_factors_in_many_configurations() -> None:
    for bias, batch_first in itertools.product([False, True], repeat=2):
        torch.manual_seed(0)
        net, _ = _twin_pair(True, 6, 5, bias, batch_first)
        pre = KFACPreconditioner(net)
        x = torch.randn(N, L, E, dtype=torch.float64)
        k, v = torch.randn(N, S, 6, dtype=torch.float64), torch.randn(N, S, 5, dtype=torch.float64)
        F.cross_entropy(net(x, k, v), torch.zeros(N, dtype=torch.long)).backward()
        pre.step()
        assert set(pre.factors()) == set(pre.layers)
        a, g = pre.factors()["attention.v_proj"]
        assert a.shape == (5 + bias, 5 + bias) and g.shape == (E, E)
