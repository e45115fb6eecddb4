"""An overhead budget: how often, and from how many samples, the curvature is worth its cost.

A K-FAC step costs the training step (forward and backward), plus the preconditioner's own
work: a fixed part every step (rotating the gradient into the eigenbasis and out of it, the
moments), the factor captures (``rows · (a² + g²)`` per layer, from ``factor_batch_size``
samples every ``factor_update_interval`` steps; less for a side kept as its diagonal or its
diagonal blocks) and the basis refreshes (``~ a³ + g³`` per layer every
``inverse_update_interval`` steps). :func:`layer_costs` counts each from the
layer sizes and the rows a step sees (in flops, plus a fixed cost per dispatched operation,
:data:`DISPATCH_FLOPS`, which is what a small layer's work is on a CPU or GPU);
:func:`choose` then takes the freshest factor batch and intervals whose total stays within
``overhead`` times the training step. It is a pure function of those numbers: every rank
computes the same choice from the same shapes, with no measurement to agree on.

The constants are fitted to what the parts cost on a CPU core (``dkfac bench suite``'s six
families, one thread, each part timed on its own against a plain SGD step): a dispatched
operation of the preconditioner is worth about a million flops (10 µs at the 100 GFLOP/s
its small products reach), and a refresh (a power step and a QR per side) about
``10 · d³`` flops. Measured so, the per-step part alone is 25-35% of the training step on the
convolutional and transformer families and 2-3 times it on the small MLP and autoencoder
(per layer, a few hundred microseconds of dispatched operations, whatever its size). The
training step is counted from the preconditioned layers' products alone, so a model with
much other work (attention, norms) is counted as over its budget sooner than it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BATCH_FRACTIONS",
    "DISPATCH_FLOPS",
    "FACTOR_INTERVALS",
    "INVERSE_INTERVALS",
    "MIN_FACTOR_ROWS",
    "MIN_FACTOR_SAMPLES",
    "ONE_SIDED_SHARE",
    "OVER_BUDGET_ALLOWANCE",
    "OVER_BUDGET_POLAR_STEPS",
    "Choice",
    "Costs",
    "LayerShape",
    "basis_limit",
    "choose",
    "choose_for",
    "layer_costs",
    "min_factor_batch",
]

DISPATCH_FLOPS = 1e6
"""The cost of one dispatched operation, in flops (about 10 µs at the 100 GFLOP/s of a CPU
core's small products; module notes)."""

BATCH_FRACTIONS = (1, 2, 4, 8)
"""Factor batches tried: the batch divided by each (never below :func:`min_factor_batch`)."""

MIN_FACTOR_ROWS = 32
"""The fewest rows (samples × positions) a factor batch is cut to, in the layer that sees
the fewest rows per sample (fewer estimate a factor poorly)."""

MIN_FACTOR_SAMPLES = 8
"""The fewest samples a factor batch is cut to, however many positions each has (the
language-model recipe's 8 of 32 sequences)."""

OVER_BUDGET_ALLOWANCE = 0.1
"""The captures and refreshes may cost this share of the budget more than the cheapest
candidate (the freshest within that wins), past the budget where the per-step part alone
is at or near it."""

OVER_BUDGET_POLAR_STEPS = 3
"""The Newton–Schulz steps of the orthogonalised updates when the five of the default do not
fit the budget: 3/5 of their flops (the smallest singular values then fall short of one,
:mod:`dkfac.solvers.polar`, which the eigenbasis preconditioning before them makes up for)."""

ONE_SIDED_SHARE = 0.5
"""A side of a layer whose rotations into and out of its basis cost more than this share of
the layer's training step keeps the identity as its basis (one-sided, as ``basis_max_dim``
makes it; :func:`basis_limit`): the rotations by a side ``s`` are ``4·a·g·s`` flops against
the step's ``6·rows·a·g``, so a side wider than ``0.75 · rows``. Measured on ``dkfac bench
suite``'s autoencoder (64-256-64-16, batch 256): its 256-wide sides one-sided took 20 and 20
steps to the target instead of 22 and 20, at 2.7x AdamW's step instead of 3.2x; the MLP's
128-wide sides (under the limit) lost a step when one-sided (6 against 5)."""


def basis_limit(rows: int) -> int:
    """The widest side a layer that sees ``rows`` rows a step keeps a basis for
    (:data:`ONE_SIDED_SHARE`); at least 1 (an expert of a mixture may see one row)."""
    return max(1, int(1.5 * ONE_SIDED_SHARE * rows))


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
    update (0: none), and the widest side it keeps a basis for (a wider one is one-sided:
    neither rotated nor refreshed, and only its diagonal captured; ``None``: every side; the
    structured one always), and the width of the diagonal blocks a wider side's basis is cut
    into (``basis_block_size``: such a side captures, rotates and refreshes its ``b``-wide
    blocks alone; ``None``: whole bases; never the structured side).

    A unit-wise layer (``units``: the samples its rows come from, > 0) is ``g`` units of
    ``a`` parameters each (BatchNorm's channels, ``a = 2``; a grouped convolution's output
    channels), with no Kronecker basis: its capture forms each sample's ``a·g`` unit
    gradients (``2·rows·a·g``, a weight gradient per sample) and their ``a × a`` products
    (``2·units·g·a²``); it is priced as the default preconditions it
    (:class:`~dkfac.solvers.unitwise_adam.UnitwiseAdamSolver`): its refresh an ``eigh`` per
    unit (``10·g·a³``, as a Kronecker side's), its every step the rotations into and out of
    each unit's basis (``4·g·a²``) and the moments (the natural-gradient solve of another
    method costs less: one product and a Cholesky factorisation per unit)."""

    a: int
    g: int
    rows: int
    a_parts: tuple[int, ...] = ()
    polar_steps: int = 0
    basis_max: int | None = None
    units: int = 0
    block: int | None = None

    def rotated(self) -> tuple[tuple[int, ...], int]:
        """The input side's parts that are rotated (``a_parts``, ``(a,)`` or none) and the
        output side when it is (else 0; a unit-wise layer has none)."""
        if self.units:
            return (), 0
        limit = self.basis_max
        a_parts = self.a_parts or ((self.a,) if limit is None or self.a <= limit else ())
        return a_parts, self.g if limit is None or self.g <= limit else 0

    def width(self, side: int) -> int:
        """The width a rotated side's basis works in: its block where it is cut into
        blocks, else the whole side."""
        return self.block if self.block is not None and side > self.block else side

    def kept(self) -> tuple[list[tuple[int, int]], int]:
        """Each rotated side as ``(side, width)`` (a structured input side's parts whole),
        and the sides' captured products per row: the whole square of a side, its diagonal
        blocks' ``side · width``, or, one-sided, its diagonal alone."""
        a_parts, g = self.rotated()
        sides = [(p, p if self.a_parts else self.width(p)) for p in a_parts]
        if g:
            sides.append((g, self.width(g)))
        if self.a_parts:
            captured = self.a * self.a
        else:
            captured = self.a * self.width(self.a) if a_parts else self.a
        captured += self.g * self.width(self.g) if g else self.g
        return sides, captured


@dataclass(frozen=True)
class Costs:
    """Per-step costs in flops: ``step``, the training step; ``fixed``, the
    preconditioner's every step; ``capture``, the products of one capture of the whole
    batch (a smaller factor batch does its share of them); ``refresh``, one refresh of every
    basis; ``capture_dispatch``, the operations of one capture, whatever its batch."""

    step: float
    fixed: float
    capture: float
    refresh: float
    capture_dispatch: float = 0.0


def layer_costs(layers: Sequence[LayerShape]) -> Costs:
    """The costs of :class:`Costs` counted from the layers (see the module docstring).

    Per Kronecker layer (a unit-wise one as :class:`LayerShape` says): the training step
    is three products (forward, two in the backward) of
    ``2 · rows · a · g`` flops; the fixed part rotates into and out of the basis (four
    products of ``2 · a · g · min(a, g)``-ish, counted as ``4 · a · g · (a + g)``; a
    flattened map's Kronecker input basis ``4 · a · g · (C + P)`` for its side) plus about
    ten elementwise moment operations, and an orthogonalised update three products of
    ``2 · a · g · min(a, g)`` and an addition per Newton–Schulz step; a capture is two
    products ``2 · rows · (a² + g²)`` and two running-average updates; a refresh is a power
    step and a QR per side, counted as ``10 · (a³ + g³)`` in sixteen operations. Each adds
    :data:`DISPATCH_FLOPS`. A side cut into blocks of ``b`` works in them
    (:meth:`LayerShape.kept`): ``b`` in place of its width in the rotations, ``side · b`` in
    place of its square in the capture and ``side · b²`` of its cube in the refresh; a
    one-sided side is captured as its diagonal (``side`` products a row).
    """
    d = DISPATCH_FLOPS
    step = sum(6.0 * x.rows * x.a * x.g + 3 * d for x in layers)
    kron = [x for x in layers if not x.units]
    units = [x for x in layers if x.units]
    kept = [x.kept() for x in kron]
    fixed = sum(
        4.0 * x.a * x.g * sum(width for _, width in sides)
        + 14 * d
        + x.polar_steps * (6.0 * x.a * x.g * min(x.a, x.g) + 4 * d)
        for x, (sides, _) in zip(kron, kept, strict=True)
    ) + sum(4.0 * x.g * x.a**2 + 12 * d for x in units)
    capture = sum(2.0 * x.rows * captured for x, (_, captured) in zip(kron, kept, strict=True))
    capture += sum(2.0 * x.rows * x.a * x.g + 2.0 * x.units * x.g * x.a**2 for x in units)
    refresh = sum(
        10.0 * sum(side * width**2 for side, width in sides) + 16 * d for sides, _ in kept
    ) + sum(10.0 * x.g * x.a**3 + 4 * d for x in units)
    return Costs(step, fixed, capture, refresh, capture_dispatch=4 * d * len(layers))


def min_factor_batch(layers: Sequence[LayerShape], batch: int) -> int:
    """The fewest samples a factor batch is cut to: enough for :data:`MIN_FACTOR_ROWS` rows
    in the layer with the fewest rows per sample (a classifier's head: one; a language
    model's: a sequence's positions), at least :data:`MIN_FACTOR_SAMPLES`, at most
    ``batch``."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    per_sample = min((max(1, x.rows // batch) for x in layers), default=1)
    return min(batch, max(MIN_FACTOR_SAMPLES, math.ceil(MIN_FACTOR_ROWS / per_sample)))


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` chose, and why.

    Attributes:
        factor_batch_size: Samples the factors are built from (``None``: the whole batch).
        factor_update_interval: Steps between factor captures.
        inverse_update_interval: Steps between basis refreshes.
        overhead: The preconditioner's cost over the training step's, as chosen.
        budget: The budget it was chosen within.
        within_budget: Whether the cheapest choice is within the budget (where it is not,
            :func:`choose_for` cuts the Newton–Schulz steps).
        reason: One sentence for ``describe()`` and the log.
        orthogonal_steps: The Newton–Schulz steps of the orthogonalised updates, where
            :func:`choose_for` cut them (``None``: as configured).
        basis_max_dims: The layers with a side wider than :func:`basis_limit` of their rows,
            each with that limit (their wider sides are one-sided); set by the engine's
            budget, which knows the layers' names.
    """

    factor_batch_size: int | None
    factor_update_interval: int
    inverse_update_interval: int
    overhead: float
    budget: float
    within_budget: bool
    reason: str
    orthogonal_steps: int | None = None
    basis_max_dims: dict[str, int] = field(default_factory=dict)


def choose(
    costs: Costs,
    batch: int,
    budget: float,
    fixed_options: Mapping[str, int | None] | None = None,
    min_batch: int | None = None,
) -> Choice:
    """The freshest factor batch and intervals whose overhead is within ``budget``.

    Overhead = ``(fixed + (capture · (b / batch) + capture_dispatch) / factor_interval +
    refresh / inverse_interval) / step``: a smaller factor batch cuts the products of a
    capture, not its operations. Among the candidates (:data:`BATCH_FRACTIONS`,
    :data:`FACTOR_INTERVALS`, :data:`INVERSE_INTERVALS`, an inverse interval at least the
    factor interval, or the factor interval itself where it is longer than all of them) that
    fit, the freshest wins: the least staleness, counted as half a unit per halving of the
    factor batch (the recipes cut it first: 50 of 700 samples on the digits CNN, 8 of 32
    sequences on the language model) and one per doubling of the factor interval or of the
    basis interval over 5 (ties: the larger batch, then the shorter intervals). A candidate
    within :data:`OVER_BUDGET_ALLOWANCE` of the budget over the cheapest one fits too, so
    that when no candidate is within the budget (the per-step part alone is at or near it)
    the captures and refreshes take as little as they can, without the staleness of the
    longest intervals where a fresher one costs a few percent more (a basis every 50 steps
    instead of every 20 took 28 steps instead of 24 to the residual CNN's target, for no
    measurable time). The overhead chosen never falls as the budget grows. A basis interval
    longer than the factor interval is applied with one more refresh at the first factor
    capture after the first step's (:class:`~dkfac.config.schedules.EarlyRefresh`; one
    refresh a run, not priced).

    Args:
        costs: :func:`layer_costs`.
        batch: Samples in a training step.
        budget: The most overhead allowed, e.g. 0.3 for 30% over the training step (> 0).
        fixed_options: ``factor_batch_size`` / ``factor_update_interval`` /
            ``inverse_update_interval`` the user set: kept as given (explicit options win).
        min_batch: The fewest samples a factor batch is cut to (:func:`min_factor_batch`;
            ``None``: :data:`MIN_FACTOR_ROWS` samples).

    Raises:
        ValueError: For a budget or a batch that is not positive, or non-positive costs.
    """
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"overhead budget must be a finite number > 0, got {budget!r}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if costs.step <= 0:
        raise ValueError(f"the training step's cost must be > 0, got {costs.step}")
    fewest = min(batch, MIN_FACTOR_ROWS if min_batch is None else max(1, min_batch))
    fixed = dict(fixed_options or {})
    if "factor_batch_size" in fixed:
        batches = [fixed["factor_batch_size"] or batch]
    else:
        batches = sorted({max(fewest, batch // k) for k in BATCH_FRACTIONS}, reverse=True)
    factor_intervals = list(FACTOR_INTERVALS)
    if "factor_update_interval" in fixed:
        factor_intervals = [fixed["factor_update_interval"] or 1]
    candidates = []
    for b in batches:
        for fi in factor_intervals:
            inverse = (
                [fixed["inverse_update_interval"] or 1]
                if "inverse_update_interval" in fixed
                else [ii for ii in INVERSE_INTERVALS if ii >= fi] or [fi]
            )
            for ii in inverse:
                overhead = (
                    costs.fixed
                    + (costs.capture * min(b, batch) / batch + costs.capture_dispatch) / fi
                    + costs.refresh / ii
                ) / costs.step
                staleness = 0.5 * math.log2(batch / b) + math.log2(fi) + math.log2(max(ii, 5) / 5)
                candidates.append((overhead, staleness, b, fi, ii))
    fixed_share = costs.fixed / costs.step
    within = any(c[0] <= budget for c in candidates)
    cheapest = min(c[0] for c in candidates)
    # the allowance over the cheapest holds within the budget too: a smaller budget then
    # never takes a costlier choice (both bounds grow with it)
    allowed = max(budget, cheapest + OVER_BUDGET_ALLOWANCE * budget)
    fitting = [c for c in candidates if c[0] <= allowed * (1 + 1e-12)]
    overhead, _, b, fi, ii = min(fitting, key=lambda c: (c[1], -c[2], c[3], c[4]))
    early = f" (and at step {fi})" if ii > fi and "inverse_update_interval" not in fixed else ""
    reason = (
        f"factors from {b} of {batch} samples every {fi} step(s), bases every {ii}{early}: "
        f"{overhead:.0%} over the training step (the per-step work alone {fixed_share:.0%}: "
        "rotations, moments, polar factors) "
        + (
            f"within the {budget:.0%} budget"
            if overhead <= budget * (1 + 1e-12)
            else f"over the {budget:.0%} budget: "
            + ("" if within else "no choice fits, so ")
            + "the captures and refreshes take the freshest within "
            f"{OVER_BUDGET_ALLOWANCE * budget:.0%} of the cheapest ({cheapest:.0%})"
        )
        + (f"; kept as given: {', '.join(sorted(fixed))}" if fixed else "")
    )
    return Choice(b if b < batch else None, fi, ii, overhead, float(budget), within, reason)


def choose_for(
    layers: Sequence[LayerShape],
    batch: int,
    budget: float,
    fixed_options: Mapping[str, int | None] | None = None,
) -> Choice:
    """:func:`choose` on the layers' counted costs, with the fewest factor samples of
    :func:`min_factor_batch`; when nothing fits and layers take an orthogonalised update
    with more than :data:`OVER_BUDGET_POLAR_STEPS` steps, those steps are cut to it (the
    per-step work is then counted with them), unless ``orthogonal_steps`` is among the
    ``fixed_options``. The other options are :func:`choose`'s.
    """
    fixed = dict(fixed_options or {})
    polar_fixed = "orthogonal_steps" in fixed
    fewest = min_factor_batch(layers, batch)
    choice = choose(layer_costs(layers), batch, budget, fixed, fewest)
    polar = [x.polar_steps for x in layers if x.polar_steps]
    if polar_fixed or choice.within_budget or max(polar, default=0) <= OVER_BUDGET_POLAR_STEPS:
        return choice
    cut = [
        dataclasses.replace(x, polar_steps=min(x.polar_steps, OVER_BUDGET_POLAR_STEPS))
        if x.polar_steps
        else x
        for x in layers
    ]
    cheaper = choose(layer_costs(cut), batch, budget, fixed, fewest)
    note = (
        f"; the orthogonalised updates in {OVER_BUDGET_POLAR_STEPS} Newton–Schulz steps "
        f"instead of {max(polar)}"
    )
    return dataclasses.replace(
        cheaper, orthogonal_steps=OVER_BUDGET_POLAR_STEPS, reason=cheaper.reason + note
    )
