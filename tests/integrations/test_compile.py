"""``torch.compile`` (the eager and aot_eager backends, no compiler toolchain needed) with
the preconditioner built before or after compiling: the same weights as the eager run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def _train(compile_with: str | None, build_first: bool = False) -> nn.Module:
    net = _net()
    model: nn.Module = net
    if build_first:
        opt = KFACOptimizer.for_model(net)
    if compile_with is not None:
        model = torch.compile(net, backend=compile_with)
    if not build_first:
        opt = KFACOptimizer.for_model(model)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return net


@pytest.mark.parametrize(("backend", "build_first"), [("eager", True), ("aot_eager", False)])
def test_compiled_equals_eager(backend: str, build_first: bool) -> None:
    torch._dynamo.reset()
    compiled, eager = _train(backend, build_first), _train(None)
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


class _ConvNet(nn.Module):
    """A convolution read flattened by a linear head: ``for_model`` finds the map."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(4 * 9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


@pytest.mark.parametrize("part", [False, True])
def test_a_compiled_model_finds_the_eager_models_flattened_map(part: bool) -> None:
    """``flattened_inputs="graph"`` traces the module ``torch.compile`` wraps (the whole
    model, or a part of it), so the compiled run takes the eager run's steps."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        net = _ConvNet()
        model: nn.Module = net
        if compiled and part:
            net.features = torch.compile(net.features, backend="eager")  # type: ignore[assignment]
        elif compiled:
            model = torch.compile(net, backend="eager")
        opt = KFACOptimizer.for_model(model)
        name = "_orig_mod.head" if compiled and not part else "head"
        assert opt.preconditioner.config.flattened_inputs == {name: (4, 9)}
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            x, y = torch.randn(8, 2, 6, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        runs.append(net.head.weight.detach())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=1e-7)
