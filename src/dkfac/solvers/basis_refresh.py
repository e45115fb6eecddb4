"""The eigenbases of a refresh: a full decomposition, a low-rank one from the range, and
one power-iteration step from the previous basis (:mod:`dkfac.solvers.eigen_moments`'s
module notes say when each is taken)."""

from __future__ import annotations

import torch
from torch import Tensor

from dkfac.solvers.eigen import symmetric_eigh
from dkfac.solvers.null_space import marked_last

__all__ = ["RANGE_MIN_DIM", "RANGE_TOLERANCE", "descending_eigh", "power_refresh", "range_eigh"]


def descending_eigh(
    matrix: Tensor, dtype: torch.dtype, checked: bool = True
) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD matrix, largest first
    (``checked``: as :func:`~dkfac.solvers.eigen.symmetric_eigh` takes it)."""
    values, vectors = symmetric_eigh(matrix, dtype, checked)
    return values.flip(-1), vectors.flip(-1)


RANGE_MIN_DIM = 512
"""Factors at least this wide try :func:`range_eigh` at their first decomposition."""
RANGE_TOLERANCE = 1e-5
"""Largest ``(tr F − tr B) / tr F`` :func:`range_eigh` accepts (rounding, not rank)."""


def range_eigh(matrix: Tensor, dtype: torch.dtype, rank: int) -> tuple[Tensor, Tensor] | None:
    """``(d, Q)`` of a symmetric PSD matrix of rank at most ``rank``, else ``None``.

    A factor built from ``r`` rows (the first capture of a wide layer whose factors are
    built from a subsample, ``factor_batch_size``) has rank ``<= r``. Then the first ``rank``
    columns ``Y`` of the complete QR of ``F Ω``, for a fixed Gaussian ``n × rank`` matrix
    ``Ω``, span the range of ``F``, the Ritz pairs of ``B = Yᵀ F Y`` are its non-zero
    eigenpairs, and the QR's other columns (orthogonal to ``Y``) hold the zero ones:
    ``O(n² · rank)`` instead of an ``n³`` ``eigh`` (measured 32-37 against 85-250 ms at
    ``n = 1000``, where a singular factor also sends ``eigh`` to its retries). The check is
    exact and free: for a PSD ``F``, ``tr F − tr B = tr((I − YYᵀ) F (I − YYᵀ)) >= 0``, zero
    exactly when the range of ``F`` lies in the span of ``Y``; above ``RANGE_TOLERANCE · tr
    F`` the rank was higher and ``None`` is returned. ``F`` is taken as symmetric (the
    factors are sums of ``RᵀR``; an asymmetry of rounding size moves nothing).

    Args:
        matrix: The ``n × n`` factor.
        dtype: Precision of the computation and of the result.
        rank: The rank to try (``< n``).

    Returns:
        Eigenvalues (descending, clamped at 0) and eigenvectors, or ``None``.
    """
    sym = matrix.to(dtype)
    size = sym.shape[0]
    generator = torch.Generator(device=sym.device).manual_seed(size)
    probe = torch.randn(size, rank, generator=generator, dtype=dtype, device=sym.device)
    basis, _ = torch.linalg.qr(sym @ probe, mode="complete")
    span = basis[:, :rank]
    projected = span.T @ (sym @ span)
    total = torch.trace(sym)
    missed = float(total - torch.trace(projected))
    if not missed <= RANGE_TOLERANCE * float(total.abs()):  # also NaN
        return None
    values, vectors = torch.linalg.eigh((projected + projected.T) / 2)
    basis[:, :rank] = span @ vectors.flip(1)  # the same span: still orthogonal to the rest
    values = torch.cat([values.flip(0).clamp(min=0.0), values.new_zeros(size - rank)])
    return values, basis


def power_refresh(
    matrix: Tensor, previous: Tensor, dtype: torch.dtype, rank: int | None = None
) -> tuple[Tensor, Tensor]:
    """One step of subspace iteration from the basis ``previous``: ``(estimates, Q)``.

    ``Q = qr(F Q_prev)`` with the signs of its columns chosen so that ``diag R > 0``;
    estimates the Rayleigh quotients of the new columns, ``diag(Qᵀ F Q)`` clamped at 0. Each
    column keeps the place of the previous basis's column it follows, so moments kept
    across the refresh (``"keep_v"``) still belong to it: a column ``F`` sends to rounding
    (its direction now in ``F``'s null space) is taken last in the QR, where it becomes the
    null space's completion, and put back in its place (in the QR's order it became a
    direction of rounding, and the columns after it were mixed into it). ``F`` is taken as
    symmetric. The old basis's quotients ``diag(Q_prevᵀ F Q_prev)`` are no estimates of the
    new columns where ``F Q_prev`` is singular (a factor of low rank whose range moved): the
    QR fills those columns with rounding, and an old quotient of 1e-4 of the largest there
    left them out of the null space (:func:`~dkfac.solvers.null_space.canonical_null_basis`
    finds it by the estimates, wherever it lies), whose rounding floor keeps Adam from
    turning rounding into whole steps (2.0 from the same run on two ranks after 20 steps,
    1e-4 with the new columns' quotients). The quotients cost one more ``2n²k`` product.

    With ``rank = k < n`` only the leading ``k`` columns follow ``F``: ``Y = qr(F Q_prev[:,
    :k])`` (the same ``k`` columns as the full step, since a QR's first columns depend only
    on the first columns of its matrix), and the other ``n − k`` columns are the orthonormal
    completion of ``Y`` that the same Householder reflectors give (a basis of the orthogonal
    complement unrelated to the previous one), each with the estimate ``(tr F − Σ top
    estimates) / (n − k)``. Cost ``2n²k`` for the product and about ``4n²k`` for the
    reflectors and completion, instead of ``2n³ + (8/3)n³``: at ``n = 1000``, ``k = 256``,
    23-27 against 67-82 ms here.

    ``matrix`` and ``previous`` may carry a leading layer dimension (a stack of layers of
    one shape, refreshed in one batched call) when ``rank`` is ``None``.
    """
    sym = matrix.to(dtype)
    size = sym.shape[-1]
    kept = size if rank is None else min(rank, size)
    if kept < size and sym.dim() > 2:
        raise ValueError("power_refresh takes a stack of matrices only with the full rank")
    product = sym @ previous.to(dtype)[..., :kept]
    order = _vanished_last(product)
    product = product.gather(-1, order.unsqueeze(-2).expand_as(product))
    reflectors, tau = torch.geqrf(product)  # what torch.linalg.qr runs, R on the diagonal
    if kept < size:  # the k reflectors, applied to all n columns: the span and its completion
        padded = reflectors.new_zeros(size, size)
        padded[:, :kept] = reflectors
        reflectors = padded
    q = torch.linalg.householder_product(reflectors, tau)
    signs = torch.diagonal(reflectors, dim1=-2, dim2=-1)[..., :kept] < 0
    q[..., :kept].mul_(torch.where(signs, -1.0, 1.0).to(dtype).unsqueeze(-2))
    places = torch.argsort(order, dim=-1)  # each column back to its previous column's place
    new = q[..., :kept].gather(-1, places.unsqueeze(-2).expand(*q.shape[:-1], kept))
    q[..., :kept] = new
    top = (new * (sym @ new)).sum(dim=-2).clamp(min=0.0)
    if kept == size:
        return top, q
    rest = (torch.trace(sym) - top.sum()).clamp(min=0.0) / (size - kept)
    return torch.cat([top, rest.expand(size - kept)]), q


def _vanished_last(product: Tensor) -> Tensor:
    """The order of ``F Q_prev``'s columns that puts those ``F`` sends to rounding (norm at
    most ``n · ε · max``: a previous column now in ``F``'s null space) last, the others
    keeping theirs: the QR then spans the range with the others first, and takes the null
    space's completion for the vanished ones, instead of a direction of rounding that the
    columns after it are mixed into."""
    norms = torch.linalg.vector_norm(product, dim=-2)
    tolerance = product.shape[-2] * torch.finfo(product.dtype).eps
    return marked_last(norms <= tolerance * norms.amax(dim=-1, keepdim=True))
