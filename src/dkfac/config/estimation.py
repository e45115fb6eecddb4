"""The estimation group: :class:`EstimationConfig`, how the curvature statistics are
estimated from the forward and backward passes.

The convolution reductions it accepts come from :mod:`dkfac.blocks.conv_positions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from dkfac.blocks.conv_positions import CONV_REDUCTIONS
from dkfac.config.checks import (
    check_bool,
    check_choice,
    check_dtype,
    check_int,
    check_patterns,
    python_numbers,
    shown,
)
from dkfac.config.schedules import Schedule, check_schedules

__all__ = [
    "FISHER_TYPES",
    "LOSS_AVERAGES",
    "SEED_END",
    "STATISTIC_DTYPES",
    "EstimationConfig",
    "FisherType",
    "LossAverage",
    "statistic_dtype",
]

FisherType = Literal["empirical", "mc"]
FISHER_TYPES: tuple[str, ...] = get_args(FisherType)
LossAverage = Literal["samples", "positions"]
LOSS_AVERAGES: tuple[str, ...] = get_args(LossAverage)

SEED_END = 2**63
"""The first seed refused: rank ``r`` seeds its Monte-Carlo generator with ``seed + r``, and
``torch.Generator.manual_seed`` takes nothing from ``2**64`` on (a seed of ``2**70`` failed
with "Overflow when unpacking long long" at the first ``sample_fisher``)."""

STATISTIC_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
"""The precisions the factors may be stored and their products taken in. Not float16: its
range (6e-8 to 65504) holds neither the sums of a batch's products of inputs of size 100
(Inf) nor the squared output gradients of a small loss (0)."""


def statistic_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The factors' default precision for parameters of ``param_dtype``: the same, but
    float32 for float16 (:data:`STATISTIC_DTYPES`)."""
    return torch.float32 if param_dtype == torch.float16 else param_dtype


@dataclass(frozen=True, kw_only=True)
class EstimationConfig:
    """How the curvature statistics are estimated from the forward and backward passes.

    Attributes:
        fisher: ``"empirical"`` (the training backward feeds the factors) or ``"mc"`` (one
            Monte-Carlo sampled backward through :meth:`KFACPreconditioner.sample_fisher`).
        factor_decay: Running-average decay of the factors in [0, 1); 0 keeps only the
            newest factors.
        accumulation_steps: Micro-batches (forward/backward passes) expected per
            ``step()``: read only where nothing else says which backward is a step's last
            (``overlap_comm`` on a model without DDP) and to estimate a step's rows for
            ``method="smw"`` and ``"auto"`` (the rank bound of a low-rank side; a step with
            more rows keeps them all: :func:`~dkfac.solvers.lowrank.factor.decay_concat`).
            The factors' scale follows the backward passes actually run (counted).
        loss_average: What the training loss is a mean over, which sets the scale of the
            output-gradient factors G (they are kept on the scale of one term of the loss):
            ``"samples"`` (default; a mean over the first dimension, e.g. classification) or
            ``"positions"`` (a mean over every position of every sample, e.g. a language
            model's mean over ``N·T`` tokens: each layer's G is then scaled by its own
            ``(N·T)²`` and the Monte-Carlo loss divides by ``N·T``). With ``"samples"`` on
            a token-mean loss, G is ``T²`` too small and the damping swamps it.
        factor_dtype: Precision the factors are stored in: ``torch.bfloat16``,
            ``torch.float32`` or ``torch.float64`` (:data:`STATISTIC_DTYPES`); ``None``
            (default): the parameters' dtype, float32 for a float16 model.
        capture_dtype: Precision of the inputs of the factor products: activations and
            output gradients are cast to it before their outer products are summed (the
            sums are then stored in ``factor_dtype``); one of :data:`STATISTIC_DTYPES`.
            ``None`` (default): ``factor_dtype``.
            ``torch.bfloat16`` about halves the cost of building the factors on GPUs and on
            CPUs with bf16 matrix instructions (AVX512-BF16, AMX; measured 1.6x on
            ResNet-20's factor step), for a relative error of the factors of a few 1e-3
            (products accumulate in fp32; each product's sum is rounded once to bf16), and
            costs many times float32 where bf16 is emulated (an AVX2 CPU); ``"auto"``:
            bfloat16 where the layer's device multiplies it natively and the model is not
            float64, ``factor_dtype`` elsewhere (:mod:`dkfac.solvers.precision`; decided
            when the preconditioner is built, from the layer's parameters).
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
        seed: Seed (an integer in ``[0, 2**63)``, :data:`SEED_END`) for the Monte-Carlo
            targets and spatial subsampling (rank ``r`` of a process group uses
            ``seed + r``, which a torch generator takes below ``2**64``).
        unitwise_bn: Precondition affine BatchNorm layers with SP-NGD's unit-wise 2×2
            Fisher per channel (on by default); off leaves them their plain gradient.
    """

    fisher: FisherType = "empirical"
    factor_decay: Schedule = 0.95
    accumulation_steps: int = 1
    loss_average: LossAverage = "samples"
    factor_dtype: torch.dtype | None = None
    capture_dtype: torch.dtype | Literal["auto"] | None = None
    skip_layers: tuple[str, ...] = field(default_factory=tuple)
    conv_reduction: str | None = None
    subsample_positions: int = 1
    factor_batch_size: int | None = None
    seed: int = 0
    unitwise_bn: bool = True

    def __post_init__(self) -> None:
        python_numbers(self)
        self._check_estimation()

    def _check_estimation(self) -> None:
        check_choice("fisher", self.fisher, FISHER_TYPES)
        check_schedules(self, ("factor_decay",))
        check_int("accumulation_steps", self.accumulation_steps)
        check_choice("loss_average", self.loss_average, LOSS_AVERAGES)
        check_dtype("factor_dtype", self.factor_dtype, allowed=STATISTIC_DTYPES)
        check_dtype("capture_dtype", self.capture_dtype, allowed=STATISTIC_DTYPES, auto=True)
        object.__setattr__(self, "skip_layers", check_patterns("skip_layers", self.skip_layers))
        check_choice("conv_reduction", self.conv_reduction, CONV_REDUCTIONS)
        check_int("subsample_positions", self.subsample_positions)
        check_int("factor_batch_size", self.factor_batch_size, optional=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.seed >= SEED_END:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {shown(self.seed)}")
        check_int("seed", self.seed, low=0)
        check_bool("unitwise_bn", self.unitwise_bn)
