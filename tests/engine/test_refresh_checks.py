"""Refreshes checked on the device equal refreshes checked on the host.

Oracle: the same run with ``flags_on_device`` off (every solver checks its new states on
the host) and on (:mod:`dkfac.engine.refresh_checks`: unchecked solvers, the states
selected on the device, null-space bases and indicators in fixed shapes), float64, over
several refreshes of a model with a BatchNorm layer and singular factors: the weights, the
solver states (null indicators included) and the moments equal to the bit. Then a
decomposition made to fail: the device path keeps the layer's last state, as the host path
does after its float64 retry fails too, and logs its warning a step late.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.solvers import basis_refresh, eigen
from tests.engine.test_device_checks import _batch, _model

STEPS = 10
POWER = {"method": "eigen_adam", "basis_refresh": "power"}
CASES: dict[str, dict[str, Any]] = {
    "eigen": {"method": "eigen", "kl_clip": 1e-2},
    "cholesky": {"method": "cholesky"},
    "eigen_adam-eigh": {"method": "eigen_adam", "basis_refresh": "eigh"},
    "eigen_adam-power": {**POWER, "moment_carry": "rotate"},
    "eigen_adam-reset": {**POWER, "moment_carry": "reset"},
    "eigen_adam-shapes": {**POWER, "basis_block_size": 8, "flattened_inputs": {"4": (4, 36)}},
}


def _run(options: dict[str, Any], on_device: bool, caplog: Any) -> dict[str, Any]:
    model = _model()
    pre = KFACPreconditioner(
        model,
        damping=0.05,
        factor_update_interval=1,
        inverse_update_interval=3,
        **options,
    )
    pre.flags_on_device = on_device
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), pre)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(step + 200)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        pre._guard.late.flush()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "states": {
            name: {k: v.clone() for k, v in (layer.solver_state or {}).items()}
            for name, layer in pre.layers.items()
        },
        "moments": {
            name: {k: v.clone() for k, v in (layer.moments or {}).items()}
            for name, layer in pre.layers.items()
        },
        "warnings": [r.getMessage() for r in caplog.records],
    }


def _assert_equal(host: dict[str, Any], device: dict[str, Any]) -> None:
    for before, after in zip(host["params"], device["params"], strict=True):
        assert torch.equal(before, after)
    for kind in ("states", "moments"):
        assert host[kind].keys() == device[kind].keys()
        for name, entries in host[kind].items():
            assert entries.keys() == device[kind][name].keys(), (kind, name)
            for key, value in entries.items():
                assert torch.equal(value, device[kind][name][key]), (kind, name, key)


@pytest.mark.parametrize("case", sorted(CASES))
def test_refreshes_on_the_device_equal_refreshes_on_the_host(case: str, caplog: Any) -> None:
    host = _run(CASES[case], on_device=False, caplog=caplog)
    device = _run(CASES[case], on_device=True, caplog=caplog)
    _assert_equal(host, device)
    assert host["warnings"] == device["warnings"] == []
    assert "0.0" in host["states"] and "fisher" in host["states"]["1"]  # a BatchNorm's state
    unit = "q" if case.startswith("eigen_adam") else "fisher"  # the depthwise convolution's
    assert unit in host["states"]["0.1"]
    if case.startswith("eigen_adam"):  # singular factors (softmax's G, the G before the LayerNorm)
        floored = {name for name, state in device["states"].items() if "null_g" in state}
        # (layer 4's G in blocks of 8: no block is singular)
        assert ({"11"} if "basis_block_size" in CASES[case] else {"4", "11"}) <= floored
        assert device["states"]["11"]["null_g"].sum() > 0


def test_a_failed_decomposition_keeps_the_last_state(
    caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second refresh of layer ``7`` (an ``eigh`` that returns NaN, in any dtype): the
    host path retries in float64, fails and keeps the last state; the device path keeps
    it by selection, with its warning a step late; the weights are equal."""
    real = eigen.symmetric_eigh
    calls = {"n": 0}

    def failing(matrix: torch.Tensor, dtype: torch.dtype, checked: bool = True) -> Any:
        values, vectors = real(matrix, dtype, checked)
        if matrix.shape[-1] == 25 and matrix.dim() == 2:  # layer 7's A (24 inputs + bias)
            calls["n"] += 1
            if calls["n"] > 1:
                return values, torch.full_like(vectors, float("nan"))
        return values, vectors

    monkeypatch.setattr(eigen, "symmetric_eigh", failing)
    monkeypatch.setattr(basis_refresh, "symmetric_eigh", failing)
    options = {"method": "eigen", "kl_clip": None}
    runs = []
    for on_device in (False, True):
        calls["n"] = 0
        runs.append(_run(options, on_device, caplog))
    host, device = runs
    for before, after in zip(host["params"], device["params"], strict=True):
        assert torch.equal(before, after)
    assert any("7:" in w and "keeping the last good inverse" in w for w in host["warnings"])
    assert any("state of 7; keeping" in w for w in device["warnings"])
    assert all(torch.isfinite(v).all() for v in device["states"]["7"].values())


@pytest.mark.parametrize("on_device", [False, True])
def test_a_solver_state_whose_squares_overflow_is_kept(
    on_device: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Inputs near 1e10: A's eigenvalues (about 1e22) are finite but their squares are not.
    The device guard checks a state as the factors are, by its plain sum, and the host's
    by ``isfinite``: each refresh's state is taken on both (with the squares' test the
    device guard refused the second as non-finite and kept the first, with a warning)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = KFACOptimizer.for_model(
        model, lr=1e-3, method="eigen", overhead=None, inverse_update_interval=1
    )
    opt.preconditioner.flags_on_device = on_device
    states = []
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        for _ in range(3):
            x = torch.randn(64, 16, generator=gen) * 1e10
            y = torch.randint(0, 4, (64,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            states.append(dict(opt.preconditioner.layers["0"].solver_state or {}))
    assert not [r for r in caplog.records if "solver state" in r.getMessage()]
    assert all(torch.isfinite(v).all() for state in states for v in state.values())
    assert any(not torch.equal(states[0][k], states[1][k]) for k in states[0])  # a new state
