"""The copy-free stride-1 path of the convolution input factor: one product per kernel shift
over the flattened input, corrected by thin border strips (:func:`flat_factor_sum`).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Slot", "StripPlan", "flat_factor_sum", "strip_plan"]


Slot = tuple[int, int]  # (kernel row shift u, column slot v + kw - 1) of a kernel shift


@dataclass(frozen=True)
class StripPlan:
    """The border strips :func:`flat_factor_sum` corrects with, and the shifts each needs.

    Attributes:
        rows: Real rows of the padded plane that lie outside some window's rows.
        cols: Real columns that lie outside some window's columns.
        row_mask: ``(kh, len(rows))`` 0/1: row outside window row ``i``.
        col_mask: ``(kw, len(cols))`` 0/1: column outside window column ``j``.
        row_slots: Per row strip, the shift slots to multiply.
        col_slots: Per column strip (real rows only), the shift slots to multiply.
        corner_slots: Per ``(row, column)`` position (rows outer), the shift slots.
    """

    rows: tuple[int, ...]
    cols: tuple[int, ...]
    row_mask: tuple[tuple[float, ...], ...]
    col_mask: tuple[tuple[float, ...], ...]
    row_slots: tuple[frozenset[Slot], ...]
    col_slots: tuple[frozenset[Slot], ...]
    corner_slots: tuple[frozenset[Slot], ...]


@functools.lru_cache(maxsize=256)
def strip_plan(
    plane: tuple[int, int],
    kernel_size: tuple[int, int],
    dilation: tuple[int, int],
    zero_padding: tuple[int, int, int, int],
) -> StripPlan:
    """Which strips and shift slots :func:`flat_factor_sum` multiplies (a pure function).

    A strip needs slot ``(u, v)`` only if some window ``(i, j)`` of that shift (``i + u <
    kh``, ``0 <= j + v < kw``) excludes it, and not every partner of its real positions
    lies in the zero frame; the rest of its products are zero or unused.

    Args:
        plane: ``(height, width)`` of the zero-padded plane.
        kernel_size: ``(kh, kw)``.
        dilation: ``(d_h, d_w)``.
        zero_padding: ``(left, right, top, bottom)`` zeros of the plane.
    """
    (height, width), (kh, kw), (dh, dw) = plane, kernel_size, dilation
    left_pad, right_pad, top_pad, bottom_pad = zero_padding
    out_h, out_w = height - dh * (kh - 1), width - dw * (kw - 1)
    real_rows = range(top_pad, height - bottom_pad)
    real_cols = range(left_pad, width - right_pad)

    def in_frame(r: int, c: int, u: int, v: int) -> bool:
        """Whether the flat partner of ``(r, c)`` at shift ``(u, v)`` is a frame zero.

        A partner past the plane is read as the next image's row (the last image's is the
        zero margin), one before it as the previous image's: never wrongly called zero.
        """
        row, col = divmod((r + u * dh) * width + c + v * dw, width)
        real = top_pad <= row % height < height - bottom_pad and left_pad <= col < width - right_pad
        return not real

    def needed(
        own: list[tuple[int, int]], rows_in: list[int], cols_in: list[int]
    ) -> frozenset[Slot]:
        """Slots of a strip outside window rows ``rows_in`` and window columns ``cols_in``."""
        slots = set()
        for u in range(kh):
            for v in range(-(kw - 1), kw):
                if u == 0 and v < 0:
                    continue  # the transpose of shift (0, -v)
                lo, hi = max(0, -v), min(kw, kw - v)
                if not any(i < kh - u for i in rows_in) or not any(lo <= j < hi for j in cols_in):
                    continue  # no window (i, j) of this shift subtracts the strip
                if not all(in_frame(r, c, u, v) for r, c in own):
                    slots.add((u, v + kw - 1))
        return frozenset(slots)

    rows_out = [{r for r in real_rows if not i * dh <= r < i * dh + out_h} for i in range(kh)]
    cols_out = [{c for c in real_cols if not j * dw <= c < j * dw + out_w} for j in range(kw)]
    rows = sorted(set().union(*rows_out))
    cols = sorted(set().union(*cols_out))
    every_i, every_j = list(range(kh)), list(range(kw))
    outside_i = {r: [i for i in every_i if r in rows_out[i]] for r in rows}
    outside_j = {c: [j for j in every_j if c in cols_out[j]] for c in cols}
    return StripPlan(
        rows=tuple(rows),
        cols=tuple(cols),
        row_mask=tuple(tuple(float(r in out) for r in rows) for out in rows_out),
        col_mask=tuple(tuple(float(c in out) for c in cols) for out in cols_out),
        row_slots=tuple(needed([(r, c) for c in real_cols], outside_i[r], every_j) for r in rows),
        col_slots=tuple(needed([(r, c) for r in real_rows], every_i, outside_j[c]) for c in cols),
        corner_slots=tuple(
            needed([(r, c)], outside_i[r], outside_j[c]) for r in rows for c in cols
        ),
    )


def flat_factor_sum(
    inputs: Tensor,
    kernel_size: tuple[int, int],
    dilation: tuple[int, int],
    zero_padding: tuple[int, int, int, int] = (0, 0, 0, 0),
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    into: Tensor | None = None,
) -> Tensor:
    """``Σ ā ā^T`` (no bias) of a stride-1 convolution by one product per kernel shift.

    With the channels-last input flattened to ``X`` (``N·Hp·Wp × C`` rows, position ``p``),
    a kernel shift ``(u, v)`` (offset pair ``(i, j), (i + u, j + v)``) pairs position ``p``
    with ``p + δ``, ``δ = u·d_h·Wp + v·d_w``. ``F_δ = X[:L]^T X[δ:δ+L]`` (zeros past the
    end) is one copy-free product over every position. The block of offsets ``(i, j)`` sums
    only its window (rows ``[i·d_h, i·d_h + Ho)``, columns ``[j·d_w, j·d_w + Wo)``), inside
    which ``p + δ`` is the same image's patch entry, so by inclusion-exclusion::

        block = F_δ − Σ_{r ∉ rows} R_r − Σ_{c ∉ cols} K_c + Σ_{r ∉ rows, c ∉ cols} P_{r,c}

    where ``R_r`` is the product over row ``r``, ``K_c`` over column ``c`` and ``P_{r,c}``
    over position ``(r, c)``, all with the same flat partner ``p + δ`` as ``F_δ``. Rows and
    columns in the zero padding contribute nothing and are skipped; for a padded ``k × k``
    kernel about one row and column per window remain. A strip is multiplied only with the
    shifts that some window it lies outside of uses and whose partners are not all in the
    zero frame (in a zero-padded ``k × k`` layer about ``k`` of the ``k(2k−1)`` slots), one
    product per kernel row over a strided view of the partners. So the work is the
    ``(2k−1)²/2`` big products plus a few thin ones; the transposed shift's blocks are
    transposes.

    Args:
        inputs: The input, ``(N, C, H, W)`` (padded by any non-zero padding mode).
        kernel_size: ``(kh, kw)``.
        dilation: ``(d_h, d_w)``.
        zero_padding: ``(left, right, top, bottom)`` zeros around ``inputs``.
        compute_dtype: Precision of the flat buffer and so of every product (default: the
            input's); the input is cast before it is copied into the buffer.
        out_dtype: Precision of the result and of the corrections (default: the input's).
        into: A ``(C·kh·kw, C·kh·kw)`` tensor of ``out_dtype`` (any strides, e.g. a corner
            of a larger buffer) to write the sum into; each block is written once, in
            place, by a strided copy per shift.

    Returns:
        The ``(C·kh·kw, C·kh·kw)`` sum in ``F.unfold`` order (``into`` when given).
    """
    out = out_dtype or inputs.dtype
    (kh, kw), (dh, dw) = kernel_size, dilation
    left_pad, right_pad, top_pad, bottom_pad = zero_padding
    batch, channels = inputs.shape[:2]
    height = inputs.shape[2] + top_pad + bottom_pad
    width = inputs.shape[3] + left_pad + right_pad
    image, length = height * width, batch * height * width
    # Flat rows with a zero margin in front (neighbourhoods reach back (kw-1)·dw positions)
    # and behind (partners past the last position are zeros).
    front = (kw - 1) * dw
    back = (kh - 1) * dh * width + (kw - 1) * dw
    flat = inputs.new_empty(front + length + back, channels, dtype=compute_dtype)
    flat[:front].zero_()
    flat[front + length :].zero_()
    grid = flat[front : front + length].view(batch, height, width, channels)
    for frame in (grid[:, :top_pad], grid[:, height - bottom_pad :]):
        frame.zero_()
    for frame in (grid[:, :, :left_pad], grid[:, :, width - right_pad :]):
        frame.zero_()
    interior = grid[:, top_pad : height - bottom_pad, left_pad : width - right_pad]
    # Cast first: a transposing copy that also converts runs ~2.5x slower (measured).
    interior.copy_(inputs.to(flat.dtype).permute(0, 2, 3, 1))
    plan = strip_plan(
        (height, width), (kh, kw), (dh, dw), (left_pad, right_pad, top_pad, bottom_pad)
    )
    rows, cols = plan.rows, plan.cols
    slots_w = 2 * kw - 1

    def strip_products(
        into: Tensor, start: int, shape: tuple[int, int], strides: tuple[int, int],
        slots: frozenset[Slot],
    ) -> None:  # fmt: skip
        """Writes a strip's products with its partners into ``into`` (``(kh, slots_w, C, C)``).

        Only ``slots`` are read back (one product per kernel row ``u``, over the partners of
        its needed slot range, a strided view); the other entries are left unwritten.
        """
        own = flat.as_strided((*shape, channels), (strides[0] * channels, strides[1] * channels, 1),
                              (front + start) * channels).reshape(-1, channels)  # fmt: skip
        for u in range(kh):
            picked = [slot for row, slot in slots if row == u]
            if not picked:
                continue
            lo, hi = min(picked), max(picked) + 1
            partners = flat.as_strided(
                (*shape, hi - lo, channels),
                (strides[0] * channels, strides[1] * channels, dw * channels, 1),
                (front + start + u * dh * width + (lo - (kw - 1)) * dw) * channels,
            ).reshape(-1, (hi - lo) * channels)
            product = (own.T @ partners).view(channels, hi - lo, channels)
            into[u, lo:hi] = product.transpose(0, 1)  # converted to ``out``

    def strip_sums(
        starts: list[int], shape: tuple[int, int], strides: tuple[int, int],
        slots: tuple[frozenset[Slot], ...],
    ) -> Tensor:  # fmt: skip
        """``(strips, kh, slots_w, C, C)`` products, one uninitialised buffer for all."""
        sums = flat.new_empty(len(starts), kh, slots_w, channels, channels, dtype=out)
        for k, (start, needed) in enumerate(zip(starts, slots, strict=True)):
            strip_products(sums[k], start, shape, strides, needed)
        return sums

    def having(slots: tuple[frozenset[Slot], ...]) -> dict[Slot, list[int]]:
        """Per slot, the strips that multiplied it (only those are read)."""
        by_slot: dict[Slot, list[int]] = {}
        for k, needed in enumerate(slots):
            for slot in needed:
                by_slot.setdefault(slot, []).append(k)
        return by_slot

    # Strip products by (row | column | corner), then (u, slot, C, C); membership 0/1 masks.
    real_h = height - top_pad - bottom_pad
    row_sums = strip_sums([r * width for r in rows], (batch, width), (image, 1), plan.row_slots)
    col_sums = strip_sums(
        [top_pad * width + c for c in cols], (batch, real_h), (image, width), plan.col_slots
    )
    corners = strip_sums(
        [r * width + c for r, c in itertools.product(rows, cols)], (batch, 1), (image, 1),
        plan.corner_slots,
    )  # fmt: skip
    row_has, col_has = having(plan.row_slots), having(plan.col_slots)
    corner_has = having(plan.corner_slots)
    corner_row = [k // max(len(cols), 1) for k in range(len(rows) * len(cols))]
    corner_col = [k % max(len(cols), 1) for k in range(len(rows) * len(cols))]
    row_mask = inputs.new_tensor(plan.row_mask, dtype=out)
    col_mask = inputs.new_tensor(plan.col_mask, dtype=out)
    rows_all = flat[front : front + length]
    dim = channels * kh * kw
    result = inputs.new_empty(dim, dim, dtype=out) if into is None else into
    # result[(c, i, j), (c', i', j')] is entry (c, c') of block ((i, j), (i', j')).
    row_stride, col_stride = result.stride()
    t_c, t_i, t_j = kh * kw * row_stride, kw * row_stride, row_stride
    t_c2, t_i2, t_j2 = kh * kw * col_stride, kw * col_stride, col_stride

    for u in range(kh):
        for v in range(-(kw - 1), kw):
            if u == 0 and v < 0:
                continue  # the transpose of shift (0, -v)
            delta = u * dh * width + v * dw
            slot = v + kw - 1
            lo, hi = max(0, -v), min(kw, kw - v)  # windows j with j + v inside the kernel
            full = (rows_all.T @ flat[front + delta : front + delta + length]).to(out)
            # pairs[i, j]: F_δ minus what lies outside window (i, j) (inclusion-exclusion).
            block_shape = (kh - u, hi - lo, channels, channels)
            pairs = full.expand(block_shape)
            in_rows, in_cols = row_mask[: kh - u], col_mask[lo:hi]
            # Each strip that multiplied this slot, weighted by the windows it lies outside
            # of (a strip without the slot is outside none of them, or its partners are
            # frame zeros).
            if has := row_has.get((u, slot)):
                outside = in_rows[:, has] @ row_sums[has, u, slot].flatten(1)
                pairs = pairs - outside.view(kh - u, 1, channels, channels)
            if has := col_has.get((u, slot)):
                outside = in_cols[:, has] @ col_sums[has, u, slot].flatten(1)
                pairs = pairs - outside.view(1, hi - lo, channels, channels)
            if has := corner_has.get((u, slot)):
                row_of = in_rows[:, [corner_row[k] for k in has]]  # (kh - u, corners)
                col_of = in_cols[:, [corner_col[k] for k in has]]  # (hi - lo, corners)
                weights = (row_of.unsqueeze(1) * col_of.unsqueeze(0)).flatten(0, 1)
                both = weights @ corners[has, u, slot].flatten(1)
                pairs = pairs + both.view(block_shape)
            # Block ((i + u, j + v), (i, j)) is the transpose of block ((i, j), (i + u, j + v)),
            # written first so that shift (0, 0) keeps its own blocks.
            steps = (t_i + t_i2, t_j + t_j2)
            transposed_start = lo * (t_j + t_j2) + u * t_i + v * t_j
            result.as_strided(
                block_shape, (*steps, t_c2, t_c), result.storage_offset() + transposed_start
            ).copy_(pairs)
            forward_start = lo * (t_j + t_j2) + u * t_i2 + v * t_j2
            result.as_strided(
                block_shape, (*steps, t_c, t_c2), result.storage_offset() + forward_start
            ).copy_(pairs)
    return result
