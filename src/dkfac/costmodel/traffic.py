"""Per-rank ledger bytes and memory of every distributed strategy, from layer shapes alone.

Byte convention: exactly that of :mod:`dkfac.distributed.ledger` — each collective records, on
every *participating* rank, the logical message size (sum of ``numel × element_size`` of the
tensors it covers; a packed symmetric ``n×n`` matrix counts ``n(n+1)/2`` elements). A
collective on a group of one rank records nothing, and nothing is recorded at world size 1.

Nothing here names a strategy or a solver: what a strategy builds, sends and keeps is its
:class:`~dkfac.distributed.strategy_base.StrategyRule` (:func:`rule_of` reads it from the table
:data:`dkfac.distributed.strategies.STRATEGIES`), and the size of a solver's state and
moments comes from its class in :data:`dkfac.solvers.SOLVERS` (:func:`element_counts`), so a
new strategy or solver is priced by the class that implements it.

What each strategy does (read from ``dkfac.distributed.strategies`` and checked against the
real ledger at 2 and 4 ranks by ``tests/costmodel/test_costmodel_ledger.py``):

* Placement: ``plan_placement({name: placement cost}, P, f)`` with the blocks' placement costs
  (Kronecker ``kronecker_cost(a, g)``, unit-wise ``C·d³`` / ``C·d²``: BatchNorm's ``8C`` /
  ``4C``); ``f = 1`` for ``replicated``,
  ``1/P`` for ``mem-opt``, ``dp`` and ``spngd``.
* ``replicated`` / ``kaisa``: every rank all-reduces every layer's statistics (kind
  ``factors``; unpacked unless ``pack_triangles``); each inverse owner broadcasts the layer's
  solver state inside the layer's grad-worker group (kind ``inverses``; eigen: ``Q_A, λ_A,
  Q_G, λ_G``; cholesky: ``A⁻¹, G⁻¹``; unit-wise: the ``C×d×d`` unit Fisher), stored in the
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
  ``gradients`` and ``factors`` counted apart; a unit-wise ``C×d×d`` statistic is not
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

from dkfac.blocks.base import CostKind
from dkfac.costmodel.layers import KFACLayer, ModelSpec
from dkfac.distributed.assignment import grad_worker_count, plan_placement
from dkfac.distributed.strategies import STRATEGIES as STRATEGY_TABLE
from dkfac.distributed.strategy_base import StrategyRule
from dkfac.solvers import SOLVERS, Solver, UnitwiseAdamSolver, method_names

__all__ = [
    "KINDS",
    "METHODS",
    "STRATEGIES",
    "DtypeBytes",
    "Placement",
    "StrategyRule",
    "element_counts",
    "placement_for",
    "predict_ledger_bytes",
    "predict_memory",
    "priced_solver",
    "rule_of",
]

KINDS = ("gradients", "factors", "inverses", "preconditioned")
STRATEGIES: tuple[str, ...] = tuple(STRATEGY_TABLE)
"""The strategies the cost model prices: every entry of the strategy table."""


def rule_of(strategy: str) -> StrategyRule:
    """The :class:`StrategyRule` of a strategy of the table (registered ones included).

    Raises:
        ValueError: For a name not in the table.
    """
    cls = STRATEGY_TABLE.get(strategy)
    if cls is None:
        raise ValueError(f"strategy must be one of {tuple(STRATEGY_TABLE)}, got {strategy!r}")
    return cls.rule


def priced_methods() -> tuple[str, ...]:
    """The methods (registered ones included) whose state size follows from the shapes
    alone: not the low-rank ones."""
    return tuple(n for n in method_names() if n in SOLVERS and SOLVERS[n].fixed_size_state)


METHODS: tuple[str, ...] = priced_methods()
"""The built-in methods the cost model prices (:func:`priced_methods` at import)."""


def priced_solver(method: str) -> type[Solver]:
    """The solver class of a method whose state size follows from the shapes.

    Raises:
        ValueError: For another method (unknown, deferred or low-rank).
    """
    priced = priced_methods()
    if method not in priced:
        raise ValueError(f"method must be one of {priced}, got {method!r}")
    return SOLVERS[method]


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
        method: One of :data:`METHODS` (BatchNorm layers always use the unit-wise solver).
        packed: Square statistics sent as packed triangles.

    Returns:
        ``{"factors_sent", "factors_stored", "inverse", "moments", "grad"}`` element counts.
        Kronecker: factors sent ``a²+g²`` (packed ``a(a+1)/2 + g(g+1)/2``); stored
        ``a²+g²``; solver state and moments as the solver's class counts them
        (:meth:`~dkfac.solvers.Solver.state_elements`: eigen ``a²+a+g²+g``, cholesky
        ``a²+g²``); gradient ``a·g``. Unit-wise (``g`` units of ``a`` parameters: BatchNorm's
        ``a = 2``, a grouped convolution's ``d``): statistic ``a²·g`` sent and stored (never
        packed), state ``a²·g``, gradient ``a·g``; no moments, but for a grouped
        convolution under a method with Adam's scale
        (:class:`~dkfac.solvers.unitwise_adam.UnitwiseAdamSolver`: ``2·a·g + 1``).
    """
    a, g = layer.a_dim, layer.g_dim
    solver = priced_solver(method)
    if layer.unitwise:
        adam = layer.kind != "batchnorm" and solver.adam_scaled
        return {
            "factors_sent": a * a * g,
            "factors_stored": a * a * g,
            "inverse": a * a * g,
            "moments": UnitwiseAdamSolver.moment_elements(a, g) if adam else 0,
            "grad": a * g,
        }
    return {
        "factors_sent": _tri(a) + _tri(g) if packed else a * a + g * g,
        "factors_stored": a * a + g * g,
        "inverse": solver.state_elements(a, g),
        "moments": solver.moment_elements(a, g),
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
    return rule_of(strategy).worker_fraction(world_size, grad_worker_fraction)


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
    priced_solver(method)


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
    """Bytes each rank's :class:`~dkfac.distributed.ledger.CommLedger` records in one step.

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
    rule, dt = rule_of(strategy), dtypes or DtypeBytes()
    place = placement_for(spec, world_size, strategy, grad_worker_fraction, cost_kind)
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
        ``{rank: {"factors", "inverses", "moments", "accumulators": bytes}}``; ``moments``:
        the per-layer state a solver keeps between steps on the ranks that precondition
        the layer (0 for eigen and cholesky), and under a solver with Adam's scale
        (``Solver.adam_scaled``: eigen_adam, whose default ``leftover_update`` keeps them)
        Adam's ``m`` and ``v`` of the parameters outside the layers, in the gradients'
        dtype but at least float32, and a float64 count per tensor, on every rank.

    Raises:
        ValueError: As :func:`predict_ledger_bytes`.
    """
    _check(world_size, method)
    rule, dt = rule_of(strategy), dtypes or DtypeBytes()
    place = placement_for(spec, world_size, strategy, grad_worker_fraction, cost_kind)
    counts = [element_counts(layer, method, False) for layer in spec.layers]
    stored_all = sum(c["factors_stored"] for c in counts) * dt.factor
    owned = [0] * world_size
    group_inv = [0] * place.n_groups
    group_moments = [0] * place.n_groups
    for owner, c in zip(place.owners, counts, strict=True):
        owned[owner] += c["factors_stored"] * dt.factor
        group_inv[owner % place.n_groups] += c["inverse"] * dt.inverse
        group_moments[owner % place.n_groups] += c["moments"] * dt.inverse
    leftover = 0
    if priced_solver(method).adam_scaled:
        moment = max(dt.grad, 4)  # kept in float32 at least
        leftover = 2 * spec.other_param_numel * moment + 8 * spec.other_param_tensors
    out: dict[int, dict[str, int]] = {}
    for r in range(world_size):
        out[r] = {
            "factors": stored_all if rule.factors_kept == "all" else owned[r],
            "inverses": group_inv[r % place.n_groups],
            "moments": group_moments[r % place.n_groups] + leftover,
            "accumulators": stored_all if rule.builders == "all" else owned[r],
        }
    return out


def ddp_gradient_bytes(spec: ModelSpec, dtypes: DtypeBytes | None = None) -> int:
    """Bytes of DDP's gradient all-reduce per step (logical size, as the ledger would count)."""
    return spec.param_numel * (dtypes or DtypeBytes()).grad


def ceil_log2(n: int) -> int:
    """``⌈log₂ n⌉`` for ``n >= 1``."""
    return max(0, math.ceil(math.log2(n)))
