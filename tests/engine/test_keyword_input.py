"""Layers called with their input by keyword (``layer(input=x)``) are captured as when it is
positional: a forward hook sees positional arguments only, so such a layer had no factors
and, under ``for_model``, its weights never moved, silently. Oracle: the same model calling
its layers positionally; both runs equal bit for bit. A copy of the model (its hooks inert)
still runs keyword calls."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer


class _Net(nn.Module):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.keyword = keyword
        self.embed = nn.Embedding(10, 4)
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.keyword:
            h = self.embed(input=ids).transpose(1, 2)
            h = torch.tanh(self.conv(input=h)).transpose(1, 2)
            h = h + self.attn(query=h, key=h, value=h, need_weights=False)[0]
            return self.head(input=h.mean(1))
        h = self.embed(ids).transpose(1, 2)
        h = torch.tanh(self.conv(h)).transpose(1, 2)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


def _train(keyword: bool) -> tuple[nn.Module, KFACOptimizer]:
    model = _Net(keyword)
    opt = KFACOptimizer.for_model(model, lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids, y = (
            torch.randint(0, 10, (16, 5), generator=gen),
            torch.randint(0, 3, (16,), generator=gen),
        )
        opt.zero_grad()
        F.cross_entropy(model(ids), y).backward()
        opt.step()
    return model, opt


def test_a_layer_called_by_keyword_is_captured_as_a_positional_one() -> None:
    (by_keyword, opt), (positional, _) = _train(True), _train(False)
    layers = opt.preconditioner.layers
    assert {"embed", "conv", "head"} <= set(layers)
    assert all(layer.complete for layer in layers.values())  # every layer has its factors
    for mine, theirs in zip(by_keyword.parameters(), positional.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    twin = copy.deepcopy(by_keyword)  # the copy's hooks are inert: the call is left as it is
    ids = torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(twin(ids), by_keyword(ids))


class _PassOn(nn.Linear):
    """A wrapper subclass whose forward passes everything on."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
        return super().forward(*args, **kwargs)  # type: ignore[arg-type]


class _KeywordOnly(nn.Linear):
    def forward(self, *, input: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input)


def test_a_wrapper_s_keyword_input_is_captured_and_a_keyword_only_one_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``forward(*args, **kwargs)`` (a wrapper subclass) called as ``layer(input=x)``: the
    name comes from ``nn.Linear.forward``, and the layer trains as its positional twin. A
    keyword-only ``forward(*, input)`` cannot take it positionally: a warning names it."""
    runs = []
    for keyword in (True, False):
        torch.manual_seed(0)
        layer = _PassOn(4, 3)
        opt = KFACOptimizer.for_model(layer, lr=0.01, overhead=None)
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            (layer(input=x) if keyword else layer(x)).pow(2).mean().backward()
            opt.step()
        assert opt.preconditioner.layers[""].complete
        runs.append(layer.weight.detach().clone())
    assert torch.equal(*runs)
    torch.manual_seed(0)
    strict = _KeywordOnly(4, 3)
    opt = KFACOptimizer.for_model(strict, lr=0.01, overhead=None)
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        strict(input=torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    assert any("not a tensor given positionally" in r.getMessage() for r in caplog.records)
