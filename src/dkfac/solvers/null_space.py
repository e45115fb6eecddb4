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

:func:`canonical_null_basis` replaces those columns by a basis that is a continuous function
of the range alone: with ``Q_r`` the columns of the ``r`` eigenvalues above ``n · ε ·
d_max`` (``ε`` of the factor's dtype), ``Y = (I − Q_r Q_rᵀ) Ω`` for the last ``n − r``
columns ``Ω`` of a fixed Gaussian ``n × n`` matrix (seeded by ``n``), orthonormalised by QR
with a positive diagonal of ``R`` (the QR of ``[Q_r, Ω]`` does both). Rounding in ``Q_r``
then moves the null basis by rounding only. The rank is never needed on the host:
:func:`masked_null_basis` computes the basis in fixed shapes (a full-width QR, the columns
selected by a mask), so a refresh on a GPU does not wait for it;
:func:`canonical_null_basis` reads the ranks first and skips that QR where no factor is
singular (the same values). ``Ω`` is kept on the device once per width and dtype (memory:
one ``n × n`` matrix per distinct factor width).

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
    "any_null",
    "canonical_null_basis",
    "flat_rounding_floor",
    "marked_last",
    "masked_null_basis",
    "null_indicators",
    "null_masks",
    "null_weights",
    "numerical_rank",
    "numerical_ranks",
    "rounding_floor",
]

ROUNDING_FLOOR = 8192 * torch.finfo(torch.float32).eps
"""The floor added to Adam's ``ε`` in null directions, relative to ``‖√v‖_F`` (module notes)."""


def _above_rounding(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Which of ``values`` (each vector of its last dimension) exceed ``n · ε(dtype) · max``:
    the range's, in any order."""
    size = values.shape[-1]
    tolerance = size * torch.finfo(dtype).eps * values.amax(dim=-1, keepdim=True).clamp(min=0.0)
    return values > tolerance


def marked_last(marked: Tensor) -> Tensor:
    """The order of each vector's entries (its last dimension) that puts the ``marked`` ones
    last, every entry otherwise in its order (a stable partition)."""
    return torch.argsort(marked.to(torch.uint8), dim=-1, stable=True)


def numerical_ranks(values: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`numerical_rank` of each vector of ``values`` (its last dimension; any leading
    ones), as an int64 tensor on their device: no host read."""
    if values.shape[-1] == 0:
        return torch.zeros(values.shape[:-1], dtype=torch.int64, device=values.device)
    return _above_rounding(values, dtype).sum(dim=-1)


def numerical_rank(values: Tensor, dtype: torch.dtype) -> int:
    """How many of the non-negative ``values`` exceed ``n · ε(dtype) · max``."""
    return int(numerical_ranks(values, dtype))


def canonical_null_basis(
    values: Tensor, basis: Tensor, factor_dtype: torch.dtype, *, check: bool = True
) -> tuple[Tensor, Tensor]:
    """``(values, basis)`` with the null space in the canonical basis (module notes).

    Args:
        values: Eigenvalues or estimates (``(n,)``; or ``(L, n)``: a stack), descending as
            an ``eigh`` gives them, or in any order (a power step's): the null columns are
            found wherever they lie and replaced in their places.
        basis: The matching orthonormal columns (``(n, n)``; or ``(L, n, n)``).
        factor_dtype: The dtype the factor was stored in (its rounding sets the rank).
        check: Read the ranks on the host (one read for a stack) and return the inputs
            themselves when every factor has full numerical rank or is zero; ``False``:
            no host read, :func:`masked_null_basis` whatever the ranks (the same values).

    Returns:
        The inputs themselves when (``check``) no factor is singular; else new tensors:
        the range's columns as they were, the null space's values set to exactly 0 and its
        columns replaced, each in its place (the canonical basis is built with the range's
        columns first, then put back).
    """
    size = basis.shape[-1]
    if size == 0:
        return values, basis
    above = _above_rounding(values, factor_dtype)
    ranks = above.sum(dim=-1)
    if check and all(rank in (0, size) for rank in ranks.reshape(-1).tolist()):
        return values, basis
    order = marked_last(~above)  # range first
    values, basis = masked_null_basis(
        values.gather(-1, order), basis.gather(-1, order.unsqueeze(-2).expand_as(basis)), ranks
    )
    places = torch.argsort(order, dim=-1)  # every column back in its place
    return values.gather(-1, places), basis.gather(-1, places.unsqueeze(-2).expand_as(basis))


def masked_null_basis(values: Tensor, basis: Tensor, ranks: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`canonical_null_basis` in fixed shapes, for any ranks held on the device.

    Column ``j >= r`` of the canonical basis is the ``j``-th column of the orthonormal
    factor of ``[Q_r, Ω_r, …, Ω_{n−1}]`` (``Ω`` a fixed Gaussian ``n × n`` matrix seeded by
    ``n``, the diagonal of ``R`` made positive), which is the orthonormalisation of
    ``P Ω_r, …`` in order (``P = I − Q_r Q_rᵀ``: the QR removes ``Q_r``'s span from each
    later column itself, to the working precision of a Householder QR, so ``P`` is never
    formed; projecting first cost four ``n³`` products, 23 ms of 31 for the digits CNN's
    577-wide side in float32, for the same columns to the rounding): one full-width QR,
    selected by the mask ``j >= r`` with ``torch.where``, so that ``r`` is never read. A
    factor of full rank (``r = n``) or zero (``r = 0``) keeps its values and basis bit for
    bit.

    Args:
        values: ``(…, n)`` values, the ``r`` of the range first.
        basis: ``(…, n, n)`` their orthonormal columns.
        ranks: ``(…)`` int64 numerical ranks (:func:`numerical_ranks`).
    """
    size = basis.shape[-1]
    rank = ranks.unsqueeze(-1)
    columns = torch.arange(size, device=basis.device)
    keep = (columns < rank) | (rank == 0)  # (…, n)
    keep_columns = keep.unsqueeze(-2)
    probe = _probe(size, basis.dtype, basis.device)
    q, r = torch.linalg.qr(torch.where(keep_columns, basis, probe))
    signs = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(q.dtype)
    null = q * signs.unsqueeze(-2)
    return torch.where(keep, values, 0.0), torch.where(keep_columns, basis, null)


_PROBES: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _probe(size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``Ω``, the fixed Gaussian ``size × size`` matrix of :func:`masked_null_basis`: drawn
    on the CPU (the same on every device), copied to ``device`` once per size and dtype
    (to a CUDA device through pinned memory, without waiting: a refresh never waits)."""
    key = (size, dtype, device)
    if key not in _PROBES:
        generator = torch.Generator().manual_seed(size)
        probe = torch.randn(size, size, generator=generator, dtype=dtype)
        if device.type == "cuda":
            probe = probe.pin_memory().to(device, non_blocking=True)
        _PROBES[key] = probe.to(device)
    return _PROBES[key]


def null_masks(dg: Tensor, da: Tensor | None) -> dict[str, Tensor]:
    """``{"null_g", "null_a"}``: 1.0 where a side's value is exactly 0 (its null space after
    :func:`canonical_null_basis`), 0.0 elsewhere, whether or not any side has a null
    direction (no host read).

    Args:
        dg: The output side's values (``(n_g,)``; empty: the identity basis).
        da: The input side's values (``None`` or empty: no null directions looked for).

    A side without values gets one 0.0, which broadcasts over its width. ``dg`` and ``da``
    may carry a leading layer dimension (a stack of layers of one shape).
    """
    sides = []
    for values in (dg, da):
        if values is None or values.numel() == 0:
            sides.append(torch.zeros((*dg.shape[:-1], 1), dtype=dg.dtype, device=dg.device))
        else:
            sides.append((values == 0).to(values.dtype))
    return {"null_g": sides[0], "null_a": sides[1]}


def any_null(masks: dict[str, Tensor]) -> Tensor:
    """A 0-d bool tensor: whether :func:`null_masks` marks any direction (no host read);
    of a stack's masks, one a layer."""
    return (masks["null_g"].sum(-1) + masks["null_a"].sum(-1)) > 0


def null_indicators(dg: Tensor, da: Tensor | None) -> dict[str, Tensor]:
    """:func:`null_masks`, or empty when neither side has a null direction (the layer's
    update is then Adam's own): one host read."""
    masks = null_masks(dg, da)
    return masks if bool(any_null(masks)) else {}


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
