"""Captures of layers of one shape computed together (``dkfac.engine.capture_groups``).

Oracle: the same preconditioner capturing each layer alone in its hooks (the per-layer
path), on the same model and batches in float64; the grouped statistics agree to 1e-12
(BatchNorm's moments are one ``var_mean`` in the group, sums of squares alone). Both
runs take the launch-bound forms (the grouping's switch), so they differ only in it.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.blocks import conv_path_choice
from dkfac.blocks.batchnorm import BatchNormBlock
from dkfac.blocks.conv2d import Conv2dBlock
from dkfac.blocks.linear import LinearBlock
from dkfac.engine import launches


class _Stage(nn.Module):
    """Three conv-BN pairs of one shape (a group of convolutions, one of BatchNorms)."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1, bias=False) for _ in range(3))
        self.norms = nn.ModuleList(nn.BatchNorm2d(4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = torch.tanh(norm(conv(x))) + x
        return x


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to 1e-12 of the statistic's largest entry (the rounding of other products)."""
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        _Stage(),
        nn.Flatten(),
        nn.Linear(4 * 25, 8),
        nn.BatchNorm1d(8),  # a shape of its own: captured alone
        nn.Tanh(),
        nn.Linear(8, 8),  # two linear layers of one shape: a group
        nn.Tanh(),
        nn.Linear(8, 8, bias=False),  # another group (of one: captured alone)
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ).double()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.3, 0.3)
    return model


def _batches(step: int, parts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(10 + step)
    x = torch.randn(24, 2, 5, 5, generator=generator, dtype=torch.float64) * 2.0 + 0.5
    y = torch.randint(0, 3, (24,), generator=generator)
    return list(zip(x.chunk(parts), y.chunk(parts), strict=True))


def _counted(kind: Any, calls: dict[str, int]) -> Any:
    """``kind.capture_group`` counting its calls for groups of several layers."""
    original = kind.capture_group.__func__

    def counted(cls: Any, blocks: Any, *args: Any) -> None:
        calls[kind.__name__] += len(blocks) > 1
        original(cls, blocks, *args)

    return classmethod(counted)


def _run(grouping: bool, parts: int = 1, **options: Any) -> tuple[dict[str, Any], dict[str, int]]:
    model = _model()
    calls = {"BatchNormBlock": 0, "Conv2dBlock": 0, "LinearBlock": 0}
    with (
        mock.patch.object(launches, "launch_bound", lambda device: True),
        mock.patch.object(conv_path_choice, "auto_path", lambda *a, **k: "unfold"),
        mock.patch.object(BatchNormBlock, "capture_group", _counted(BatchNormBlock, calls)),
        mock.patch.object(Conv2dBlock, "capture_group", _counted(Conv2dBlock, calls)),
        mock.patch.object(LinearBlock, "capture_group", _counted(LinearBlock, calls)),
    ):
        pre = KFACPreconditioner(model, damping=0.05, factor_decay=0.8, lr=0.1, **options)
        pre.capture.grouping = grouping
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            for x, y in _batches(step, parts):
                (F.cross_entropy(model(x), y) / parts).backward()
            pre.step()
            opt.step()
    running = {
        name: {key: value.clone() for key, value in layer.running.items()}
        for name, layer in pre.layers.items()
    }
    return running, calls


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("method", ["eigen", "eigen_adam"])
def test_grouped_captures_equal_each_layer_captured_alone(method: str, parts: int) -> None:
    alone, none = _run(False, parts, method=method)
    grouped, calls = _run(True, parts, method=method)
    assert none == {"BatchNormBlock": 0, "Conv2dBlock": 0, "LinearBlock": 0}
    # A step: the four BatchNorm2d, the three stage convolutions (the first one has a
    # bias) and the two biased 8 x 8 linear layers; with two micro-batches also each
    # layer alone of its kind twice (the BatchNorm1d, the unbiased 8 x 8 and the others).
    assert calls == {
        "BatchNormBlock": 3 * parts,
        "Conv2dBlock": 3,
        "LinearBlock": 3 * (1 + 3 * (parts - 1)),
    }
    assert alone.keys() == grouped.keys()
    assert {k for layer in alone.values() for k in layer} == {"A", "G", "F"}
    for name, stats in alone.items():
        assert stats.keys() == grouped[name].keys(), name
        for key, value in stats.items():
            _close(grouped[name][key], value)


def test_a_cpu_takes_no_group_and_factor_batch_size_is_kept() -> None:
    """Off a launch-bound device nothing is held; ``factor_batch_size`` rows reach the
    group as they reach a layer alone."""
    model = _model()
    pre = KFACPreconditioner(model, damping=0.05, lr=0.1)
    x, y = _batches(0, 1)[0]
    F.cross_entropy(model(x), y).backward()
    assert not pre.capture._groups._groups
    alone, _ = _run(False, factor_batch_size=16)
    grouped, calls = _run(True, factor_batch_size=16)
    assert calls == {"BatchNormBlock": 3, "Conv2dBlock": 3, "LinearBlock": 3}
    for name, stats in alone.items():
        for key, value in stats.items():
            _close(grouped[name][key], value)


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")
def test_a_backward_that_builds_a_graph_leaves_the_statistics_out_of_it() -> None:
    """The hooks read inputs and gradients that are not detached, without gradients."""
    model = _model()
    pre = KFACPreconditioner(model, damping=0.05, lr=0.1)
    x, y = _batches(0, 1)[0]
    F.cross_entropy(model(x), y).backward(create_graph=True)
    pre.step()
    for layer in pre.layers.values():
        for value in layer.running.values():
            assert not value.requires_grad
    for param in model.parameters():
        param.grad = None  # the graph of the gradients holds the parameters


def test_memory_usage_counts_the_held_captures_until_the_step() -> None:
    """Between the backward and the step, ``accumulators`` counts the inputs and output
    gradients held for their groups (each tensor once: the held tensors' own sizes); after
    the step nothing is held."""
    model = _model()
    with (
        mock.patch.object(launches, "launch_bound", lambda device: True),
        mock.patch.object(conv_path_choice, "auto_path", lambda *a, **k: "unfold"),
    ):
        pre = KFACPreconditioner(model, damping=0.05, lr=0.1)
        pre.capture.grouping = True
        ((x, y),) = _batches(0, 1)
        for _ in range(2):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            held = [h for members in pre.capture._groups._groups.values() for h in members]
            assert held
            tensors = {id(t): t for h in held for t in (h.inputs, h.grad)}
            want = sum(t.numel() * t.element_size() for t in tensors.values())
            got = pre.memory_usage()["accumulators"]
            with mock.patch.object(pre.capture, "held_bytes", lambda: 0):
                assert got - pre.memory_usage()["accumulators"] == want > 0
            pre.step()
            assert pre.capture.held_bytes() == 0
