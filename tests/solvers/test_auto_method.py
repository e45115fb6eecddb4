"""``choose_method`` picks what its documented cost rule says, for given shapes."""

from __future__ import annotations

import itertools

import pytest

from dkfac.solvers import make_solver
from dkfac.solvers.lowrank.auto import choose_method


def _documented_costs(d: int, m: int, n: int, f: int, k: int) -> tuple[float, float]:
    """The docstring's table, written out again: (dense Cholesky, low-rank) flops per step."""
    dense = 2 * d**2 * m / f + d**3 / k + 2 * d**2 * n
    lowrank = (2 * d * m**2 + m**3) / k + 4 * d * m * n + 2 * m**2 * n
    return dense, lowrank


def test_wide_linear_small_batch_is_smw_on_both_sides() -> None:
    choice = choose_method(4097, 4096, 128, 128)
    assert (choice.method, choice.a, choice.g) == ("smw", "lowrank", "lowrank")
    assert choice.describe() == "smw(A=lowrank,G=lowrank)"


def test_small_conv_expanded_rows_is_eigen() -> None:
    # 3×3 conv 3→16 with bias, batch 128 at 32×32 expanded: 131072 rows >> 28.
    choice = choose_method(28, 16, 128 * 1024, 128 * 1024)
    assert (choice.method, choice.a, choice.g) == ("eigen", "dense", "dense")
    assert choice.describe() == "eigen"


def test_reduced_conv_mixes_lowrank_input_and_dense_output() -> None:
    # 3×3 conv 512→512 with Reduce Sum at batch 256: A is 4609-dim with 256 rows,
    # G is 512-dim with 256 rows (exactly the margin) but its apply against n=4609 makes
    # low-rank dearer (≈3.10e9 vs ≈2.68e9 flops), so G stays dense inside the SMW solver.
    choice = choose_method(4609, 512, 256, 256)
    dense, lowrank = _documented_costs(512, 256, 4609, 1, 1)
    assert lowrank == pytest.approx(3.10e9, rel=1e-2) and dense == pytest.approx(2.68e9, rel=1e-2)
    assert (choice.method, choice.a, choice.g) == ("smw", "lowrank", "dense")
    assert choice.describe() == "smw(A=lowrank,G=dense)"


def test_margin_boundary() -> None:
    # Cheap enough on both sides, so only the margin decides.
    assert choose_method(1000, 1000, 500, 500).a == "lowrank"
    assert choose_method(1000, 1000, 501, 501).a == "dense"
    assert choose_method(1000, 1000, 501, 501).method == "eigen"
    assert choose_method(1000, 1000, 300, 300, margin=0.25).method == "eigen"


def test_large_dense_layer_switches_to_cholesky() -> None:
    assert choose_method(3000, 3000, 5000, 5000).method == "cholesky"
    assert choose_method(3000, 3000, 5000, 5000, eigen_max_dim=None).method == "eigen"
    assert choose_method(300, 300, 5000, 5000, dense_method="cholesky").method == "cholesky"


@pytest.mark.parametrize("f,k", [(1, 1), (1, 10), (10, 100)])
def test_grid_follows_documented_rule(f: int, k: int) -> None:
    dims = [10, 64, 257, 1025, 4097]
    rows = [1, 8, 32, 128, 256, 2048]
    for a_dim, g_dim, ra, rg in itertools.product(dims, dims, rows, rows):
        choice = choose_method(
            a_dim, g_dim, ra, rg, factor_update_interval=f, inverse_update_interval=k
        )
        kinds = []
        for d, m, n in ((a_dim, ra, g_dim), (g_dim, rg, a_dim)):
            dense, lowrank = _documented_costs(d, m, n, f, k)
            kinds.append("lowrank" if m <= 0.5 * d and lowrank < dense else "dense")
        assert (choice.a, choice.g) == tuple(kinds)
        if "lowrank" in kinds:
            expected = "smw"
        else:
            expected = "cholesky" if max(a_dim, g_dim) > 2048 else "eigen"
        assert choice.method == expected
        make_solver(choice.method)  # every choice names a registered solver


def test_cost_estimates_exposed() -> None:
    choice = choose_method(100, 50, 10, 20, inverse_update_interval=5)
    assert (choice.a_cost.dense, choice.a_cost.lowrank) == pytest.approx(
        _documented_costs(100, 10, 50, 1, 5)
    )
    assert (choice.g_cost.dense, choice.g_cost.lowrank) == pytest.approx(
        _documented_costs(50, 20, 100, 1, 5)
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(a_dim=0), "a_dim"),
        (dict(g_dim=-1), "g_dim"),
        (dict(rows_a=0), "rows_a"),
        (dict(rows_g=1.5), "rows_g"),
        (dict(margin=0.0), "margin"),
        (dict(margin=1.5), "margin"),
        (dict(dense_method="smw"), "dense_method"),
        (dict(eigen_max_dim=0), "eigen_max_dim"),
        (dict(factor_update_interval=0), "factor_update_interval"),
        (dict(inverse_update_interval=True), "inverse_update_interval"),
    ],
)
def test_validation(kwargs: dict, match: str) -> None:
    args = dict(a_dim=10, g_dim=10, rows_a=2, rows_g=2) | kwargs
    with pytest.raises(ValueError, match=match):
        choose_method(**args)
