"""Layer configurations small user models contain, under the default
(``KFACOptimizer.for_model``): ``int32`` token ids, an embedding with ``max_norm``, Linear
layers on 4-D inputs, each against an oracle (the same layer fed another way it accepts,
whose K-FAC step is known to be the same); and what ``describe()`` says of an attention's
parameters no block holds."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from tests.integrations.twins import max_difference

DT = torch.float64


class _Tokens(nn.Module):
    """An embedding table and a head over the mean of a sequence's vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 4, padding_idx=0), nn.Linear(4, 2)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(ids))).mean(dim=1)


def test_int32_token_ids_train_as_int64_ones() -> None:
    """``nn.Embedding`` takes ``int32`` ids as well as ``int64``: the table's factors count
    them alike, and the weights after 4 steps equal the ``int64`` run's to the bit."""
    torch.manual_seed(0)
    models = [_Tokens().to(DT) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for model, dtype in zip(models, (torch.int64, torch.int32), strict=True):
        opt = KFACOptimizer.for_model(model, lr=0.01)
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 7, (4, 5), generator=gen)
            opt.zero_grad()
            F.mse_loss(model(ids.to(dtype)), torch.randn(4, 2, generator=gen, dtype=DT)).backward()
            opt.step()
    assert max_difference(*models) == 0.0


class _Attention(nn.Module):
    """An attention (keys and values narrower with ``kdim``/``vdim``) and a head."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, **options)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        key, value = x[..., : self.attn.kdim], x[..., : self.attn.vdim]
        return self.head(self.attn(x, key, value, need_weights=False)[0]).mean(dim=1)


def _left_out(model: nn.Module) -> dict[str, str]:
    rows = KFACOptimizer.for_model(model, lr=0.01).preconditioner.describe()
    return {row["name"]: row["reason"] for row in rows if row["block"] == "inner optimizer"}


def test_an_attentions_left_out_parameters_say_why() -> None:
    """``bias_k``/``bias_v`` (``add_bias_kv``) and the projections left out because one
    projection weight is frozen (q, k and v go together) are named with their reason, and
    every trainable parameter of the attention has a row."""
    reasons = _left_out(_Attention(add_bias_kv=True))
    assert reasons.keys() == {"attn.bias_k", "attn.bias_v"}
    assert "one more key appended to every sequence" in reasons["attn.bias_k"]
    assert "one more value appended to every sequence" in reasons["attn.bias_v"]
    model = _Attention(kdim=3, vdim=2)
    assert model.attn.k_proj_weight is not None
    model.attn.k_proj_weight.requires_grad_(False)
    reasons = _left_out(model)
    assert reasons.keys() == {"attn.q_proj_weight", "attn.v_proj_weight", "attn.in_proj_bias"}
    assert all("k_proj_weight does not require a gradient" in r for r in reasons.values())


class _Renormed(_Tokens):
    """:class:`_Tokens` with ``max_norm``'s renormalisation done by hand before the lookup."""

    def forward(self, ids: Tensor) -> Tensor:
        with torch.no_grad():
            torch.embedding_renorm_(self.emb.weight, ids, 1.0, 2.0)
        return super().forward(ids)


def test_an_embedding_with_max_norm_trains_as_one_renormalised_by_hand() -> None:
    """``max_norm`` rescales the looked-up rows of the table in place during the forward:
    the weights after 5 steps equal a twin's that renormalises them itself before a plain
    lookup, to the bit, and the rows looked up last stay within the norm."""
    torch.manual_seed(0)
    model, twin = _Tokens().to(DT), _Renormed().to(DT)
    model.emb.max_norm = 1.0
    twin.load_state_dict(model.state_dict())
    for net in (model, twin):
        opt = KFACOptimizer.for_model(net, lr=0.1)
        for step in range(5):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 7, (4, 5), generator=gen)
            opt.zero_grad()
            F.mse_loss(net(ids), torch.randn(4, 2, generator=gen, dtype=DT)).backward()
            opt.step()
    assert max_difference(model, twin) == 0.0
    with torch.no_grad():
        model.emb(ids)
    assert model.emb.weight[ids.unique()].norm(dim=1).max() <= 1.0 + 1e-12


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, 5), nn.Linear(5, 2, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.inp(x)))


def test_linear_layers_on_4d_inputs_train_as_on_the_flattened_rows() -> None:
    """Linear layers on ``(B, H, W, C)`` inputs: the weights after 5 steps equal those of
    the same layers on the ``(B·H·W, C)`` rows (the loss a mean over the same entries)."""
    torch.manual_seed(0)
    model, flat = _Mlp().to(DT), _Mlp().to(DT)
    flat.load_state_dict(model.state_dict())
    for net, shape in ((model, (4, 2, 3)), (flat, (24,))):
        opt = KFACOptimizer.for_model(net, lr=0.01)
        for step in range(5):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(24, 3, generator=gen, dtype=DT), torch.randn(24, 2, generator=gen)
            opt.zero_grad()
            F.mse_loss(net(x.reshape(*shape, 3)), y.to(DT).reshape(*shape, 2)).backward()
            opt.step()
    assert max_difference(model, flat) < 1e-13
