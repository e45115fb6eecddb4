"""Every kind of block under ``torch.compile`` (the aot_eager backend): a compiled model,
compiled before or after the preconditioner was built, captures every step's batch, and
its factors at every step and its weights are the eager run's.

Factors every step (``for_model(..., overhead=None)``, or an explicit ``eigen``
preconditioner under SGD with both intervals 1), so a capture a compiled graph dropped
shows at the step it was lost. Each model is float64 and tiny; each case takes one of the
two builds and one of the two orders, together covering both with each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dkfac import KFACOptimizer, KFACPreconditioner

BATCH, STEPS = 8, 4


class _Flat(nn.Module):
    """Convolutions whose map a linear head reads flattened (``flattened_inputs``)."""

    def __init__(self, features: nn.Module, width: int) -> None:
        super().__init__()
        self.features = features
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class _Attention(nn.Module):
    """A token embedding read by a ``MultiheadAttention`` (its own installed forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        return self.head(self.att(h, h, h)[0].mean(1))


class _Encoder(nn.Module):
    """A ``TransformerEncoderLayer`` between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(self.inp(x)).mean(1))


class _Tied(nn.Module):
    """An output head sharing the token embedding's weight (preconditioned as the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids)))).mean(1)[:, :3]


class _GPT2Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D`` (a linear layer with a transposed weight)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c = Conv1D(8, 6)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.c(x)))


class _Checkpointed(nn.Module):
    """A block under ``checkpoint(..., use_reentrant=False)`` (recomputed in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.block, torch.tanh(self.inp(x)), use_reentrant=False)
        return self.head(torch.tanh(h))


def _linear() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3, bias=False))


def _conv2d() -> nn.Module:
    """Conv2d, BatchNorm2d (unit-wise), a grouped convolution and a transposed one."""
    return _Flat(
        nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.Tanh(),
            nn.Conv2d(4, 4, 3, padding=1, groups=2),
            nn.Tanh(),
            nn.ConvTranspose2d(4, 2, 3, stride=2),
        ),
        2 * 9 * 9,
    )


def _conv1d() -> nn.Module:
    return _Flat(nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.Tanh()), 4 * 6)


def _conv3d() -> nn.Module:
    return _Flat(nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.Tanh()), 3 * 27)


# id -> (model, one sample's input shape or ("ids", vocabulary), options, build, compile order)
_Case = tuple[Callable[[], nn.Module], Any, dict[str, Any], str, str]
CASES: dict[str, _Case] = {
    "linear": (_linear, (6,), {}, "for_model", "after"),
    "linear-explicit": (_linear, (6,), {}, "explicit", "before"),
    "conv2d-bn-grouped-transposed": (_conv2d, (2, 4, 4), {}, "for_model", "before"),
    "conv2d-bn-grouped-transposed-explicit": (_conv2d, (2, 4, 4), {}, "explicit", "after"),
    "conv1d": (_conv1d, (2, 6), {}, "explicit", "before"),
    "conv3d": (_conv3d, (2, 3, 3, 3), {}, "for_model", "after"),
    "embedding-attention": (_Attention, ("ids", 10), {}, "for_model", "after"),
    "embedding-attention-explicit": (_Attention, ("ids", 10), {}, "explicit", "before"),
    "encoder-layer": (_Encoder, (5, 6), {}, "for_model", "before"),
    "tied": (_Tied, ("ids", 7), {}, "explicit", "after"),
    "gpt2-conv1d": (_GPT2Conv1D, (6,), {}, "for_model", "after"),
    "checkpoint": (_Checkpointed, (6,), {}, "for_model", "before"),
    "mc-checkpoint": (_Checkpointed, (6,), {"fisher": "mc"}, "explicit", "after"),
    "input-rms": (
        _linear,
        (6,),
        {"orthogonal_layers": [".*"], "orthogonal_input_rms": True},
        "for_model",
        "after",
    ),
}


def _batch(shape: Any, step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    if shape[0] == "ids":
        x = torch.randint(0, shape[1], (BATCH, 5), generator=gen)
    else:
        x = torch.randn(BATCH, *shape, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (BATCH,), generator=gen)


def _train(case: _Case, compiled: bool) -> tuple[nn.Module, list[int], list[dict[str, Any]]]:
    """The weights, each step's captured batch and each step's factors."""
    make, shape, options, build, order = case
    torch.manual_seed(0)
    net = make().double()
    model = net
    if compiled and order == "before":
        model = torch.compile(net, backend="aot_eager")
    opt: torch.optim.Optimizer
    if build == "for_model":
        opt = KFACOptimizer.for_model(model, lr=0.01, overhead=None, **options)
        pre = opt.preconditioner
    else:
        pre = KFACPreconditioner(
            model, method="eigen", factor_update_interval=1, inverse_update_interval=1, **options
        )
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
    if compiled and order == "after":
        model = torch.compile(net, backend="aot_eager")
    captured, factors = [], []
    for step in range(STEPS):
        x, y = _batch(shape, step)
        opt.zero_grad()
        out = model(x)
        if pre.config.fisher == "mc":
            pre.sample_fisher(out, loss="cross_entropy")
        F.cross_entropy(out, y).backward()
        captured.append(pre.capture.captured_batch)
        if build == "explicit":
            pre.step()
        opt.step()
        factors.append({name: (a.clone(), g.clone()) for name, (a, g) in pre.factors().items()})
    return net, captured, factors


@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_block_captures_every_step_as_eager(case: str) -> None:
    if case == "gpt2-conv1d":
        pytest.importorskip("transformers")
    torch._dynamo.reset()
    eager, eager_captured, eager_factors = _train(CASES[case], compiled=False)
    net, captured, factors = _train(CASES[case], compiled=True)
    assert captured == eager_captured == [BATCH] * STEPS
    assert factors[0], "no layer registered"
    for got, want in zip(factors, eager_factors, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
    for p, q in zip(net.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("order", ["before", "after"])
def test_fullgraph_refuses_the_hooks_naming_them(order: str) -> None:
    """``fullgraph=True`` cannot hold dkfac's hooks (they run eagerly): dynamo's refusal
    gives their reason, before a step runs with statistics lost."""
    torch._dynamo.reset()
    net = _linear().double()
    model = torch.compile(net, backend="aot_eager", fullgraph=True) if order == "before" else net
    opt = KFACOptimizer.for_model(model, lr=0.01, overhead=None)
    if order == "after":
        model = torch.compile(net, backend="aot_eager", fullgraph=True)
    x, y = _batch((6,), 0)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="dkfac's hooks on the model run"):
        F.cross_entropy(model(x), y).backward()
    assert opt.preconditioner.capture.captured_batch == 0
