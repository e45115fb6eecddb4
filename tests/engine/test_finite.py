"""all_finite and finite_each against the definition, torch.isfinite(t).all(), on the values
that matter."""

from __future__ import annotations

import pytest
import torch

from dkfac.engine.finite import all_finite, finite_each, gradients_finite

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_entry_anywhere_is_found(dtype: torch.dtype, bad: float) -> None:
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(37, 11, generator=gen).to(dtype)
    assert bool(all_finite(t)) is bool(torch.isfinite(t).all()) is True
    for index in (0, 200, t.numel() - 1):
        broken = t.clone()
        broken.view(-1)[index] = bad
        assert bool(all_finite(broken)) is bool(torch.isfinite(broken).all()) is False


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_of_both_signs_is_found(dtype: torch.dtype) -> None:
    t = torch.tensor([1.0, float("inf"), float("-inf"), 2.0], dtype=dtype)
    assert not bool(all_finite(t))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_large_half_precision_values_are_no_false_alarm(dtype: torch.dtype) -> None:
    # 4096 entries of 6e4 sum past float16's largest value (65504): summed in float32.
    t = torch.full((64, 64), 6.0e4, dtype=dtype)
    assert bool(torch.isfinite(t).all())
    assert bool(all_finite(t))


def test_integer_empty_and_shape() -> None:
    assert bool(all_finite(torch.arange(5)))
    assert bool(all_finite(torch.zeros(0)))
    flag = all_finite(torch.ones(3, 3))
    assert flag.shape == () and flag.dtype == torch.bool


def test_finite_each_is_the_definition_per_tensor() -> None:
    """Mixed dtypes, an integer tensor, complex parts, bad entries anywhere, 0-d and empty."""
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(9, 4, generator=gen).to(dtype) for dtype in DTYPES]
    tensors += [torch.arange(6), torch.tensor(3.0), torch.empty(0, 5)]
    tensors += [torch.randn(3, generator=gen, dtype=torch.complex64) for _ in range(2)]
    tensors += [torch.full((64, 64), 6.0e4, dtype=torch.float16)]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in (0, 3, 5, 7):
            tensors.append(tensors[i].clone())
            tensors[-1].view(-1)[-1] = bad
    broken = tensors[8].clone()
    broken[1] = complex(0.0, float("nan"))
    tensors.append(broken)
    want = [bool(torch.isfinite(t).all()) for t in tensors]
    assert want.count(False) == 13
    got = finite_each(tensors, torch.device("cpu"))
    assert got.dtype == torch.bool and got.tolist() == want
    same = [t for t in tensors if t.dtype == torch.float32]  # no cast: one dtype
    assert finite_each(same, torch.device("cpu")).tolist() == [
        bool(torch.isfinite(t).all()) for t in same
    ]
    with pytest.raises(ValueError, match="at least one tensor"):
        finite_each([], torch.device("cpu"))


def test_fused_finite_each_is_the_definition_per_tensor() -> None:
    """The one-call 1-norms (a CUDA device's path, asked for here on the CPU): bad entries
    anywhere, half-precision values whose total passes 65504, 0-d and empty tensors."""
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(9, 4, generator=gen).to(dtype) for dtype in DTYPES[:3]]
    tensors += [torch.tensor(3.0), torch.empty(0, 5)]
    tensors += [torch.full((64, 64), 6.0e4, dtype=dtype) for dtype in DTYPES[:2]]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in (0, 1, 2, 5):
            tensors.append(tensors[i].clone())
            tensors[-1].view(-1)[7] = bad
    want = [bool(torch.isfinite(t).all()) for t in tensors]
    assert want.count(False) == 12
    got = finite_each(tensors, torch.device("cpu"), fused=True)
    assert got.dtype == torch.bool and got.tolist() == want
    assert finite_each(tensors, torch.device("cpu")).tolist() == want  # the sums agree


def test_fused_finite_each_refuses_what_it_cannot_norm() -> None:
    for other in (torch.ones(3, dtype=torch.float64), torch.arange(3)):
        with pytest.raises(ValueError, match="float16, bfloat16 and float32 tensors, got"):
            finite_each([torch.ones(2), other], torch.device("cpu"), fused=True)


def test_a_sparse_gradient_is_tested_on_its_values() -> None:
    """An ``nn.Embedding(sparse=True)`` gradient: uncoalesced rows (a repeated index) are
    summed first, as the dense gradient holds them."""
    indices = torch.tensor([[0, 2, 2]])
    good = torch.sparse_coo_tensor(indices, torch.tensor([[1.0], [2.0], [3.0]]), (4, 1))
    bad = torch.sparse_coo_tensor(indices, torch.tensor([[1.0], [float("nan")], [3.0]]), (4, 1))
    large = torch.sparse_coo_tensor(indices, torch.tensor([[1.0], [3e38], [3e38]]), (4, 1))
    for tensor in (good, bad, large):
        expected = bool(all_finite(tensor.to_dense()))
        assert bool(all_finite(tensor)) is expected
        assert finite_each([tensor, torch.ones(2)], torch.device("cpu")).tolist() == [
            expected,
            True,
        ]
    assert [bool(all_finite(t)) for t in (good, bad, large)] == [True, False, False]


def test_gradients_finite_skips_absent_ones_and_says_none_without_any() -> None:
    good, bad = torch.ones(3), torch.tensor([1.0, float("nan")])
    for grads, want in (([good, None], True), ([None, bad, good], False)):
        found = gradients_finite(grads)
        assert found is not None
        flag, sharded = found
        assert bool(flag) is want and sharded is False
    assert gradients_finite([None, None]) is None
    assert gradients_finite([]) is None
