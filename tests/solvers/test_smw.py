"""SMW (SKFAC) solver equals the dense factored π-damped solve; low-rank running averages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dkfac.blocks import Conv2dBlock, LinearBlock, Rows
from dkfac.solvers import CholeskySolver, SMWSolver, make_solver
from dkfac.solvers.lowrank.factor import (
    LowRank,
    LowRankRowsAccumulator,
    LowRankRunningFactor,
    decay_concat,
    default_max_rank,
)
from tests.oracles import dense_factored_solve, weight_grad_matrix

DT = torch.float64


def _grads_and_rows(module: nn.Module, block, x: torch.Tensor) -> tuple[Rows, Rows, torch.Tensor]:
    """A and G rows of one mean-loss backward (grad_output scaled by B) and the gradient."""
    out = module(x)
    loss = out.pow(2).flatten(1).sum(dim=1).mean() + out.sum()
    delta = torch.autograd.grad(loss, out, retain_graph=True)[0]
    loss.backward()
    return block.a_rows(x), block.g_rows(delta * x.shape[0]), weight_grad_matrix(module)


def _check_against_dense(a_rows: Rows, g_rows: Rows, grad: torch.Tensor, damping: float):
    a_low, g_low = LowRank.from_rows(a_rows), LowRank.from_rows(g_rows)
    solver = SMWSolver(DT)
    state = solver.compute(a_low, g_low, damping)
    got = solver.apply(state, grad, damping)
    expected = dense_factored_solve(a_low.dense(), g_low.dense(), grad, damping)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)
    return state


@pytest.mark.parametrize("damping", [1e-4, 1e-2, 1.0])
def test_linear_rank_deficient_equals_dense_factored_solve(damping: float) -> None:
    layer = nn.Linear(10, 7).to(DT)
    block = LinearBlock("", layer)
    a_rows, g_rows, grad = _grads_and_rows(layer, block, torch.randn(4, 10, dtype=DT))
    state = _check_against_dense(a_rows, g_rows, grad, damping)
    # Both sides took the low-rank path and nothing d×d was stored.
    assert state["a_u"].shape == (11, 4) and state["a_core"].shape == (4, 4)
    assert state["g_u"].shape == (7, 4) and state["g_core"].shape == (4, 4)
    assert "a_inv" not in state and "g_inv" not in state


def test_linear_fallback_when_rank_not_below_dim() -> None:
    layer = nn.Linear(10, 3).to(DT)
    block = LinearBlock("", layer)
    a_rows, g_rows, grad = _grads_and_rows(layer, block, torch.randn(5, 10, dtype=DT))
    state = _check_against_dense(a_rows, g_rows, grad, 0.01)
    assert SMWSolver.is_lowrank_side(state, "a") and not SMWSolver.is_lowrank_side(state, "g")
    assert state["g_inv"].shape == (3, 3)


def test_leading_dims_and_dense_input_mix() -> None:
    layer = nn.Linear(9, 6, bias=False).to(DT)
    block = LinearBlock("", layer)
    a_rows, g_rows, grad = _grads_and_rows(layer, block, torch.randn(2, 2, 9, dtype=DT))
    a_low, g_low = LowRank.from_rows(a_rows), LowRank.from_rows(g_rows)
    solver = SMWSolver(DT)
    # G passed dense: inverted densely, A stays low-rank; same answer.
    state = solver.compute(a_low, g_low.dense(), 0.05)
    assert "g_inv" in state and "a_u" in state
    expected = dense_factored_solve(a_low.dense(), g_low.dense(), grad, 0.05)
    torch.testing.assert_close(solver.apply(state, grad, 0.05), expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("reduction,positions", [("sum", 1), ("subsample", 2), ("subsample", 100)])
def test_reduced_conv_equals_dense_factored_solve(reduction: str, positions: int) -> None:
    conv = nn.Conv2d(3, 5, 3, stride=1, padding=1).to(DT)
    block = Conv2dBlock("", conv, reduction=reduction, positions=positions, seed=3)
    block.set_step(7)
    x = torch.randn(2, 3, 5, 4, dtype=DT)
    a_rows, g_rows, grad = _grads_and_rows(conv, block, x)
    state = _check_against_dense(a_rows, g_rows, grad, 0.03)
    rank = a_rows.rows.shape[0]
    assert rank == {"sum": 2, "subsample": 2 * min(positions, 20)}[reduction]
    assert SMWSolver.is_lowrank_side(state, "a") == (rank < 28)
    assert SMWSolver.is_lowrank_side(state, "g") == (rank < 5)


def test_all_dense_equals_cholesky_solver() -> None:
    a = torch.randn(6, 6, dtype=DT)
    g = torch.randn(4, 4, dtype=DT)
    a, g = a @ a.T, g @ g.T
    grad = torch.randn(4, 6, dtype=DT)
    smw = SMWSolver(DT)
    chol = CholeskySolver(DT)
    torch.testing.assert_close(
        smw.apply(smw.compute(a, g, 0.1), grad, 0.1),
        chol.apply(chol.compute(a, g, 0.1), grad, 0.1),
    )


def test_float32_close_to_float64() -> None:
    u_a = torch.randn(60, 8, dtype=DT)
    u_g = torch.randn(30, 8, dtype=DT) * 0.1
    grad = torch.randn(30, 60, dtype=DT)
    expected = dense_factored_solve(u_a @ u_a.T, u_g @ u_g.T, grad, 0.01)
    solver = SMWSolver(torch.float32)
    state = solver.compute(LowRank(u_a.float()), LowRank(u_g.float()), 0.01)
    got = solver.apply(state, grad.float(), 0.01)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-3, atol=1e-4 * expected.abs().max())


def test_registry_and_flag() -> None:
    assert isinstance(make_solver("smw", DT), SMWSolver)
    assert SMWSolver.accepts_lowrank and not CholeskySolver.accepts_lowrank
    with pytest.raises(ValueError, match="method"):
        make_solver("auto")


def test_validation_errors() -> None:
    solver = SMWSolver(DT)
    u = LowRank(torch.randn(5, 2, dtype=DT))
    with pytest.raises(ValueError, match="damping"):
        solver.compute(u, u, 0.0)
    with pytest.raises(ValueError, match="damping"):
        solver.compute(u, u, float("nan"))
    with pytest.raises(ValueError, match="square"):
        solver.compute(torch.randn(5, 4, dtype=DT), u, 0.1)
    with pytest.raises(TypeError, match="LowRank"):
        solver.compute([[1.0]], u, 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(d, m\)"):
        LowRank(torch.randn(5, dtype=DT))
    with pytest.raises(TypeError, match="floating"):
        LowRank(torch.ones(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="normaliser"):
        LowRank.from_rows(Rows(torch.randn(2, 3), 0.0))
    with pytest.raises(ValueError, match="side"):
        SMWSolver.is_lowrank_side({}, "b")


# --- low-rank running averages ------------------------------------------------------------


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.95])
def test_decay_concat_equals_dense_running_average(decay: float) -> None:
    running = LowRankRunningFactor(max_rank=1000)
    dense = None
    for _ in range(4):
        u_new = torch.randn(9, 3, dtype=DT)
        running.update(LowRank(u_new), decay)
        new = u_new @ u_new.T
        dense = new if dense is None else decay * dense + (1 - decay) * new
        value = running.value()
        assert value is not None
        torch.testing.assert_close(value.dense(), dense, rtol=1e-12, atol=1e-12)
    assert value.rank == (3 if decay == 0.0 else 12)


def test_decay_concat_truncation_drops_oldest_and_underestimates() -> None:
    u1, u2, u3 = (torch.randn(8, 3, dtype=DT) for _ in range(3))
    u = decay_concat(decay_concat(u1, u2, 0.9, 6), u3, 0.9, 6)
    assert u.shape == (8, 6)
    # Kept: the (scaled) second and third updates; u1 was the oldest and is gone.
    kept = 0.9 * (0.1 * u2 @ u2.T) + 0.1 * u3 @ u3.T
    torch.testing.assert_close(u @ u.T, kept)
    full = 0.81 * u1 @ u1.T + kept
    assert float(torch.linalg.eigvalsh(full - u @ u.T).min()) > -1e-12


@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_decay_concat_keeps_every_column_of_the_newest_update(decay: float) -> None:
    """An update wider than ``max_rank`` is kept whole (only older columns are dropped):
    with ``decay = 0`` the factor is the newest one exactly."""
    u_old, u_new = torch.randn(8, 3, dtype=DT), torch.randn(8, 5, dtype=DT)
    u = decay_concat(u_old, u_new, decay, 3)
    assert u.shape == (8, 5)
    torch.testing.assert_close(u @ u.T, (1 - decay) * u_new @ u_new.T)


def test_decay_concat_validation() -> None:
    u = torch.randn(4, 2)
    with pytest.raises(ValueError, match="decay"):
        decay_concat(u, u, 1.0, 4)
    with pytest.raises(ValueError, match="max_rank"):
        decay_concat(u, u, 0.5, 0)
    with pytest.raises(ValueError, match="u_old"):
        decay_concat(torch.randn(5, 2), u, 0.5, 4)
    with pytest.raises(ValueError, match="u_new"):
        decay_concat(None, torch.randn(4), 0.5, 4)
    with pytest.raises(ValueError, match="max_rank"):
        LowRankRunningFactor(max_rank=0)


def test_rows_accumulator_equals_dense_sum_over_micro_batches() -> None:
    parts = [Rows(torch.randn(3, 5, dtype=DT), 3.0), Rows(torch.randn(2, 5, dtype=DT), 2.0)]
    scales = [1.0, 4.0]
    acc = LowRankRowsAccumulator()
    assert acc.to_lowrank() is None
    for rows, scale in zip(parts, scales, strict=True):
        acc.add(rows, scale)
    low = acc.to_lowrank()
    assert low is not None and low.rank == 5
    dense = sum(s * r.rows.T @ r.rows for r, s in zip(parts, scales, strict=True)) / 5.0
    torch.testing.assert_close(low.dense(), dense)
    assert low.trace() == pytest.approx(float(torch.trace(dense)), rel=1e-12)
    with pytest.raises(ValueError, match="scale"):
        acc.add(parts[0], -1.0)
    with pytest.raises(ValueError, match="columns"):
        acc.add(Rows(torch.randn(2, 4, dtype=DT), 2.0))
    acc.reset()
    assert acc.to_lowrank() is None


def test_smw_with_running_concatenation_equals_dense_running_solve() -> None:
    layer = nn.Linear(12, 8).to(DT)
    block = LinearBlock("", layer)
    run_a, run_g = LowRankRunningFactor(max_rank=64), LowRankRunningFactor(max_rank=64)
    dense_a = dense_g = None
    for _ in range(3):
        layer.zero_grad()
        a_rows, g_rows, grad = _grads_and_rows(layer, block, torch.randn(2, 12, dtype=DT))
        for run, rows in ((run_a, a_rows), (run_g, g_rows)):
            run.update(LowRank.from_rows(rows), 0.8)
        new_a = a_rows.rows.T @ a_rows.rows / a_rows.normaliser
        new_g = g_rows.rows.T @ g_rows.rows / g_rows.normaliser
        dense_a = new_a if dense_a is None else 0.8 * dense_a + 0.2 * new_a
        dense_g = new_g if dense_g is None else 0.8 * dense_g + 0.2 * new_g
    a_low, g_low = run_a.value(), run_g.value()
    assert a_low is not None and g_low is not None and a_low.rank == 6
    solver = SMWSolver(DT)
    got = solver.apply(solver.compute(a_low, g_low, 0.02), grad, 0.02)
    expected = dense_factored_solve(dense_a, dense_g, grad, 0.02)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)


def test_default_max_rank_keeps_updates_above_weight_floor() -> None:
    assert default_max_rank(32, 0.0) == 32
    assert default_max_rank(10, 0.5) == 70  # 0.5**6 = 0.0156 >= 0.01 > 0.5**7
    assert default_max_rank(10, 0.5, weight_floor=0.25) == 30  # 0.5**2 = 0.25 kept exactly
    assert default_max_rank(4, 0.95) == 4 * 90  # 0.95**89 >= 0.01 > 0.95**90
    with pytest.raises(ValueError, match="rows"):
        default_max_rank(0, 0.5)
    with pytest.raises(ValueError, match="decay"):
        default_max_rank(4, 1.0)
    with pytest.raises(ValueError, match="weight_floor"):
        default_max_rank(4, 0.5, weight_floor=0.0)
