"""The moment update and scaling, and a group's whole update, through ``torch.compile``
equal the eager ones.

Oracle: the same solver without a backend (eager), over several steps, through each path
that runs it (one layer, a stack of one shape, the flat pass over groups of several
shapes). ``aot_eager`` captures the functions and runs the captured graph with eager
kernels: to 1e-12 in float64. ``inductor`` generates C++ on this CPU (it needs a C
compiler, skipped without one): to 1e-12 in float64 as well (its kernels may contract a
multiply and an add, a rounding apart). A compiler that fails is logged once and the
eager function runs from then on, with eager's values. A group's whole update
(``step_compile_backend``: rotations, moments, polar factor) is checked the same way, stacked
and for one layer alone, and each :class:`Compiled` compiles a code object of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from typing import Any

import pytest
import torch
from torch import Tensor

from dkfac.solvers import EigenAdamSolver, EKFACSolver, MomentOptions
from dkfac.solvers.base import BatchJob
from dkfac.solvers.compiled import Compiled, check_backend, own_code

DT = torch.float64
TOL: dict[str, Any] = {"rtol": 1e-12, "atol": 1e-12}
SHAPES = [(5, 7, 3), (4, 6, 1), (3, 5, 2)]
"""``(g, a, layers)`` of each group."""


SINGULAR = {(0, "A"): 3, (2, "G"): 2}
"""``(group, side) -> rank`` of the factors made singular in the singular runs."""


def _spd(n: int, seed: int, rank: int | None = None) -> Tensor:
    """A full-rank factor, or one of ``rank`` (a null space: Adam's rounding floor)."""
    gen = torch.Generator().manual_seed(seed)
    if rank is not None:
        x = torch.randn(n, rank, generator=gen, dtype=DT)
        return x @ x.T / rank
    x = torch.randn(n, 2 * n, generator=gen, dtype=DT)
    return x @ x.T / n + 0.05 * torch.eye(n, dtype=DT)


def _grads(step: int, group: int) -> list[Tensor]:
    g, a, count = SHAPES[group]
    gen = torch.Generator().manual_seed(100 * step + group)
    return [torch.randn(g, a, generator=gen, dtype=DT) for _ in range(count)]


def _run(
    cls: type[EigenAdamSolver] | type[EKFACSolver],
    options: MomentOptions,
    steps: int = 3,
    singular: bool = False,
) -> list[Tensor]:
    """Every update and moment of ``steps`` steps: the flat pass over the groups, each
    group's own batched pass and the first layer alone (fresh solvers of ``options``;
    the factors of :data:`SINGULAR` singular where ``singular``)."""
    solvers = [cls(DT, options) for _ in SHAPES]

    def factor(k: int, side: str, n: int, seed: int) -> Tensor:
        return _spd(n, seed, SINGULAR.get((k, side)) if singular else None)

    states = [
        [
            solvers[k].completed(
                solvers[k].compute(
                    factor(k, "A", a, 5 * k + i), factor(k, "G", g, 5 * k + i + 2), 0.1
                )
            )
            for i in range(c)
        ]
        for k, (g, a, c) in enumerate(SHAPES)
    ]
    if singular and cls.adam_scaled:
        assert ["null_g" in group[0] for group in states] == [True, False, True]
    alone, batched = cls(DT, options), [cls(DT, options) for _ in SHAPES]
    flat: list[list[Any]] = [[None] * c for _, _, c in SHAPES]
    own: list[list[Any]] = [[None] * c for _, _, c in SHAPES]
    single: Any = None
    out: list[Tensor] = []
    for step in range(steps):
        grads = [_grads(step, k) for k in range(len(SHAPES))]
        jobs = [BatchJob(solvers[k], states[k], flat[k], grads[k]) for k in range(len(SHAPES))]
        for k, group in enumerate(solvers[0].apply_groups(jobs, 0.1)):
            flat[k] = [m for _, m in group]
            out += [u for u, _ in group] + [v for m in flat[k] for v in m.values()]
        for k in range(len(SHAPES)):
            results = batched[k].apply_batch(states[k], own[k], grads[k], 0.1)
            own[k] = [m for _, m in results]
            out += [u for u, _ in results] + [v for m in own[k] for v in m.values()]
        update, single = alone.apply_with_moments(states[0][0], single, grads[0][0], 0.1)
        out += [update, *single.values()]
    return out


@pytest.mark.parametrize(
    ("cls", "options", "singular"),
    [
        (EigenAdamSolver, MomentOptions(), False),
        (EigenAdamSolver, MomentOptions(), True),
        (EigenAdamSolver, MomentOptions(nesterov=True, block_size=4), False),
        (EKFACSolver, MomentOptions(bias_correction=False), False),
    ],
)
def test_the_captured_moment_step_equals_the_eager_one(
    cls: type[EigenAdamSolver], options: MomentOptions, singular: bool
) -> None:
    """Singular factors too: the rounding floor, per matrix and per layer of the flat pass."""
    torch._dynamo.reset()
    eager = _run(cls, options, singular=singular)
    compiled = MomentOptions(**{**vars(options), "compile_backend": "aot_eager"})
    captured = _run(cls, compiled, singular=singular)
    assert len(captured) == len(eager)
    for got, want in zip(captured, eager, strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")), reason="inductor needs a C compiler"
)
def test_inductor_s_kernels_equal_the_eager_ones_on_the_cpu() -> None:
    """One compiled step (the flat pass's, one graph, with the rounding floor of the
    :data:`SINGULAR` factors) against eager, two steps."""
    torch._dynamo.reset()
    options = MomentOptions(nesterov=True)
    solvers = [EigenAdamSolver(DT, options) for _ in SHAPES]
    compiled_options = MomentOptions(nesterov=True, compile_backend="inductor")
    twins = [EigenAdamSolver(DT, compiled_options) for _ in SHAPES]
    states = [
        [
            solvers[k].completed(
                solvers[k].compute(
                    _spd(a, 3 * k + i, SINGULAR.get((k, "A"))),
                    _spd(g, 3 * k + i + 1, SINGULAR.get((k, "G"))),
                    0.1,
                )
            )
            for i in range(c)
        ]
        for k, (g, a, c) in enumerate(SHAPES)
    ]
    assert ["null_g" in group[0] for group in states] == [True, False, True]
    mine: list[list[Any]] = [[None] * c for _, _, c in SHAPES]
    theirs: list[list[Any]] = [[None] * c for _, _, c in SHAPES]
    for step in range(2):
        grads = [_grads(step, k) for k in range(len(SHAPES))]
        want = solvers[0].apply_groups(
            [BatchJob(solvers[k], states[k], mine[k], grads[k]) for k in range(len(SHAPES))], 0.1
        )
        got = twins[0].apply_groups(
            [BatchJob(twins[k], states[k], theirs[k], grads[k]) for k in range(len(SHAPES))], 0.1
        )
        assert twins[0]._moment_step.active  # compiled, not fallen back
        for k in range(len(SHAPES)):
            for (u, m), (w, n) in zip(got[k], want[k], strict=True):
                torch.testing.assert_close(u, w, **TOL)
                for key in n:
                    torch.testing.assert_close(m[key], n[key], **TOL)
            mine[k] = [m for _, m in want[k]]
            theirs[k] = [m for _, m in got[k]]


def test_a_failing_compiler_falls_back_to_eager_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(function: Any, **kwargs: Any) -> Any:
        def run(*args: Any) -> Any:
            raise RuntimeError("no backend here\nsecond line")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    eager = _run(EigenAdamSolver, MomentOptions(), steps=2)
    with caplog.at_level(logging.WARNING, logger="dkfac.solvers.compiled"):
        fallen = _run(EigenAdamSolver, MomentOptions(compile_backend="inductor"), steps=2)
    for got, want in zip(fallen, eager, strict=True):
        assert torch.equal(got, want)
    # once per solver that compiled (the flat pass's, three groups' and one layer's)
    warned = [r for r in caplog.records if "running it eagerly" in r.getMessage()]
    assert len(warned) == 5
    assert all("RuntimeError: no backend here" in r.getMessage() for r in warned)


def test_backends_are_checked() -> None:
    check_backend(None)
    check_backend("aot_eager")
    with pytest.raises(ValueError, match="compile_backend must be None or one of"):
        check_backend("cudagraphs")
    with pytest.raises(ValueError, match="compile_backend"):
        MomentOptions(compile_backend="fast")
    plain = Compiled(lambda x: x + 1, None)
    assert not plain.active and plain(1) == 2


def test_each_instance_compiles_a_code_object_of_its_own() -> None:
    """Twelve solvers' bound methods, each a graph of its own under a recompile limit of
    one: a shared code object would recompile for each new instance and, past the limit,
    run eagerly without a word (counted: the backend sees every graph)."""

    class Scaled:
        def __init__(self, k: float) -> None:
            self.k = k

        def run(self, x: Tensor) -> Tensor:
            return (x * self.k).sin() @ x

    graphs: list[Any] = []

    def counting(gm: Any, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(3, 3, dtype=DT)
    with torch._dynamo.config.patch(recompile_limit=1):
        for k in range(12):
            method = Scaled(float(k)).run
            own = own_code(method)
            assert own.__code__ is not method.__code__  # type: ignore[attr-defined]
            torch.testing.assert_close(torch.compile(own, backend=counting)(x), method(x))
    assert len(graphs) == 12
    plain = own_code(_grads)
    assert plain(0, 1)[0].equal(_grads(0, 1)[0])  # a plain function copies too


def test_each_shape_compiles_a_graph_of_its_own_and_stop_runs_eagerly() -> None:
    """One solver preconditions every group of its options, each of its own shapes: twelve
    shapes through one :class:`Compiled` under a recompile limit of one give twelve graphs
    and no fallback (one code object would reach the limit at the second shape and run the
    rest eagerly). :meth:`Compiled.stop` before the first call changes nothing; after it,
    the function runs eagerly (no new graph)."""
    graphs: list[Any] = []

    def counting(gm: Any, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def run(x: Tensor, k: float) -> Tensor:
        return (x * k).sin() @ x.mT

    torch._dynamo.reset()
    compiled = Compiled(run, "aot_eager")
    compiled.backend = counting  # type: ignore[assignment]
    assert not compiled.stop() and compiled.active  # nothing compiled yet
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in range(1, 13):
            x = torch.randn(n, 3, dtype=DT)
            torch.testing.assert_close(compiled(x, 0.5), run(x, 0.5))
            torch.testing.assert_close(compiled(x, 0.5), run(x, 0.5))  # the same graph
    assert len(graphs) == 12 and compiled.active
    assert compiled.stop() and not compiled.active
    x = torch.randn(13, 3, dtype=DT)
    assert compiled(x, 0.25).equal(run(x, 0.25)) and len(graphs) == 12


def _group_run(options: MomentOptions, steps: int = 2) -> list[Tensor]:
    """Updates and moments of ``steps`` steps of one group (a stack of the shape of
    ``SHAPES[0]``, each layer's input factor singular) and of its first layer alone,
    under ``options``; checks that the whole update compiled where ``options`` say so."""
    g, a, count = SHAPES[0]
    solver, alone = EigenAdamSolver(DT, options), EigenAdamSolver(DT, options)
    states = [
        solver.completed(solver.compute(_spd(a, i, 3), _spd(g, i + 7), 0.1)) for i in range(count)
    ]
    moments: list[Any] = [None] * count
    single: Any = None
    out: list[Tensor] = []
    for step in range(steps):
        grads = _grads(step, 0)
        results = solver.apply_batch(states, moments, grads, 0.1)
        moments = [m for _, m in results]
        out += [u for u, _ in results] + [v for m in moments for v in m.values()]
        update, single = alone.apply_with_moments(states[0], single, grads[0], 0.1)
        out += [update, *single.values()]
    assert all("null_a" in state for state in states)  # Adam's rounding floor runs
    compiled = options.step_compile_backend is not None
    assert solver._update.active == alone._update.active == compiled
    return out


@pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")), reason="inductor needs a C compiler"
)
def test_inductor_s_compiled_update_equals_the_eager_one_on_the_cpu() -> None:
    """``step_compile_backend="inductor"``: a group's whole update in generated C++ (the
    rotations, the moments with a singular factor's rounding floor, the Newton-Schulz
    iteration in float64) against eager, stacked and alone, two steps, to 1e-10 (its
    kernels may contract a multiply and an add; the polar factor's iteration magnifies a
    rounding a little)."""
    torch._dynamo.reset()
    options = MomentOptions(orthogonal_rms=1.5)
    eager = _group_run(options)
    compiled = _group_run(MomentOptions(orthogonal_rms=1.5, step_compile_backend="inductor"))
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "options",
    [
        MomentOptions(orthogonal_rms=1.5),
        MomentOptions(orthogonal_rms=1.5, orthogonal_split=0.5),
        MomentOptions(orthogonal_rms=1.5, orthogonal_rms_power=0.5),
        MomentOptions(nesterov=True, block_size=4),
    ],
)
def test_a_captured_update_equals_the_eager_one(options: MomentOptions) -> None:
    """``step_compile_backend="aot_eager"`` (the whole update captured, eager kernels)
    against eager: the polar factor, the split around it, a length that follows the
    update's own, and a plain Adam update with blocked bases, to 1e-12."""
    torch._dynamo.reset()
    eager = _group_run(options)
    captured = _group_run(dataclasses.replace(options, step_compile_backend="aot_eager"))
    for got, want in zip(captured, eager, strict=True):
        torch.testing.assert_close(got, want, **TOL)
