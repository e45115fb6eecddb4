"""Per-iteration time by phase, bytes and memory per strategy, and the planner's choice.

Time model (per rank, per iteration, phases added up — no overlap is assumed, so the total is
an upper bound for implementations that overlap communication with the backward):

====================  ==========================================================================
phase                 seconds
====================  ==========================================================================
forward_backward      3 · forward flops · B / matmul rate (identical for every strategy)
factor_build          Σ over layers the rank builds of 2·B·T·(a² + g²) / matmul rate, ÷ f_int
factor_comm           ring all-reduce ``2(P−1)/P·M/bw + 2(P−1)·α`` per bucket (``reduce_scatter``:
                      half of it), M = factor bytes, ÷ f_int
inverse               Σ over owned layers of (a³ + g³) / eigh (or cholesky) rate, ÷ i_int
inverse_comm          Σ over the rank's group's layers of ``M/bw + ⌈log₂ n⌉·α``, ÷ i_int
precondition          Σ over layers the rank preconditions of c·a·g·(a + g) / matmul rate
                      (c = 4 eigen, 2 cholesky)
preconditioned_comm   broadcasts in grad-receiver blocks (``M/bw + ⌈log₂ k⌉·α`` each), or a
                      ring all-gather ``(P−1)/P·M/bw + (P−1)·α`` (spngd)
grad_comm             DDP ring all-reduce of every gradient (spngd: reduce-scatter of the K-FAC
                      gradients + all-reduce of the others)
====================  ==========================================================================

Every phase is the maximum over ranks (the slowest rank sets the pace). ``α`` is the latency,
``bw`` the per-rank bandwidth in bytes/s. Per-rank loops are ``O(P + L)``, so world sizes of
many thousands are cheap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dkfac.costmodel.layers import ModelSpec
from dkfac.costmodel.traffic import (
    KINDS,
    DtypeBytes,
    ceil_log2,
    ddp_gradient_bytes,
    element_counts,
    placement_for,
    predict_ledger_bytes,
    predict_memory,
    priced_solver,
    rule_of,
)

__all__ = [
    "PHASES",
    "DeviceRates",
    "StrategyPrediction",
    "calibrate",
    "candidate_strategies",
    "predict",
    "recommend",
]

PHASES = (
    "forward_backward",
    "factor_build",
    "factor_comm",
    "inverse",
    "inverse_comm",
    "precondition",
    "preconditioned_comm",
    "grad_comm",
)


@dataclass(frozen=True, kw_only=True)
class DeviceRates:
    """Compute and network rates of one rank.

    Defaults are rough figures for a data-centre GPU and a 100 Gb/s network; use
    :func:`calibrate` to measure the compute rates of the local device.

    Attributes:
        matmul_flops: Dense matmul throughput, flop/s.
        eigh_rate: Symmetric eigendecomposition speed, ``n³`` per second.
        cholesky_rate: Cholesky-based inverse speed, ``n³`` per second.
        bandwidth: Network bandwidth per rank, bytes/s.
        latency: Per-message latency ``α``, seconds.
        bucket_bytes: Bucket size of the bucketed collectives (latency is paid per bucket).
    """

    matmul_flops: float = 20e12
    eigh_rate: float = 4e10
    cholesky_rate: float = 2e11
    bandwidth: float = 100e9 / 8
    latency: float = 5e-6
    bucket_bytes: int = 25 * 2**20

    def __post_init__(self) -> None:
        for name in ("matmul_flops", "eigh_rate", "cholesky_rate", "bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not math.isfinite(self.latency) or self.latency < 0:
            raise ValueError(f"latency must be finite and >= 0, got {self.latency!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class StrategyPrediction:
    """What the cost model predicts for one strategy.

    Attributes:
        strategy: Strategy name.
        grad_worker_fraction: KAISA fraction used for the placement.
        phases: Phase -> seconds per iteration (amortised by the update intervals).
        total_seconds: Sum of the phases.
        ledger_bytes: Kind -> max over ranks of ledger bytes per iteration (amortised).
        ledger_bytes_mean: Kind -> mean over ranks.
        ddp_bytes: DDP's gradient all-reduce per iteration (0 for spngd, which has no DDP).
        wire_bytes: Mean bytes a rank puts on the wire per iteration (ring algorithms),
            DDP included.
        full_step_ledger_bytes: Max over ranks of ledger bytes of a step updating both factors
            and inverses (one "second-order update").
        memory: Kind -> max over ranks of K-FAC state bytes (see :func:`predict_memory`).
        memory_max: Max over ranks of the sum of the K-FAC state kinds.
        model_state_bytes: Weights, gradients and one momentum buffer (same for every rank).
    """

    strategy: str
    grad_worker_fraction: float
    phases: dict[str, float]
    total_seconds: float
    ledger_bytes: dict[str, float]
    ledger_bytes_mean: dict[str, float]
    ddp_bytes: float
    wire_bytes: float
    full_step_ledger_bytes: int
    memory: dict[str, int]
    memory_max: int
    model_state_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """``"kaisa(f=0.25)"`` for kaisa, the strategy name otherwise."""
        if self.strategy == "kaisa":
            return f"kaisa(f={self.grad_worker_fraction:g})"
        return self.strategy

    @property
    def total_bytes_incl_ddp(self) -> float:
        """Max ledger bytes per iteration (all kinds) plus DDP's gradient all-reduce."""
        return sum(self.ledger_bytes.values()) + self.ddp_bytes


def _allreduce_s(nbytes: float, p: int, rates: DeviceRates) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    buckets = math.ceil(nbytes / rates.bucket_bytes)
    return 2 * (p - 1) / p * nbytes / rates.bandwidth + buckets * 2 * (p - 1) * rates.latency


def _scatter_s(nbytes: float, p: int, rates: DeviceRates) -> float:
    """Ring reduce-scatter or all-gather of ``nbytes`` in total."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    buckets = math.ceil(nbytes / rates.bucket_bytes)
    return (p - 1) / p * nbytes / rates.bandwidth + buckets * (p - 1) * rates.latency


def _broadcast_s(nbytes: float, k: int, rates: DeviceRates) -> float:
    if k <= 1 or nbytes <= 0:
        return 0.0
    return nbytes / rates.bandwidth + ceil_log2(k) * rates.latency


def predict(
    spec: ModelSpec,
    world_size: int,
    strategy: str,
    *,
    batch_per_rank: int,
    rates: DeviceRates | None = None,
    grad_worker_fraction: float = 1.0,
    method: str = "eigen",
    dtypes: DtypeBytes | None = None,
    factor_interval: int = 1,
    inverse_interval: int = 1,
) -> StrategyPrediction:
    """Predicts time by phase, bytes and memory of one strategy.

    Args:
        spec: The model.
        world_size: Ranks ``P``.
        strategy: ``replicated``, ``kaisa``, ``mem-opt``, ``dp`` or ``spngd``.
        batch_per_rank: Local batch ``B``.
        rates: Device rates (defaults: :class:`DeviceRates`).
        grad_worker_fraction: KAISA fraction (kaisa only).
        method: ``"eigen"`` or ``"cholesky"``.
        dtypes: Element sizes.
        factor_interval: Steps between factor updates.
        inverse_interval: Steps between inverse updates.

    Returns:
        The :class:`StrategyPrediction`.

    Raises:
        ValueError: For a bad argument (named in the message).
    """
    for name, value in (
        ("batch_per_rank", batch_per_rank),
        ("factor_interval", factor_interval),
        ("inverse_interval", inverse_interval),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    rates = rates or DeviceRates()
    dt = dtypes or DtypeBytes()
    p = world_size
    rule = rule_of(strategy)
    kw = {"grad_worker_fraction": grad_worker_fraction, "method": method, "dtypes": dt}
    ledger = predict_ledger_bytes(spec, p, strategy, **kw)  # type: ignore[arg-type]
    plain = predict_ledger_bytes(
        spec,
        p,
        strategy,
        factor_step=False,
        inverse_step=False,
        **kw,  # type: ignore[arg-type]
    )
    memory = predict_memory(spec, p, strategy, **kw)  # type: ignore[arg-type]
    place = placement_for(spec, p, strategy, grad_worker_fraction)
    f_int, i_int = factor_interval, inverse_interval

    # Amortised ledger bytes per rank: plain every step, factors 1/f_int, inverses 1/i_int.
    amort = {
        r: {
            "gradients": plain[r]["gradients"],
            "preconditioned": plain[r]["preconditioned"],
            "factors": ledger[r]["factors"] / f_int,
            "inverses": ledger[r]["inverses"] / i_int,
        }
        for r in ledger
    }
    ranks = list(amort)
    ledger_max = {k: max(amort[r][k] for r in ranks) for k in KINDS}
    ledger_mean = {k: sum(amort[r][k] for r in ranks) / len(ranks) for k in KINDS}
    full_step = max(sum(ledger[r].values()) for r in ranks)

    counts = [element_counts(layer, method, rule.pack_factors) for layer in spec.layers]
    b = batch_per_rank
    solver = priced_solver(method)
    inv_rate = rates.eigh_rate if solver.cost_rate == "eigh" else rates.cholesky_rate
    c = float(solver.apply_products)
    build, invert, precond = [], [], []
    for lay in spec.layers:
        a, g = lay.a_dim, lay.g_dim
        if lay.unitwise:  # per sample: the a·g per-unit gradients and their a×a products
            per_sample = 2.0 * lay.positions * a * g if a != 2 else 0.0  # (BN's: elementwise)
            build.append(2.0 * b * a * a * g + b * per_sample)
            # BN's closed-form 2×2 solves cost nothing to form; a Cholesky inverse per unit
            invert.append(0.0 if a == 2 else g * a**3 / rates.cholesky_rate)
            precond.append(4.0 * a * a * g)
        else:
            build.append(2.0 * b * lay.positions * (a**2 + g**2))
            invert.append((a**3 + g**3) / inv_rate)
            precond.append(c * a * g * (a + g))
    owned_build = [0.0] * p
    owned_inv = [0.0] * p
    group_pre = [0.0] * place.n_groups
    group_inv_s = [0.0] * place.n_groups
    for i, owner in enumerate(place.owners):
        owned_build[owner] += build[i]
        owned_inv[owner] += invert[i]
        group_pre[owner % place.n_groups] += precond[i]
        group_inv_s[owner % place.n_groups] += _broadcast_s(
            counts[i]["inverse"] * dt.inverse, place.n_workers, rates
        )

    phases = dict.fromkeys(PHASES, 0.0)
    phases["forward_backward"] = 3.0 * spec.forward_flops_per_sample * b / rates.matmul_flops
    build_flops = sum(build) if rule.builders == "all" else max(owned_build)
    phases["factor_build"] = build_flops / rates.matmul_flops / f_int
    factor_bytes = sum(cnt["factors_sent"] for cnt in counts) * dt.factor
    if rule.factor_collective == "all_reduce":
        phases["factor_comm"] = _allreduce_s(factor_bytes, p, rates) / f_int
    elif rule.factor_collective == "reduce_scatter":
        phases["factor_comm"] = _scatter_s(factor_bytes, p, rates) / f_int
    phases["inverse"] = max(owned_inv) / i_int
    if rule.inverse_broadcast and place.n_workers > 1:
        phases["inverse_comm"] = max(group_inv_s) / i_int
    phases["precondition"] = max(group_pre) / rates.matmul_flops
    grad_bytes = sum(cnt["grad"] for cnt in counts) * dt.grad
    block = p // place.n_workers
    if rule.preconditioned == "all_gather":
        phases["preconditioned_comm"] = _scatter_s(grad_bytes, p, rates)
    elif rule.preconditioned == "receivers" and block > 1:
        phases["preconditioned_comm"] = sum(
            _broadcast_s(cnt["grad"] * dt.grad, block, rates) for cnt in counts
        )
    ddp = float(ddp_gradient_bytes(spec, dt)) if rule.gradients == "ddp" and p > 1 else 0.0
    if rule.gradients == "ddp":
        phases["grad_comm"] = _allreduce_s(ddp, p, rates)
    else:
        other = spec.other_param_numel * dt.grad
        phases["grad_comm"] = _scatter_s(grad_bytes, p, rates) + _allreduce_s(other, p, rates)

    # Wire bytes (mean per rank): ring all-reduce 2(P-1)/P·M, scatter/gather (P-1)/P·M,
    # broadcast to k ranks (k-1)/k·M on average.
    frac = (p - 1) / p
    wire = 2 * frac * ddp
    wire += (2 * frac if rule.factor_collective == "all_reduce" else frac) * (
        ledger_mean["factors"]
    )
    if rule.gradients == "reduce_scatter":
        wire += frac * grad_bytes + 2 * frac * spec.other_param_numel * dt.grad
    wire += (place.n_workers - 1) / place.n_workers * ledger_mean["inverses"]
    wire += (frac if rule.preconditioned == "all_gather" else (block - 1) / block) * ledger_mean[
        "preconditioned"
    ]

    mem = {k: max(memory[r][k] for r in ranks) for k in ("factors", "inverses", "accumulators")}
    return StrategyPrediction(
        strategy=strategy,
        grad_worker_fraction=place.n_workers / p,
        phases=phases,
        total_seconds=sum(phases.values()),
        ledger_bytes=ledger_max,
        ledger_bytes_mean=ledger_mean,
        ddp_bytes=ddp,
        wire_bytes=wire,
        full_step_ledger_bytes=full_step,
        memory=mem,
        memory_max=max(sum(memory[r].values()) for r in ranks),
        model_state_bytes=3 * spec.param_numel * dt.grad,
    )


def candidate_strategies(
    world_size: int, fractions: Sequence[float] = (0.5, 0.25)
) -> list[tuple[str, float]]:
    """``(strategy, fraction)`` pairs worth comparing at ``world_size``.

    KAISA fractions whose ``f·P`` is not a divisor of ``P`` strictly between 1 and ``P`` are
    left out (they coincide with mem-opt / replicated or are invalid).
    """
    out: list[tuple[str, float]] = [("replicated", 1.0)]
    for f in fractions:
        n = f * world_size
        if abs(n - round(n)) < 1e-9 and 1 < round(n) < world_size and world_size % round(n) == 0:
            out.append(("kaisa", float(f)))
    out += [("mem-opt", 1.0 / world_size), ("dp", 1.0 / world_size), ("spngd", 1.0 / world_size)]
    return out


def recommend(
    spec: ModelSpec,
    world_size: int,
    *,
    batch_per_rank: int,
    rates: DeviceRates | None = None,
    memory_budget_bytes: float | None = None,
    strategies: Sequence[tuple[str, float]] | None = None,
    **options: object,
) -> tuple[StrategyPrediction, list[StrategyPrediction]]:
    """The fastest predicted strategy whose per-rank memory fits the budget.

    Memory counts K-FAC state plus weights, gradients and one momentum buffer; activations
    are not modelled.

    Args:
        spec: The model.
        world_size: Ranks.
        batch_per_rank: Local batch.
        rates: Device rates.
        memory_budget_bytes: Per-rank budget; ``None`` means unlimited.
        strategies: ``(strategy, fraction)`` pairs (default :func:`candidate_strategies`).
        **options: Passed to :func:`predict` (``method``, ``dtypes``, intervals).

    Returns:
        ``(choice, every prediction)``.

    Raises:
        ValueError: If nothing fits the budget (the message gives the smallest need).
    """
    if memory_budget_bytes is not None and not memory_budget_bytes > 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes!r}")
    pairs = list(strategies) if strategies is not None else candidate_strategies(world_size)
    preds = [
        predict(
            spec,
            world_size,
            name,
            batch_per_rank=batch_per_rank,
            rates=rates,
            grad_worker_fraction=f,
            **options,  # type: ignore[arg-type]
        )
        for name, f in pairs
    ]

    def need(pred: StrategyPrediction) -> int:
        return pred.memory_max + pred.model_state_bytes

    fitting = [p for p in preds if memory_budget_bytes is None or need(p) <= memory_budget_bytes]
    if not fitting:
        smallest = min(preds, key=need)
        raise ValueError(
            f"no strategy fits memory_budget_bytes={memory_budget_bytes:.4g}; the smallest "
            f"need is {need(smallest):.4g} bytes ({smallest.label})"
        )
    return min(fitting, key=lambda p: p.total_seconds), preds


def calibrate(
    device: torch.device | str = "cpu", seconds: float = 1.0, size: int = 512
) -> DeviceRates:
    """Measures matmul, eigh and Cholesky-inverse rates on ``device`` (network rates default).

    Args:
        device: Where to measure.
        seconds: Rough time budget per measurement.
        size: Matrix side used.

    Returns:
        :class:`DeviceRates` with the measured compute rates.
    """
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(size, size, generator=gen).to(dev)
    spd = x @ x.T / size + torch.eye(size, device=dev)

    def rate(fn: object, work: float) -> float:
        assert callable(fn)
        fn()  # warm-up
        count, start = 0, time.perf_counter()
        while True:
            fn()
            count += 1
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / 3 or count >= 1000:
                return work * count / elapsed

    n3 = float(size) ** 3
    return DeviceRates(
        matmul_flops=rate(lambda: x @ x, 2 * n3),
        eigh_rate=rate(lambda: torch.linalg.eigh(spd), n3),
        cholesky_rate=rate(lambda: torch.cholesky_inverse(torch.linalg.cholesky(spd)), n3),
    )
