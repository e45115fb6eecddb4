"""The expand-convention input factor of a convolution without unfolding its input.

For a 2-D convolution (``groups=1``) on an already padded input ``xp`` of shape
``(N, C, Hp, Wp)`` with stride ``s``, dilation ``d`` and a ``kh × kw`` kernel, the im2col
patch at output position ``(a, b)`` holds ``xp[n, c, a·s_h + i·d_h, b·s_w + j·d_w]`` for
the kernel offsets ``(i, j)``. The sum over images and output positions of the patch outer
products, ``Σ_{n,a,b} ā ā^T``, is made of ``C × C`` blocks, one per pair of offsets
``((i, j), (i', j'))``::

    Σ_n Σ_{a<Ho, b<Wo} xp[n, :, a·s_h + p_i, b·s_w + q_j] xp[n, :, a·s_h + p_i', b·s_w + q_j']^T

with ``p_i = i·d_h`` and ``q_j = j·d_w``. Writing ``p_i = r_i + s_h·m_i`` (``0 <= r_i <
s_h``), row ``a·s_h + p_i`` is row ``a + m_i`` of the sub-grid of rows ``≡ r_i (mod s_h)``,
so along one axis a pair ``(i, i')`` only depends on the *key* ``(r_i, r_i', m_i' − m_i)``
(a shift between two sub-grids) and on the window ``[m_i, m_i + Ho)`` it is summed over.
Pairs with the same key (for stride 1: the same offset difference) share their products:
the union of their windows is cut at every window end into segments, the products are
summed once per (row segment, column segment) by one matrix product, and every block is the
sum of the segment sums inside its window. Each position and key is thus multiplied once:
about ``(2k−1)²`` keys instead of ``k⁴`` offset pairs for a ``k × k`` kernel at stride 1, and
half of those again since the block of the transposed key is the transposed block. A
``1 × 1`` kernel is one ``C × C`` product over all positions.

The bias column (a constant 1 in every patch) contributes the sums of the patch entries
(one window sum per offset and channel) and the count ``N·Ho·Wo``. The result equals
``R^T R`` for the ``(N·Ho·Wo, D)`` unfolded rows ``R`` (same entry order as ``F.unfold``:
channel slowest, then kernel row, then kernel column; bias last) up to rounding.

For stride 1 a second exact path, :func:`flat_factor_sum`, needs no copies at all: one
product per kernel shift over the whole flattened input, corrected by thin border strips.
:func:`conv_input_factor_sum` picks the path with the smallest estimated cost at stride 1
(:func:`shift_cost`, :func:`segment_cost`, :func:`unfold_cost`: small inputs are mostly
per-operation overhead, where one unfolded product wins); a strided convolution, whose
sub-grids share few products, is unfolded (one ``RᵀR`` product; measured faster on
ResNet-20's strided layers), its bias column still summed without a column of ones.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["conv_input_factor_sum"]


@dataclass(frozen=True)
class AxisGroup:
    """The offset pairs along one axis that share a sub-grid shift.

    Attributes:
        residue: Sub-grid (``p mod s``) of the left offsets.
        residue_other: Sub-grid of the right offsets.
        shift: ``m_i' − m_i`` (sub-grid rows from a left to its right position).
        pairs: The offset pairs ``(i, i')`` with this key.
        segments: ``(lo, hi)`` sub-grid ranges of the left position covered by some window.
        membership: ``(len(pairs), len(segments))`` 0/1 matrix: segment inside pair's window.
    """

    residue: int
    residue_other: int
    shift: int
    pairs: tuple[tuple[int, int], ...]
    segments: tuple[tuple[int, int], ...]
    membership: tuple[tuple[float, ...], ...]

    @property
    def key(self) -> tuple[int, int, int]:
        """The sub-grid shift this group stands for."""
        return (self.residue, self.residue_other, self.shift)

    @property
    def transposed_key(self) -> tuple[int, int, int]:
        """The key of the group holding the reversed pairs ``(i', i)``."""
        return (self.residue_other, self.residue, -self.shift)


def axis_groups(kernel: int, stride: int, dilation: int, length: int) -> list[AxisGroup]:
    """Groups the ``kernel²`` offset pairs of one axis by sub-grid shift.

    Args:
        kernel: Kernel size along the axis.
        stride: Stride along the axis.
        dilation: Dilation along the axis.
        length: Output size along the axis (the window length).
    """
    keyed: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for first in range(kernel):
        for second in range(kernel):
            m1, r1 = divmod(first * dilation, stride)
            m2, r2 = divmod(second * dilation, stride)
            keyed.setdefault((r1, r2, m2 - m1), []).append((first, second))
    groups = []
    for (r1, r2, shift), pairs in keyed.items():
        starts = [(first * dilation) // stride for first, _ in pairs]
        cuts = sorted({m for m in starts} | {m + length for m in starts})
        segments: list[tuple[int, int]] = []
        rows: list[list[float]] = [[] for _ in pairs]
        for lo, hi in itertools.pairwise(cuts):
            inside = [float(m <= lo and hi <= m + length) for m in starts]
            if any(inside):
                segments.append((lo, hi))
                for row, flag in zip(rows, inside, strict=True):
                    row.append(flag)
        groups.append(
            AxisGroup(r1, r2, shift, tuple(pairs), tuple(segments), tuple(tuple(r) for r in rows))
        )
    return groups


def _window(residue: int, stride: int, lo: int, hi: int) -> slice:
    """Padded-input indices of sub-grid rows ``[lo, hi)`` of sub-grid ``residue``."""
    return slice(residue + stride * lo, residue + stride * (hi - 1) + 1, stride)


def output_size(padded: int, kernel: int, stride: int, dilation: int) -> int:
    """Output positions along an axis of a padded input (as ``F.conv2d`` computes it)."""
    return (padded - dilation * (kernel - 1) - 1) // stride + 1


def conv_input_factor_sum(
    inputs: Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    bias: bool,
    zero_padding: tuple[int, int, int, int] = (0, 0, 0, 0),
    path: str = "auto",
    *,
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, float]:
    """``Σ_{n,t} ā ā^T`` over the im2col patches of a padded input, without unfolding it.

    Two exact paths: the sub-grid segments of the module docstring (any stride; two copies
    per product) and, for stride 1, one copy-free product per kernel shift
    (:func:`flat_factor_sum`; it also multiplies the padding border and corrects for it).

    Args:
        inputs: The input, ``(N, C, H, W)``, already padded by any non-zero padding mode.
        kernel_size: ``(kh, kw)``.
        stride: ``(s_h, s_w)``.
        dilation: ``(d_h, d_w)``.
        bias: Whether a column of ones (the folded-in bias) ends every patch.
        zero_padding: ``(left, right, top, bottom)`` zeros around ``inputs`` (``F.pad``
            order). The shift path writes the input into its zero-framed buffer directly and
            skips the frame; the segment path pads first.
        path: ``"shift"`` (stride 1 only), ``"segment"``, ``"unfold"`` (the im2col rows,
            one product), or ``"auto"``: ``"unfold"`` for a strided convolution (its
            sub-grids share few products; measured on ResNet-20) and, on a CUDA device, for
            rows of at most :data:`UNFOLD_MAX_BYTES`; else the one of the three with the
            smallest estimated cost (:func:`auto_path`).
        compute_dtype: Precision of the products' inputs (default: the input's). The
            input is cast once, before the layout copy each path makes; every product is
            converted to ``out_dtype`` before the border corrections and block sums.
        out_dtype: Precision of the result (default: the input's).

    Returns:
        The ``(D, D)`` sum (``D = C·kh·kw + bias``, in ``F.unfold`` order) in ``out_dtype``
        (autocast is disabled inside), and the number of patches ``N·Ho·Wo`` (the expand
        normaliser).

    Raises:
        ValueError: If ``inputs`` is not 4-D or leaves no output position, or on a bad
            ``zero_padding`` or ``path``.
    """
    if inputs.dim() != 4:
        raise ValueError(f"inputs must be (N, C, H, W), got shape {tuple(inputs.shape)}")
    if len(zero_padding) != 4 or any(int(w) < 0 for w in zero_padding):
        raise ValueError(f"zero_padding must be 4 widths >= 0, got {zero_padding}")
    left, right, top, bottom = zero_padding
    batch, channels, height, width = inputs.shape
    shape = (batch, channels, height + top + bottom, width + left + right)
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    out_h, out_w = output_size(shape[2], kh, sh, dh), output_size(shape[3], kw, sw, dw)
    if min(out_h, out_w) < 1:
        raise ValueError(f"padded input {shape} leaves no output position")
    if path not in ("auto", "shift", "segment", "unfold"):
        raise ValueError(f'path must be "auto", "shift", "segment" or "unfold", got {path!r}')
    if path == "shift" and (sh, sw) != (1, 1):
        raise ValueError(f'path="shift" needs stride 1, got {stride}')
    dtypes = (compute_dtype or inputs.dtype, out_dtype or inputs.dtype)
    if path == "auto":
        padding = (left, right, top, bottom)
        device, size = inputs.device.type, dtypes[0].itemsize
        path = auto_path(shape, (kh, kw), (sh, sw), (dh, dw), padding, device, size)
    # Every product is in compute_dtype (an enclosing autocast would mix dtypes).
    with torch.autocast(inputs.device.type, enabled=False):
        dim, count = channels * kh * kw, batch * out_h * out_w
        if path == "shift":  # written in place, into the corner of the (D + 1)² buffer
            total = inputs.new_empty(dim + bias, dim + bias, dtype=dtypes[1])
            flat_factor_sum(
                inputs, kernel_size, dilation, zero_padding, *dtypes, into=total[:dim, :dim]
            )
        else:
            source = inputs.to(dtypes[0])  # cast before padding: the pad copies fewer bytes
            padded = F.pad(source, zero_padding) if any(zero_padding) else source
            by_path = _unfolded_sum if path == "unfold" else _factor_sum
            total = by_path(padded, kernel_size, stride, dilation, dtypes[1])
            if bias:
                total = F.pad(total, (0, 1, 0, 1))
        if not bias:
            return total, float(count)
        # The bias column: every patch entry summed over all patches, and the count.
        image_sum = inputs.sum(dim=0, keepdim=True, dtype=total.dtype)
        entry_sums = window_sums(image_sum, kernel_size, stride, dilation, zero_padding)
        entry_sums = entry_sums.reshape(-1)
        total[:dim, dim] = entry_sums
        total[dim, :dim] = entry_sums
        total[dim, dim] = count
        return total, float(count)


def window_sums(
    inputs: Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    zero_padding: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> Tensor:
    """``(N, C, kh, kw)``: per image, each patch entry summed over all output positions.

    Entry ``(c, i, j)`` sums the padded input over the window of kernel offset ``(i, j)``.
    Separable: one reduction over the window rows per kernel row, then thin sums per
    column. The zero padding is never materialised: rows in it are left out of the
    reduction and the per-column sums are padded instead.

    Args:
        inputs: ``(N, C, H, W)``, already padded by any non-zero padding mode.
        kernel_size: ``(kh, kw)``.
        stride: ``(s_h, s_w)``.
        dilation: ``(d_h, d_w)``.
        zero_padding: ``(left, right, top, bottom)`` zeros around ``inputs``.
    """
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    left, right, top, bottom = zero_padding
    batch, channels, real_h, real_w = inputs.shape
    out_h = output_size(real_h + top + bottom, kh, sh, dh)
    out_w = output_size(real_w + left + right, kw, sw, dw)
    sums = inputs.new_empty(batch, channels, kh, kw)
    for i in range(kh):
        # Window rows i·dh + sh·a (a < Ho) of the padded input that are real rows.
        first = max(0, -((i * dh - top) // sh))
        last = min(out_h - 1, (real_h - 1 - (i * dh - top)) // sh)
        if first > last:  # the whole window lies in the padding
            by_column = inputs.new_zeros(batch, channels, real_w)
        else:
            start = i * dh - top + sh * first
            by_column = inputs[:, :, start : start + sh * (last - first) + 1 : sh].sum(2)
        by_column = F.pad(by_column, (left, right)) if left or right else by_column
        for j in range(kw):
            cols = slice(j * dw, j * dw + sw * (out_w - 1) + 1, sw)
            sums[:, :, i, j] = by_column[:, :, cols].sum(dim=2)
    return sums


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
    """Estimated cost of :func:`flat_factor_sum`, in multiply-adds (as above)."""
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


def _unfolded_sum(
    padded: Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    out_dtype: torch.dtype,
) -> Tensor:
    """The ``(D, D)`` patch sum (no bias) as ``RᵀR`` of the im2col rows ``R``.

    The product runs in the input's dtype (the caller casts before padding, so the unfold
    moves fewer bytes); the rows are made position-major in one copy; the bias column is
    left to the caller.
    """
    patches = F.unfold(padded, kernel_size, dilation=dilation, stride=stride)  # (N, D, T)
    rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    return (rows.T @ rows).to(out_dtype)


def _factor_sum(
    padded: Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """The ``(D, D)`` patch sum (no bias) by the sub-grid segment path, outside autocast.

    The products run in the input's dtype (the caller casts it) and are summed into blocks
    in ``out_dtype`` (default: the input's).
    """
    out = out_dtype or padded.dtype
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    _, channels, height, width = padded.shape
    out_h = output_size(height, kh, sh, dh)
    out_w = output_size(width, kw, sw, dw)
    # Channels last: a window's copy is then a few long contiguous runs, and a product over
    # it one (C × N·h·w) @ (N·h·w × C) matmul.
    channels_last = padded.permute(0, 2, 3, 1).contiguous()
    blocks = padded.new_zeros(kh, kw, kh, kw, channels, channels, dtype=out)
    groups_h = axis_groups(kh, sh, dh, out_h)
    groups_w = axis_groups(kw, sw, dw, out_w)
    for gh in groups_h:
        for gw in groups_w:
            key, transposed = (gh.key, gw.key), (gh.transposed_key, gw.transposed_key)
            if transposed < key:
                continue  # filled below as the transpose of the other key's blocks
            sums = padded.new_empty(len(gh.segments), len(gw.segments), channels, channels)
            for a, (lo_h, hi_h) in enumerate(gh.segments):
                rows_left = _window(gh.residue, sh, lo_h, hi_h)
                rows_right = _window(gh.residue_other, sh, lo_h + gh.shift, hi_h + gh.shift)
                for b, (lo_w, hi_w) in enumerate(gw.segments):
                    cols_left = _window(gw.residue, sw, lo_w, hi_w)
                    cols_right = _window(gw.residue_other, sw, lo_w + gw.shift, hi_w + gw.shift)
                    left = channels_last[:, rows_left, cols_left].reshape(-1, channels)
                    right = channels_last[:, rows_right, cols_right].reshape(-1, channels)
                    torch.mm(left.T, right, out=sums[a, b])
            member_h = torch.tensor(gh.membership, dtype=out, device=padded.device)
            member_w = torch.tensor(gw.membership, dtype=out, device=padded.device)
            per_pair = torch.einsum("ps,qt,stcd->pqcd", member_h, member_w, sums.to(out))
            i1 = torch.tensor([p[0] for p in gh.pairs]).view(-1, 1)
            i2 = torch.tensor([p[1] for p in gh.pairs]).view(-1, 1)
            j1 = torch.tensor([p[0] for p in gw.pairs]).view(1, -1)
            j2 = torch.tensor([p[1] for p in gw.pairs]).view(1, -1)
            blocks[i1, j1, i2, j2] = per_pair
            if transposed != key:
                blocks[i2, j2, i1, j1] = per_pair.transpose(-1, -2)
    dim = channels * kh * kw
    # blocks[i, j, i', j'][c, c'] is entry ((c, i, j), (c', i', j')) of the factor.
    return blocks.permute(4, 0, 1, 5, 2, 3).reshape(dim, dim)
