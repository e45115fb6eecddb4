"""The default (``KFACOptimizer.for_model``) under what users' training code does around it,
each against the same run without it (the oracle): activation checkpointing
(``torch.utils.checkpoint``, reentrant or not, whose backward runs the forward again), a
``channels_last`` model and inputs, and validation passes between steps."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dkfac import KFACOptimizer
from tests.integrations.twins import max_difference

DT = torch.float64


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Residual(nn.Module):
    """Three residual blocks, each run through ``checkpoint`` (``reentrant`` True or False)
    or plainly (``None``)."""

    def __init__(self, reentrant: bool | None = None, width: int = 8) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(3))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = (
                block(h)
                if self.reentrant is None
                else checkpoint(block, h, use_reentrant=self.reentrant)
            )
        return self.head(h)


def _vectors(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 5, generator=gen, dtype=DT), torch.randint(0, 3, (16,), generator=gen)


def _run(model: nn.Module, opt: KFACOptimizer, steps: range, batch=_vectors) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _factors(opt: KFACOptimizer) -> dict[str, tuple[Tensor | None, Tensor | None]]:
    return {name: (layer.a, layer.g) for name, layer in opt.preconditioner.layers.items()}


def _assert_same_factors(a: KFACOptimizer, b: KFACOptimizer, atol: float = 0.0) -> None:
    first, second = _factors(a), _factors(b)
    assert first.keys() == second.keys()
    for name, pair in first.items():
        for x, y in zip(pair, second[name], strict=True):
            assert (x is None) == (y is None), name
            if x is not None:
                assert y is not None
                torch.testing.assert_close(x, y, rtol=0.0, atol=atol, msg=name)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_capture_once_as_the_plain_model_does(reentrant: bool) -> None:
    """The recomputation inside the backward is captured once, on the batch's scale: the
    factors and the weights after 4 steps (factors every step) equal the plain model's."""
    torch.manual_seed(0)
    plain = _Residual().to(DT)
    twin = _Residual(reentrant).to(DT)
    twin.load_state_dict(plain.state_dict())
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        opts = [KFACOptimizer.for_model(m, lr=0.01, overhead=None) for m in (plain, twin)]
    assert not shown  # tracing the checkpointed forward (on proxies) warns nothing
    for model, opt in zip((plain, twin), opts, strict=True):
        _run(model, opt, range(4))
    _assert_same_factors(*opts)
    assert max_difference(plain, twin) == 0.0
    assert opts[0].preconditioner.describe() == opts[1].preconditioner.describe()


class _OddConvs(nn.Module):
    """Non-square kernels, ``padding="same"``, reflect and replicate padding, dilation,
    stride 2, BatchNorm, and a head reading the flattened map."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, (1, 3), padding="same")
        self.wide = nn.Conv2d(4, 4, (3, 1), dilation=2, padding="same", padding_mode="reflect")
        self.down = nn.Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0))
        self.norm = nn.BatchNorm2d(6)
        self.last = nn.Conv2d(6, 6, 3, stride=2, dilation=(1, 2), padding=(1, 2),
                              padding_mode="replicate")  # fmt: skip
        self.head = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.wide(F.relu(self.stem(x))))
        x = F.relu(self.last(F.relu(self.norm(self.down(x)))))
        return self.head(x.flatten(1))


def test_a_channels_last_model_equals_the_contiguous_one() -> None:
    def images(memory: torch.memory_format):
        def batch(step: int) -> tuple[Tensor, Tensor]:
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(8, 3, 7, 7, generator=gen, dtype=DT)
            return x.contiguous(memory_format=memory), torch.randint(0, 3, (8,), generator=gen)

        return batch

    torch.manual_seed(0)
    plain = _OddConvs().to(DT)
    twin = _OddConvs().to(DT).to(memory_format=torch.channels_last)
    twin.load_state_dict(plain.state_dict())
    assert twin.wide.weight.is_contiguous(memory_format=torch.channels_last)
    opts = [KFACOptimizer.for_model(m, lr=0.01, overhead=None) for m in (plain, twin)]
    for model, opt, memory in zip(
        (plain, twin), opts, (torch.contiguous_format, torch.channels_last), strict=True
    ):
        _run(model, opt, range(3), images(memory))
    _assert_same_factors(*opts, atol=1e-12)
    assert max_difference(plain, twin) < 1e-10
    assert opts[1].preconditioner.config.flattened_inputs == {"head": (6, 4)}


def test_validation_passes_between_steps_capture_nothing() -> None:
    """``model.eval()`` and ``torch.no_grad()`` forwards (and a train-mode forward under
    ``no_grad``, and an eval-mode one with gradients) between steps change nothing."""
    torch.manual_seed(0)
    plain, twin = _Residual().to(DT), _Residual().to(DT)
    twin.load_state_dict(plain.state_dict())
    opts = [KFACOptimizer.for_model(m, lr=0.01, overhead=None) for m in (plain, twin)]
    held_out = _vectors(99)[0]
    for step in range(4):
        _run(plain, opts[0], range(step, step + 1))
        _run(twin, opts[1], range(step, step + 1))
        twin.eval()
        with torch.no_grad():
            twin(held_out)
        twin(held_out).sum()  # a metric forward with gradients, never backpropagated
        twin.train()
        with torch.no_grad():
            twin(held_out[:3])
    _assert_same_factors(*opts)
    assert max_difference(plain, twin) == 0.0
