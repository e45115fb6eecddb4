"""``apply_batch``: layers of one shape and one set of options preconditioned in one pass.

Oracle: each layer's own :meth:`~dkfac.solvers.base.Solver.apply_with_moments` (float64,
to 1e-12; the batched products may round in another order): the updates and the moments,
over several steps, with fresh and carried moments mixed in one batch, for every option
that changes the apply (Nesterov, EKFAC, one-sided and block-diagonal sides, the
orthogonalised update, lowered rotations: those to the float32 rounding).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from dkfac.solvers import EigenAdamSolver, EigenSolver, EKFACSolver, MomentOptions, make_solver
from dkfac.solvers.base import Solver
from dkfac.solvers.eigen_moments import EigenMomentsSolver

DT = torch.float64
G_DIM, A_DIM, LAYERS = 6, 9, 4
TOL: dict[str, Any] = {"rtol": 1e-12, "atol": 1e-12}
LOW_TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5}
"""Rotations in float32: the batched products may round in another order (1e-7 here)."""


def _spd(n: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3 * n, generator=gen, dtype=DT)
    return x @ x.T / (3 * n) + 0.01 * torch.eye(n, dtype=DT)


def _grad(step: int, layer: int) -> Tensor:
    gen = torch.Generator().manual_seed(100 * step + layer)
    return torch.randn(G_DIM, A_DIM, generator=gen, dtype=DT)


def _states(solver: EigenMomentsSolver) -> list[dict[str, Tensor]]:
    return [solver.compute(_spd(A_DIM, 2 * i), _spd(G_DIM, 2 * i + 1), 0.1) for i in range(LAYERS)]


CASES: dict[str, tuple[type[EigenMomentsSolver], MomentOptions]] = {
    "eigen_adam": (EigenAdamSolver, MomentOptions()),
    "nesterov, no bias correction": (
        EigenAdamSolver,
        MomentOptions(nesterov=True, bias_correction=False),
    ),
    "ekfac": (EKFACSolver, MomentOptions()),
    "one-sided": (EigenAdamSolver, MomentOptions(max_dim=7)),
    "blocks": (EigenAdamSolver, MomentOptions(block_size=4)),
    "orthogonal": (EigenAdamSolver, MomentOptions(orthogonal_rms=0.5, orthogonal_steps=3)),
    "orthogonal, split": (
        EigenAdamSolver,
        MomentOptions(orthogonal_rms=0.5, orthogonal_split=0.5, block_size=4),
    ),
    "ekfac, orthogonal, split": (
        EKFACSolver,
        MomentOptions(orthogonal_rms=0.5, orthogonal_split=0.25),
    ),
    "lowered rotations, blocks, orthogonal": (
        EigenAdamSolver,
        MomentOptions(
            carry="reset",
            gradient_rotation_dtype=torch.float32,
            rotation_dtype=torch.float32,
            block_size=4,
            orthogonal_rms=1.5,
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_equals_each_layer_on_its_own(case: str) -> None:
    cls, options = CASES[case]
    solver = cls(DT, options)
    tol = LOW_TOL if options.rotation_dtype is not None else TOL
    states = _states(solver)
    keys = {solver.batch_key(s, _grad(0, 0)) for s in states}
    assert len(keys) == 1 and None not in keys
    single: list[Any] = [None] * LAYERS
    batched: list[Any] = [None] * LAYERS
    for step in range(4):
        grads = [_grad(step, i) for i in range(LAYERS)]
        if step == 1:  # layer 2 starts afresh (a reset): fresh and carried moments in one batch
            single[2] = batched[2] = None
        outputs = solver.apply_batch(states, batched, grads, 0.1)
        assert len(outputs) == LAYERS
        for i, (update, moments) in enumerate(outputs):
            want, single[i] = solver.apply_with_moments(states[i], single[i], grads[i], 0.1)
            torch.testing.assert_close(update, want, **tol, msg=f"{case}: step {step}, {i}")
            assert moments is not None and set(moments) == set(single[i])
            for key, value in moments.items():
                assert value.shape == single[i][key].shape, key
                torch.testing.assert_close(value, single[i][key], **tol, msg=key)
            batched[i] = moments
    assert single[2]["t"].item() == 3.0 and single[0]["t"].item() == 4.0


def test_the_given_moments_are_left_alone() -> None:
    solver = EigenAdamSolver(DT, MomentOptions(nesterov=True))
    states = _states(solver)
    grads = [_grad(0, i) for i in range(LAYERS)]
    moments = [m for _, m in solver.apply_batch(states, [None] * LAYERS, grads, 0.1)]
    copies = [{k: v.clone() for k, v in m.items()} for m in moments]  # type: ignore[union-attr]
    solver.apply_batch(states, moments, [_grad(1, i) for i in range(LAYERS)], 0.1)
    for m, c in zip(moments, copies, strict=True):
        assert m is not None and all(torch.equal(m[k], c[k]) for k in c)


def test_keys_part_shapes_options_and_structured_sides() -> None:
    solver = EigenAdamSolver(DT)
    state = _states(solver)[0]
    key = solver.batch_key(state, _grad(0, 0))
    assert key == EigenAdamSolver(DT).batch_key(state, _grad(0, 0))  # equal options
    assert key != EigenAdamSolver(DT, MomentOptions(beta2=0.9)).batch_key(state, _grad(0, 0))
    assert key != EKFACSolver(DT).batch_key(state, _grad(0, 0))
    assert key != solver.batch_key(state, _grad(0, 0).float())
    other = solver.compute(_spd(A_DIM + 1, 0), _spd(G_DIM, 1), 0.1)
    assert key != solver.batch_key(other, torch.zeros(G_DIM, A_DIM + 1, dtype=DT))
    structured = make_solver("eigen_adam", DT, input_map=(3, 3))
    assert isinstance(structured, EigenMomentsSolver)
    s_state = structured.compute(_spd(A_DIM, 0), _spd(G_DIM, 1), 0.1)
    assert structured.batch_key(s_state, _grad(0, 0)) is None


def test_the_default_is_layer_by_layer() -> None:
    """A solver without a batched pass is never grouped; its ``apply_batch`` loops."""
    solver = make_solver("cholesky", DT)
    assert type(solver).batch_key is Solver.batch_key
    state = solver.compute(_spd(A_DIM, 0), _spd(G_DIM, 1), 0.1)
    assert solver.batch_key(state, _grad(0, 0)) is None
    grads = [_grad(0, i) for i in range(2)]
    outputs = solver.apply_batch([state, state], [None, None], grads, 0.1)
    for (update, moments), grad in zip(outputs, grads, strict=True):
        assert moments is None
        torch.testing.assert_close(update, solver.apply(state, grad, 0.1), rtol=0, atol=0)


def test_an_eigen_batch_equals_each_layer_on_its_own() -> None:
    """``eigen``'s batched pass: the stacked states (kept, then restacked after a refresh
    of one layer) give each layer its own :meth:`apply`; its key parts shapes and dtypes."""
    solver = make_solver("eigen", DT)
    assert isinstance(solver, EigenSolver)
    states = [solver.compute(_spd(A_DIM, 2 * i), _spd(G_DIM, 2 * i + 1), 0.1) for i in range(3)]
    keys = {solver.batch_key(s, _grad(0, 0)) for s in states}
    assert len(keys) == 1 and None not in keys
    assert solver.batch_key(states[0], _grad(0, 0).float()) not in keys
    other = solver.compute(_spd(A_DIM + 1, 0), _spd(G_DIM, 1), 0.1)
    assert solver.batch_key(other, torch.zeros(G_DIM, A_DIM + 1, dtype=DT)) not in keys
    for step in range(3):
        if step == 2:  # one layer refreshed: new tensors, a new stack
            states[1] = solver.compute(_spd(A_DIM, 7), _spd(G_DIM, 8), 0.1)
        grads = [_grad(step, i) for i in range(3)]
        outputs = solver.apply_batch(states, [None] * 3, grads, 0.2)
        assert len(outputs) == 3
        for state, grad, (update, moments) in zip(states, grads, outputs, strict=True):
            assert moments is None
            torch.testing.assert_close(update, solver.apply(state, grad, 0.2), **TOL)
            qa, da, qg, dg = (state[k] for k in ("qa", "da", "qg", "dg"))
            want = qg @ ((qg.T @ grad @ qa) / (torch.outer(dg, da) + 0.2)) @ qa.T
            torch.testing.assert_close(update, want, **TOL)


def test_the_last_stack_is_reused_only_for_its_own_slices() -> None:
    """Moments that are the last call's slices are read from its stack (no new stack);
    copies of them, or the slices in another order, are stacked anew: the same results."""
    solver = EigenAdamSolver(DT, MomentOptions(nesterov=True))
    states = _states(solver)
    first = [
        m
        for _, m in solver.apply_batch(
            states, [None] * LAYERS, [_grad(0, i) for i in range(LAYERS)], 0.1
        )
    ]
    copies = [{k: v.clone() for k, v in m.items()} for m in first]  # type: ignore[union-attr]
    assert solver._restacked(first) is not None
    assert solver._restacked(copies) is None
    assert solver._restacked(first[::-1]) is None
    grads = [_grad(1, i) for i in range(LAYERS)]
    reused = solver.apply_batch(states, first, grads, 0.1)
    fresh = EigenAdamSolver(DT, MomentOptions(nesterov=True)).apply_batch(
        states, copies, grads, 0.1
    )
    for (u1, m1), (u2, m2) in zip(reused, fresh, strict=True):
        assert torch.equal(u1, u2)
        assert m1 is not None and m2 is not None
        assert all(torch.equal(m1[k], m2[k]) for k in m1)


def test_the_stack_of_states_is_reused_only_for_the_same_states() -> None:
    """Between two refreshes the layers hand the same state tensors: their stack is kept;
    a refreshed state (new tensors), the states in another order or fewer of them are
    stacked anew, and every call's updates equal a fresh solver's."""
    solver = EigenAdamSolver(DT)
    states = _states(solver)
    grads = [_grad(0, i) for i in range(LAYERS)]
    solver.apply_batch(states, [None] * LAYERS, grads, 0.1)
    kept = solver._state_stack.stacked(states)
    assert solver._state_stack.stacked(states) is kept
    assert solver._state_stack.stacked(states[::-1]) is not kept
    assert solver._state_stack.stacked(states[:2])["qa"].shape[0] == 2
    again = solver._state_stack.stacked(states)  # the stack of all four again, kept
    assert solver._state_stack.stacked(states) is again
    refreshed = [dict(s) for s in states]
    refreshed[1]["qa"] = refreshed[1]["qa"].flip(-1)  # a new basis tensor for layer 1
    restacked = solver._state_stack.stacked(refreshed)
    assert restacked is not again
    assert torch.equal(restacked["qa"][1], refreshed[1]["qa"])
    for chosen in (states, refreshed, states[::-1]):
        got = solver.apply_batch(chosen, [None] * LAYERS, grads, 0.1)
        want = EigenAdamSolver(DT).apply_batch(chosen, [None] * LAYERS, grads, 0.1)
        for (u1, _), (u2, _) in zip(got, want, strict=True):
            assert torch.equal(u1, u2)


def test_the_stacked_states_become_the_layers_storage() -> None:
    """A new stack of states is written back into the states' dicts as slices (the same
    values), so the group's bases are held once: every layer's tensors live in the
    stack's storage, and the next call finds the very tensors it stacked."""
    solver = EigenAdamSolver(DT)
    states = _states(solver)
    before = [{k: v.clone() for k, v in s.items()} for s in states]
    grads = [_grad(0, i) for i in range(LAYERS)]
    want = EigenAdamSolver(DT).apply_batch([dict(s) for s in before], [None] * LAYERS, grads, 0.1)
    got = solver.apply_batch(states, [None] * LAYERS, grads, 0.1)
    stacked = solver._state_stack.stacked(states)  # no new stack: the same tensors
    for i, (state, old) in enumerate(zip(states, before, strict=True)):
        assert state.keys() == old.keys()
        for key in state:
            assert torch.equal(state[key], old[key])
            assert state[key].untyped_storage().data_ptr() == (
                stacked[key].untyped_storage().data_ptr()
            )
            assert torch.equal(stacked[key][i], old[key])
    for (u1, _), (u2, _) in zip(got, want, strict=True):
        assert torch.equal(u1, u2)
