"""``capture_dtype``: factor products from bf16 inputs, sums stored in the factor dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACConfig, KFACPreconditioner
from dkfac.app.cli import parse_args
from dkfac.app.runconfig import kfac_config_from_args
from dkfac.blocks.base import Rows
from dkfac.blocks.conv2d import Conv2dBlock
from dkfac.blocks.conv_factor import conv_input_factor_sum
from dkfac.solvers.statistics import FactorAccumulator
from tests.oracles import conv_patches_by_hand, with_ones

BF16 = torch.bfloat16
# bf16 keeps 8 significant bits: inputs and each product's sum are rounded once (relative
# 2^-9 each), so a factor is off by a few 1e-3 in relative Frobenius norm.
TOLERANCE = 1e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖_F / ‖want‖_F`` in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def oracle_sum(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``RᵀR`` of the hand-built patch rows (bias column appended), in float64."""
    patches = conv_patches_by_hand(conv.double(), x.double())
    rows = with_ones(patches.reshape(-1, patches.shape[-1]))
    return rows.T @ rows


@pytest.mark.parametrize(
    ("stride", "padding", "path"),
    [(1, 1, "shift"), (1, 1, "segment"), (1, 0, "shift"), (2, 1, "segment"), (2, 1, "unfold")],
)
def test_conv_sum_from_bf16_products_is_close_to_the_exact_sum(
    stride: int, padding: int, path: str
) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 4, 3, stride=stride, padding=padding)
    x = torch.randn(5, 6, 9, 8)
    total, count = conv_input_factor_sum(
        x,
        (3, 3),
        (stride, stride),
        (1, 1),
        True,
        zero_padding=(padding,) * 4,
        path=path,
        compute_dtype=BF16,
        out_dtype=torch.float32,
    )
    exact = oracle_sum(conv, x)
    assert total.dtype == torch.float32 and count == exact[-1, -1].item()
    error = relative_error(total, exact)
    assert 0 < error < TOLERANCE  # > 0: the products really ran in bf16
    full, _ = conv_input_factor_sum(
        x, (3, 3), (stride, stride), (1, 1), True, zero_padding=(padding,) * 4, path=path
    )
    assert relative_error(full, exact) < 1e-5  # the default is the input's precision


def test_accumulator_casts_rows_for_the_product_and_stores_in_its_dtype() -> None:
    rows = torch.randn(50, 7)
    sink = FactorAccumulator(torch.float32, BF16)
    sink.add(Rows(rows, 50.0), scale=2.0)
    sink.add(Rows(rows, 50.0))
    assert sink.compute_dtype == BF16
    assert sink.total is not None and sink.total.dtype == torch.float32
    exact = 3.0 * rows.double().T @ rows.double()
    assert 0 < relative_error(sink.total, exact) < TOLERANCE
    assert FactorAccumulator(torch.float64).compute_dtype == torch.float64


def test_conv_gradient_factor_sums_bf16_products_in_the_storage_dtype() -> None:
    block = Conv2dBlock("c", nn.Conv2d(2, 5, 3))
    grad = torch.randn(8, 5, 6, 6)
    sink = FactorAccumulator(torch.float32, BF16)
    block.capture_grad(None, grad, {"G": sink}, 4.0)
    flat = grad.double().permute(0, 2, 3, 1).reshape(-1, 5)
    assert sink.total is not None and sink.total.dtype == torch.float32
    assert 0 < relative_error(sink.total, 4.0 * flat.T @ flat) < TOLERANCE


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),  # stride 1: the unfold-free sum
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),  # strided: unfolded rows
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),  # rows
    )


def _factors(**options: object) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    model = _model()
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    pre = KFACPreconditioner(model, factor_decay=0.0, **options)  # type: ignore[arg-type]
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return pre.factors()


def test_preconditioner_factors_from_bf16_products_match_the_fp32_ones() -> None:
    exact = _factors()
    fast = _factors(capture_dtype=BF16)
    assert set(fast) == set(exact) and len(exact) == 3
    for name, pair in exact.items():
        for got, want in zip(fast[name], pair, strict=True):
            assert got.dtype == torch.float32
            assert 0 < relative_error(got, want) < TOLERANCE, name


@pytest.mark.parametrize("bad", [torch.int64, torch.bool, "bfloat16", 16])
def test_capture_dtype_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="capture_dtype"):
        KFACConfig(capture_dtype=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("option", ["factor_dtype", "capture_dtype"])
def test_float16_statistics_are_refused_when_built(option: str) -> None:
    # float16's largest number is 65504 and its smallest 6e-8: the sums of a batch's
    # products of inputs of size 100 were Inf, the squared output gradients of a small
    # loss were 0.
    allowed = r"torch\.bfloat16, torch\.float32, torch\.float64, got torch\.float16"
    with pytest.raises(ValueError, match=f"{option} must be .*{allowed}"):
        KFACConfig(**{option: torch.float16})  # type: ignore[arg-type]


def _linear_factors(dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The factors of one step of a model of ``dtype`` (float16-rounded weights and
    inputs), on inputs of size 100 and a loss a hundredth of a mean squared error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).half().to(dtype)
    x = (100 * torch.randn(32, 6)).half().to(dtype)
    y = torch.randn(32, 3)
    pre = KFACPreconditioner(model, factor_decay=0.0)
    (F.mse_loss(model(x).float(), y) / 100).backward()
    pre.step()
    return pre.factors()


def test_a_float16_model_keeps_float32_factors_as_its_float32_twin() -> None:
    want = _linear_factors(torch.float32)
    got = _linear_factors(torch.float16)
    assert set(got) == set(want) == {"0", "2"}
    for name, pair in want.items():
        for side, (a, b) in zip("AG", zip(got[name], pair, strict=True), strict=True):
            assert a.dtype == torch.float32, (name, side)
            # the activations and gradients themselves are float16: 2^-11 each
            assert relative_error(a, b) < 1e-2, (name, side)


def test_capture_dtype_flag() -> None:
    assert kfac_config_from_args(parse_args(["train"])).capture_dtype is None
    args = parse_args(["train", "--optimizer", "kfac", "--capture-dtype", "bfloat16"])
    assert kfac_config_from_args(args).capture_dtype == BF16
