"""``compile_moments``: the option, its rule, and a preconditioner whose moments compile.

Oracle: a twin preconditioner with ``compile_moments="off"`` (eager), float64, the same
batches over refreshes, the per-shape and the flat (launch-bound) paths: gradients and
moments to 1e-12. The head's output factor is singular (a softmax's gradients sum to zero)
and a LayerNorm makes the input factor of the layer after it singular, so Adam's rounding
floor runs in both paths. ``aot_eager`` stands in for inductor here (the same capture, eager
kernels; inductor's CPU kernels are checked in ``tests/solvers/test_compiled.py``, its
CUDA ones in ``tests/engine/test_cuda.py``).
"""

from __future__ import annotations

import importlib.util
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACConfig, KFACOptimizer, KFACPreconditioner
from dkfac.engine import launches
from dkfac.solvers.eigen_moments import EigenMomentsSolver

OPTIONS: dict[str, Any] = {
    "method": "eigen_adam",
    "kl_clip": None,
    "inverse_update_interval": 2,
    "basis_refresh": "power",
    "moment_nesterov": True,
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)
    ).double()


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_moments_equal_eager_ones(fused: bool) -> None:
    torch._dynamo.reset()
    model, twin = _model(), _model()
    pre = KFACPreconditioner(model, compile_moments="aot_eager", **OPTIONS)
    eager = KFACPreconditioner(twin, compile_moments="off", **OPTIONS)
    solvers = [layer.solver for layer in pre.layers.values()]
    assert all(isinstance(s, EigenMomentsSolver) and s._moment_step.active for s in solvers)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = torch.randn(12, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (12,), generator=gen)
        for net, kfac in ((model, pre), (twin, eager)):
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            with mock.patch.object(launches, "launch_bound", lambda device: fused):
                kfac.step()
        for name, layer in pre.layers.items():
            other = eager.layers[name]
            for a, b in zip(layer.block.parameters(), other.block.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
            assert layer.moments is not None and other.moments is not None
            for key, value in layer.moments.items():
                torch.testing.assert_close(value, other.moments[key], rtol=1e-12, atol=1e-12)
        with torch.no_grad():
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                a -= 0.05 * a.grad
                b.copy_(a)
    assert all(s._moment_step.active for s in solvers)  # no fallback on the way
    floored = [name for name, layer in pre.layers.items() if "null_g" in (layer.solver_state or {})]
    assert floored  # the floor ran (the head's G: the softmax's gradients sum to zero)


def test_the_rule_compiles_only_on_a_cuda_device_with_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert launches.compile_backend("auto", cpu) is None
    assert launches.compile_backend("off", cuda) is None
    assert launches.compile_backend("aot_eager", cpu) == "aot_eager"
    assert launches.compile_backend("inductor", cpu) == "inductor"
    found = object()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found)
    assert launches.compile_backend("auto", cuda) == "inductor"
    assert launches.compile_backend("auto", cpu) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert launches.compile_backend("auto", cuda) is None


@pytest.mark.parametrize(
    ("option", "default", "bad"),
    [("compile_moments", "auto", "fast"), ("compile_step", "off", "auto")],
)
def test_the_options_are_validated(option: str, default: str, bad: str) -> None:
    with pytest.raises(ValueError, match=f"{option} must be one of"):
        KFACConfig(method="eigen_adam", **{option: bad})
    with pytest.raises(ValueError, match=f"{option} is not read by method 'eigen'"):
        KFACConfig(method="eigen", **{option: "off" if default != "off" else "inductor"})
    assert getattr(KFACConfig(method="eigen"), option) == default
    KFACConfig(method="ekfac", **{option: "inductor"})


def _cnn() -> nn.Module:
    """A convolution read flattened by a Linear layer (its Kronecker-structured input basis,
    applied layer by layer), two hidden Linear layers of one shape (an orthogonalised
    group), a LayerNorm (its singular factor: Adam's rounding floor) and a head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 16, 8),
        nn.LayerNorm(8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ).double()


def _step_both(models: list[nn.Module], opts: list[KFACOptimizer], gen: torch.Generator) -> None:
    """One step of each of ``_cnn``'s twins on the same batch."""
    x = torch.randn(16, 2, 4, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=gen)
    for model, opt in zip(models, opts, strict=True):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("blocks", [None, 4])
def test_a_compiled_step_equals_the_eager_one(blocks: int | None) -> None:
    """``compile_step="aot_eager"`` (each group's whole update captured: rotations, moments,
    polar factors) against ``"off"``: ``for_model``'s default over refreshes, and with
    block-diagonal bases (blocks of 4 on the 8- and 9-wide sides), both arms float64 from
    the same weights and batches; the gradients it writes and the moments to 1e-12, every
    solver still compiled at the end (no fallback)."""
    torch._dynamo.reset()
    models = [_cnn(), _cnn()]
    opts = [
        KFACOptimizer.for_model(
            model,
            lr=0.01,
            compile_step=choice,
            inverse_update_interval=2,
            basis_block_size=blocks,
        )
        for model, choice in zip(models, ("aot_eager", "off"), strict=True)
    ]
    pre, eager = (opt.preconditioner for opt in opts)
    labels = {layer.solver.label for layer in pre.layers.values()}
    assert any("orthogonal" in label for label in labels)  # the polar factor runs
    assert any("A basis" in label for label in labels)  # and the structured input side
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        _step_both(models, opts, gen)
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        for name, layer in pre.layers.items():
            assert layer.moments is not None
            for key, value in layer.moments.items():
                want = eager.layers[name].moments[key]  # type: ignore[index]
                torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-12)
    solvers = [layer.solver for layer in pre.layers.values()]
    assert all(isinstance(s, EigenMomentsSolver) and s._update.active for s in solvers)
    assert not any(s._update.active for s in (lay.solver for lay in eager.layers.values()))


@pytest.mark.parametrize("changing", ["betas", "damping"])
def test_values_changed_in_training_run_eagerly_after_the_first_compiled_step(
    changing: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled update reads the moments' betas and EKFAC's damping as constants, so each
    new value would compile a new graph (seconds each with inductor) until dynamo's limit of
    eight made it fall back. ``OneCycleLR`` cycles β₁ every step (``for_model``'s groups hold
    the moments' betas), a damping schedule changes the damping: either, after a solver's
    first compiled step, makes it run eagerly from then on, said once. Oracle: the same run
    with ``compile_step="off"``; the compiled graphs counted by a counting backend."""
    torch._dynamo.reset()
    monkeypatch.setattr(EigenMomentsSolver, "_damping_said", False)  # said once a process
    compiled: list[int] = []

    def counting(gm: torch.fx.GraphModule, example: Any) -> Any:
        compiled.append(1)
        return gm.forward

    options: dict[str, Any] = {}
    if changing == "damping":
        options = {"method": "ekfac", "damping": lambda step: 0.01 * (step + 1)}
    models = [_cnn(), _cnn()]
    opts = [
        KFACOptimizer.for_model(model, lr=0.01, compile_step=choice, **options)
        for model, choice in zip(models, ("aot_eager", "off"), strict=True)
    ]
    schedulers = (
        [torch.optim.lr_scheduler.OneCycleLR(opt, 0.02, total_steps=10) for opt in opts]
        if changing == "betas"
        else []
    )
    solvers = [layer.solver for layer in opts[0].preconditioner.layers.values()]
    assert all(isinstance(s, EigenMomentsSolver) and s._update.active for s in solvers)
    gen = torch.Generator().manual_seed(3)
    with caplog.at_level("WARNING", logger="dkfac"):
        for solver in solvers:  # the counting backend in place of aot_eager's
            solver._update.backend = counting  # type: ignore[assignment]
        for step in range(6):
            _step_both(models, opts, gen)
            for scheduler in schedulers:
                scheduler.step()
            if step == 0:
                first = len(compiled)
                assert first > 0
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert len(compiled) == first  # no graph after the values changed
    ran = [s for s in solvers if s._update._compiled]  # the solvers that ran groups
    assert ran and not any(s._update.active for s in ran)
    said = [r.getMessage() for r in caplog.records if changing in r.getMessage()]
    assert len(said) == 1 and "eagerly" in said[0], said
    assert not any("failed" in r.getMessage() for r in caplog.records)
