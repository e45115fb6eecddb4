"""An overhead budget: how often, and from how many samples, the curvature is worth its cost.

A K-FAC step costs the training step (forward and backward), plus the preconditioner's own
work: a fixed part every step (rotating the gradient into the eigenbasis and out of it, the
moments), the factor captures (``rows · (a² + g²)`` per layer, from ``factor_batch_size``
samples every ``factor_update_interval`` steps) and the basis refreshes (``~ a³ + g³`` per
layer every ``inverse_update_interval`` steps). :func:`layer_costs` counts each from the
layer sizes and the rows a step sees (in flops, plus a fixed cost per dispatched operation,
:data:`DISPATCH_FLOPS`, which is what a small layer's work is on a CPU or GPU);
:func:`choose` then takes the freshest factor batch and intervals whose total stays within
``overhead`` times the training step. It is a pure function of those numbers: every rank
computes the same choice from the same shapes, with no measurement to agree on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "BATCH_FRACTIONS",
    "DISPATCH_FLOPS",
    "FACTOR_INTERVALS",
    "INVERSE_INTERVALS",
    "Choice",
    "Costs",
    "LayerShape",
    "choose",
    "layer_costs",
]

DISPATCH_FLOPS = 2e5
"""The cost of one dispatched operation, in flops (about 10 µs at 20 GFLOP/s)."""

BATCH_FRACTIONS = (1, 2, 4, 8)
"""Factor batches tried: the batch divided by each (never below :data:`MIN_FACTOR_BATCH`)."""

MIN_FACTOR_BATCH = 32
"""The fewest samples a factor batch is cut to (fewer estimate a factor poorly)."""

FACTOR_INTERVALS = (1, 2, 4, 8)
"""Factor update intervals tried."""

INVERSE_INTERVALS = (5, 10, 20, 50)
"""Basis refresh intervals tried (at least the factor interval)."""


@dataclass(frozen=True)
class LayerShape:
    """One preconditioned layer: its input side ``a`` (bias column included), output side
    ``g``, the rows one training step sees (samples × positions), and the sides its input
    basis is refreshed as (``(channels, positions)`` for a flattened map's Kronecker
    basis; ``()``: the whole side ``a``), and the Newton–Schulz steps of its orthogonalised
    update (0: none)."""

    a: int
    g: int
    rows: int
    a_parts: tuple[int, ...] = ()
    polar_steps: int = 0


@dataclass(frozen=True)
class Costs:
    """Per-step costs in flops: ``step``, the training step; ``fixed``, the
    preconditioner's every step; ``capture``, one capture of the whole batch; ``refresh``,
    one refresh of every basis."""

    step: float
    fixed: float
    capture: float
    refresh: float


def layer_costs(layers: Sequence[LayerShape]) -> Costs:
    """The costs of :class:`Costs` counted from the layers (see the module docstring).

    Per layer: the training step is three products (forward, two in the backward) of
    ``2 · rows · a · g`` flops; the fixed part rotates into and out of the basis (four
    products of ``2 · a · g · min(a, g)``-ish, counted as ``4 · a · g · (a + g)``) plus
    about ten elementwise moment operations, and an orthogonalised update three products of
    ``2 · a · g · min(a, g)`` and an addition per Newton–Schulz step; a capture is two
    products ``2 · rows · (a² + g²)`` and two running-average updates; a refresh is a power
    step and a QR per side, counted as ``6 · (a³ + g³)`` in eight operations. Each adds
    :data:`DISPATCH_FLOPS`.
    """
    d = DISPATCH_FLOPS
    step = sum(6.0 * x.rows * x.a * x.g + 3 * d for x in layers)
    fixed = sum(
        4.0 * x.a * x.g * (x.a + x.g)
        + 14 * d
        + x.polar_steps * (6.0 * x.a * x.g * min(x.a, x.g) + 4 * d)
        for x in layers
    )
    capture = sum(2.0 * x.rows * (x.a**2 + x.g**2) + 4 * d for x in layers)
    refresh = sum(6.0 * (sum(p**3 for p in x.a_parts or (x.a,)) + x.g**3) + 8 * d for x in layers)
    return Costs(step, fixed, capture, refresh)


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` chose, and why.

    Attributes:
        factor_batch_size: Samples the factors are built from (``None``: the whole batch).
        factor_update_interval: Steps between factor captures.
        inverse_update_interval: Steps between basis refreshes.
        overhead: The preconditioner's cost over the training step's, as chosen.
        budget: The budget it was chosen within.
        within_budget: Whether any choice fitted (else the cheapest was taken).
        reason: One sentence for ``describe()`` and the log.
    """

    factor_batch_size: int | None
    factor_update_interval: int
    inverse_update_interval: int
    overhead: float
    budget: float
    within_budget: bool
    reason: str


def choose(
    costs: Costs, batch: int, budget: float, fixed_options: Mapping[str, int | None] | None = None
) -> Choice:
    """The freshest factor batch and intervals whose overhead is within ``budget``.

    Overhead = ``(fixed + capture · (b / batch) / factor_interval + refresh /
    inverse_interval) / step``. Among the candidates (:data:`BATCH_FRACTIONS`,
    :data:`FACTOR_INTERVALS`, :data:`INVERSE_INTERVALS`, an inverse interval at least the
    factor interval) that fit, the freshest wins: the least staleness, counted as half a unit
    per halving of the factor batch (the recipes cut it first: 50 of 700 samples on the
    digits CNN, 8 of 32 sequences on the language model) and one per doubling of the factor
    interval or of the basis interval over 5 (ties: the larger batch, then the shorter
    intervals). When the per-step part alone exceeds the budget, no choice fits; the
    captures and refreshes then get half the budget on top of that part (the freshest
    within it, or the cheapest of all if even that fails).

    Args:
        costs: :func:`layer_costs`.
        batch: Samples in a training step.
        budget: The most overhead allowed, e.g. 0.3 for 30% over the training step (> 0).
        fixed_options: ``factor_batch_size`` / ``factor_update_interval`` /
            ``inverse_update_interval`` the user set: kept as given (explicit options win).

    Raises:
        ValueError: For a budget or a batch that is not positive, or non-positive costs.
    """
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"overhead budget must be a finite number > 0, got {budget!r}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if costs.step <= 0:
        raise ValueError(f"the training step's cost must be > 0, got {costs.step}")
    fixed = dict(fixed_options or {})
    if "factor_batch_size" in fixed:
        batches = [fixed["factor_batch_size"] or batch]
    else:
        batches = sorted(
            {max(min(batch, MIN_FACTOR_BATCH), batch // k) for k in BATCH_FRACTIONS}, reverse=True
        )
    factor_intervals = list(FACTOR_INTERVALS)
    if "factor_update_interval" in fixed:
        factor_intervals = [fixed["factor_update_interval"] or 1]
    candidates = []
    for b in batches:
        for fi in factor_intervals:
            inverse = (
                [fixed["inverse_update_interval"] or 1]
                if "inverse_update_interval" in fixed
                else [ii for ii in INVERSE_INTERVALS if ii >= fi]
            )
            for ii in inverse:
                overhead = (
                    costs.fixed + costs.capture * min(b, batch) / batch / fi + costs.refresh / ii
                ) / costs.step
                staleness = 0.5 * math.log2(batch / b) + math.log2(fi) + math.log2(max(ii, 5) / 5)
                candidates.append((overhead, staleness, b, fi, ii))
    fixed_share = costs.fixed / costs.step
    within = any(c[0] <= budget for c in candidates)
    # The rotation is paid every step whatever the intervals: when nothing fits, the
    # captures and refreshes still get half the budget on top of it, not nothing.
    allowed = budget if within else max(budget, fixed_share + budget / 2)
    fitting = [c for c in candidates if c[0] <= allowed] or [min(candidates)]
    overhead, _, b, fi, ii = min(fitting, key=lambda c: (c[1], -c[2], c[3], c[4]))
    reason = (
        f"factors from {b} of {batch} samples every {fi} step(s), bases every {ii}: "
        f"{overhead:.0%} over the training step (the per-step work alone {fixed_share:.0%}: "
        "rotations, moments, polar factors) "
        + ("within" if within else "over")
        + f" the {budget:.0%} budget"
        + (
            ""
            if within
            else ": no choice fits, so the captures and refreshes get half the budget on top"
            " of the rotation"
        )
        + (f"; kept as given: {', '.join(sorted(fixed))}" if fixed else "")
    )
    return Choice(b if b < batch else None, fi, ii, overhead, float(budget), within, reason)
