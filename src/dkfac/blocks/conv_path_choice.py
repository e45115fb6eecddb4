"""Which path builds a convolution's input factor: each path's estimated cost, fit on a CPU,
and the choice of ``path="auto"`` (:func:`auto_path`); it steers the choice only, every path
is exact.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from dkfac.blocks.conv_segments import axis_groups, output_size
from dkfac.blocks.conv_shifts import strip_plan

__all__ = ["UNFOLD_MAX_BYTES", "auto_path", "segment_cost", "shift_cost", "unfold_cost"]

# The path estimates below count multiply-adds and weight everything else in them. Fit on 24
# stride-1 shapes (N 8-700, C 1-512, planes 2x2-32x32, 3x3 and 5x5 kernels, with and
# without padding; one thread, ~40 multiply-adds/ns): the picked path's total time is 1.01x
# the fastest path's there and 1.00x on 10 shapes left out of the fit, against 1.24x / 1.06x
# for the earlier shift-or-segment choice without overhead terms (dkfac bench conv-paths,
# benchmarks/results/conv_factor_paths.json). Only steers the path
# choice; every path is exact.
#
# Copying one element (strided copies run at ~1 element/ns, products at 30-40/ns).
COPY_WEIGHT = 30.0
# The shift path ran ~1.4x slower than its count below (the thin strip products and the
# per-shift corrections run far below peak); the count is scaled by it.
SHIFT_OVERHEAD = 1.4
# One dispatched tensor operation (~1 µs): small inputs are all overhead, and the segment
# path issues ~4,000 operations for a 3x3 kernel where the unfolded one issues ~200.
OP_WEIGHT = 40_000.0
# Writing the (D, D) result, per entry: the shift path writes its C x C blocks by strided
# copies, the segment path by index writes and a permuting copy, the unfolded product once.
ASSEMBLY_WEIGHT = {"shift": 100.0, "segment": 400.0, "unfold": 50.0}


def _output_shape(
    shape: Sequence[int],
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[int, int, int, int]:
    """``(N, C, Ho, Wo)`` of a convolution on a padded input of ``shape``."""
    batch, channels, height, width = shape
    out_h = output_size(height, kernel_size[0], stride[0], dilation[0])
    return batch, channels, out_h, output_size(width, kernel_size[1], stride[1], dilation[1])


def segment_cost(
    shape: Sequence[int],
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
) -> float:
    """Estimated cost of the segment path, in multiply-adds (copies, operations weighted)."""
    batch, channels, out_h, out_w = _output_shape(shape, kernel_size, stride, dilation)
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    groups_h = axis_groups(kh, sh, dh, out_h)
    groups_w = axis_groups(kw, sw, dw, out_w)
    covered_h = sum(hi - lo for g in groups_h for lo, hi in g.segments)
    covered_w = sum(hi - lo for g in groups_w for lo, hi in g.segments)
    positions = covered_h * covered_w / 2  # transposes are free
    products = sum(len(g.segments) for g in groups_h) * sum(len(g.segments) for g in groups_w)
    operations = 24 * products / 2 + 170 * len(groups_h) * len(groups_w) / 2
    dim = channels * kh * kw
    return (
        batch * positions * (channels**2 + 2 * COPY_WEIGHT * channels)
        + OP_WEIGHT * operations
        + ASSEMBLY_WEIGHT["segment"] * dim**2
    )


def shift_cost(
    shape: Sequence[int],
    kernel_size: tuple[int, int],
    dilation: tuple[int, int],
    zero_padding: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> float:
    """Estimated cost of :func:`~dkfac.blocks.conv_shifts.flat_factor_sum`, in multiply-adds
    (as above)."""
    batch, channels, height, width = shape
    (kh, kw), (dh, dw) = kernel_size, dilation
    left, right, top, bottom = zero_padding
    real_h, real_w = height - top - bottom, width - left - right
    shifts = (kh * (2 * kw - 1) + kw) / 2  # the non-negative half of the kernel shifts
    strip_rows = min(kh - 1, real_h) * dh  # at most, outside some window and not zero
    strip_cols = min(kw - 1, real_w) * dw
    strips = strip_rows * width + strip_cols * real_h + strip_rows * strip_cols
    # Slots a strip multiplies: in a zero frame about one kernel row or column of them (the
    # other partners are zeros or belong to no window of the strip), else about half.
    slots = max(kh, kw) if any(zero_padding) else kh * (2 * kw - 1) / 2
    plane = height * width
    per_image = (
        shifts * plane * channels**2
        + COPY_WEIGHT * channels * plane
        + strips * (slots * channels**2 + COPY_WEIGHT * channels * (slots + 1))
    )
    # Per shift, the windows' corrections: a few (C × C) passes for each offset pair.
    corrections = 3 * COPY_WEIGHT * (kh * kw) ** 2 / 2 * channels**2
    plan = strip_plan((height, width), kernel_size, dilation, zero_padding)
    strip_count = len(plan.rows) + len(plan.cols) + len(plan.rows) * len(plan.cols)
    strip_products = sum(
        len({u for u, _ in slots_of})
        for slots_of in plan.row_slots + plan.col_slots + plan.corner_slots
    )
    operations = 155 * shifts + 13 * strip_count + 16 * strip_products
    return (
        SHIFT_OVERHEAD * (batch * per_image + corrections)
        + OP_WEIGHT * operations
        + ASSEMBLY_WEIGHT["shift"] * (channels * kh * kw) ** 2
    )


def unfold_cost(
    shape: Sequence[int],
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
) -> float:
    """Estimated cost of the unfolded ``RᵀR`` product, in multiply-adds (as above)."""
    batch, channels, out_h, out_w = _output_shape(shape, kernel_size, stride, dilation)
    kh, kw = kernel_size
    rows = batch * out_h * out_w
    dim = channels * kh * kw
    operations = 4 * batch + 12 * kh * kw + 80  # the unfold works image by image
    return (
        rows * dim**2
        + 2 * COPY_WEIGHT * rows * dim
        + OP_WEIGHT * operations
        + ASSEMBLY_WEIGHT["unfold"] * dim**2
    )


# On a GPU every operation is a kernel launch of several µs against ~30 multiply-adds a ns:
# the unfolded product (~75 operations for a 3x3 kernel with a bias, counted with a
# dispatch mode) beats the shift path (~445) unless its rows are very large. The H200's
# profile of a ResNet-20 factor step (batch 128) spent
# 90 ms of host time in the A captures, about 19 layers x 445 launches; not yet timed
# path by path on a GPU (benchmarks/gpu_runs.sh runs dkfac bench conv-paths there).
UNFOLD_MAX_BYTES = 512 * 2**20
"""The largest im2col rows (``N·Ho·Wo × D`` entries of the product's precision) that
``"auto"`` unfolds on a GPU; the unfold and its position-major copy hold twice that at once.
Larger inputs take the CPU's choice (no unfolded copy at stride 1)."""


@functools.lru_cache(maxsize=256)
def auto_path(
    shape: tuple[int, int, int, int],
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    zero_padding: tuple[int, int, int, int],
    device_type: str = "cpu",
    element_size: int = 4,
) -> str:
    """The path ``"auto"`` takes for a padded input ``shape`` (a pure, cached function).

    A strided convolution is unfolded (its sub-grids share few products; measured on
    ResNet-20). At stride 1 on a CUDA device, the unfolded product while its rows take at
    most :data:`UNFOLD_MAX_BYTES` (``element_size`` bytes an entry): launches, not
    multiply-adds, cost there (see the notes above it). Otherwise the path with the
    smallest :func:`shift_cost`, :func:`segment_cost` or :func:`unfold_cost` (fit on a CPU).
    """
    if stride != (1, 1):
        return "unfold"
    if device_type == "cuda":
        batch, channels, out_h, out_w = _output_shape(shape, kernel_size, stride, dilation)
        entries = batch * out_h * out_w * channels * kernel_size[0] * kernel_size[1]
        if entries * element_size <= UNFOLD_MAX_BYTES:
            return "unfold"
    costs = {
        "shift": shift_cost(shape, kernel_size, dilation, zero_padding),
        "segment": segment_cost(shape, kernel_size, stride, dilation),
        "unfold": unfold_cost(shape, kernel_size, stride, dilation),
    }
    return min(costs, key=costs.__getitem__)
