"""Phase 3 preconditions the layers of one shape and one solver's options together.

Oracle: a twin preconditioner on an identical model whose solvers refuse every batch
(each layer on its own, as before batching); float64, the same batches, several steps with
refreshes and resets: every preconditioned gradient and every moment equal the twin's to
1e-12, and the three hidden layers did go through one batched call. The same for two
BatchNorm layers of different widths under the unit-wise solver.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.engine import launches
from dkfac.solvers.base import Solver
from dkfac.solvers.eigen import EigenSolver
from dkfac.solvers.eigen_moments import EigenMomentsSolver

OPTIONS: dict[str, Any] = {
    "method": "eigen_adam",
    "kl_clip": None,
    "inverse_update_interval": 2,
    "basis_refresh": "power",
    "moment_carry": "reset",
    "moment_nesterov": True,
    "basis_block_size": 4,
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(6, 4)).double()


def _batch_sizes(monkeypatch: pytest.MonkeyPatch, solver: type[Solver]) -> list[int]:
    """A list that gets the number of layers of every ``solver.apply_batch`` call."""
    sizes: list[int] = []
    original = solver.apply_batch

    def counted(self: Solver, states: Any, *rest: Any) -> Any:
        sizes.append(len(states))
        return original(self, states, *rest)

    monkeypatch.setattr(solver, "apply_batch", counted)
    return sizes


def _twins(
    make: Callable[[], nn.Module], **options: Any
) -> tuple[tuple[nn.Module, KFACPreconditioner], tuple[nn.Module, KFACPreconditioner]]:
    """Two identical models and their preconditioners; the second's solvers refuse every
    batch (each layer on its own, as before batching)."""
    model, twin = make(), make()
    pre, alone = KFACPreconditioner(model, **options), KFACPreconditioner(twin, **options)
    for layer in alone.layers.values():
        layer.solver.batch_key = lambda state, grad: None  # type: ignore[method-assign]
    return (model, pre), (twin, alone)


def _move_both(model: nn.Module, twin: nn.Module) -> None:
    """An SGD step of ``model`` with its gradients; ``twin`` takes the same weights."""
    with torch.no_grad():
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            a -= 0.05 * a.grad
            b.copy_(a)


def _step_both(
    pairs: tuple[tuple[nn.Module, KFACPreconditioner], ...], gen: torch.Generator
) -> None:
    """One batch of :func:`_model`'s inputs, a backward and a preconditioner step each."""
    x = torch.randn(16, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (16,), generator=gen)
    for model, pre in pairs:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()


@pytest.mark.parametrize("orthogonal", [(), ("^[024]$",)])
def test_grouped_layers_equal_each_layer_on_its_own(
    orthogonal: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = _batch_sizes(monkeypatch, EigenMomentsSolver)
    (model, pre), (twin, alone) = _twins(_model, orthogonal_layers=orthogonal, **OPTIONS)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        sizes.clear()
        _step_both(((model, pre), (twin, alone)), gen)
        assert sorted(sizes) == [1, 1, 1, 1, 1, 3], sizes  # the hidden three, then the twin's
        for name, layer in pre.layers.items():
            other = alone.layers[name]
            for a, b in zip(layer.block.parameters(), other.block.parameters(), strict=True):
                assert a.grad is not None and b.grad is not None
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
            assert layer.moments is not None and other.moments is not None
            for key, value in layer.moments.items():
                torch.testing.assert_close(value, other.moments[key], rtol=1e-12, atol=1e-12)
        _move_both(model, twin)
    state = pre.state_dict()  # the moments of a batch are saved per layer, as their own shape
    for name in ("0", "2", "4"):
        assert state["layers"][name]["moments"]["m"].shape == (6, 7)


def test_batchnorm_layers_share_one_solve_as_each_alone() -> None:
    """Two BatchNorm layers of different widths go through one unit-wise solve; the
    preconditioned gradients equal a twin's that solves each alone."""

    def cnn() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6), nn.ReLU(),
            nn.Flatten(), nn.Linear(6 * 4 * 4, 3),
        ).double()  # fmt: skip

    (model, pre), (twin, alone) = _twins(cnn, method="eigen", kl_clip=None)
    assert sum(row["method"] == "unitwise" for row in pre.describe()) == 2
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(8, 3, 8, 8, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=gen)
        for m, p in ((model, pre), (twin, alone)):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
            p.step()
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_eigen_layers_of_one_shape_share_one_pass_as_each_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``eigen`` (the default method): the three hidden layers go through one batched
    apply, with refreshes between; every gradient equals a twin's that applies each alone."""
    sizes = _batch_sizes(monkeypatch, EigenSolver)
    options: dict[str, Any] = {"method": "eigen", "kl_clip": 1e-3, "lr": 0.05}
    (model, pre), (twin, alone) = _twins(_model, inverse_update_interval=2, **options)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        sizes.clear()
        _step_both(((model, pre), (twin, alone)), gen)
        assert sorted(sizes) == [1, 1, 1, 1, 1, 3], sizes
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
        _move_both(model, twin)


def _shapes_model() -> nn.Module:
    torch.manual_seed(0)
    widths = [6, 6, 6, 5, 5, 4]
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(widths):
        layers += [nn.Linear(n_in, n_out), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


@pytest.mark.parametrize(
    ("method", "device_guard", "orthogonal"),
    [("eigen_adam", False, False), ("ekfac", True, False), ("eigen_adam", True, True)],
)
def test_groups_of_several_shapes_fused_equal_each_group_alone(
    method: str, device_guard: bool, orthogonal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a launch-bound device the groups of one solver's options (four shapes here, one
    of them a stack of two) share one flat pass of their elementwise work: bit for bit the
    per-group path's gradients and moments, over refreshes, resets and a skipped step (the
    guard's flags read on the host, or left on the device: the moments held by a mask).
    Orthogonalised updates too, their polar factors one zero-padded iteration: the moments
    bit for bit, the gradients to the rounding of the padded products."""
    options = {**OPTIONS, "method": method}
    if method == "ekfac":
        del options["moment_nesterov"]
    if orthogonal:  # every layer: one fused set, as the test counts
        options["orthogonal_layers"] = ("^[0-9]+$",)
    (model, pre), (twin, alone) = _twins(_shapes_model, **options)
    for layer in alone.layers.values():  # the twin batches by shape, as on a CPU
        del layer.solver.batch_key
    pre.flags_on_device = alone.flags_on_device = device_guard
    calls: list[int] = []
    original = EigenMomentsSolver.apply_groups

    def counted(self: EigenMomentsSolver, groups: Any, *rest: Any, **kw: Any) -> Any:
        calls.append(len(groups))
        return original(self, groups, *rest, **kw)

    monkeypatch.setattr(EigenMomentsSolver, "apply_groups", counted)
    gen = torch.Generator().manual_seed(3)
    floored: set[str] = set()
    for step in range(6):
        calls.clear()
        x = torch.randn(16, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 4, (16,), generator=gen)
        for net, kfac in ((model, pre), (twin, alone)):
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            if step == 3:  # a non-finite gradient: the moments hold, the layer is zeroed
                net[0].weight.grad[0, 0] = float("nan")
            fused = kfac is pre
            with mock.patch.object(launches, "launch_bound", lambda device, on=fused: on):
                kfac.step()
        # One fused pass, and the twin's four, a group each; a layer whose factor is singular
        # (Adam's floor in its null space, dkfac.solvers.null_space) is fused too.
        floored |= {
            name
            for name, layer in pre.layers.items()
            if layer.solver_state is not None and "null_g" in layer.solver_state
        }
        assert sorted(calls) == [1, 1, 1, 1, 4], calls
        for name, layer in pre.layers.items():
            other = alone.layers[name]
            for a, b in zip(layer.block.parameters(), other.block.parameters(), strict=True):
                assert a.grad is not None and b.grad is not None
                if orthogonal:
                    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
                else:
                    assert torch.equal(a.grad, b.grad), (step, name)
            assert layer.moments is not None and other.moments is not None
            for key, value in layer.moments.items():
                assert torch.equal(value, other.moments[key]), (step, name, key)
        _move_both(model, twin)
    # The head's output factor is singular (a softmax's gradients sum to zero): eigen_adam
    # floors it; EKFAC's damping bounds the null directions.
    assert bool(floored) is (method == "eigen_adam"), floored
