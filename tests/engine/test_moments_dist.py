"""Eigenbasis moments on 2 gloo ranks equal the serial engine, for every strategy.

The moments live on every rank that preconditions a layer; the runs below must give the
serial parameters and, gathered into a checkpoint, the serial moments. A serial checkpoint
loaded into each strategy (a re-shard from 1 to 2 ranks) continues like the serial run.
Under ``dp`` the owners build factors from their local batch only, so its ranks get the
same batch: then its update is the serial one too.

Adam in an eigenbasis is not invariant to rotations inside a degenerate eigenspace, and
rounding picks that part of the basis: with a factor of lower rank than its size (fewer
samples than inputs) a distributed run differs from the serial one by much more than
rounding, although all its ranks agree (they share the owner's basis). The batch here is
large enough for full-rank factors, and ``ε`` large against the rounding of the gradient
in the one-dimensional null space softmax and LayerNorm leave in ``G``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import (
    Hooks,
    assert_ranks_match,
    assert_tensors_close,
    train_sharded,
)
from tests.strategy_cases import OPTIONS, STEPS, global_batch, make_model

MOMENTS: dict[str, Any] = {
    "method": "eigen_adam",
    "basis_refresh": "power",
    "moment_carry": "rotate",
    "moment_eps": 1e-6,
}
TOL = {"rtol": 1e-9, "atol": 1e-11}
# The global batch: 64 rows (global_batch's seeds, as for 8 ranks of 8).
_batch = functools.partial(global_batch, world_size=8)
CONFIGS = [("replicated", 1.0), ("kaisa", 0.5), ("kaisa", 1.0), ("mem-opt", 1.0), ("spngd", 1.0)]
RESUME = ("replicated", "mem-opt", "spngd")
SPLIT = 2  # the serial checkpoint is taken after this many steps
# basis_max_dim=10: the A factors wider than 10 (19 and 49) keep the identity basis, stored
# empty; their owners must still send the (partly empty) state to the grad workers.
ONE_SIDED = [("kaisa", 0.5), ("mem-opt", 1.0)]
# rotation_dtype: the update leaves the basis in float32 (the model is float64) on the rank
# that preconditions the layer. The ranks must agree bit for bit and match serial within
# float32 rounding; that rounding is of the order of the option's own effect, so that it is
# applied at all is the solver tests' part (tests/solvers/test_eigen_moments.py).
LOW_ROTATION = [("kaisa", 0.5), ("spngd", 1.0)]
LOW_TOL = {"rtol": 1e-5, "atol": 1e-7}
# gradient_rotation_dtype: the gradient enters the basis in float32 (it needs the reset
# carry) on the rank that preconditions the layer. Adam moves every entry of the rotated
# gradient by up to about lr whatever its size, so an entry below float32's rounding of the
# products takes its sign from the last bits of the all-reduced gradient, which the ranks sum
# in another order than serial: the ranks agree to the bit, serial only to that rounding
# (measured 4e-4 of the largest weight of a layer after the run; the float64 cases above
# stay at TOL). The solver and engine tests pin the formula itself to the bit.
LOW_GRADIENT_ROTATION = {"gradient_rotation_dtype": torch.float32, "moment_carry": "reset"}
LOW_GRADIENT_ROTATION_TOL = 2e-3
# flattened_inputs: the Linear(48→6) reads the flattened 3 × 16 output of the convolution;
# its owner builds the structured basis and sends it like any other.
STRUCTURED = [("kaisa", 0.5), ("spngd", 1.0)]
MAP = {"3": (3, 16)}
# orthogonal_layers: the two Linear layers take the polar factor of their update, computed
# where the layer is preconditioned (float64 model: the iteration runs in float64). The
# polar factor amplifies the rounding of the update it is taken of, up to the slope of the
# quintic map at 0 (3.4445⁵ ≈ 480, solvers/polar.py) in its small singular directions, so
# the tolerance is that much wider than TOL, still far below the option's own effect.
# power_rank=4: the power refresh at step 2 follows 4 columns of the 19-, 49- and 6-wide
# factors and completes them where the layer is preconditioned; the completion is a
# function of those columns, so the ranks match serial as closely as the full refresh does.
POWER_RANK = [("kaisa", 0.5), ("spngd", 1.0)]
# basis_block_size=8: the 19- and 49-wide A factors are captured as their diagonal blocks
# (all-reduced like dense ones) and get block-diagonal bases, sent with their empty
# (0, 8) markers to the grad workers, which rotate block by block.
BLOCKS = [("kaisa", 0.5), ("mem-opt", 1.0), ("spngd", 1.0)]
ORTHOGONAL = [("kaisa", 0.5), ("mem-opt", 1.0), ("spngd", 1.0)]
PICK = ("Linear",)
ORTHOGONAL_TOL = {"rtol": 1e-6, "atol": 1e-8}


def _run(
    rank: int | None, strategy: str, *, start: dict[str, Any] | None = None, **kw: Any
) -> tuple[list[Tensor], dict[str, Any]]:
    """Steps ``[SPLIT, STEPS)`` from ``start`` (a :meth:`Run.checkpoint`), or all steps
    from scratch, on ``rank``'s shard of 2 (``None``: the whole batch); the parameters and
    the gathered preconditioner state."""
    resume = Hooks(setup=lambda run: run.restore(start)) if start is not None else None
    run = train_sharded(
        rank,
        2,
        model_fn=make_model,
        batch_fn=_batch,
        steps=STEPS if start is None else range(SPLIT, STEPS),
        hooks=resume,
        strategy=strategy,
        **{**OPTIONS, **MOMENTS, **kw},
    )
    return run.params(), run.pre.state_dict()


def _rank_main(rank: int, world: int, start: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, fraction in CONFIGS:
        out[f"{strategy}/{fraction}"] = _run(rank, strategy, grad_worker_fraction=fraction)
    out["dp"] = _run(None, "dp")  # every rank on the whole batch
    for strategy, fraction in ONE_SIDED:
        out[f"one-sided/{strategy}/{fraction}"] = _run(
            rank, strategy, grad_worker_fraction=fraction, basis_max_dim=10
        )
    for strategy, fraction in LOW_ROTATION:
        out[f"float32-rotation/{strategy}/{fraction}"] = _run(
            rank, strategy, grad_worker_fraction=fraction, rotation_dtype=torch.float32
        )
    out["float32-gradient-rotation/kaisa/0.5"] = _run(
        rank, "kaisa", grad_worker_fraction=0.5, **LOW_GRADIENT_ROTATION
    )[0]
    for strategy, fraction in STRUCTURED:
        out[f"structured/{strategy}/{fraction}"] = _run(
            rank, strategy, grad_worker_fraction=fraction, flattened_inputs=MAP
        )
    for strategy, fraction in ORTHOGONAL:
        out[f"orthogonal/{strategy}/{fraction}"] = _run(
            rank, strategy, grad_worker_fraction=fraction, orthogonal_layers=PICK
        )[0]
    for strategy, fraction in POWER_RANK:
        out[f"power-rank/{strategy}/{fraction}"] = _run(
            rank, strategy, grad_worker_fraction=fraction, power_rank=4
        )[0]
    for strategy, fraction in BLOCKS:
        out[f"blocks/{strategy}/{fraction}"] = _run(
            rank, strategy, grad_worker_fraction=fraction, basis_block_size=8
        )[0]
    for strategy in RESUME:
        out[f"resume/{strategy}"] = _run(rank, strategy, start=start)[0]
    return out


def _serial_start() -> dict[str, Any]:
    """The serial run's model, optimizer and preconditioner states after ``SPLIT`` steps."""
    return train_sharded(
        None, 2, model_fn=make_model, batch_fn=_batch, steps=SPLIT, **{**OPTIONS, **MOMENTS}
    ).checkpoint()


@pytest.fixture(scope="module")
def serial() -> tuple[list[Tensor], dict[str, Any]]:
    return _run(None, "replicated")


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every configuration in one spawn of 2 ranks."""
    return run_distributed(_rank_main, 2, _serial_start(), timeout=180)


@pytest.mark.parametrize("label", [f"{s}/{f}" for s, f in CONFIGS])
def test_moments_on_two_ranks_equal_serial(
    label: str,
    two_ranks: list[dict[str, Any]],
    serial: tuple[list[Tensor], dict[str, Any]],
) -> None:
    serial_params, serial_state = serial
    for rank, out in enumerate(two_ranks):
        params, state = out[label]
        assert_tensors_close(params, serial_params, label=f"{label}, rank {rank}", **TOL)
        for name, entry in state["layers"].items():
            want = serial_state["layers"][name]["moments"]
            assert set(entry["moments"]) == {"m", "v", "t"}
            for key, value in want.items():
                torch.testing.assert_close(
                    entry["moments"][key], value, **TOL, msg=f"{label}, rank {rank}, {name} {key}"
                )
        # the LayerNorm no block takes: Adam's moments on its averaged gradient, the same
        # on every rank (leftover_update's default under eigen_adam)
        assert set(state["leftover"]) == {"4.weight", "4.bias"}
        for name, moments in serial_state["leftover"].items():
            for key, value in moments.items():
                torch.testing.assert_close(
                    state["leftover"][name][key], value, **TOL, msg=f"{label}, rank {rank}, {name}"
                )


def test_dp_on_two_ranks_with_the_same_batch_equals_serial(
    two_ranks: list[dict[str, Any]],
) -> None:
    dp_params, _ = _run(None, "dp")
    assert_ranks_match([out["dp"][0] for out in two_ranks], dp_params, label="dp", **TOL)


@pytest.mark.parametrize("strategy", RESUME)
def test_serial_checkpoint_resumed_on_two_ranks_continues_like_serial(
    strategy: str,
    two_ranks: list[dict[str, Any]],
    serial: tuple[list[Tensor], dict[str, Any]],
) -> None:
    assert_ranks_match(
        [out[f"resume/{strategy}"] for out in two_ranks],
        serial[0],
        label=f"resume {strategy}",
        **TOL,
    )


@pytest.mark.parametrize("label", [f"one-sided/{s}/{f}" for s, f in ONE_SIDED])
def test_one_sided_moments_on_two_ranks_equal_serial(
    label: str, two_ranks: list[dict[str, Any]]
) -> None:
    serial_params, serial_state = _run(None, "replicated", basis_max_dim=10)
    assert any(entry["inverse"]["qa"].numel() == 0 for entry in serial_state["layers"].values()), (
        "no layer is one-sided: the case tests nothing"
    )
    assert_ranks_match([out[label][0] for out in two_ranks], serial_params, label=label, **TOL)


@pytest.mark.parametrize("label", [f"float32-rotation/{s}/{f}" for s, f in LOW_ROTATION])
def test_low_precision_rotation_on_two_ranks_equals_serial(
    label: str, two_ranks: list[dict[str, Any]], serial: tuple[list[Tensor], dict[str, Any]]
) -> None:
    low_params, _ = _run(None, "replicated", rotation_dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(low_params, serial[0], strict=True))
    first, second = (out[label][0] for out in two_ranks)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True)), label
    assert_ranks_match([first, second], low_params, label=label, **LOW_TOL)


def test_low_precision_gradient_rotation_on_two_ranks_matches_serial_to_its_rounding(
    two_ranks: list[dict[str, Any]],
) -> None:
    label = "float32-gradient-rotation/kaisa/0.5"
    low_params, _ = _run(None, "replicated", **LOW_GRADIENT_ROTATION)
    exact_params, _ = _run(None, "replicated", moment_carry="reset")
    first, second = (out[label] for out in two_ranks)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True)), label
    assert any(  # the ranks lowered the rotation: not the exact run
        not torch.allclose(a, b, **TOL) for a, b in zip(first, exact_params, strict=True)
    ), label
    for index, (got, want) in enumerate(zip(first, low_params, strict=True)):
        error = float((got - want).abs().max() / want.abs().max())
        assert error < LOW_GRADIENT_ROTATION_TOL, (label, index, error)


@pytest.mark.parametrize("label", [f"structured/{s}/{f}" for s, f in STRUCTURED])
def test_structured_input_basis_on_two_ranks_equals_serial(
    label: str, two_ranks: list[dict[str, Any]], serial: tuple[list[Tensor], dict[str, Any]]
) -> None:
    structured_params, structured_state = _run(None, "replicated", flattened_inputs=MAP)
    assert any(not torch.equal(a, b) for a, b in zip(structured_params, serial[0], strict=True))
    for rank, out in enumerate(two_ranks):
        params, state = out[label]
        assert_tensors_close(params, structured_params, label=f"{label}, rank {rank}", **TOL)
        torch.testing.assert_close(
            state["layers"]["3"]["inverse"]["qa"],
            structured_state["layers"]["3"]["inverse"]["qa"],
            **TOL,
            msg=f"{label}, rank {rank}",
        )


@pytest.mark.parametrize("label", [f"orthogonal/{s}/{f}" for s, f in ORTHOGONAL])
def test_orthogonalised_updates_on_two_ranks_equal_serial(
    label: str, two_ranks: list[dict[str, Any]], serial: tuple[list[Tensor], dict[str, Any]]
) -> None:
    orthogonal_params, _ = _run(None, "replicated", orthogonal_layers=PICK)
    effect = max((a - b).abs().max() for a, b in zip(orthogonal_params, serial[0], strict=True))
    assert effect > 1e-3, effect
    assert_ranks_match(
        [out[label] for out in two_ranks], orthogonal_params, label=label, **ORTHOGONAL_TOL
    )


@pytest.mark.parametrize("label", [f"power-rank/{s}/{f}" for s, f in POWER_RANK])
def test_partial_power_refresh_on_two_ranks_equals_serial(
    label: str, two_ranks: list[dict[str, Any]], serial: tuple[list[Tensor], dict[str, Any]]
) -> None:
    partial_params, _ = _run(None, "replicated", power_rank=4)
    effect = max((a - b).abs().max() for a, b in zip(partial_params, serial[0], strict=True))
    assert effect > 1e-3, effect
    assert_ranks_match([out[label] for out in two_ranks], partial_params, label=label, **TOL)


@pytest.mark.parametrize("label", [f"blocks/{s}/{f}" for s, f in BLOCKS])
def test_block_diagonal_bases_on_two_ranks_equal_serial(
    label: str, two_ranks: list[dict[str, Any]], serial: tuple[list[Tensor], dict[str, Any]]
) -> None:
    blocked_params, blocked_state = _run(None, "replicated", basis_block_size=8)
    assert any("qa_block" in e["inverse"] for e in blocked_state["layers"].values())
    effect = max((a - b).abs().max() for a, b in zip(blocked_params, serial[0], strict=True))
    assert effect > 1e-3, effect
    assert_ranks_match([out[label] for out in two_ranks], blocked_params, label=label, **TOL)
