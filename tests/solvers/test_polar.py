"""Newton–Schulz polar factors (solvers/polar.py) against the SVD.

Five quintic steps map each singular value ``σ`` of ``U`` to ``φ⁵(σ/‖U‖_F)`` and keep the
singular vectors; in float64 that is checked to rounding against the SVD, in bfloat16 to
bf16's precision, and the band the singular values land in against the exact polar factor.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from dkfac.solvers import polar, precision
from dkfac.solvers.polar import newton_schulz, orthogonal_update, weighted_orthogonal_update
from tests.oracles import quintic_polar


def _matrix(rows: int, cols: int, seed: int, spread: float = 1e-2) -> Tensor:
    """A matrix with singular values spread log-evenly over [spread, 1]."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    p, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    r, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    sigma = torch.logspace(0, torch.log10(torch.tensor(spread)).item(), k, dtype=torch.float64)
    return (p * sigma) @ r.T


SHAPES = [(6, 6), (4, 9), (9, 4), (1, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("steps", [1, 5])
def test_float64_iteration_maps_the_singular_values_by_the_quintic(
    shape: tuple[int, int], steps: int
) -> None:
    u = _matrix(*shape, seed=1)
    got = newton_schulz(u, steps, dtype=torch.float64)
    torch.testing.assert_close(got, quintic_polar(u, steps), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_five_steps_land_in_the_band_around_the_exact_polar_factor(shape: tuple[int, int]) -> None:
    u = _matrix(*shape, seed=2, spread=2e-2)
    got = newton_schulz(u, dtype=torch.float64)
    p, _, rt = torch.linalg.svd(u, full_matrices=False)
    polar = p @ rt
    # The same singular vectors: Pᵀ N R is diagonal, its entries in [0.68, 1.21].
    inner = p.T @ got @ rt.T
    diagonal = torch.diagonal(inner)
    torch.testing.assert_close(inner, torch.diag(diagonal), rtol=0, atol=1e-10)
    assert diagonal.min() > 0.68 and diagonal.max() < 1.21, diagonal
    assert torch.linalg.matrix_norm(got - polar) < 0.35 * torch.linalg.matrix_norm(polar)


def test_bf16_iteration_stays_within_bf16_of_the_exact_one() -> None:
    u = _matrix(32, 48, seed=3).float()
    got = newton_schulz(u)
    assert got.dtype == torch.float32
    want = newton_schulz(u.double(), dtype=torch.float64).float()
    error = torch.linalg.matrix_norm(got - want) / torch.linalg.matrix_norm(want)
    assert error < 5e-2, error


@pytest.mark.parametrize("shape", [(8, 8), (4, 16), (16, 4)], ids=str)
def test_orthogonal_update_has_the_asked_rms(shape: tuple[int, int]) -> None:
    """An orthogonal input is a fixed point up to the quintic's band: RMS within it."""
    q = _matrix(*shape, seed=4, spread=1.0)  # every singular value 1
    got = orthogonal_update(q, 0.3)
    torch.testing.assert_close(got, quintic_polar(q, 5) * 0.3 * max(shape) ** 0.5)
    rms = got.pow(2).mean().sqrt().item()
    assert 0.68 * 0.3 < rms < 1.21 * 0.3


@pytest.mark.parametrize("native", [True, False], ids=["bf16-native", "bf16-emulated"])
def test_orthogonal_update_keeps_float64_and_runs_float32_in_bf16_where_native(
    native: bool, native_bf16: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(For any work: the CPU's minimum is tested in ``test_precision``.)"""
    native_bf16(native)
    monkeypatch.setattr(precision, "CPU_BF16_MIN_WORK", 1)
    u = _matrix(5, 7, seed=5)
    torch.testing.assert_close(orthogonal_update(u, 1.0), quintic_polar(u, 5) * 7**0.5)
    low = orthogonal_update(u.float(), 1.0)
    want = newton_schulz(u.float(), dtype=torch.bfloat16 if native else torch.float32)
    torch.testing.assert_close(low, want * 7**0.5, rtol=0, atol=0)


@pytest.mark.parametrize("steps", [1, 3])
def test_orthogonal_update_takes_the_asked_number_of_steps(steps: int) -> None:
    u = _matrix(6, 9, seed=6)
    got = orthogonal_update(u, 0.5, steps)
    torch.testing.assert_close(got, quintic_polar(u, steps) * 0.5 * 9**0.5, rtol=1e-10, atol=0)
    assert not torch.allclose(got, orthogonal_update(u, 0.5), rtol=1e-3, atol=0)


def test_three_steps_land_in_the_band_above_their_threshold() -> None:
    """The documented soft polar factor: singular values above 1.8e-2 of ``‖U‖_F`` land in
    [0.68, 1.21] after three steps, and one far below it is scaled by about ``a³``."""
    u = _matrix(12, 20, seed=7, spread=1.0)
    p, _, rt = torch.linalg.svd(u, full_matrices=False)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.04, 1e-4])
    v = p @ torch.diag(sigma.double() / sigma.norm()) @ rt  # ‖V‖_F = 1: σ as given
    got = torch.linalg.svdvals(newton_schulz(v, 3, torch.float64))
    want_order = torch.linalg.svdvals(v)
    assert ((got[:-1] >= 0.68) & (got[:-1] <= 1.21)).all(), got
    assert got[-1] == pytest.approx(want_order[-1].item() * 3.4445**3, rel=1e-3)


def test_a_zero_update_stays_zero() -> None:
    assert torch.equal(orthogonal_update(torch.zeros(3, 4), 1.0), torch.zeros(3, 4))
    zero = orthogonal_update(torch.zeros(2, 3, 4), 1.5, power=0.5)
    assert torch.equal(zero, torch.zeros(2, 3, 4))


@pytest.mark.parametrize("power", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(5, 7), (9, 4)], ids=str)
def test_the_length_follows_the_replaced_update_by_its_power(
    shape: tuple[int, int], power: float
) -> None:
    """Each matrix of a stack gets its polar factor at ``rms^(1−p) · r^p``, ``r`` its own
    RMS entry: the fixed ``rms`` at ``p = 0``, its own at ``p = 1``."""
    stack = torch.stack([_matrix(*shape, seed=20 + i) * (i + 1) for i in range(3)])
    got = orthogonal_update(stack, 1.5, 4, power)
    for i in range(3):
        own = stack[i].square().mean().sqrt().item()
        length = 1.5 ** (1 - power) * own**power
        want = quintic_polar(stack[i], 4) * (length * max(shape) ** 0.5)
        torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-12)
        assert got[i].square().mean().sqrt().item() == pytest.approx(length, rel=0.25)


@pytest.mark.parametrize(
    ("matrix", "steps", "match"),
    [
        (torch.ones(3), 5, "2-D"),
        (torch.ones(2, 2, 2, 2), 5, "3-D stack"),
        (torch.ones(2, 2), 0, "steps"),
    ],
)
def test_bad_arguments_are_refused(matrix: Tensor, steps: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        newton_schulz(matrix, steps)


@pytest.mark.parametrize("shape", [(5, 12, 7), (4, 7, 12), (3, 9, 9)])
def test_a_stack_is_each_matrix_on_its_own(shape: tuple[int, int, int]) -> None:
    """A stack (one batched call for the layers of one shape) gives each matrix's own
    polar factor: in float64 to 1e-12 (the batched products may round in another order),
    in bf16 to its rounding; a matrix of the stack that is all zero stays zero."""
    stack = torch.stack([_matrix(*shape[1:], seed=i) for i in range(shape[0])])
    stack[1] = 0.0
    exact = newton_schulz(stack, 4, torch.float64)
    low = orthogonal_update(stack.float(), 0.7, 4)
    assert exact.shape == low.shape == stack.shape
    for i in range(shape[0]):
        want = newton_schulz(stack[i], 4, torch.float64)
        torch.testing.assert_close(exact[i], want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            low[i], orthogonal_update(stack[i].float(), 0.7, 4), rtol=2e-2, atol=2e-2
        )
    assert torch.equal(low[1], torch.zeros(shape[1:]))
    assert not torch.allclose(exact[0], exact[2], atol=1e-3)


def test_bf16_iteration_rounds_each_step_s_sums_once() -> None:
    """``addmm`` adds ``b XXᵀ`` and ``a X`` inside the products' float32 accumulators, so a
    bf16 step rounds once per product; rounded after every elementwise pass (the form
    ``a X + (b G + c G²) X`` written pass by pass) the error against float64 is larger."""
    u = _matrix(64, 200, seed=5).float()
    want = newton_schulz(u.double(), dtype=torch.float64)
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.to(torch.bfloat16)
    x = x / (torch.linalg.matrix_norm(u).to(torch.bfloat16) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x

    def error(got: Tensor) -> float:
        return float(torch.linalg.matrix_norm(got.double() - want) / torch.linalg.matrix_norm(want))

    assert error(newton_schulz(u)) < 0.75 * error(x), (error(newton_schulz(u)), error(x))


@pytest.mark.parametrize("shape", [(5, 12, 7), (4, 7, 12)])
def test_the_batched_iteration_is_each_matrix_on_its_own(
    shape: tuple[int, int, int],
) -> None:
    """A stack is one batched iteration (``polar.iterate`` of the stack, on the Gram matrix
    too); it agrees with each matrix's own iteration: float64 to 1e-12, and float32 to its
    rounding."""
    stack = torch.stack([_matrix(*shape[1:], seed=10 + i) for i in range(shape[0])])
    stack[2] = 0.0
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for form in (polar.iterate, polar.iterate_gram):
            batched = form(stack, 5, dtype)
            assert batched.dtype == stack.dtype and batched.shape == stack.shape
            each = torch.stack([form(matrix, 5, dtype) for matrix in stack])
            torch.testing.assert_close(batched, each, rtol=tol, atol=tol)
    assert torch.equal(polar.iterate(stack, 5, torch.float64)[2], torch.zeros(shape[1:]).double())


@pytest.mark.parametrize("shape", [(4, 9), (9, 4)], ids=str)
def test_a_weighted_polar_factor_with_row_and_column_weights(
    shape: tuple[int, int],
) -> None:
    """With a weight per row and per column (``W = l rᵀ``), ``W ⊙ O(U ⊘ W)`` is ``diag(l)
    O(diag(l)⁻¹ U diag(r)⁻¹) diag(r)`` (products with diagonal matrices and an SVD polar
    factor, float64), rescaled to RMS exactly ``rms``; a constant weight gives the plain
    polar factor's direction (to the iteration's ``1e-7`` added to ``‖U ⊘ W‖_F``)."""
    u = _matrix(*shape, seed=5, spread=0.1)
    gen = torch.Generator().manual_seed(6)
    left = torch.rand(shape[0], generator=gen, dtype=torch.float64) + 0.2
    right = torch.rand(shape[1], generator=gen, dtype=torch.float64) + 0.2
    got = weighted_orthogonal_update(u, left[:, None] * right[None, :], 0.7)
    inner = torch.diag(1 / left) @ u @ torch.diag(1 / right)
    want = torch.diag(left) @ quintic_polar(inner) @ torch.diag(right)
    want = want * (0.7 / want.square().mean().sqrt())
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert got.square().mean().sqrt().item() == pytest.approx(0.7, rel=1e-12)
    plain = weighted_orthogonal_update(u, torch.full(shape, 3.0, dtype=torch.float64), 0.7)
    polar = quintic_polar(u)
    torch.testing.assert_close(
        plain, polar * (0.7 / polar.square().mean().sqrt()), rtol=1e-5, atol=1e-7
    )


def test_a_weighted_stack_is_rescaled_matrix_by_matrix_and_zero_stays_zero() -> None:
    stack = torch.stack([_matrix(5, 7, seed=i) * (i + 1) for i in range(3)])
    stack[1] = 0.0
    weight = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(1)).double() + 0.5
    got = weighted_orthogonal_update(stack, weight, 0.3, 4)
    for i in range(3):
        want = weighted_orthogonal_update(stack[i], weight[i], 0.3, 4)
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[1], torch.zeros(5, 7, dtype=torch.float64))
    assert got[2].square().mean().sqrt().item() == pytest.approx(0.3, rel=1e-12)


GRAM_SHAPES = [(64, 100), (100, 64), (3, 64, 160)]  # k²n >= 64³ and n > 1.5k: the Gram path


@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=str)
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_the_gram_iteration_is_the_quintic_of_the_singular_values(
    shape: tuple[int, ...], steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``polar_factor`` on a wide enough matrix runs on its Gram matrix (spied on), and maps
    each singular value by ``φᵗ`` as the SVD says, to float64 rounding, each matrix of a
    stack on its own."""
    gen = torch.Generator().manual_seed(11)
    u = torch.randn(shape, generator=gen, dtype=torch.float64)
    taken: list[tuple[int, ...]] = []
    real = polar.iterate_gram

    def spy(matrix: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
        taken.append(tuple(matrix.shape))
        return real(matrix, steps, dtype)

    monkeypatch.setattr(polar, "iterate_gram", spy)
    got = polar.polar_factor(u, steps, torch.float64)
    assert taken, "the Gram iteration was not taken"
    mats = u if u.dim() == 3 else u[None]
    want = torch.stack([quintic_polar(m, steps) for m in mats]).reshape(shape)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(got, newton_schulz(u, steps, torch.float64), rtol=1e-9, atol=1e-11)


def test_the_gram_iteration_in_float32_is_as_close_to_float64_as_the_quintic() -> None:
    u = _matrix(64, 300, seed=12, spread=1e-3).float()
    exact = newton_schulz(u.double(), 3, torch.float64)
    gram = (polar.polar_factor(u, 3, torch.float32).double() - exact).abs().max()
    plain = (newton_schulz(u, 3, torch.float32).double() - exact).abs().max()
    assert gram < max(4 * plain, 1e-6), (gram, plain)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((64, 90), torch.float32), ((16, 65), torch.float32), ((64, 100), torch.bfloat16)],
    ids=["square-ish", "small", "bf16"],
)
def test_the_plain_iteration_is_kept_where_the_gram_one_does_not_pay(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    """``n <= 1.5k``, below ``GRAM_MIN_WORK``, or bf16 (the Gram matrix squares the
    singular values): :func:`newton_schulz` itself, bit for bit."""
    u = torch.randn(shape, generator=torch.Generator().manual_seed(13))
    assert torch.equal(polar.polar_factor(u, 3, dtype), newton_schulz(u, 3, dtype))


def test_a_zero_update_stays_zero_on_the_gram_path() -> None:
    assert torch.equal(orthogonal_update(torch.zeros(64, 100), 0.2, 3), torch.zeros(64, 100))


def test_the_gram_path_refuses_what_newton_schulz_refuses() -> None:
    with pytest.raises(ValueError, match="steps >= 1"):
        polar.polar_factor(torch.randn(64, 100), 0, torch.float32)
    with pytest.raises(ValueError, match="2-D matrix or a 3-D stack"):
        polar.polar_factor(torch.randn(64), 3, torch.float32)
