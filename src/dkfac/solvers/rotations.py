"""Products with the Kronecker eigenbases of the eigenbasis-moment solvers.

A state's bases (``qa``, ``qg``; :mod:`dkfac.solvers.eigen_moments`) may be dense, empty
(the identity of a one-sided layer), block-diagonal (an empty ``*_block`` marker whose last
dimension is the block width) or, on the input side, Kronecker-structured (``qa_channels``,
``qa_positions``, ``qa_order``: :mod:`dkfac.solvers.kron_basis`). The functions here
multiply by each kind, with a leading layer dimension (a stack of layers of one shape)
allowed throughout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dkfac.solvers.base import SolverState
from dkfac.solvers.block_layout import block_bounds
from dkfac.solvers.kron_basis import times_basis
from dkfac.solvers.stacking import matmul

__all__ = [
    "BLOCK_PRODUCT_SHARE",
    "bases",
    "change_basis",
    "dense_side",
    "lowered_bases",
    "rotate",
    "side_block",
    "times_blocks",
    "times_input_basis",
    "transition",
    "with_transposes",
]


def _as(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor.to(dtype)``, without the dispatched call where it is already of ``dtype``
    (a few a rotation, each a call of the dispatcher that does nothing)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def rotate(matrix: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """``left @ matrix @ right``, an empty ``left`` or ``right`` standing for the identity."""
    if left.numel():
        matrix = left @ matrix
    return matrix @ right if right.numel() else matrix


def side_block(state: SolverState, key: str) -> int | None:
    """The block width of the basis ``state[key]`` (``"qa"``/``"qg"``): the last
    dimension of its empty marker ``state[key + "_block"]``, ``None`` for a dense basis
    (module notes: a shape, not a value, so that reading it never waits for a device)."""
    marker = state.get(f"{key}_block")
    return None if marker is None else int(marker.shape[-1])


BLOCK_PRODUCT_SHARE = 0.75
"""A block-diagonal basis is multiplied block by block only when its blocks hold at most
this share of the dense product's flops (``Σ bᵢ² ≤ share · n²``): a side split into one
block and a remainder of a few columns (a 129-wide input side in blocks of 128: the bias
column) saves under 2% of the flops, less than the extra products and the concatenation
cost (measured on the language model)."""


def times_blocks(basis: Tensor, matrix: Tensor, block: int | None, left: bool) -> Tensor:
    """``basis @ matrix`` (``left``) or ``matrix @ basis`` for a square ``basis`` that is
    block-diagonal with blocks of ``block`` (:func:`~dkfac.solvers.statistics.block_bounds`;
    ``None``: dense): one product per block, the zero blocks never multiplied (the whole
    product where that saves little, :data:`BLOCK_PRODUCT_SHARE`; the same value). Both
    may carry a leading layer dimension."""
    size = basis.shape[-1]
    bounds = [] if block is None else block_bounds(size, block)
    if sum((j - i) ** 2 for i, j in bounds) > BLOCK_PRODUCT_SHARE * size * size or not bounds:
        return matmul(basis, matrix) if left else matmul(matrix, basis)
    if left:
        return torch.cat([basis[..., i:j, i:j] @ matrix[..., i:j, :] for i, j in bounds], dim=-2)
    return torch.cat([matrix[..., i:j] @ basis[..., i:j, i:j] for i, j in bounds], dim=-1)


def change_basis(
    matrix: Tensor, state: SolverState, dtype: torch.dtype | None, out: bool = False
) -> Tensor:
    """``Q_Gᵀ M Q_A`` (into the basis), or ``Q_G M Q_Aᵀ`` with ``out``, in ``matrix``'s dtype.

    The dense products run in ``dtype`` (``None``: ``matrix``'s; the module notes on
    rotation precision); the structured input side is cheap and keeps full precision, and
    a state with no dense side (both one-sided) is not rounded at all. A block-diagonal
    side (:func:`side_block`) is multiplied block by block.
    """
    structured = "qa_order" in state
    low = (dtype if dense_side(state) else None) or matrix.dtype
    qg = _as(state["qg"], low)
    half = _as(matrix, low)
    if qg.numel():
        side = qg if out else _transposed(state, "qg", low)
        half = times_blocks(side, half, side_block(state, "qg"), left=True)
    if structured:
        half = _as(half, matrix.dtype)
    return _as(times_input_basis(half, state, transpose=out), matrix.dtype)


def lowered_bases(state: SolverState, dtype: torch.dtype) -> SolverState:
    """``state`` with its dense bases cast to ``dtype`` (the structured input side's parts
    kept): what :func:`change_basis` casts them to, done once for several rotations."""
    lowered = {**state, "qg": state["qg"].to(dtype)}
    if "qa_order" not in state:
        lowered["qa"] = state["qa"].to(dtype)
    return lowered


def bases(state: SolverState) -> SolverState:
    """The dense bases of ``state`` (what :func:`lowered_bases` casts)."""
    return {key: state[key] for key in ("qa", "qg")}


def times_input_basis(matrix: Tensor, state: SolverState, transpose: bool = False) -> Tensor:
    """``matrix @ Q_A`` (or ``@ Q_Aᵀ``) of a state: through the Kronecker structure when
    the state carries its parts (``qa_channels``, ``qa_positions``, ``qa_order``; the same
    product as with the dense ``qa``, for ``(C + P)/(C·P)`` of its cost), else dense (an
    empty ``qa`` is the identity)."""
    if "qa_order" in state:
        channels = _as(state["qa_channels"], matrix.dtype)
        positions = _as(state["qa_positions"], matrix.dtype)
        return times_basis(matrix, channels, positions, state["qa_order"], transpose)
    qa = _as(state["qa"], matrix.dtype)
    if not qa.numel():
        return matrix
    side = _transposed(state, "qa", matrix.dtype) if transpose else qa
    return times_blocks(side, matrix, side_block(state, "qa"), left=False)


def dense_side(state: SolverState) -> bool:
    """Whether a state has a dense basis to multiply by (not both sides the identity, the
    structured input side not counted): only then is a rotation lowered."""
    structured = "qa_order" in state
    return state["qg"].numel() > 0 or (not structured and state["qa"].numel() > 0)


def with_transposes(state: SolverState) -> SolverState:
    """``state`` with the transposes of its dense bases as views (``qg_mT``, ``qa_mT``),
    which the rotations take instead of transposing a basis each step (a view is no
    arithmetic, but a dispatched operation all the same)."""
    extra = {}
    if state["qg"].numel():
        extra["qg_mT"] = state["qg"].mT
    if "qa_order" not in state and state["qa"].numel():
        extra["qa_mT"] = state["qa"].mT
    return {**state, **extra}


def _transposed(state: SolverState, key: str, dtype: torch.dtype) -> Tensor:
    """The transpose of ``state[key]`` in ``dtype``: its view kept by
    :func:`with_transposes` where that is in ``dtype``."""
    kept = state.get(f"{key}_mT")
    if kept is not None and kept.dtype == dtype:
        return kept
    return _as(state[key], dtype).mT


def transition(new: Tensor, old: Tensor) -> Tensor:
    """``Q'ᵀ Q`` from basis ``old`` to ``new`` (of each layer of a stack); empty (the identity)
    when both are identities.

    A side that switches between the identity and a basis (a checkpoint of another
    ``max_dim``) gets that basis itself (or its transpose), the other being the identity.
    """
    if not new.numel() and not old.numel():
        return new
    if not new.numel():
        return old
    if not old.numel():
        return new.mT
    return new.mT @ old
