"""Eigen-based preconditioning with exact Tikhonov damping of A⊗G (SC20).

With ``A = Q_A Λ_A Q_A^T`` and ``G = Q_G Λ_G Q_G^T`` (eigenvalues clamped at 0),
``V = Q_G [(Q_G^T ∇W Q_A) ⊘ (λ_G λ_A^T + λ)] Q_A^T`` solves ``(A ⊗ G + λI) vec(V) = vec(∇W)``
exactly. Damping enters only at apply time, so a damping schedule takes effect at once.
Layers of one shape are preconditioned in one batched pass (:meth:`EigenSolver.apply_batch`,
their states stacked once between refreshes: :mod:`dkfac.solvers.stacking`), a few calls
for the group instead of ten a layer (a GPU step is launches). A refresh decomposes the
factor sides of one width together, of any layer and either side (:meth:`EigenSolver.compute_batch`:
one batched ``eigh`` a width).

A factor with many exactly zero rows (the inputs or outputs of dead ReLU units) has as many
equal zero eigenvalues, and LAPACK's divide-and-conquer ``eigh`` then fails to converge in
float32 (a 1000-wide factor with half its units dead does), or returns non-finite
eigenvectors without an error (the digits autoencoder's 251- and 501-wide input factors at
the first step). ``F + δI`` has the same
eigenvectors and eigenvalues ``λ + δ``: :func:`symmetric_eigh` retries once with
``δ = 1e-6 · mean(diag F)`` and subtracts it, rather than leave the whole layer to the
solver's float64 retry (twice the cost, paid on the first step of the digits autoencoder).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.solvers.base import Solver, SolverError, SolverState
from dkfac.solvers.stacking import StateStack, matmul, stack_key, stacked_calls

_Prepared = tuple[
    tuple[Tensor, ...], tuple[torch.dtype, float], tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
]
"""``(state tensors, (dtype, damping), prepared)``: :meth:`EigenSolver._prepared`'s last."""

SHIFT = 1e-6
"""The relative diagonal shift of :func:`symmetric_eigh`'s retry (module notes)."""


def symmetric_eigh(
    matrix: Tensor, dtype: torch.dtype, checked: bool = True
) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD matrix in ``dtype``
    (or of each of a stack of them: one batched call, one check).

    Retries once on ``F + δI`` when LAPACK does not converge or returns non-finite
    eigenvectors (module notes); without ``checked`` the eigenvectors are not read on the
    host (only a raised error retries; the caller checks the result on the device). A stack
    that fails is decomposed matrix by matrix, and a matrix that fails there too gets NaN
    values and vectors (which its layer's check refuses) rather than failing the others.

    Raises:
        torch.linalg.LinAlgError: If the shifted matrix fails too.
    """
    sym = matrix.to(dtype)
    sym = (sym + sym.mT) / 2
    try:
        values, vectors = torch.linalg.eigh(sym)
        if checked and not bool(torch.isfinite(vectors).all()):  # LAPACK's other way of failing
            raise torch.linalg.LinAlgError("non-finite eigenvectors")
    except torch.linalg.LinAlgError:
        if sym.dim() > 2:  # a stack: each matrix is tried again on its own
            pairs = [_eigh_or_nan(one, dtype, checked) for one in sym.unbind(0)]
            return torch.stack([v for v, _ in pairs]), torch.stack([q for _, q in pairs])
        shift = SHIFT * float(torch.diagonal(sym).abs().mean()) or SHIFT
        eye = torch.eye(len(sym), dtype=dtype, device=sym.device)
        values, vectors = torch.linalg.eigh(sym + shift * eye)
        values = values - shift
    return values.clamp(min=0.0), vectors


def _eigh_or_nan(matrix: Tensor, dtype: torch.dtype, checked: bool) -> tuple[Tensor, Tensor]:
    """:func:`symmetric_eigh` of one matrix of a stack, or NaN values and vectors where it
    fails (its layer's check then refuses its state; the stack's other matrices keep
    theirs)."""
    try:
        return symmetric_eigh(matrix, dtype, checked)
    except torch.linalg.LinAlgError:
        nan = torch.full_like(matrix, float("nan"))
        return nan[..., 0], nan


class EigenSolver(Solver):
    """Eigendecomposition solver: state ``qa, da, qg, dg``."""

    name = "eigen"

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(compute_dtype)
        self._state_stack = StateStack()
        self._last_prepared: _Prepared | None = None

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Eigendecomposes both factors (``damping`` is applied later, in :meth:`apply`)."""
        return self.with_retry(lambda dtype: self._states([a], [g], dtype)[0])

    def _states(
        self, a: Sequence[Tensor], g: Sequence[Tensor], dtype: torch.dtype
    ) -> list[SolverState]:
        """The states of the factor pairs ``(a[i], g[i])`` in ``dtype``, the sides of one
        size (of any layer, either side) as one batched ``eigh``
        (:func:`~dkfac.solvers.stacking.stacked_calls`), each stored in its factor's dtype."""
        checked = self.host_checks
        sides = [*a, *g]
        found = stacked_calls(
            [((tuple(side.shape), side.dtype), (side,)) for side in sides],
            lambda key, matrix: symmetric_eigh(matrix, dtype, checked),
        )
        states = []
        for i, one in enumerate(a):
            (da, qa), (dg, qg) = found[i], found[len(a) + i]
            pairs = {"qa": qa, "da": da, "qg": qg, "dg": dg}
            states.append({key: value.to(one.dtype) for key, value in pairs.items()})
        return states

    def refresh_key(
        self, stats: Mapping[str, Any], previous: SolverState | None
    ) -> Hashable | None:
        """The class, the compute dtype and both factors' dtypes and device: equal keys
        share :meth:`compute_batch` (whose sides of one size are decomposed together)."""
        del previous
        a, g = stats["A"], stats["G"]
        if not (isinstance(a, Tensor) and isinstance(g, Tensor)):
            return None
        return (type(self), self.compute_dtype, a.dtype, g.dtype, a.device)

    def compute_batch(
        self,
        stats: Sequence[Mapping[str, Any]],
        damping: float,
        previous: Sequence[SolverState | None],
    ) -> list[SolverState | SolverError]:
        """:meth:`compute` of every layer, the sides of one size (any layer, either side)
        as one batched ``eigh`` (a matrix that fails alone retried alone, as
        :func:`symmetric_eigh` does); a layer whose state fails is refreshed alone, the
        others keeping theirs (:meth:`~dkfac.solvers.base.Solver.batch_once`)."""
        if len(stats) == 1:
            return super().compute_batch(stats, damping, previous)
        a = [one["A"] for one in stats]
        g = [one["G"] for one in stats]
        return self.batch_once(
            lambda dtype: self._states(a, g, dtype),
            lambda i: self.compute_statistics(stats[i], damping, previous[i]),
            len(stats),
        )

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """``Q_G [(Q_Gᵀ ∇W Q_A) ⊘ (λ_G λ_Aᵀ + λ)] Q_Aᵀ``; every tensor may carry a leading
        layer dimension (a stack of layers of one shape: :meth:`apply_batch`)."""
        qa, qg, qa_t, qg_t, denominator = self._prepared(state, grad.dtype, damping)
        rotated = matmul(matmul(qg_t, grad), qa)
        rotated = rotated / denominator
        return matmul(matmul(qg, rotated), qa_t)

    def _prepared(
        self, state: SolverState, dtype: torch.dtype, damping: float
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``Q_A``, ``Q_G``, their transposes (views) and ``λ_G λ_Aᵀ + λ`` of ``state`` in
        ``dtype``: the last ones again while the state holds the very same tensors (states
        are replaced at a refresh, never changed in place) and the damping and dtype are
        the same, else made anew (three passes and two transposes a step saved between
        refreshes)."""
        tensors = tuple(state[key] for key in ("qa", "qg", "da", "dg"))
        last = self._last_prepared
        if (
            last is not None
            and all(a is b for a, b in zip(last[0], tensors, strict=True))
            and last[1] == (dtype, damping)
        ):
            return last[2]
        qa, qg, da, dg = (tensor.to(dtype) for tensor in tensors)
        value = (qa, qg, qa.mT, qg.mT, dg.unsqueeze(-1) * da.unsqueeze(-2) + damping)
        self._last_prepared = (tensors, (dtype, damping), value)
        return value

    def batch_key(self, state: SolverState, grad: Tensor) -> Hashable | None:
        """The class, the gradient's shape, dtype and device and every state tensor's
        name, shape and dtype: equal keys share :meth:`apply_batch`."""
        return None if grad.dim() != 2 else (type(self), *stack_key(state, grad))

    def apply_batch(
        self,
        states: Sequence[SolverState],
        moments: Sequence[SolverState | None],
        grads: Sequence[Tensor],
        damping: float,
        *,
        advance: Tensor | None = None,
    ) -> list[tuple[Tensor, SolverState | None]]:
        """:meth:`apply` of several layers of equal :meth:`batch_key` on their stacked
        states and gradients (the states' stack kept between refreshes, and held by the
        states as slices: :class:`~dkfac.solvers.stacking.StateStack`)."""
        if len(states) == 1:
            return super().apply_batch(states, moments, grads, damping, advance=advance)
        stacked = self._state_stack.stacked(states)
        update = self.apply(stacked, torch.stack(list(grads)), damping)
        return [(layer, None) for layer in update.unbind(0)]
