"""The engine's seam for stateful solvers: moments advance, carry, skip and checkpoint.

Single process; the distributed side is tests/engine/test_moments_dist.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACConfig, KFACOptimizer, KFACPreconditioner
from dkfac.engine.optimizer_state import unpack
from dkfac.solvers.block_layout import blocks_shape
from dkfac.solvers.null_space import ROUNDING_FLOOR
from dkfac.solvers.statistics import BlockDiagonalStatistic
from tests.oracles import weight_grad_matrix
from tests.strategy_cases import global_batch, make_model, serial_step

OPTIONS: dict[str, Any] = {
    "method": "eigen_adam",
    "kl_clip": None,
    "factor_decay": 0.9,
    "inverse_update_interval": 2,
    "eigen_dtype": torch.float64,
}


def _trained(steps: int, **options: Any) -> tuple[nn.Module, KFACOptimizer]:
    model = make_model()
    pre = KFACPreconditioner(model, **{**OPTIONS, **options})
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), pre)
    for step in range(steps):
        serial_step(model, opt, step)
    return model, opt


def _basis(q: Tensor, dim: int) -> Tensor:
    """A side's basis: the identity where the state keeps none (one-sided)."""
    return q if q.numel() else torch.eye(dim, dtype=q.dtype)


@pytest.mark.parametrize(
    ("max_dim", "into", "block"),
    [(None, None, None), (10, None, None), (None, torch.float32, None), (None, None, 8)],
    ids=["two-sided", "one-sided-above-10", "float32-gradient-rotation", "blocks-of-8"],
)
def test_engine_update_is_adam_in_the_basis_of_the_layer_state(
    max_dim: int | None, into: torch.dtype | None, block: int | None
) -> None:
    """Between two refreshes the engine's update equals Adam on ``Q_Gᵀ ∇W Q_A``; with
    ``basis_max_dim=10`` the A factors wider than 10 (19 and 49; not 7) keep ``I``; with
    ``gradient_rotation_dtype`` that product is taken in that precision (the same products
    in the same order, so to the bit), the rest in the model's; with
    ``basis_block_size=8`` the 19- and 49-wide bases are block-diagonal (blocks of 8, the
    last of 3 and 1) and the engine's block-by-block rotations equal the dense products.
    Where a factor of the first steps is singular, Adam's rounding floor applies in its null
    directions (``dkfac.solvers.null_space``)."""
    model = make_model()
    options = {**OPTIONS, "inverse_update_interval": 10, "basis_max_dim": max_dim}
    if block is not None:
        options["basis_block_size"] = block
    if into is not None:
        options |= {"gradient_rotation_dtype": into, "moment_carry": "reset"}
    pre = KFACPreconditioner(model, **options)
    b1, b2, eps = 0.9, 0.95, 1e-8
    m: dict[str, Tensor] = {}
    v: dict[str, Tensor] = {}
    for t in range(1, 4):
        x, y = global_batch(t, 1)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = {n: weight_grad_matrix(layer.block.module).clone() for n, layer in pre.layers.items()}
        pre.step()
        for name, layer in pre.layers.items():
            state = layer.solver_state
            assert state is not None
            g_dim, a_dim = raw[name].shape
            qa, qg = _basis(state["qa"], a_dim), _basis(state["qg"], g_dim)
            assert (state["qa"].numel() == 0) == (max_dim is not None and a_dim > max_dim)
            blocked = block is not None and a_dim > block
            assert ("qa_block" in state) == blocked
            if blocked:  # the basis, and the running factor it came from: blocks of 8 only
                assert isinstance(layer.kinds["A"], BlockDiagonalStatistic)
                assert layer.running["A"].shape == blocks_shape(a_dim, 8)
                off = qa.clone()
                for start in range(0, a_dim, 8):
                    off[start : start + 8, start : start + 8] = 0
                assert not off.any(), f"{name}: not block-diagonal"
            low = into or raw[name].dtype
            r = ((qg.T.to(low) @ raw[name].to(low)) @ qa.to(low)).to(raw[name].dtype)
            m[name] = b1 * m.get(name, 0 * r) + (1 - b1) * r
            v[name] = b2 * v.get(name, 0 * r) + (1 - b2) * r * r
            v_hat = v[name] / (1 - b2**t)
            floor = 0.0 * v_hat  # the rounding floor: only in a singular factor's null space
            if "null_g" in state:
                null = (state["null_g"][:, None] + state["null_a"][None, :]).clamp(max=1.0)
                assert torch.equal(state["null_g"], (state["dg"] == 0).to(null.dtype))
                floor = ROUNDING_FLOOR * v_hat.sum().sqrt() * null
            scaled = (m[name] / (1 - b1**t)) / (v_hat.sqrt() + eps + floor)
            want = qg @ scaled @ qa.T
            torch.testing.assert_close(weight_grad_matrix(layer.block.module), want)
            assert layer.moments is not None and layer.moments["t"].tolist() == [float(t)]


@pytest.mark.parametrize(("carry", "count"), [("reset", 1.0), ("keep_v", 3.0)])
def test_a_refresh_carries_the_moments_by_the_rule(carry: str, count: float) -> None:
    _, opt = _trained(3, moment_carry=carry)  # refreshes at steps 0 and 2
    for layer in opt.preconditioner.layers.values():
        assert layer.moments is not None and layer.moments["t"].tolist() == [count]


def test_moments_stay_put_on_a_step_with_a_non_finite_gradient() -> None:
    model, opt = _trained(3)  # step 3 refreshes no basis
    pre = opt.preconditioner
    before = {
        n: {k: v.clone() for k, v in (layer.moments or {}).items()}
        for n, layer in pre.layers.items()
    }
    weights = [p.detach().clone() for p in model.parameters()]
    x, y = global_batch(5, 1)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    model[0].weight.grad[0, 0, 0, 0] = float("nan")  # one layer's gradient only
    opt.step()
    for name, layer in pre.layers.items():
        assert layer.moments is not None
        for key, value in before[name].items():
            assert torch.equal(layer.moments[key], value), (name, key)
    assert opt.skipped_steps == 1
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_inner_sgd_weight_decay_is_decoupled_from_the_preconditioner() -> None:
    """``W ← W − lr·(V + wd·W)``: the decay does not pass through the moments (AdamW)."""
    lr, wd = 0.01, 0.1
    results = []
    for decay in (0.0, wd):
        model = make_model()
        pre = KFACPreconditioner(model, **OPTIONS)
        opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=lr, weight_decay=decay), pre)
        serial_step(model, opt, 0)
        start = [p.detach().clone() for p in make_model().parameters()]
        results.append(([p.detach().clone() for p in model.parameters()], start))
    (plain, start), (decayed, _) = results
    for p0, p1, w in zip(plain, decayed, start, strict=True):
        torch.testing.assert_close(p1 - p0, -lr * wd * w)


def _continue(model: nn.Module, opt: KFACOptimizer, first: int, last: int) -> list[Tensor]:
    for step in range(first, last):
        serial_step(model, opt, step)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("refresh", "max_dim", "maps", "power_rank"),
    [
        ("eigh", None, {}, None),
        ("power", None, {}, None),
        ("power", 10, {}, None),
        ("power", None, {"3": (3, 16)}, None),
        ("power", None, {}, 4),
        ("power", None, {}, "blocks"),
    ],
    ids=["eigh", "power", "power-one-sided", "power-flattened-input", "power-rank", "blocks"],
)
def test_checkpoint_round_trip_continues_bit_identically(
    refresh: str,
    max_dim: int | None,
    maps: dict[str, tuple[int, int]],
    power_rank: int | str | None,
) -> None:
    """``"blocks"`` in the last column: ``basis_block_size=8`` (the markers of the
    block-diagonal bases must survive the trip) instead of a ``power_rank``."""
    blocks = power_rank == "blocks"
    options = {
        "basis_refresh": refresh,
        "inverse_update_interval": 2,
        "basis_max_dim": max_dim,
        "flattened_inputs": maps,
        "power_rank": None if blocks else power_rank,
        "moment_carry": "keep_v" if power_rank is None or blocks else "rotate",
        "basis_block_size": 8 if blocks else None,
    }
    model, opt = _trained(3, **options)
    saved = copy.deepcopy(opt.state_dict())  # the live tensors change as training goes on
    assert all("moments" in e and "inverse" in e for e in unpack(saved)[1]["layers"].values())
    params = [p.detach().clone() for p in model.parameters()]
    want = _continue(model, opt, 3, 6)

    fresh = make_model()
    with torch.no_grad():
        for p, q in zip(fresh.parameters(), params, strict=True):
            p.copy_(q)
    pre = KFACPreconditioner(fresh, **{**OPTIONS, **options})
    again = KFACOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.01), pre)
    again.load_state_dict(saved)
    got = _continue(fresh, again, 3, 6)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_method_switch_drops_or_starts_the_moments() -> None:
    _, opt = _trained(3)
    saved = opt.preconditioner.state_dict()
    eigen = KFACPreconditioner(make_model(), **{**OPTIONS, "method": "eigen"})
    eigen.load_state_dict(saved)  # eigen keeps no moments: the saved ones are ignored
    assert all(layer.moments is None for layer in eigen.layers.values())
    assert all(layer.solver_state is not None for layer in eigen.layers.values())
    ekfac = KFACPreconditioner(make_model(), **{**OPTIONS, "method": "ekfac"})
    ekfac.load_state_dict(saved)  # another solver's basis: recomputed, moments afresh
    assert all(layer.moments is None for layer in ekfac.layers.values())
    from_eigen = KFACPreconditioner(make_model(), **OPTIONS)
    from_eigen.load_state_dict(eigen.state_dict(include_inverses=True))
    assert all(layer.moments is None for layer in from_eigen.layers.values())
    assert all(layer.solver_state is not None for layer in from_eigen.layers.values())


def test_saved_moments_of_a_wrong_shape_are_refused() -> None:
    _, opt = _trained(1)
    saved = opt.preconditioner.state_dict()
    entry = saved["layers"]["0"]
    entry["moments"] = {**entry["moments"], "m": torch.zeros(2, 2, dtype=torch.float64)}
    pre = KFACPreconditioner(make_model(), **OPTIONS)
    with pytest.raises(ValueError, match=r"0: saved moments 'm' has shape \(2, 2\)"):
        pre.load_state_dict(saved)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("m", float("nan"), "saved moments m is not finite"),
        ("v", float("inf"), "saved moments v is not finite"),
        ("v", -1.0, "saved moments 'v' has negative entries"),
        ("t", -3.0, "saved moments 't' has negative entries"),
    ],
)
def test_saved_moments_that_no_run_makes_are_refused(key: str, value: float, message: str) -> None:
    """Each would stop training: a NaN or Inf moment skips every later step, a negative
    count fails in the bias correction."""
    _, opt = _trained(1)
    saved = opt.preconditioner.state_dict()
    entry = saved["layers"]["0"]
    entry["moments"] = {**entry["moments"], key: torch.full_like(entry["moments"][key], value)}
    pre = KFACPreconditioner(make_model(), **OPTIONS)
    with pytest.raises(ValueError, match=f"0: {message}"):
        pre.load_state_dict(saved)


@pytest.mark.parametrize("key", ["m", "v", "t"])
def test_saved_moments_missing_one_the_solver_keeps_are_refused(key: str) -> None:
    """Every check passed and the next step ended in ``KeyError``; nothing changes."""
    _, opt = _trained(1)
    saved = opt.preconditioner.state_dict()
    entry = saved["layers"]["0"]
    entry["moments"] = {k: v for k, v in entry["moments"].items() if k != key}
    pre = KFACPreconditioner(make_model(), **OPTIONS)
    with pytest.raises(ValueError, match=r"0: saved moments hold .* keeps \['m', 't', 'v'\]"):
        pre.load_state_dict(saved)
    assert all(layer.moments is None for layer in pre.layers.values())


def test_an_entry_without_a_statistic_is_refused() -> None:
    """A statistic that was not saved is held as ``None``; a missing key is an edited or
    foreign entry, not silently a layer without statistics."""
    _, opt = _trained(1)
    saved = opt.preconditioner.state_dict()
    del saved["layers"]["0"]["A"]
    pre = KFACPreconditioner(make_model(), **OPTIONS)
    with pytest.raises(ValueError, match=r"0: the saved entry lacks \['A'\]"):
        pre.load_state_dict(saved)


def test_memory_counts_the_moments_apart_from_the_solver_state() -> None:
    _, opt = _trained(1)
    pre = opt.preconditioner
    state = sum(  # a singular factor's null indicators are not counted (n beside n² values)
        t.numel() * 8
        for layer in pre.layers.values()
        for k, t in (layer.solver_state or {}).items()
        if not k.startswith("null_")
    )
    moments = sum(
        layer.solver.moment_elements(layer.block.a_dim, layer.block.g_dim) * 8
        for layer in pre.layers.values()
    )
    left = pre.leftover  # the LayerNorm's Adam moments: m, v and a count per parameter
    assert left is not None and left.nbytes() == sum((2 * 6 + 1) * 8 for _ in range(2))
    usage = pre.memory_usage()
    assert (usage["inverses"], usage["moments"]) == (state, moments + left.nbytes())


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("moment_beta1", 1.0, ValueError),
        ("moment_beta2", -0.5, ValueError),
        ("moment_eps", 0.0, ValueError),
        ("moment_bias_correction", "yes", TypeError),
        ("moment_nesterov", 1, TypeError),
        ("basis_refresh", "qr", ValueError),
        ("moment_carry", "keep", ValueError),
        ("basis_max_dim", 0, ValueError),
        ("basis_max_dim", 8.0, ValueError),
        ("rotation_dtype", torch.int64, ValueError),
        ("rotation_dtype", "bfloat16", ValueError),
        ("gradient_rotation_dtype", torch.int64, ValueError),
        ("gradient_rotation_dtype", torch.bfloat16, ValueError),  # the default carry keep_v
        ("gradient_rotation_dtype", torch.float16, ValueError),
        ("power_rank", 0, ValueError),
        ("power_rank", 4, ValueError),  # the default refresh eigh
        ("basis_block_size", 0, ValueError),
        ("basis_block_size", 128.0, ValueError),
    ],
)
def test_config_validates_the_moment_fields(field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=field):
        KFACConfig(**{field: value})  # type: ignore[arg-type]


def test_a_block_no_narrower_than_basis_max_dim_is_an_error() -> None:
    """Every side wider than such a block is one-sided: the option would do nothing."""
    for block in (64, 100):
        with pytest.raises(ValueError, match=f"basis_block_size {block} >= basis_max_dim 64"):
            KFACConfig(method="eigen_adam", basis_block_size=block, basis_max_dim=64)
    config = KFACConfig(method="eigen_adam", basis_block_size=32, basis_max_dim=64)
    assert (config.basis_block_size, config.basis_max_dim) == (32, 64)


def test_power_rank_needs_the_power_refresh_of_a_moment_method() -> None:
    with pytest.raises(ValueError, match=r"power_rank .* needs basis_refresh 'power'"):
        KFACConfig(method="eigen_adam", moment_carry="reset", power_rank=4)
    with pytest.raises(ValueError, match="use moment_carry 'reset' or 'rotate'"):
        KFACConfig(method="eigen_adam", basis_refresh="power", power_rank=4)
    with pytest.raises(ValueError, match="power_rank needs method"):
        KFACConfig(method="eigen", basis_refresh="power", moment_carry="reset", power_rank=4)
    config = KFACConfig(method="ekfac", basis_refresh="power", moment_carry="reset", power_rank=4)
    assert config.power_rank == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("rotation_dtype", torch.bfloat16), ("basis_max_dim", 64), ("basis_block_size", 128)],
)
def test_a_moment_option_with_another_method_is_an_error(field: str, value: object) -> None:
    """Options only the moment solvers read are refused, not silently unused."""
    with pytest.raises(ValueError, match=f"{field} needs method"):
        KFACConfig(method="eigen", **{field: value})  # type: ignore[arg-type]
    assert getattr(KFACConfig(method="ekfac", **{field: value}), field) == value  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("moment_beta1", 0.8),
        ("moment_beta2", 0.99),
        ("moment_eps", 1e-6),
        ("moment_bias_correction", False),
        ("moment_nesterov", True),
        ("basis_refresh", "power"),
        ("moment_carry", "reset"),
    ],
)
def test_a_moment_hyperparameter_another_method_never_reads_is_an_error(
    field: str, value: object
) -> None:
    """Moved from its default, each is refused where it would be silently unused: by every
    method without moments, and the first moment's and ``eps`` by ``ekfac``; at its default
    (as the CLI passes it) and with a method that reads it, accepted."""
    first_moment = field in ("moment_beta1", "moment_nesterov", "moment_eps")
    readers = "'eigen_adam'" if first_moment else "'eigen_adam' or 'ekfac'"
    for method in ("eigen", "cholesky", "smw", "auto"):
        message = f"{field} is not read by method '{method}': drop it or use {readers}$"
        with pytest.raises(ValueError, match=message):
            KFACConfig(method=method, **{field: value})  # type: ignore[arg-type]
        default = getattr(KFACConfig(), field)
        assert getattr(KFACConfig(method=method, **{field: default}), field) == default
    assert getattr(KFACConfig(method="eigen_adam", **{field: value}), field) == value  # type: ignore[arg-type]
    if first_moment:
        with pytest.raises(ValueError, match=f"{field} is not read by method 'ekfac'"):
            KFACConfig(method="ekfac", **{field: value})  # type: ignore[arg-type]
    else:
        assert getattr(KFACConfig(method="ekfac", **{field: value}), field) == value  # type: ignore[arg-type]


def test_config_accepts_the_new_methods() -> None:
    assert KFACConfig(method="ekfac").method == "ekfac"
    with pytest.raises(ValueError, match="eigen_adam"):
        KFACConfig(method="adam")  # type: ignore[arg-type]


def test_bf16_rotations_train_as_float32_ones_within_bf16() -> None:
    """The engine passes ``rotation_dtype`` to the solver: three steps with bf16 rotations
    leave the weights within bf16 rounding of the float32 run, and not bit-equal to it."""
    exact, _ = _trained(3)
    low, _ = _trained(3, rotation_dtype=torch.bfloat16)
    start = make_model()
    for (name, w), w_low, w0 in zip(
        exact.named_parameters(), low.parameters(), start.parameters(), strict=True
    ):
        moved = (w - w0).norm()
        assert (w_low - w).norm() <= 3e-2 * moved + 1e-7, name
    assert any(
        not torch.equal(a, b) for a, b in zip(exact.parameters(), low.parameters(), strict=True)
    )
