"""set_moment_betas: the groups' betas given to the solvers that keep moments."""

from __future__ import annotations

import math

import pytest

from dkfac.engine.moment_betas import set_moment_betas
from dkfac.solvers import MomentOptions


class _Solver:
    def __init__(self, options: object) -> None:
        self.options = options


def test_the_moment_solvers_take_the_betas_and_the_others_are_left() -> None:
    a, b = _Solver(MomentOptions(beta1=0.9, beta2=0.95)), _Solver(MomentOptions(beta2=0.99))
    other = _Solver(object())
    before = other.options
    assert set_moment_betas([a, b, other], 0.8, 0.95) == 2
    assert (a.options.beta1, a.options.beta2) == (b.options.beta1, b.options.beta2) == (0.8, 0.95)
    assert a.options == MomentOptions(beta1=0.8, beta2=0.95)  # only the betas change
    assert other.options is before
    kept = a.options
    assert set_moment_betas([a, b], 0.8, 0.95) == 0  # the usual step changes nothing
    assert a.options is kept
    assert set_moment_betas([a], 0, 0.95) == 1  # an int goes through MomentOptions' checks
    assert a.options.beta1 == 0.0


@pytest.mark.parametrize("betas", [(1.0, 0.95), (0.9, math.nan), (0.9, -0.1), ("0.9", 0.95)])
def test_bad_betas_are_refused_before_any_solver_changes(betas: tuple[object, object]) -> None:
    solvers = [_Solver(MomentOptions(beta1=0.9, beta2=0.95)) for _ in range(3)]
    before = [s.options for s in solvers]
    with pytest.raises((TypeError, ValueError), match="beta"):
        set_moment_betas(solvers, *betas)  # type: ignore[arg-type]
    assert [s.options for s in solvers] == before
