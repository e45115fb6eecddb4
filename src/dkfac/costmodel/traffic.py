"""Per-rank ledger bytes and memory of every distributed strategy, from layer shapes alone.

Byte convention: exactly that of :mod:`dkfac.distributed.comm` — each collective records, on
every *participating* rank, the logical message size (sum of ``numel × element_size`` of the
tensors it covers; a packed symmetric ``n×n`` matrix counts ``n(n+1)/2`` elements). A
collective on a group of one rank records nothing, and nothing is recorded at world size 1.

All strategy-specific choices live in two small tables, :data:`RULES` (who builds, sends and
keeps what) and :func:`element_counts` (how many elements each kind of message holds per
layer), so they can be aligned with the strategies' implementation in one place.

What each strategy does (read from ``dkfac.distributed.strategies`` and checked against the
real ledger at 2 and 4 ranks by ``tests/test_costmodel_ledger.py``):

* Placement: ``plan_placement({name: placement cost}, P, f)`` with the blocks' placement costs
  (Kronecker ``kronecker_cost(a, g)``, BatchNorm ``8C`` / ``4C``); ``f = 1`` for ``replicated``,
  ``1/P`` for ``mem-opt``, ``dp`` and ``spngd``.
* ``replicated`` / ``kaisa``: every rank all-reduces every layer's statistics (kind
  ``factors``; unpacked unless ``pack_triangles``); each inverse owner broadcasts the layer's
  solver state inside the layer's grad-worker group (kind ``inverses``; eigen: ``Q_A, λ_A,
  Q_G, λ_G``; cholesky: ``A⁻¹, G⁻¹``; BatchNorm: the ``C×2×2`` unit Fisher), stored in the
  factor dtype; in every grad-receiver block of more than one rank the block's grad worker
  broadcasts the preconditioned gradient (``a·g`` elements; kind ``preconditioned``).
  Gradients are averaged by DDP, outside the ledger. Only ``replicated`` keeps every layer's
  running factors; ``kaisa`` keeps them on the owner only.
* ``mem-opt``: ``kaisa`` with ``f = 1/P`` (no inverse traffic; the owner broadcasts the
  preconditioned gradient to all ranks); ranks keep factors only for the layers they own.
* ``dp``: statistics built by the owner from its local batch, never communicated; otherwise
  as ``mem-opt``.
* ``spngd``: no DDP. Every preconditioned layer's gradient (BatchNorm γ, β included) and its
  packed statistics are reduced to the owner in the same buffers (``reduce_scatter``; kinds
  ``gradients`` and ``factors`` counted apart; BatchNorm's ``C×2×2`` statistic is not
  square, so it is sent unpacked), the
  other parameters' gradients are all-reduced (kind ``gradients``), and every layer's final
  gradient is all-gathered from its owner (kind ``preconditioned``).
* Statistics are sent only on factor-update steps, solver states only on inverse-update
  steps; gradients and preconditioned gradients on every step. The engine's small control
  messages (presence and finite-flag agreement, KL-clip sums, state signatures) are not in
  the ledger and not here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

from dkfac.blocks.base import CostKind
from dkfac.costmodel.layers import KFACLayer, ModelSpec
from dkfac.distributed.assignment import (
    grad_worker_count,
    plan_placement,
)

__all__ = [
    "KINDS",
    "METHODS",
    "RULES",
    "STRATEGIES",
    "DtypeBytes",
    "Placement",
    "StrategyRule",
    "element_counts",
    "placement_for",
    "predict_ledger_bytes",
    "predict_memory",
]

KINDS = ("gradients", "factors", "inverses", "preconditioned")
STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp", "spngd")
METHODS = ("eigen", "cholesky")


@dataclass(frozen=True)
class StrategyRule:
    """Who builds, communicates and keeps what under one strategy (see the module notes).

    Attributes:
        builders: ``"all"`` ranks build every layer's factors, or only the ``"owner"``.
        factor_collective: ``"all_reduce"``, ``"reduce_scatter"`` or ``None``.
        pack_factors: Factors are sent as packed upper triangles.
        inverse_broadcast: Solver state broadcast inside the grad-worker group.
        preconditioned: ``"receivers"`` (broadcast inside each grad-receiver block),
            ``"all_gather"`` (from owners to all) or ``None``.
        gradients: ``"ddp"`` (outside the ledger) or ``"reduce_scatter"`` (by the strategy).
        factors_kept: Running factors kept for ``"all"`` layers or only ``"owner"``'s.
        fraction: Fixed grad-worker fraction: ``"one"`` (1), ``"inverse_p"`` (1/P) or
            ``"given"`` (the caller's ``grad_worker_fraction``).
    """

    builders: Literal["all", "owner"]
    factor_collective: Literal["all_reduce", "reduce_scatter"] | None
    pack_factors: bool
    inverse_broadcast: bool
    preconditioned: Literal["receivers", "all_gather"] | None
    gradients: Literal["ddp", "reduce_scatter"]
    factors_kept: Literal["all", "owner"]
    fraction: Literal["one", "inverse_p", "given"]


RULES: dict[str, StrategyRule] = {
    "replicated": StrategyRule("all", "all_reduce", False, True, "receivers", "ddp", "all", "one"),
    "kaisa": StrategyRule("all", "all_reduce", False, True, "receivers", "ddp", "owner", "given"),
    "mem-opt": StrategyRule(
        "all", "all_reduce", False, True, "receivers", "ddp", "owner", "inverse_p"
    ),
    "dp": StrategyRule("owner", None, False, True, "receivers", "ddp", "owner", "inverse_p"),
    "spngd": StrategyRule(
        "all", "reduce_scatter", True, False, "all_gather", "reduce_scatter", "owner", "inverse_p"
    ),
}
"""Strategy -> :class:`StrategyRule`: the single table of per-strategy traffic choices."""


@dataclass(frozen=True, kw_only=True)
class DtypeBytes:
    """Element sizes in bytes of what is communicated and stored.

    Attributes:
        factor: Factors (and their accumulators), default fp32.
        inverse: Solver state as stored and sent. The engine computes in ``eigen_dtype`` but
            stores the state in the factor dtype, so this equals ``factor`` for the engine.
        grad: Gradients and preconditioned gradients, default fp32.
    """

    factor: int = 4
    inverse: int = 4
    grad: int = 4

    def __post_init__(self) -> None:
        for name in ("factor", "inverse", "grad"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value not in (2, 4, 8):
                raise ValueError(f"{name} bytes must be 2, 4 or 8, got {value!r}")


def _tri(n: int) -> int:
    return n * (n + 1) // 2


def element_counts(layer: KFACLayer, method: str, packed: bool) -> dict[str, int]:
    """Elements per layer of each message and each stored object.

    Args:
        layer: The layer.
        method: ``"eigen"`` or ``"cholesky"`` (BatchNorm layers always use the unit-wise
            solver).
        packed: Square statistics sent as packed triangles.

    Returns:
        ``{"factors_sent", "factors_stored", "inverse", "grad"}`` element counts. Kronecker:
        factors sent ``a²+g²`` (packed ``a(a+1)/2 + g(g+1)/2``); stored ``a²+g²``; solver
        state (eigen ``a²+a+g²+g``, cholesky ``a²+g²``); gradient ``a·g``. BatchNorm
        (``a = 2``, ``g = C``): statistic ``4C`` sent and stored (never packed), state
        ``4C``, gradient ``2C``.
    """
    a, g = layer.a_dim, layer.g_dim
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if layer.unitwise:
        return {"factors_sent": 4 * g, "factors_stored": 4 * g, "inverse": 4 * g, "grad": 2 * g}
    inverse = a * a + a + g * g + g if method == "eigen" else a * a + g * g
    return {
        "factors_sent": _tri(a) + _tri(g) if packed else a * a + g * g,
        "factors_stored": a * a + g * g,
        "inverse": inverse,
        "grad": a * g,
    }


@dataclass(frozen=True)
class Placement:
    """Owner and grad-worker group of every layer, in the compact form the model needs.

    Attributes:
        owners: Inverse owner per layer (module order).
        n_workers: Grad workers per layer ``n = f·P``.
        n_groups: Number of grad-worker groups ``P/n`` (rank ``r`` is in group ``r % n_groups``).
    """

    owners: tuple[int, ...]
    n_workers: int
    n_groups: int


def _fraction(strategy: str, world_size: int, grad_worker_fraction: float) -> float:
    if strategy not in RULES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    kind = RULES[strategy].fraction
    if kind == "one":
        return 1.0
    if kind == "inverse_p":
        return 1.0 / world_size
    return grad_worker_fraction


def placement_for(
    spec: ModelSpec,
    world_size: int,
    strategy: str,
    grad_worker_fraction: float = 1.0,
    cost_kind: CostKind = "compute",
) -> Placement:
    """The placement a strategy uses, via :func:`~dkfac.distributed.assignment.plan_placement`.

    Raises:
        ValueError: For an unknown strategy, a bad world size, or a fraction that does not
            divide the world size.
    """
    fraction = _fraction(strategy, world_size, grad_worker_fraction)
    costs = tuple((layer.name, layer.placement_cost(cost_kind)) for layer in spec.layers)
    return _placement(costs, world_size, fraction)


@functools.lru_cache(maxsize=64)
def _placement(
    named_costs: tuple[tuple[str, float], ...], world_size: int, fraction: float
) -> Placement:
    """Cached: the planner asks for the same placement several times per strategy."""
    n_workers = grad_worker_count(world_size, fraction)
    plan = plan_placement(dict(named_costs), world_size, fraction)
    owners = tuple(plan[name].inverse_owner for name, _ in named_costs)
    return Placement(owners=owners, n_workers=n_workers, n_groups=world_size // n_workers)


def _check(world_size: int, method: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def predict_ledger_bytes(
    spec: ModelSpec,
    world_size: int,
    strategy: str,
    *,
    grad_worker_fraction: float = 1.0,
    method: str = "eigen",
    dtypes: DtypeBytes | None = None,
    factor_step: bool = True,
    inverse_step: bool = True,
    cost_kind: CostKind = "compute",
    pack_triangles: bool | None = None,
) -> dict[int, dict[str, int]]:
    """Bytes each rank's :class:`~dkfac.distributed.comm.CommLedger` records in one step.

    Args:
        spec: The model (see :func:`~dkfac.costmodel.extract_layers`).
        world_size: Number of ranks ``P``.
        strategy: One of :data:`STRATEGIES`.
        grad_worker_fraction: KAISA ``f`` (used by ``"kaisa"`` only).
        method: Solver, which sets the size of the broadcast solver state.
        dtypes: Element sizes (default: all fp32).
        factor_step: The step updates factors.
        inverse_step: The step updates inverses.
        cost_kind: Placement cost (see :func:`~dkfac.blocks.base.kronecker_cost`).
        pack_triangles: ``KFACConfig.pack_triangles``; ``None``: on for ``spngd`` only.

    Returns:
        ``{rank: {kind: bytes}}`` for every rank and every kind of :data:`KINDS`. DDP's own
        gradient all-reduce is NOT included (it does not go through the ledger).

    Raises:
        ValueError: For an unknown strategy or method, or a bad world size or fraction.
    """
    _check(world_size, method)
    rule, dt = RULES.get(strategy), dtypes or DtypeBytes()
    place = placement_for(spec, world_size, strategy, grad_worker_fraction, cost_kind)
    assert rule is not None
    zero = dict.fromkeys(KINDS, 0)
    if world_size == 1:
        return {0: dict(zero)}
    packed = rule.pack_factors if pack_triangles is None else pack_triangles
    counts = [element_counts(layer, method, packed) for layer in spec.layers]
    uniform = dict(zero)
    if factor_step and rule.factor_collective is not None:
        uniform["factors"] = sum(c["factors_sent"] for c in counts) * dt.factor
    grad_bytes = sum(c["grad"] for c in counts) * dt.grad
    if rule.gradients == "reduce_scatter":
        uniform["gradients"] = grad_bytes + spec.other_param_numel * dt.grad
    if rule.preconditioned == "all_gather" or (
        rule.preconditioned == "receivers" and place.n_groups > 1
    ):
        uniform["preconditioned"] = grad_bytes
    per_group = [0] * place.n_groups
    if inverse_step and rule.inverse_broadcast and place.n_workers > 1:
        for owner, c in zip(place.owners, counts, strict=True):
            per_group[owner % place.n_groups] += c["inverse"] * dt.inverse
    return {r: {**uniform, "inverses": per_group[r % place.n_groups]} for r in range(world_size)}


def predict_memory(
    spec: ModelSpec,
    world_size: int,
    strategy: str,
    *,
    grad_worker_fraction: float = 1.0,
    method: str = "eigen",
    dtypes: DtypeBytes | None = None,
    cost_kind: CostKind = "compute",
) -> dict[int, dict[str, int]]:
    """Bytes of K-FAC state each rank holds, by the kinds of ``pre.memory_usage()``.

    ``factors``: running A and G (full matrices) of the layers the rank keeps;
    ``inverses``: solver state of the layers the rank preconditions (its grad-worker group's
    layers, or its own under ``mem-opt`` / ``dp`` / ``spngd``); ``accumulators``: the
    per-step factor sums the rank builds, i.e. the PEAK during a factor-update step
    (``memory_usage()`` reads 0 after ``step()`` has consumed them).

    Returns:
        ``{rank: {"factors", "inverses", "accumulators": bytes}}``.

    Raises:
        ValueError: As :func:`predict_ledger_bytes`.
    """
    _check(world_size, method)
    rule, dt = RULES.get(strategy), dtypes or DtypeBytes()
    place = placement_for(spec, world_size, strategy, grad_worker_fraction, cost_kind)
    assert rule is not None
    counts = [element_counts(layer, method, False) for layer in spec.layers]
    stored_all = sum(c["factors_stored"] for c in counts) * dt.factor
    owned = [0] * world_size
    group_inv = [0] * place.n_groups
    for owner, c in zip(place.owners, counts, strict=True):
        owned[owner] += c["factors_stored"] * dt.factor
        group_inv[owner % place.n_groups] += c["inverse"] * dt.inverse
    out: dict[int, dict[str, int]] = {}
    for r in range(world_size):
        out[r] = {
            "factors": stored_all if rule.factors_kept == "all" else owned[r],
            "inverses": group_inv[r % place.n_groups],
            "accumulators": stored_all if rule.builders == "all" else owned[r],
        }
    return out


def ddp_gradient_bytes(spec: ModelSpec, dtypes: DtypeBytes | None = None) -> int:
    """Bytes of DDP's gradient all-reduce per step (logical size, as the ledger would count)."""
    return spec.param_numel * (dtypes or DtypeBytes()).grad


def ceil_log2(n: int) -> int:
    """``⌈log₂ n⌉`` for ``n >= 1``."""
    return max(0, math.ceil(math.log2(n)))
