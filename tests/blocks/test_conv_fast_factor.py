"""The convolution's A factor built without unfolding equals the unfolded ``RᵀR`` exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.blocks.conv2d import Conv2dBlock, conv_padding, pad_input
from dkfac.blocks.conv_factor import conv_input_factor_sum
from dkfac.blocks.conv_path_choice import (
    UNFOLD_MAX_BYTES,
    auto_path,
    segment_cost,
    shift_cost,
    unfold_cost,
)
from dkfac.blocks.conv_shifts import strip_plan
from dkfac.solvers.lowrank.factor import LowRankRowsAccumulator
from dkfac.solvers.statistics import FactorAccumulator
from tests.oracles import conv_patches_by_hand, with_ones

DT = torch.float64


def unfolded_sum(conv: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Oracle: ``RᵀR`` of the hand-built patch rows (bias column appended) and ``B·T``."""
    patches = conv_patches_by_hand(conv, x)
    rows = patches.reshape(-1, patches.shape[-1])
    if conv.bias is not None:
        rows = with_ones(rows)
    return rows.T @ rows, float(rows.shape[0])


def fast_sum(
    conv: nn.Conv2d, x: torch.Tensor, use_border: bool = False, path: str = "auto"
) -> tuple[torch.Tensor, float]:
    """The fast sum; with ``use_border`` (zero padding mode) the zeros are added inside."""
    inside = use_border and conv.padding_mode == "zeros"
    return conv_input_factor_sum(
        x if inside else pad_input(conv, x),
        conv.kernel_size,  # type: ignore[arg-type]
        conv.stride,  # type: ignore[arg-type]
        conv.dilation,  # type: ignore[arg-type]
        conv.bias is not None,
        zero_padding=conv_padding(conv) if inside else (0, 0, 0, 0),
        path=path,
    )


def check_case(conv: nn.Conv2d, x: torch.Tensor) -> None:
    """Every path (shift only at stride 1), with and without the zero-border hint."""
    expected, count = unfolded_sum(conv, x)
    paths = ["auto", "segment", "unfold"] + (["shift"] if tuple(conv.stride) == (1, 1) else [])
    for path in paths:
        for use_border in (False, True):
            total, fast_count = fast_sum(conv, x, use_border, path)
            assert fast_count == count
            assert total.shape == expected.shape
            torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-10)


KERNELS = [1, 2, 3, 5, (1, 3), (3, 2)]
PADDINGS: list[int | str] = [0, 1, 2, "same", "valid"]
# (stride, padding_mode, bias): every value of each, kept few so the grid stays fast.
COMBINATIONS = [
    (1, "zeros", True),
    (1, "reflect", False),
    (1, "circular", True),
    (2, "zeros", False),
    ((2, 1), "reflect", True),
    ((1, 2), "circular", False),
]


@pytest.mark.parametrize("kernel", KERNELS, ids=str)
@pytest.mark.parametrize("padding", PADDINGS, ids=str)
@pytest.mark.parametrize("dilation", [1, 2])
def test_fast_factor_equals_unfold_grid(kernel: int | tuple[int, int], padding, dilation) -> None:
    torch.manual_seed(0)
    for stride, mode, bias in COMBINATIONS:
        if padding == "same" and stride != 1:
            continue  # torch refuses 'same' with stride
        conv = nn.Conv2d(
            2, 3, kernel, stride=stride, padding=padding, dilation=dilation,
            bias=bias, padding_mode=mode,
        ).to(DT)  # fmt: skip
        x = torch.randn(2, 2, 9, 8, dtype=DT)
        try:
            conv(x)
        except RuntimeError:
            continue  # kernel larger than the (padded) input, or reflect pad too wide
        check_case(conv, x)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kh=st.integers(1, 5),
    kw=st.integers(1, 5),
    sh=st.integers(1, 3),
    sw=st.integers(1, 3),
    dh=st.integers(1, 3),
    dw=st.integers(1, 3),
    ph=st.integers(0, 2),
    pw=st.integers(0, 2),
    mode=st.sampled_from(["zeros", "reflect", "circular", "replicate"]),
    bias=st.booleans(),
    batch=st.integers(1, 3),
    channels=st.integers(1, 3),
    height=st.integers(1, 11),
    width=st.integers(1, 11),
    seed=st.integers(0, 2**16),
)
def test_fast_factor_equals_unfold_property(
    kh: int,
    kw: int,
    sh: int,
    sw: int,
    dh: int,
    dw: int,
    ph: int,
    pw: int,
    mode: str,
    bias: bool,
    batch: int,
    channels: int,
    height: int,
    width: int,
    seed: int,
) -> None:
    conv = nn.Conv2d(
        channels, 2, (kh, kw), stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw),
        bias=bias, padding_mode=mode,
    ).to(DT)  # fmt: skip
    x = torch.randn(
        batch, channels, height, width, dtype=DT, generator=torch.Generator().manual_seed(seed)
    )
    try:
        conv(x)
    except RuntimeError:
        return  # no output position, or a reflect pad wider than the input
    check_case(conv, x)


def test_one_by_one_is_a_plain_channel_product() -> None:
    conv = nn.Conv2d(4, 2, 1).to(DT)
    x = torch.randn(3, 4, 5, 6, dtype=DT)
    total, count = fast_sum(conv, x)
    rows = with_ones(x.permute(0, 2, 3, 1).reshape(-1, 4))
    assert count == 90.0
    torch.testing.assert_close(total, rows.T @ rows, rtol=1e-12, atol=1e-10)


def test_path_choice_follows_the_cost_estimates() -> None:
    """Thin channels on a large plane shift; tiny inputs (all overhead) and wide channels on
    a 4x4 plane (whose blocks cost more to assemble than one product) are unfolded; strided
    convolutions are always unfolded."""
    pad = (1, 1, 1, 1)
    shape = (128, 16, 34, 34)
    costs = [shift_cost(shape, (3, 3), (1, 1), pad), segment_cost(shape, (3, 3), (1, 1), (1, 1))]
    assert costs[0] < min(costs[1], unfold_cost(shape, (3, 3), (1, 1), (1, 1)))
    assert auto_path(shape, (3, 3), (1, 1), (1, 1), pad) == "shift"
    assert auto_path((50, 1, 10, 10), (3, 3), (1, 1), (1, 1), pad) == "unfold"
    assert auto_path((8, 512, 6, 6), (3, 3), (1, 1), (1, 1), pad) == "unfold"
    assert auto_path((128, 16, 34, 34), (3, 3), (2, 2), (1, 1), pad) == "unfold"


def test_a_gpu_unfolds_unless_the_rows_exceed_the_budget() -> None:
    """On CUDA the stride-1 choice is the unfolded product (launches cost, not products)
    while the im2col rows fit :data:`UNFOLD_MAX_BYTES` in the product's precision; beyond,
    the CPU's estimate decides (here the shift path, which copies nothing whole)."""
    pad = (1, 1, 1, 1)
    resnet = (128, 16, 34, 34)  # ResNet-20's first stage at batch 128: 75 MB of rows
    assert auto_path(resnet, (3, 3), (1, 1), (1, 1), pad) == "shift"
    assert auto_path(resnet, (3, 3), (1, 1), (1, 1), pad, "cuda") == "unfold"
    entries = 128 * 32 * 32 * 16 * 9
    assert entries * 4 <= UNFOLD_MAX_BYTES
    # 2.4 GB of float32 rows at batch 4096: over the budget, the CPU's choice.
    wide = (4096, 16, 34, 34)
    assert UNFOLD_MAX_BYTES < 4096 * 32 * 32 * 16 * 9 * 4
    assert auto_path(wide, (3, 3), (1, 1), (1, 1), pad, "cuda") == auto_path(
        wide, (3, 3), (1, 1), (1, 1), pad
    )
    assert auto_path(wide, (3, 3), (1, 1), (1, 1), pad) != "unfold"
    # The precision counts: the same rows in bf16 take half the bytes.
    edge = (UNFOLD_MAX_BYTES // (32 * 32 * 16 * 9 * 2), 16, 34, 34)
    assert auto_path(edge, (3, 3), (1, 1), (1, 1), pad, "cuda", 2) == "unfold"
    assert auto_path(edge, (3, 3), (1, 1), (1, 1), pad, "cuda", 4) != "unfold"


def test_strip_plan_of_a_padded_three_by_three_layer() -> None:
    """8×8 input, 3×3 kernel, padding 1: each border strip needs one kernel row or column.

    Rows 1 and 8 are outside window rows 2 and 0: only shift row u = 0 has a window for
    row 1, and row 8's partners one or two rows down are the zero frame. Columns 1 and 8
    keep only v = 0 (the others land in padding columns), for every u. Corners keep the
    unshifted slot alone (slot index v + 2).
    """
    plan = strip_plan((10, 10), (3, 3), (1, 1), (1, 1, 1, 1))
    assert plan.rows == (1, 8) and plan.cols == (1, 8)
    assert plan.row_mask == ((0.0, 1.0), (0.0, 0.0), (1.0, 0.0))
    assert plan.row_slots == (frozenset({(0, 2), (0, 3), (0, 4)}),) * 2
    assert plan.col_slots == (frozenset({(0, 2), (1, 2), (2, 2)}),) * 2
    assert plan.corner_slots == (frozenset({(0, 2)}),) * 4


def test_fast_factor_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="inputs must be"):
        conv_input_factor_sum(torch.zeros(2, 3, 4), (1, 1), (1, 1), (1, 1), False)
    with pytest.raises(ValueError, match="no output position"):
        conv_input_factor_sum(torch.zeros(1, 1, 2, 2), (3, 3), (1, 1), (1, 1), False)
    with pytest.raises(ValueError, match="path"):
        conv_input_factor_sum(torch.zeros(1, 1, 4, 4), (3, 3), (1, 1), (1, 1), False, path="x")
    with pytest.raises(ValueError, match="stride 1"):
        conv_input_factor_sum(torch.zeros(1, 1, 5, 5), (3, 3), (2, 2), (1, 1), False, path="shift")
    with pytest.raises(ValueError, match="zero_padding"):
        conv_input_factor_sum(
            torch.zeros(1, 1, 4, 4), (3, 3), (1, 1), (1, 1), False, zero_padding=(1, -1, 0, 0)
        )


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
@pytest.mark.parametrize("unbatched", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_capture_input_feeds_dense_sink_the_unfolded_factor(
    padding_mode: str, unbatched: bool, stride: int
) -> None:
    conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode=padding_mode, stride=stride).to(DT)
    block = Conv2dBlock("c", conv)
    x = torch.randn(3, 6, 5, dtype=DT) if unbatched else torch.randn(2, 3, 6, 5, dtype=DT)
    fast, by_rows = FactorAccumulator(), FactorAccumulator()
    assert block.capture_input(x, {"A": fast}) is None
    by_rows.add(block.a_rows(x))
    assert fast.total is not None and by_rows.total is not None
    positions = (30.0 if stride == 1 else 9.0) * (1 if unbatched else 2)
    assert fast.normaliser == by_rows.normaliser == positions
    torch.testing.assert_close(fast.total, by_rows.total, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("unbatched", [False, True])
def test_capture_grad_feeds_dense_sink_the_row_factor(unbatched: bool) -> None:
    """The batched-product G equals scale · Σ rows rowsᵀ of the position-major rows."""
    block = Conv2dBlock("c", nn.Conv2d(3, 4, 3, padding=1).to(DT))
    g = torch.randn(4, 6, 5, dtype=DT) if unbatched else torch.randn(2, 4, 6, 5, dtype=DT)
    fast, by_rows = FactorAccumulator(), FactorAccumulator()
    block.capture_grad(None, g, {"G": fast}, 9.0)
    by_rows.add(block.g_rows(g), 9.0)
    assert fast.total is not None and by_rows.total is not None
    assert fast.normaliser == by_rows.normaliser == (1.0 if unbatched else 2.0)
    torch.testing.assert_close(fast.total, by_rows.total, rtol=1e-12, atol=1e-10)
    flat = (g if not unbatched else g.unsqueeze(0)).permute(0, 2, 3, 1).reshape(-1, 4)
    torch.testing.assert_close(fast.total, 9.0 * flat.T @ flat, rtol=1e-12, atol=1e-10)
    single = FactorAccumulator(DT)
    block.capture_grad(None, g.float(), {"G": single}, 1.0)
    assert single.total is not None and single.total.dtype == DT


def test_capture_input_respects_factor_dtype() -> None:
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(2, 2, 7, 7)
    sink = FactorAccumulator(DT)
    Conv2dBlock("c", conv).capture_input(x, {"A": sink})
    assert sink.total is not None and sink.total.dtype == DT
    expected, _ = unfolded_sum(conv.to(DT), x.to(DT))
    torch.testing.assert_close(sink.total, expected, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_factor_under_autocast_keeps_the_input_dtype(dtype: torch.dtype) -> None:
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(2, 2, 6, 5).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = fast_sum(conv, x)
    assert total.dtype == dtype
    expected, _ = unfolded_sum(conv.to(DT), x.to(DT))
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(total.to(DT), expected, rtol=tolerance, atol=tolerance * 10)


def test_capture_input_skips_a_that_is_not_due() -> None:
    block = Conv2dBlock("c", nn.Conv2d(2, 3, 3).to(DT))
    g_sink = FactorAccumulator()
    assert block.capture_input(torch.randn(1, 2, 5, 5, dtype=DT), {"G": g_sink}) is None
    assert not g_sink.has_data


def test_capture_input_gives_rows_to_low_rank_and_reduced_sides() -> None:
    x = torch.randn(2, 2, 5, 5, dtype=DT)
    conv = nn.Conv2d(2, 3, 3).to(DT)
    low = LowRankRowsAccumulator()
    Conv2dBlock("c", conv).capture_input(x, {"A": low})  # add_sum would raise here
    assert len(low.parts) == 1 and low.parts[0].shape == (18, 19)
    for reduction in ("sum", "subsample"):
        block = Conv2dBlock("c", conv, reduction=reduction, positions=4)
        dense, by_rows = FactorAccumulator(), FactorAccumulator()
        block.capture_input(x, {"A": dense})
        by_rows.add(block.a_rows(x))
        assert dense.total is not None and by_rows.total is not None
        assert dense.normaliser == by_rows.normaliser
        torch.testing.assert_close(dense.total, by_rows.total)


@pytest.mark.parametrize(
    "case",
    [
        dict(kernel_size=3, stride=1, padding=1),
        dict(kernel_size=3, stride=2, padding=1, padding_mode="circular"),
        dict(kernel_size=(2, 3), stride=1, padding="same", dilation=2, bias=False),
        dict(kernel_size=1, stride=2, padding=0),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_preconditioner_factor_equals_patch_formula(case: dict) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 3, **case), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1)).to(DT)
    x = torch.randn(3, 2, 7, 6, dtype=DT)
    pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None)
    out = model(x)
    out.pow(2).sum(dim=(1, 2, 3)).mean().backward()
    pre.step()
    factors = pre.factors()
    hidden = torch.relu(model[0](x)).detach()
    for name, conv, inputs in (("0", model[0], x), ("2", model[2], hidden)):
        expected, count = unfolded_sum(conv, inputs)
        torch.testing.assert_close(factors[name][0], expected / count, rtol=1e-10, atol=1e-12)
