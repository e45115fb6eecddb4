"""A canonical basis for the null space of a rank-deficient factor, and the rounding floor
of a rotated gradient.

Adam's moments in an eigenbasis (``"eigen_adam"``) normalise each coordinate of the rotated
gradient on its own, so the update depends on the basis itself, not only on its span. Where
a factor is rank-deficient (built from fewer rows than its width: a position embedding
looked up once for the whole batch, a factor subsample narrower than its layer) its
numerically zero eigenvalues are rounding, and an eigendecomposition or a power step picks
any orthonormal basis of that null space: two runs whose factors differ by rounding (a
batch against the same batch accumulated in two halves) get unrelated bases there, and
Adam's per-coordinate steps in them differ by the size of a whole step.

:func:`canonical_null_basis` replaces those columns by a basis that is a continuous
function of the range alone: with ``Q_r`` the columns of the ``r`` eigenvalues above
``n · ε · d_max`` (``ε`` of the factor's dtype), ``Y = (I − Q_r Q_rᵀ) Ω`` for a fixed
Gaussian ``n × (n − r)`` matrix ``Ω`` (seeded by ``n``), orthonormalised by QR with a positive
diagonal of ``R``. Rounding in ``Q_r`` then moves the null basis by rounding only.

:func:`null_indicators` and :func:`rounding_floor` are the other half. Where the gradient
has no component (the null space of a factor built from the same rows) the rotated
gradient holds rounding of about ``ε · ‖R‖_F``, which Adam's normalisation would blow up to
whole steps. In the coordinates of a null direction of either factor (``null_g[i]`` or
``null_a[j]``, kept in the solver state beside a basis that has a null space),
``φ = ROUNDING_FLOOR · ‖√v‖_F`` is added to Adam's ``ε``: about 1e-3 of the layer's norm, so
rounding moves such a coordinate by about a thousandth of a step (a larger floor, measured on
a GPT-2's position embedding, brought an accumulated batch and the unaccumulated one to
AdamW's 1e-6 after three steps; 2¹⁰ ε left 1e-5). Directions outside the null spaces, and
every layer of full rank, are untouched.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "ROUNDING_FLOOR",
    "canonical_null_basis",
    "flat_rounding_floor",
    "null_indicators",
    "null_weights",
    "numerical_rank",
    "rounding_floor",
]

ROUNDING_FLOOR = 8192 * torch.finfo(torch.float32).eps
"""The floor added to Adam's ``ε`` in null directions, relative to ``‖√v‖_F`` (module notes)."""


def numerical_rank(values: Tensor, dtype: torch.dtype) -> int:
    """How many of the descending, non-negative ``values`` exceed ``n · ε(dtype) · max``."""
    if values.numel() == 0:
        return 0
    tolerance = values.numel() * torch.finfo(dtype).eps * values[0].clamp(min=0.0)
    return int((values > tolerance).sum())


def canonical_null_basis(
    values: Tensor, basis: Tensor, factor_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(values, basis)`` with the null space in the canonical basis (module notes).

    Args:
        values: Eigenvalues or estimates, descending (``(n,)``).
        basis: The matching orthonormal columns (``(n, n)``).
        factor_dtype: The dtype the factor was stored in (its rounding sets the rank).

    Returns:
        The inputs themselves when the factor has full numerical rank or is zero; else new
        tensors: the values of the null space set to exactly 0, its columns replaced.
    """
    size = basis.shape[-1]
    rank = numerical_rank(values, factor_dtype)
    if rank in (0, size):
        return values, basis
    kept = basis[:, :rank]
    generator = torch.Generator().manual_seed(size)  # on the CPU: the same on every device
    probe = torch.randn(size, size - rank, generator=generator, dtype=basis.dtype)
    probe = probe.to(basis.device)
    for _ in range(2):  # twice: orthogonal to the range to the working precision
        probe = probe - kept @ (kept.T @ probe)
    null, r = torch.linalg.qr(probe)
    null = null * torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(null.dtype)
    values = torch.cat([values[:rank], values.new_zeros(size - rank)])
    return values, torch.cat([kept, null], dim=1)


def null_indicators(dg: Tensor, da: Tensor | None) -> dict[str, Tensor]:
    """``{"null_g", "null_a"}``: 1.0 where a side's value is exactly 0 (its null space after
    :func:`canonical_null_basis`), 0.0 elsewhere; empty when neither side has a null
    direction (the layer's update is then Adam's own).

    Args:
        dg: The output side's values (``(n_g,)``; empty: the identity basis).
        da: The input side's values (``None`` or empty: no null directions looked for).

    A side without values gets one 0.0, which broadcasts over its width.
    """
    sides = []
    for values in (dg, da):
        if values is None or values.numel() == 0:
            sides.append(torch.zeros(1, dtype=dg.dtype, device=dg.device))
        else:
            sides.append((values == 0).to(values.dtype))
    if not any(bool(side.any()) for side in sides):
        return {}
    return {"null_g": sides[0], "null_a": sides[1]}


def null_weights(state: dict[str, Tensor]) -> Tensor | None:
    """1.0 on the coordinates in a null direction of either side, 0.0 elsewhere (``None``
    when the state has no null directions)."""
    if "null_g" not in state:
        return None
    return (state["null_g"][..., :, None] + state["null_a"][..., None, :]).clamp_(max=1.0)


def rounding_floor(v: Tensor, relative: float = ROUNDING_FLOOR) -> Tensor:
    """``relative · ‖√v‖_F`` of each matrix in ``v`` (shaped to broadcast over it).

    ``‖√v‖_F² = Σ v`` is taken as the 1-norm of ``v`` (``v ≥ 0``): the reduction
    :func:`flat_rounding_floor` runs on each layer of a flat vector, so both round alike.
    """
    return torch.linalg.vector_norm(v, 1, dim=(-2, -1), keepdim=True).sqrt_().mul_(relative)


def flat_rounding_floor(
    v: Tensor, sizes: tuple[int, ...], index: Tensor, relative: float = ROUNDING_FLOOR
) -> Tensor:
    """:func:`rounding_floor` of each layer of a flat vector ``v`` (layers of ``sizes``
    entries end to end), repeated to its entries (``index``: the layer of each entry).

    The layers' norms are one multi-tensor norm of ``v``'s slices (a few launches for any
    number of layers), each the norm :func:`rounding_floor` takes of that layer's matrix.
    """
    norms = torch.stack(torch._foreach_norm(v.split(sizes), 1))
    return norms.sqrt_().mul_(relative).index_select(0, index)
