"""Configuration of the K-FAC preconditioner.

Every hyperparameter that may change during training is a :data:`Schedule`: either a constant
or a callable of the preconditioner's step counter (the number of completed ``step()`` calls).
:class:`KFACConfig` is frozen and keyword-only; it validates constants when built and
callable values each time they are resolved, so a bad schedule fails with a message that names
the argument and the step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch

from dkfac import solvers

Schedule: TypeAlias = float | int | Callable[[int], float]

METHODS = solvers.METHODS
FISHER_TYPES = ("empirical", "mc")
STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp", "spngd", "auto")
CONV_REDUCTIONS = (None, "sum", "subsample")

PLACEMENT_COSTS = ("compute", "memory")
OVERLAP_MODES = ("auto", "on", "off")

Method = solvers.MethodName
FisherType = Literal["empirical", "mc"]
RefreshKind = Literal["fixed", "adaptive"]
StrategyName = Literal["replicated", "kaisa", "mem-opt", "dp", "spngd", "auto"]
PlacementCost = Literal["compute", "memory"]
OverlapMode = Literal["auto", "on", "off"]


def _check_range(
    name: str,
    value: float,
    *,
    low: float,
    high: float = math.inf,
    low_inclusive: bool = False,
    high_inclusive: bool = False,
) -> None:
    """Raises ValueError unless ``value`` is a finite number in the given interval."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    ok_low = value >= low if low_inclusive else value > low
    ok_high = value <= high if high_inclusive else value < high
    if not (math.isfinite(value) or high == math.inf) or not (ok_low and ok_high):
        lo = "[" if low_inclusive else "("
        hi = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value!r}")


# name -> (low, high, low_inclusive, high_inclusive, integer)
_SCHEDULE_RANGES: dict[str, tuple[float, float, bool, bool, bool]] = {
    "damping": (0.0, math.inf, False, False, False),
    "factor_decay": (0.0, 1.0, True, False, False),
    "factor_update_interval": (1, math.inf, True, False, True),
    "inverse_update_interval": (1, math.inf, True, False, True),
    "kl_clip": (0.0, math.inf, False, False, False),
    "lr": (0.0, math.inf, True, False, False),
    "bn_damping": (0.0, math.inf, False, False, False),
}


def check_schedule_value(name: str, value: float) -> float:
    """Validates one resolved hyperparameter value against its allowed range.

    Args:
        name: Hyperparameter name, a key of the table of ranges.
        value: The resolved value.

    Returns:
        The value, as an ``int`` for the update intervals and a ``float`` otherwise.

    Raises:
        ValueError: If the value is outside the allowed range or not an integer where one is
            required.
    """
    low, high, low_inc, high_inc, integer = _SCHEDULE_RANGES[name]
    if isinstance(value, torch.Tensor):
        value = value.item()
    _check_range(name, value, low=low, high=high, low_inclusive=low_inc, high_inclusive=high_inc)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if integer:
        if int(value) != value:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        return int(value)
    return float(value)


def resolve(name: str, value: Schedule | None, step: int) -> float | None:
    """Resolves a schedule at ``step`` and validates the result (``None`` passes through)."""
    if value is None:
        return None
    raw = value(step) if callable(value) else value
    try:
        return check_schedule_value(name, raw)
    except (TypeError, ValueError) as err:
        if callable(value):
            raise type(err)(f"{err} (returned by the {name} schedule at step {step})") from None
        raise


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """Hyperparameters of :class:`~dkfac.KFACPreconditioner`.

    Attributes:
        method: How the damped inverse is applied: ``"eigen"`` (exact Tikhonov damping of
            A⊗G through eigendecompositions, SC20), ``"cholesky"`` (factored damping with the
            π-correction), ``"smw"`` (Sherman–Morrison–Woodbury low-rank inverse, SKFAC) or
            ``"auto"`` (chosen per layer from the shapes).
        damping: Tikhonov damping λ > 0, constant or a schedule of the step. The default,
            0.03, is relative to factors on the per-sample Fisher scale; with 1e-3 the
            default ``dkfac train --optimizer kfac`` runs on digits diverged.
        factor_decay: Running-average decay of the factors in [0, 1); 0 keeps only the
            newest factors.
        factor_update_interval: Steps between factor updates (>= 1).
        inverse_update_interval: Steps between inverse updates (>= 1).
        kl_clip: KL-clip constant κ > 0, or ``None`` to disable the clip.
        lr: Learning rate used by the KL-clip (constant or schedule); ``KFACOptimizer`` feeds
            the inner optimizer's current value instead.
        accumulation_steps: Micro-batches (forward/backward passes) per ``step()``.
        fisher: ``"empirical"`` (the training backward feeds the factors) or ``"mc"`` (one
            Monte-Carlo sampled backward through :meth:`KFACPreconditioner.sample_fisher`).
        eigen_dtype: Precision of the eigendecompositions / inversions (SMW's too):
            ``torch.float32``, ``torch.float64`` or ``None`` (default): the factors' dtype,
            at least float32 (a float64 model gets float64 decompositions).
        factor_dtype: Precision the factors are stored in (default: the parameters' dtype).
        capture_dtype: Precision of the inputs of the factor products: activations and
            output gradients are cast to it before their outer products are summed (the
            sums are then stored in ``factor_dtype``). ``None`` (default): ``factor_dtype``.
            ``torch.bfloat16`` about halves the cost of building the factors on GPUs and on
            CPUs with bf16 matrix instructions (AVX512-BF16, AMX; measured 1.6x on
            ResNet-20's factor step), for a relative error of the factors of a few 1e-3
            (products accumulate in fp32; each product's sum is rounded once to bf16).
            Applies to dense Kronecker factors; low-rank (SMW) rows and BatchNorm's
            unit-wise statistics keep ``factor_dtype``.
        skip_layers: Regular expressions; a module whose qualified name or class name
            contains a match of one (``re.search``: anchor with ``^...$`` for a full match)
            is not preconditioned.
        conv_reduction: Spatial reduction of convolution factors: ``None`` (expand
            convention), ``"sum"`` or ``"subsample"`` (SKFAC).
        subsample_positions: Output positions sampled per image for ``"subsample"``.
        factor_batch_size: Build the statistics from the first ``factor_batch_size``
            samples of every micro-batch only (``None``: all of them). The factors stay on
            the per-sample scale; their cost falls in proportion. BatchNorm's unit-wise
            statistics then use the moments of those samples.
        seed: Seed for the Monte-Carlo targets and spatial subsampling (rank ``r`` of a
            process group uses ``seed + r``).
        strategy: Distribution strategy (DESIGN.md section 4; see ``docs/distributed.md``):
            ``"replicated"`` (SC20 / KAISA COMM-OPT), ``"kaisa"`` (gradient-worker fraction
            ``grad_worker_fraction``), ``"mem-opt"`` (KAISA with one gradient worker per
            layer), ``"dp"`` (DP-KFAC), ``"spngd"`` (SP-NGD; takes an unwrapped model and
            averages every gradient itself) or ``"auto"``: the cost model's
            :func:`dkfac.costmodel.select_strategy` picks the fastest strategy that computes
            the exact global-batch update and fits in memory (spngd when the model is not
            wrapped in DDP on several ranks; the rule of
            :func:`dkfac.distributed.strategies.choose_strategy` for models it cannot
            describe).
        grad_worker_fraction: KAISA fraction f in (0, 1] of ranks that precondition each
            layer (``"kaisa"`` only); ``f × world_size`` must divide the world size.
        bucket_bytes: Maximum size in bytes of one flattened communication bucket.
        pack_triangles: Send symmetric factors as upper triangles; ``None`` means on for
            ``"spngd"`` and off otherwise.
        placement_cost: How layers are balanced over inverse owners: ``"compute"``
            (``a_dim³ + g_dim³``) or ``"memory"`` (``a_dim² + g_dim²``).
        unitwise_bn: Precondition affine BatchNorm layers with SP-NGD's unit-wise 2×2
            Fisher per channel (on by default); off leaves them their plain gradient.
        bn_damping: Damping of the unit-wise BatchNorm solve (constant or schedule);
            ``None`` (default) uses ``damping`` itself, i.e. a multiple of 1.
        refresh: When statistics are recomputed: ``"fixed"`` (all of them every
            ``factor_update_interval`` steps) or ``"adaptive"`` (SP-NGD stale statistics:
            each statistic's own interval, doubled when its relative Frobenius change is
            below ``refresh_threshold`` and halved otherwise; ``factor_update_interval``
            is then unused).
        refresh_threshold: α of the adaptive policy, > 0 (SP-NGD's value: 0.1).
        refresh_max_interval: Cap of an adaptive interval, an integer >= 1.
        overlap_comm: Launch each layer's statistic (and, for ``"spngd"``, gradient)
            reduction from the backward hooks, in fixed buckets, so it overlaps the rest of
            the backward (:mod:`dkfac.engine.eager`). Only correct when every rank runs
            every registered layer on every step. ``"auto"`` (default): on when that is
            guaranteed, i.e. several ranks and a ``DistributedDataParallel`` model with
            ``find_unused_parameters=False``; ``"on"``: always (a rank that misses a layer
            raises ``RuntimeError`` in ``step()``); ``"off"``: reduce everything in
            ``step()`` after the ranks agree which layers ran (data-dependent branches).

        moment_beta1: β₁ in [0, 1) of the first moment (``"eigen_adam"``).
        moment_beta2: β₂ in [0, 1) of the second moment (``"ekfac"``, ``"eigen_adam"``).
        moment_eps: ε > 0 added to ``√v̂`` (``"eigen_adam"``).
        moment_bias_correction: Divide the moments by ``1 − βᵗ``.
        moment_nesterov: Nesterov's look-ahead first moment (``"eigen_adam"``).
        basis_refresh: How the eigenbasis is refreshed at the inverse interval: ``"eigh"``
            (a full eigendecomposition) or ``"power"`` (one power-iteration step and a QR
            from the previous basis; the first refresh is a full eigendecomposition).
        moment_carry: What the moments become when the basis is refreshed: ``"reset"``,
            ``"keep_v"`` (the first moment rotated exactly, the second kept, as SOAP does)
            or ``"rotate"`` (the second moment rotated approximately too). Formulas:
            :mod:`dkfac.solvers.eigen_moments`.
    """

    method: Method = "eigen"
    damping: Schedule = 0.03
    factor_decay: Schedule = 0.95
    factor_update_interval: Schedule = 1
    inverse_update_interval: Schedule = 10
    kl_clip: Schedule | None = 1e-3
    lr: Schedule = 0.1
    accumulation_steps: int = 1
    fisher: FisherType = "empirical"
    eigen_dtype: torch.dtype | None = None
    factor_dtype: torch.dtype | None = None
    capture_dtype: torch.dtype | None = None
    skip_layers: tuple[str, ...] = field(default_factory=tuple)
    conv_reduction: str | None = None
    subsample_positions: int = 1
    factor_batch_size: int | None = None
    seed: int = 0
    strategy: StrategyName = "replicated"
    grad_worker_fraction: float = 1.0
    bucket_bytes: int = 25 * 2**20
    pack_triangles: bool | None = None
    placement_cost: PlacementCost = "compute"
    unitwise_bn: bool = True
    bn_damping: Schedule | None = None
    refresh: RefreshKind = "fixed"
    refresh_threshold: float = 0.1
    refresh_max_interval: int = 64
    overlap_comm: OverlapMode = "auto"

    # --- Moments in the Kronecker eigenbasis (method "ekfac" / "eigen_adam"; issue 18).
    # Formulas, refresh and carry rules: dkfac.solvers.eigen_moments.
    moment_beta1: float = 0.9
    moment_beta2: float = 0.95
    moment_eps: float = 1e-8
    moment_bias_correction: bool = True
    moment_nesterov: bool = False
    basis_refresh: solvers.BasisRefresh = "eigh"
    moment_carry: solvers.MomentCarry = "keep_v"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.fisher not in FISHER_TYPES:
            raise ValueError(f"fisher must be one of {FISHER_TYPES}, got {self.fisher!r}")
        for name in _SCHEDULE_RANGES:
            value = getattr(self, name)
            if name in ("kl_clip", "bn_damping") and value is None:
                continue
            if not callable(value):
                check_schedule_value(name, value)
        if self.refresh not in ("fixed", "adaptive"):
            raise ValueError(f"refresh must be 'fixed' or 'adaptive', got {self.refresh!r}")
        _check_range("refresh_threshold", self.refresh_threshold, low=0.0)
        if (
            isinstance(self.refresh_max_interval, bool)
            or not isinstance(self.refresh_max_interval, int)
            or self.refresh_max_interval < 1
        ):
            raise ValueError(
                f"refresh_max_interval must be an integer >= 1, got {self.refresh_max_interval!r}"
            )
        if not isinstance(self.unitwise_bn, bool):
            raise TypeError(f"unitwise_bn must be a bool, got {self.unitwise_bn!r}")
        if (
            isinstance(self.accumulation_steps, bool)
            or not isinstance(self.accumulation_steps, int)
            or self.accumulation_steps < 1
        ):
            raise ValueError(
                f"accumulation_steps must be an integer >= 1, got {self.accumulation_steps!r}"
            )
        if self.eigen_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(
                f"eigen_dtype must be None, torch.float32 or torch.float64, got {self.eigen_dtype}"
            )
        if self.factor_dtype is not None and not self.factor_dtype.is_floating_point:
            raise ValueError(f"factor_dtype must be a floating dtype, got {self.factor_dtype}")
        if self.capture_dtype is not None and (
            not isinstance(self.capture_dtype, torch.dtype)
            or not self.capture_dtype.is_floating_point
        ):
            raise ValueError(
                "capture_dtype must be None or a floating dtype (e.g. torch.bfloat16), "
                f"got {self.capture_dtype!r}"
            )
        if isinstance(self.skip_layers, str):
            object.__setattr__(self, "skip_layers", (self.skip_layers,))
        object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        if not all(isinstance(p, str) for p in self.skip_layers):
            raise TypeError("skip_layers must be a string or a sequence of regex strings")
        for pattern in self.skip_layers:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"skip_layers: {pattern!r} is not a regular expression ({err})"
                ) from None
        if self.conv_reduction not in CONV_REDUCTIONS:
            raise ValueError(
                f"conv_reduction must be one of {CONV_REDUCTIONS}, got {self.conv_reduction!r}"
            )
        if (
            isinstance(self.subsample_positions, bool)
            or not isinstance(self.subsample_positions, int)
            or self.subsample_positions < 1
        ):
            raise ValueError(
                f"subsample_positions must be an integer >= 1, got {self.subsample_positions!r}"
            )
        if self.factor_batch_size is not None and (
            isinstance(self.factor_batch_size, bool)
            or not isinstance(self.factor_batch_size, int)
            or self.factor_batch_size < 1
        ):
            raise ValueError(
                f"factor_batch_size must be None or an integer >= 1, got {self.factor_batch_size!r}"
            )
        if not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        _check_range(
            "grad_worker_fraction",
            self.grad_worker_fraction,
            low=0.0,
            high=1.0,
            high_inclusive=True,
        )
        if (
            isinstance(self.bucket_bytes, bool)
            or not isinstance(self.bucket_bytes, int)
            or self.bucket_bytes < 1
        ):
            raise ValueError(f"bucket_bytes must be an integer >= 1, got {self.bucket_bytes!r}")
        if self.pack_triangles is not None and not isinstance(self.pack_triangles, bool):
            raise TypeError(
                f"pack_triangles must be True, False or None, got {self.pack_triangles!r}"
            )
        if self.overlap_comm not in OVERLAP_MODES:
            raise ValueError(
                f"overlap_comm must be one of {OVERLAP_MODES}, got {self.overlap_comm!r}"
            )
        if self.placement_cost not in PLACEMENT_COSTS:
            raise ValueError(
                f"placement_cost must be one of {PLACEMENT_COSTS}, got {self.placement_cost!r}"
            )
        self._check_moments()

    def _check_moments(self) -> None:
        """Validates the eigenbasis-moment block (messages name the config fields)."""
        for name in ("moment_beta1", "moment_beta2"):
            _check_range(name, getattr(self, name), low=0.0, low_inclusive=True, high=1.0)
        _check_range("moment_eps", self.moment_eps, low=0.0)
        for name in ("moment_bias_correction", "moment_nesterov"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.basis_refresh not in solvers.BASIS_REFRESHES:
            raise ValueError(
                f"basis_refresh must be one of {solvers.BASIS_REFRESHES}, "
                f"got {self.basis_refresh!r}"
            )
        if self.moment_carry not in solvers.MOMENT_CARRIES:
            raise ValueError(
                f"moment_carry must be one of {solvers.MOMENT_CARRIES}, got {self.moment_carry!r}"
            )
