"""The orthogonal polar factor of an update, by Newton–Schulz iteration (Muon's step).

For an ``m × n`` matrix ``U = P Σ Rᵀ`` (thin SVD, ``k = min(m, n)``), the polar factor is
``O = P Rᵀ``: every non-zero singular value set to 1, the singular vectors kept. Starting
from ``X₀ = U / (‖U‖_F + 1e-7)`` (singular values in [0, 1)), the odd quintic iteration

    Xₜ₊₁ = a Xₜ + (b Xₜ Xₜᵀ + c (Xₜ Xₜᵀ)²) Xₜ,      (a, b, c) = (3.4445, −4.7750, 2.0315)

maps each singular value ``σ`` to ``φ(σ) = aσ + bσ³ + cσ⁵`` and keeps the singular vectors.
These coefficients (Keller Jordan's, also ``torch.optim.Muon``'s) make ``φ`` steep at 0, so
that five steps bring every singular value above 2e-3 of ``‖U‖_F`` into [0.68, 1.21]
(``φ⁵`` on that interval) instead of converging exactly: :func:`newton_schulz` is ``≈ O``,
with the same singular vectors, which is what a Muon step needs. Fewer steps leave the small
singular values short of the band: after three, those above 1.8e-2 of ``‖U‖_F`` land in
[0.68, 1.21] and smaller ones are scaled by about ``a³ ≈ 41`` (a soft polar factor, enough
for an update whose spectrum is already flat, too little for a raw momentum: Muon itself
needs twice the steps to its target with three). It runs on the
wide orientation (``m <= n``; a tall matrix is transposed), so ``X Xᵀ`` is ``k × k``. Its cost is
``steps · (2k²n + 2k³ + 2k²n)`` flops (the Gram matrix, its square and the product), each
step as ``torch.optim.Muon`` takes it: the Gram matrix, then two ``addmm`` that add ``b X
Xᵀ`` and ``a X`` inside the products (in bf16 the sums are then rounded once, not after each
pass: half the error against a float64 iteration, and 5-25% faster here).

:func:`orthogonal_update` scales the polar factor to a chosen root-mean-square entry:
``O`` has ``k`` unit singular values, so ``‖O‖_F = √k`` and its RMS entry is
``√(k / mn) = 1 / √max(m, n)``; ``rms · √max(m, n) · O`` has RMS ``rms`` whatever the shape
(Moonshot's "match the RMS of AdamW" convention, with their 0.2 as one choice of ``rms``).
With ``power`` ``p > 0`` the length follows the update it replaces, per matrix and per
step: for the polar factor of an update ``U`` (Adam's normalised step in K-FAC's
eigenbasis) the RMS entry is ``rms^(1−p) · r^p``, ``r`` the RMS entry of ``U`` itself.
``r`` is about 1 while the moments see more signal than noise (Adam's first step is the
sign of the gradient) and shrinks as they see more noise, so ``p`` is how much of that
shrinking the orthogonalised step takes: ``p = 0`` a fixed length (Muon's), ``p = 1``
Adam's length (the direction of the polar factor, the length of the update it replaces),
``p = ½`` their geometric mean.

:func:`weighted_orthogonal_update` takes the polar factor between positive weights ``W`` of
the update's shape: ``W ⊙ O(U ⊘ W)``, rescaled to RMS ``rms`` (the result is no longer
orthogonal, so its RMS is set exactly; a zero update stays zero). For ``U = W² ⊙ M`` and
``W = l rᵀ`` (a weight per row and per column) it is ``diag(l) O(diag(l) M diag(r))
diag(r)``, the steepest-descent direction of ``⟨M, Δ⟩`` under the spectral norm of
``diag(l)⁻¹ Δ diag(r)⁻¹``; ``W = 1`` is Muon's step. ``orthogonal_split`` of
:mod:`dkfac.solvers.eigen_moments` uses it with ``W`` a power of Adam's scale.

The functions also take a stack of matrices of one shape (``L × m × n``): each is
orthogonalised on its own, as batched products (``bmm``), so that the layers of one shape
cost the dispatched operations of one. That pays on a CPU too (one thread, AVX512-BF16,
three steps): 16 × 128 × 129 in bf16 4.1 ms against 8.0 ms for a loop of single
iterations, 4 × 512 × 129 2.9 against 4.4 ms, 12 × 16 × 65 in float32 0.14 against
0.71 ms, 8 × 64 × 65 0.92 against 1.13 ms (an earlier AVX2 machine measured the float32
stacks of the language model 7-17% slower batched).

**The iteration on the Gram matrix** (:func:`polar_factor`, what the solvers' orthogonalised
updates take): every iterate is ``Xₜ = Pₜ X₀`` with ``Pₜ`` a polynomial in the ``k × k``
Gram matrix ``M₀ = X₀ X₀ᵀ``, so the steps can run on ``k × k`` matrices alone:
``Qₜ = a I + b Mₜ + c Mₜ²``, ``Pₜ₊₁ = Qₜ Pₜ``, ``Mₜ₊₁ = Qₜ Mₜ Qₜ`` (all polynomials in
``M₀``, so they commute), and ``X₀`` is multiplied once, by the last ``P``. That is
``4k²n + (8·steps − 6)k³`` flops against ``steps · (4k²n + 2k³)``: fewer whenever
``n > 1.5 k``, half for a 128 × 1025 layer at three steps (measured on one CPU thread:
2.2 ms against 1.1 ms; 64 × 577: 0.33 against 0.19 ms). The values are the same to the
rounding (exactly the same polynomial of ``X₀``; float32 against a float64 iteration:
2-4e-7 either way, measured). The Gram matrix holds the squares of the singular values, so
it is taken only in float32 and float64 (in bfloat16 a singular value of 0.1 of the largest
would be lost in the rounding of ``M``), and only for matrices whose products are worth more
than the handful of extra dispatched operations (:data:`GRAM_MIN_WORK`).
:func:`newton_schulz` itself stays Muon's iteration on ``X`` (the float32 Muon peer of
``dkfac bench`` runs it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dkfac.solvers.precision import low_precision

__all__ = [
    "GRAM_MIN_WORK",
    "NORM_EPS",
    "NS_COEFFICIENTS",
    "NS_STEPS",
    "gram_pays",
    "newton_schulz",
    "orthogonal_update",
    "polar_dtype",
    "polar_factor",
    "weighted_orthogonal_update",
    "weighted_polar",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""``(a, b, c)`` of the quintic iteration (module notes)."""
NS_STEPS = 5
"""Newton–Schulz steps per update."""
NORM_EPS = 1e-7
"""Added to ``‖U‖_F`` in ``X₀``, so that a zero update stays zero."""
GRAM_MIN_WORK = 64**3
"""The iteration on the Gram matrix (module notes) is taken for a ``k × n`` matrix (``k <=
n``) with ``n > 1.5 k`` and ``k² n`` at least this (a 64 × 64 × 64 product): below it the
matrices are so small that each step costs its dispatched operations, not its flops (a
16 × 65 layer's three steps: about 0.1 ms either way)."""


def newton_schulz(
    matrix: Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """``≈`` the polar factor of ``matrix`` (module notes), in ``matrix``'s dtype.

    Args:
        matrix: The ``m × n`` matrix, or a stack of them (``L × m × n``; each on its own).
        steps: Newton–Schulz steps (>= 1).
        dtype: Precision of the iteration (bf16, as Muon; float64 for a reference).

    Raises:
        ValueError: If ``matrix`` is not 2-D or 3-D, or ``steps < 1``.
    """
    if matrix.dim() not in (2, 3):
        raise ValueError(
            f"newton_schulz needs a 2-D matrix or a 3-D stack, got shape {tuple(matrix.shape)}"
        )
    if steps < 1:
        raise ValueError(f"newton_schulz needs steps >= 1, got {steps}")
    return iterate(matrix, steps, dtype)


def iterate(matrix: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """:func:`newton_schulz` of a matrix, or of a stack as one batched iteration
    (arguments checked by the caller)."""
    a, b, c = NS_COEFFICIENTS
    tall = matrix.shape[-2] > matrix.shape[-1]
    x = (matrix.mT if tall else matrix).to(dtype)
    wide = torch.promote_types(dtype, torch.float32)
    norm = torch.linalg.matrix_norm(x.to(wide), keepdim=True)
    x = x / (norm.to(dtype) + NORM_EPS)
    product, fused = _products(x)
    for _ in range(steps):  # two fused products (addmm: the sum inside the product's
        gram = product(x, x.mT)  # accumulator) instead of two products and five passes
        x = fused(x, fused(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(matrix.dtype)


def _products(x: Tensor) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
    """The product and the fused product-and-sum for a matrix or a stack of ``x``'s rank:
    ``mm``/``addmm`` or ``bmm``/``baddbmm`` (``@`` on a stack dispatches an expand, a view
    and an ``_unsafe_view`` around each ``bmm``: host work on a launch-bound device)."""
    if x.dim() == 2:
        return torch.mm, torch.addmm
    return torch.bmm, torch.baddbmm


def polar_factor(
    matrix: Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """:func:`newton_schulz` of ``matrix`` (a matrix or a stack, arguments as there), run on
    the Gram matrix where that takes fewer flops (module notes: ``n > 1.5 k``, float32 or
    float64, at least :data:`GRAM_MIN_WORK`): the same polynomial of the normalised matrix,
    the same values to the rounding."""
    if matrix.dim() not in (2, 3) or steps < 1 or not gram_pays(matrix, dtype):
        return newton_schulz(matrix, steps, dtype)  # its errors for bad arguments
    return iterate_gram(matrix, steps, dtype)


def gram_pays(matrix: Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`polar_factor` takes the Gram matrix's iteration (module notes)."""
    rows, cols = matrix.shape[-2:]  # min and max, which torch.compile traces, not sorted
    k, n = min(rows, cols), max(rows, cols)
    wide_enough = 2 * n > 3 * k and k * k * n >= GRAM_MIN_WORK
    return wide_enough and dtype in (torch.float32, torch.float64)


def iterate_gram(matrix: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """:func:`iterate`'s polynomial of the normalised matrix, its steps taken on the ``k ×
    k`` Gram matrix (module notes; arguments checked by the caller)."""
    a, b, c = NS_COEFFICIENTS
    tall = matrix.shape[-2] > matrix.shape[-1]
    x = matrix.mT if tall else matrix
    x = x if x.dtype == dtype else x.to(dtype)
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)
    product, fused = _products(x)
    gram = product(x, x.mT)  # M₀
    k = gram.shape[-1]
    scaled_eye = torch.eye(k, dtype=dtype, device=x.device).mul_(a)
    poly: Tensor | None = None
    for step in range(steps):
        q = fused(torch.add(scaled_eye, gram, alpha=b), gram, gram, alpha=c)  # a + bM + cM²
        poly = q if poly is None else product(q, poly)
        if step < steps - 1:
            gram = product(product(q, gram), q)
    assert poly is not None
    x = product(poly, x)
    x = x.mT if tall else x
    return x if x.dtype == matrix.dtype else x.to(matrix.dtype)


def polar_dtype(
    dtype: torch.dtype, device: torch.device, shape: Sequence[int] | None = None
) -> torch.dtype:
    """The precision :func:`orthogonal_update` iterates in for an update of ``dtype`` on
    ``device`` (of ``shape``, a matrix's or a stack's): float64 for float64, else bfloat16
    (Muon's) where the device multiplies bf16 natively and float32 where it does not
    (emulated bf16 is many times slower there), and on a CPU float32 for a matrix whose
    smaller side ``k`` is under 128 (work ``k³``: the Gram matrix's products, and below
    that bf16 does not pay, :func:`~dkfac.solvers.precision.low_precision`)."""
    work = None if shape is None else min(shape[-2:]) ** 3
    return low_precision(device, dtype, work)


def orthogonal_update(
    update: Tensor, rms: float, steps: int = NS_STEPS, power: float = 0.0
) -> Tensor:
    """``rms^(1−power) · r^power · √max(m, n) · polar_factor(update, steps)``: the polar
    factor of ``update`` (or of each matrix of a stack) at an RMS entry of about ``rms``
    (module notes), or with ``power`` in (0, 1] a length that follows ``r``, the RMS entry
    of ``update`` itself (of each matrix of a stack): the polar factor takes the direction,
    ``rms`` and the update it replaces (Adam's normalised step) the length. A zero
    ``update`` stays zero.

    The iteration runs in bfloat16 (Muon's precision: the singular values land in a band
    anyway) where the device multiplies bf16 natively (on a CPU: a matrix at least 128
    on its smaller side), in float32 elsewhere (:func:`polar_dtype`), and in float64
    for a float64 ``update``: a float64 model asks
    for precision, as it gets float64 decompositions (``KFACConfig.eigen_dtype``).
    """
    polar = polar_factor(update, steps, polar_dtype(update.dtype, update.device, update.shape))
    scale = float(rms) * max(update.shape[-2:]) ** 0.5
    if not power:
        return polar * scale
    own = update.square().mean((-2, -1), keepdim=True).sqrt() / float(rms)
    return polar * (own.pow(power) * scale).to(polar.dtype)


def weighted_orthogonal_update(
    update: Tensor, weight: Tensor, rms: float, steps: int = NS_STEPS
) -> Tensor:
    """``W ⊙ newton_schulz(U ⊘ W)`` rescaled to an RMS entry of ``rms`` (module notes), for
    ``update`` ``U`` (a matrix or a stack) and positive ``weight`` ``W`` that broadcasts to
    it; each matrix of a stack is rescaled on its own. The iteration's precision is
    :func:`orthogonal_update`'s.
    """
    return weighted_polar(update / weight, weight, rms, steps)


def weighted_polar(ratio: Tensor, weight: Tensor, rms: float, steps: int = NS_STEPS) -> Tensor:
    """``W ⊙ newton_schulz(ratio)`` rescaled to an RMS entry of ``rms``: the
    :func:`weighted_orthogonal_update` of ``U`` for ``ratio = U ⊘ W``, given that way by a
    caller that has ``U ⊘ W`` for fewer passes than ``U`` (eigen_adam's split). Each
    matrix's own positive scale of ``ratio`` or of ``weight`` drops out (the iteration
    normalises its input, to its ``1e-7``; the result is rescaled)."""
    polar = polar_factor(ratio, steps, polar_dtype(ratio.dtype, ratio.device, ratio.shape))
    weighted = polar * weight
    norm = weighted.square().mean((-2, -1), keepdim=True).sqrt()
    return weighted * (rms / norm.clamp(min=torch.finfo(norm.dtype).tiny))
