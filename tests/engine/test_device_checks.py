"""The finiteness guard on the device equals the branching one, and reads nothing on the host.

Oracle: the same run with ``flags_on_device`` off (the guard reads its flags and branches)
and on (masks: :mod:`dkfac.engine.device_checks`), float64, with a NaN injected into one
layer's gradient, then into the input (every statistic and gradient), then recovery. The
weights, the factors and the moments must be equal to the bit, and so must the warnings
(logged a step late on the device path). Host reads are counted with
:class:`tests.host_reads.HostReads` (a CPU stands in for the GPU: the same code reads the
same values).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.engine.device_checks import GradientBuffer, select_where, zero_nonfinite
from dkfac.engine.grad_writes import GradientWrites
from dkfac.engine.step_math import write_back
from dkfac.optimizer import DEFAULT_OPTIONS
from dkfac.solvers import host_copy
from dkfac.solvers.stacking import ALIGNMENT
from tests.host_reads import HostData, HostReads

STEPS = 8
GRAD_NAN_STEP = 3  # a NaN in one layer's gradient
INPUT_NAN_STEP = 5  # a NaN in the input: every statistic and gradient


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        # a convolution and a depthwise one (unit-wise: unitwise_adam under eigen_adam)
        nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1, groups=4)),
        nn.BatchNorm2d(4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 36, 24),
        nn.LayerNorm(24),
        nn.Tanh(),
        nn.Linear(24, 16),
        nn.Tanh(),
        nn.Linear(16, 16),  # the same shape as the layer before: a batched group
        nn.Tanh(),
        nn.Linear(16, 5),
    ).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(32, 1, 6, 6, generator=generator, dtype=torch.float64)
    if step == INPUT_NAN_STEP:
        x[0, 0, 0, 0] = float("nan")
    return x, torch.randint(0, 5, (32,), generator=generator)


CASES: dict[str, dict[str, Any]] = {
    "eigen": {"method": "eigen", "inverse_update_interval": 2, "kl_clip": 1e-2},
    "eigen-no-clip": {"method": "eigen", "inverse_update_interval": 2, "kl_clip": None},
    "eigen_adam": {
        "method": "eigen_adam",
        "basis_refresh": "power",
        "moment_nesterov": True,
        "kl_clip": None,
        "inverse_update_interval": 3,
    },
    "cholesky": {"method": "cholesky", "inverse_update_interval": 2},
    # factors kept as diagonal blocks of 8 and, above 100, as the diagonal: held on the
    # device in those layouts
    "eigen_adam-compact": {
        "method": "eigen_adam",
        "kl_clip": None,
        "inverse_update_interval": 3,
        "basis_block_size": 8,
        "basis_max_dim": 100,
    },
}


def _train(model: nn.Module, opt: KFACOptimizer) -> None:
    """``STEPS`` steps, a NaN in one layer's gradient at ``GRAD_NAN_STEP`` and in the input
    at ``INPUT_NAN_STEP``."""
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        if step == GRAD_NAN_STEP:
            model[7].weight.grad[0, 0] = float("nan")
        opt.step()


def _run(options: dict[str, Any], on_device: bool, fused: bool, caplog: Any) -> dict[str, Any]:
    model = _model()
    pre = KFACPreconditioner(model, damping=0.05, factor_decay=0.9, **options)
    pre.flags_on_device = on_device
    inner = torch.optim.SGD(model.parameters(), lr=0.05, fused=fused or None)
    opt = KFACOptimizer(inner, pre)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        _train(model, opt)
        pre._guard.late.flush()
        opt._late.flush()
    warnings = sorted(r.getMessage() for r in caplog.records)
    moments = {
        name: {k: v.clone() for k, v in layer.moments.items()}
        for name, layer in pre.layers.items()
        if layer.moments is not None
    }
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "factors": {n: tuple(f.clone() for f in ag) for n, ag in pre.factors().items()},
        "moments": moments,
        "skipped": opt.skipped_steps,
        "warnings": warnings,
    }


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fused", [False, True])
def test_the_guard_on_the_device_equals_the_branching_guard(
    case: str, fused: bool, caplog: Any
) -> None:
    branching = _run(CASES[case], on_device=False, fused=fused, caplog=caplog)
    masked = _run(CASES[case], on_device=True, fused=fused, caplog=caplog)
    for before, after in zip(branching["params"], masked["params"], strict=True):
        assert torch.isfinite(after).all()
        assert torch.equal(before, after)
    assert branching["factors"].keys() == masked["factors"].keys()
    for name, pair in branching["factors"].items():
        for before, after in zip(pair, masked["factors"][name], strict=True):
            assert torch.equal(before, after), name
    assert branching["moments"].keys() == masked["moments"].keys()
    for name, moments in branching["moments"].items():
        for key, value in moments.items():
            assert torch.equal(value, masked["moments"][name][key]), (name, key)
    assert branching["skipped"] == masked["skipped"] == 2
    assert branching["warnings"] == masked["warnings"]
    assert any("non-finite gradient in 7" in w for w in masked["warnings"])
    assert any("non-finite factors in 0" in w for w in masked["warnings"])


EXEMPT = ("device_checks.py", "host_copy.py")
"""The modules whose reads are of host copies made for the purpose (late warnings, the
null-space floor's late flag)."""


def _steady_reads(options: dict[str, Any], steps: int) -> list[dict[tuple[str, str], int]]:
    model = _model()
    pre = KFACPreconditioner(model, damping=0.05, **options)
    pre.flags_on_device = True
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, fused=True), pre)
    counts = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step + 100)
        F.cross_entropy(model(x), y).backward()
        with (
            HostReads(exempt=EXEMPT) as reads,
            HostData(("launches.py",)) as data,
            pytest.MonkeyPatch.context() as patch,
        ):
            patch.setattr(host_copy, "HOST_COUNT_DEVICES", frozenset())  # as on a GPU
            opt.step()
        counts.append({**reads.reads, **{("host data", k): n for k, n in data.made.items()}})
    return counts


REFRESHES = {
    "eigen": {"method": "eigen"},
    "cholesky": {"method": "cholesky"},
    "eigen_adam-eigh": {"method": "eigen_adam", "basis_refresh": "eigh"},
    "eigen_adam-power": {"method": "eigen_adam", "basis_refresh": "power"},
    "ekfac": {"method": "ekfac"},
    "eigen_adam-shapes": {  # block-diagonal, one-sided and structured bases
        "method": "eigen_adam",
        "basis_block_size": 8,
        "basis_max_dim": 100,
        "flattened_inputs": {"4": (4, 36)},
    },
    "eigen_adam-rank": {
        "method": "eigen_adam",
        "basis_refresh": "power",
        "power_rank": 4,
        "moment_carry": "rotate",
    },
    # for_model's options: the hidden layers' polar factors, and their split scaling
    "default": DEFAULT_OPTIONS,
    "default-split": {**DEFAULT_OPTIONS, "orthogonal_split": 0.5, "orthogonal_steps": 3},
    "default-input-rms": {**DEFAULT_OPTIONS, "orthogonal_input_rms": True},  # engine.input_rms
}


@pytest.mark.parametrize("case", sorted(REFRESHES))
def test_steps_read_nothing_on_the_host_after_the_first(case: str) -> None:
    """After the first step (each layer's first capture has no running value to hold and
    its first refresh no state to keep, so they are checked on the host), no step reads a
    device value or makes a tensor from host data (on a GPU, a copy the host waits for;
    :func:`dkfac.engine.launches.device_constant` copies its constants once, through
    pinned memory): plain steps, factor steps and refresh steps (eigen, cholesky and
    eigen_adam with both basis refreshes), with a BatchNorm layer
    (its unit-wise state), a depthwise convolution (its unit-wise state, or its units' bases
    and moments under eigen_adam) and singular factors (the G of the layer before the LayerNorm,
    the head's: their canonical null bases and Adam's floor,
    :mod:`dkfac.solvers.null_space`), two refreshes after the first."""
    options = {**REFRESHES[case], "factor_update_interval": 2, "inverse_update_interval": 4}
    counts = _steady_reads(options, 10)
    assert counts[0], "the first step reads the flags (nothing to hold yet)"
    for step in range(1, 10):  # refreshes 4 and 8, factor steps 2 and 6, plain the others
        assert counts[step] == {}, (step, counts[step])


def test_the_branching_guard_reads_its_flags() -> None:
    """The instrument sees the reads the device guard removes (a test that can fail)."""
    model = _model()
    opt = KFACOptimizer.for_model(model)
    assert not opt.preconditioner.flags_on_device  # a CPU keeps the branching guard
    for step in range(2):
        opt.zero_grad()
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        with HostReads() as reads:
            opt.step()
    lines = {where for _, where in reads.reads}
    assert any(where.startswith("step_math.py") for where in lines)
    assert any(where.startswith("optimizer.py") for where in lines)


def test_an_optimizer_that_cannot_skip_on_the_device_reads_the_flag() -> None:
    """A non-fused inner optimizer has no ``found_inf``: the skip is decided on the host."""
    model = _model()
    pre = KFACPreconditioner(model, damping=0.05)
    pre.flags_on_device = True
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), pre)
    before = copy.deepcopy([p.detach() for p in model.parameters()])
    opt.zero_grad()
    x, y = _batch(INPUT_NAN_STEP)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.skipped_steps == 1
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old, new.detach())


def test_the_gradient_buffer_zeroes_as_the_selection_does() -> None:
    """:class:`GradientBuffer` against :func:`zero_nonfinite` (concatenate, select, split),
    bit for bit, over steps whose failing layers change, a missing gradient, a change of
    shapes (a new buffer) and gradients of two dtypes (the selection itself)."""
    names = ["a", "b", "c", "d"]
    buffer = GradientBuffer()
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (2, 5), (3, 4), (6, 1)]
    for step in range(6):
        if step == 4:
            shapes[1] = (5, 2)
        grads: dict[str, torch.Tensor | None] = {
            n: torch.randn(*shape, generator=gen, dtype=torch.float64)
            for n, shape in zip(names, shapes, strict=True)
        }
        if step == 2:
            grads["c"] = None
        if step == 5:
            grads["d"] = grads["d"].float()  # type: ignore[union-attr]
        grads["b"][0, 0] = float("nan")  # type: ignore[index]
        masks = torch.rand(8, generator=gen) > 0.4
        masks[3] = step % 2 == 0  # b's flag: its NaN kept or zeroed
        want = zero_nonfinite(grads, masks, names)
        got = buffer.zero_nonfinite(grads, masks, names)
        assert got.keys() == want.keys()
        for name in names:
            w, g = want[name], got[name]
            assert (w is None) == (g is None), (step, name)
            if w is not None and g is not None:
                assert g.shape == w.shape and g.dtype == w.dtype, (step, name)
                assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)), (step, name)


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(7, 6)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.hidden = nn.Linear(4 * 9, 6, bias=False)
        self.head = nn.Linear(6, 2)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        mapped = self.norm(self.conv(images)).flatten(1)
        return self.head(torch.tanh(self.hidden(mapped) + self.tokens(tokens)))


def test_gathered_gradients_equal_each_block_s_own() -> None:
    """:meth:`GradientBuffer.gather` against each block's ``weight_grad``, bit for bit:
    convolutions and linear layers with and without a bias, BatchNorm (its two columns), an
    embedding (its own ``weight_grad``, copied whole), a missing bias gradient (the block's
    own zeros); over steps, the same views while the sources keep their shapes."""
    model = _Mixed().double()
    pre = KFACPreconditioner(model, method="eigen")
    assert {type(layer.block).__name__ for layer in pre.layers.values()} >= {"EmbeddingBlock"}
    buffer = GradientBuffer()
    gen = torch.Generator().manual_seed(4)
    last: dict[str, Any] = {}
    for step in range(4):
        model.zero_grad(set_to_none=True)
        tokens = torch.randint(0, 7, (8,), generator=gen)
        images = torch.randn(8, 2, 3, 3, generator=gen, dtype=torch.float64)
        model(tokens, images).sum().backward()
        if step == 1:
            model.head.bias.grad = None  # the block's weight_grad fills zeros
        want = {name: layer.block.weight_grad() for name, layer in pre.layers.items()}
        got = buffer.gather(pre.layers)
        assert got.keys() == want.keys()
        for name, w in want.items():
            g = got[name]
            assert w is not None and g is not None
            assert g.shape == w.shape and torch.equal(g, w), (step, name)
        if step == 3:  # the sources of step 2 again: the very same views
            assert all(got[name] is last[name] for name in got)
        last = got


def test_buffered_writes_equal_write_back() -> None:
    """:class:`GradientWrites` against :func:`write_back` with the same per-layer factors,
    bit for bit: ready layers times their factor (one of them 0, a failed gradient's),
    a delivered layer that is not ready unscaled; over steps with the same views. A
    block that writes its own way (an embedding) or a missing bias gradient: that layer
    left to ``write_back``."""
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Linear(4 * 9, 6, bias=False),
        nn.Linear(6, 2),
    ).double()
    twin = copy.deepcopy(model)
    pre, other = KFACPreconditioner(model), KFACPreconditioner(twin)
    names = list(pre.layers)
    writes = GradientWrites()
    gen = torch.Generator().manual_seed(6)
    for step in range(3):
        for net in (model, twin):
            net.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            net(torch.randn(5, 2, 3, 3, dtype=torch.float64)).sum().backward()
        finals = {
            n: torch.randn(layer.block.weight_grad().shape, generator=gen, dtype=torch.float64)
            for n, layer in pre.layers.items()
        }
        factors = torch.rand(len(names), generator=gen, dtype=torch.float64)
        factors[1] = 0.0
        ready = [n for n in names if n != names[2]]
        assert writes.write(pre.layers, finals, names, ready, factors) == []
        per_layer = dict(zip(names, factors.unbind(0), strict=True))
        write_back(other.layers, finals, names, ready, None, per_layer)
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad), step
    model[4].bias.grad = None
    assert writes.write(pre.layers, finals, names, names, factors) == [names[-1]]
    net = _Mixed().double()
    mixed = KFACPreconditioner(net)
    net(torch.arange(4), torch.randn(4, 2, 3, 3, dtype=torch.float64)).sum().backward()
    finals = {n: layer.block.weight_grad() for n, layer in mixed.layers.items()}  # type: ignore[misc]
    ones = torch.ones(len(mixed.layers), dtype=torch.float64)
    assert writes.write(mixed.layers, finals, list(mixed.layers), [], ones) == ["tokens"]
    for name, layer in mixed.layers.items():  # the others written, unscaled (not ready)
        if name != "tokens":
            assert torch.equal(layer.block.weight_grad(), finals[name]), name


@pytest.mark.parametrize("aligned", [False, True])
def test_select_where_equals_where_tensor_by_tensor(aligned: bool) -> None:
    """Each result is ``where(flag, tensor, other)``; aligned, each also starts on an
    ``ALIGNMENT``-byte boundary (odd sizes, two dtypes)."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*shape, generator=g) for shape in ((3, 5), (7,), (2, 2, 3))]
    tensors.append(torch.randn(5, 5, generator=g, dtype=torch.float64))
    others = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in tensors]
    flags = torch.tensor([True, False])
    positions = [0, 1, 1, 0]
    chosen = select_where(flags, positions, tensors, others, aligned=aligned)
    for got, tensor, other, at in zip(chosen, tensors, others, positions, strict=True):
        assert torch.equal(got, torch.where(flags[at], tensor, other))
        assert not aligned or got.data_ptr() % ALIGNMENT == 0


def _for_model_run(launch_bound_at_build: bool, by_hand: bool | None = None) -> dict[str, Any]:
    """``for_model`` with a CPU taken for a launch-bound device from the first step on, and
    at the build too or not (a model a framework moves onto the GPU after the optimizer was
    built: accelerate's ``prepare``, the Trainer); ``by_hand``: flags_on_device set so."""
    import dkfac.optimizer as optimizer_module
    import dkfac.preconditioner as preconditioner_module

    model = _model()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimizer_module, "_fused_sgd_fits", lambda params: True)
        patch.setattr(preconditioner_module, "launch_bound", lambda d: launch_bound_at_build)
        opt = KFACOptimizer.for_model(model, lr=0.01, overhead=None)
        if by_hand is not None:
            opt.preconditioner.flags_on_device = by_hand
        patch.setattr(preconditioner_module, "launch_bound", lambda d: True)
        _train(model, opt)
        opt._late.flush()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "skipped": opt.skipped_steps,
        "on_device": opt.preconditioner.flags_on_device,
        "fused": [g["fused"] for g in opt.param_groups],
    }


def test_a_model_moved_to_a_launch_bound_device_after_the_build_keeps_its_flags_there() -> None:
    """The device decides at the first step, not at the build: the guard's flags stay on the
    device and ``for_model``'s SGD is fused, as in a run built there, to the bit (a NaN step
    skipped on the device in both); flags set by hand stay as set."""
    built_there, moved = _for_model_run(True), _for_model_run(False)
    assert moved["on_device"] and moved["fused"] == [True]
    assert built_there["on_device"] and built_there["fused"] == [True]
    assert moved["skipped"] == built_there["skipped"] == 2  # the NaN gradient, the NaN input
    for a, b in zip(moved["params"], built_there["params"], strict=True):
        assert torch.equal(a, b)
    by_hand = _for_model_run(False, by_hand=False)
    assert not by_hand["on_device"] and by_hand["fused"] == [None]


def test_a_resumed_run_decides_its_flags_at_its_own_first_step() -> None:
    """A run resumed from a checkpoint (its step count past 0) on a model moved after the
    build decides at the first step it takes, as a fresh one does."""
    import dkfac.optimizer as optimizer_module
    import dkfac.preconditioner as preconditioner_module

    first = _model()
    opt = KFACOptimizer.for_model(first, lr=0.01, overhead=None)
    for step in range(2):
        opt.zero_grad()
        x, y = _batch(step)
        F.cross_entropy(first(x), y).backward()
        opt.step()
    model = _model()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimizer_module, "_fused_sgd_fits", lambda params: True)
        patch.setattr(preconditioner_module, "launch_bound", lambda d: False)
        resumed = KFACOptimizer.for_model(model, lr=0.01, overhead=None)
        resumed.load_state_dict(opt.state_dict())
        patch.setattr(preconditioner_module, "launch_bound", lambda d: True)
        resumed.zero_grad()
        x, y = _batch(2)
        F.cross_entropy(model(x), y).backward()
        resumed.step()
    assert resumed.preconditioner.steps == 3
    assert resumed.preconditioner.flags_on_device
    assert [g["fused"] for g in resumed.param_groups] == [True]
