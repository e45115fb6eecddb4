"""``method="auto"``: the per-layer, per-factor choice between SMW, eigen and Cholesky.

The rule is a pure function of the shapes (:func:`choose_method`), so every rank computes
the same answer and it is unit-tested without a model.

**Cost model** (flops per training step, a multiply-add counts 2; ``d`` is the factor's
dimension, ``m`` the rank its ``U`` will have when inverted — the rows of one factor update,
or the bounded rank of the running concatenation when factors are averaged — and ``n`` the
other factor's dimension; ``f`` and ``k`` are the factor and inverse update intervals):

============  =========================  ============================  ==================
side kind     build (per factor update)  inverse (per inverse update)  apply (every step)
============  =========================  ============================  ==================
dense         ``2 d² m`` (``RᵀR``)       Cholesky ``d³``, eigh ``9 d³``  ``2 d² n``
low-rank      0 (rows are kept)          ``2 d m² + m³``                 ``4 d m n + 2 m² n``
============  =========================  ============================  ==================

so ``cost = build/f + inverse/k + apply``. A factor goes **low-rank** when
``m <= margin · d`` (default ``margin = 0.5``: SMW must at least halve the matrix it works
with) *and* its low-rank cost is below its dense Cholesky cost. If either factor is low-rank
the layer's method is ``"smw"`` (factored π-damping; the other factor, if dense, is inverted
by Cholesky inside the SMW solver). Otherwise the layer is dense and uses ``dense_method``
(default ``"eigen"``, exact Tikhonov damping) unless its larger factor exceeds
``eigen_max_dim`` (default 2048), where the eigendecomposition (≈9·d³, and far slower than
its flop count on CPUs) is replaced by ``"cholesky"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DenseMethod = Literal["eigen", "cholesky"]
LayerMethod = Literal["smw", "eigen", "cholesky"]
SideKind = Literal["lowrank", "dense"]

EIGH_FLOPS_PER_D3 = 9.0
CHOLESKY_INVERSE_FLOPS_PER_D3 = 1.0


@dataclass(frozen=True, kw_only=True)
class SideCost:
    """Estimated flops per step of one factor, dense (Cholesky) and low-rank."""

    dense: float
    lowrank: float


@dataclass(frozen=True, kw_only=True)
class MethodChoice:
    """The outcome of :func:`choose_method` for one layer.

    Attributes:
        method: The layer's solver: ``"smw"``, ``"eigen"`` or ``"cholesky"``.
        a: ``"lowrank"`` or ``"dense"``: how the input factor A is held and inverted.
        g: Likewise for the output-gradient factor G.
        a_cost: The cost estimates of A.
        g_cost: The cost estimates of G.
    """

    method: LayerMethod
    a: SideKind
    g: SideKind
    a_cost: SideCost
    g_cost: SideCost

    def describe(self) -> str:
        """One line for logs and ``describe()`` tables, e.g. ``smw(A=lowrank,G=dense)``."""
        if self.method != "smw":
            return self.method
        return f"smw(A={self.a},G={self.g})"


def dense_side_cost(
    dim: int, rows: int, other_dim: int, *, inverse_flops_per_d3: float, f: int, k: int
) -> float:
    """Flops per step of a dense factor: ``2d²m/f + c·d³/k + 2d²n``."""
    d, m, n = float(dim), float(rows), float(other_dim)
    return 2 * d * d * m / f + inverse_flops_per_d3 * d**3 / k + 2 * d * d * n


def lowrank_side_cost(dim: int, rows: int, other_dim: int, *, k: int) -> float:
    """Flops per step of a low-rank factor: ``(2dm² + m³)/k + 4dmn + 2m²n``."""
    d, m, n = float(dim), float(rows), float(other_dim)
    return (2 * d * m * m + m**3) / k + 4 * d * m * n + 2 * m * m * n


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def choose_method(
    a_dim: int,
    g_dim: int,
    rows_a: int,
    rows_g: int,
    *,
    margin: float = 0.5,
    dense_method: DenseMethod = "eigen",
    eigen_max_dim: int | None = 2048,
    factor_update_interval: int = 1,
    inverse_update_interval: int = 1,
) -> MethodChoice:
    """Picks the solver of one layer and the kind of each factor (rule: module docstring).

    Args:
        a_dim: Dimension of A (bias column included).
        g_dim: Dimension of G.
        rows_a: Columns ``U_A`` will have when inverted (rows of A's update, times the
            number of updates kept by a running concatenation).
        rows_g: Likewise for G.
        margin: A factor may go low-rank only when ``rows <= margin · dim``; in (0, 1].
        dense_method: The method of a layer with no low-rank factor.
        eigen_max_dim: Above this larger factor dimension a dense layer uses Cholesky
            instead of eigen; ``None`` never switches.
        factor_update_interval: Steps between factor updates (>= 1).
        inverse_update_interval: Steps between inverse updates (>= 1).

    Returns:
        The choice, with the cost estimates that decided it.

    Raises:
        ValueError: For a non-positive dimension, row count or interval, a margin outside
            (0, 1], or an unknown ``dense_method``.
    """
    for name, value in (("a_dim", a_dim), ("g_dim", g_dim), ("rows_a", rows_a)):
        _check_positive_int(name, value)
    _check_positive_int("rows_g", rows_g)
    f = _check_positive_int("factor_update_interval", factor_update_interval)
    k = _check_positive_int("inverse_update_interval", inverse_update_interval)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin <= 1:
        raise ValueError(f"margin must be a number in (0, 1], got {margin!r}")
    if dense_method not in ("eigen", "cholesky"):
        raise ValueError(f"dense_method must be 'eigen' or 'cholesky', got {dense_method!r}")
    if eigen_max_dim is not None:
        _check_positive_int("eigen_max_dim", eigen_max_dim)

    def side(dim: int, rows: int, other: int) -> tuple[SideKind, SideCost]:
        cost = SideCost(
            dense=dense_side_cost(
                dim, rows, other, inverse_flops_per_d3=CHOLESKY_INVERSE_FLOPS_PER_D3, f=f, k=k
            ),
            lowrank=lowrank_side_cost(dim, rows, other, k=k),
        )
        lowrank = rows <= margin * dim and cost.lowrank < cost.dense
        return ("lowrank" if lowrank else "dense"), cost

    a_kind, a_cost = side(a_dim, rows_a, g_dim)
    g_kind, g_cost = side(g_dim, rows_g, a_dim)
    method: LayerMethod
    if "lowrank" in (a_kind, g_kind):
        method = "smw"
    elif eigen_max_dim is not None and max(a_dim, g_dim) > eigen_max_dim:
        method = "cholesky"
    else:
        method = dense_method
    return MethodChoice(method=method, a=a_kind, g=g_kind, a_cost=a_cost, g_cost=g_cost)
