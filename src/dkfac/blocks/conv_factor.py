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
(:mod:`~dkfac.blocks.conv_path_choice`'s ``shift_cost``, ``segment_cost`` and
``unfold_cost``: small inputs are mostly
per-operation overhead, where one unfolded product wins); a strided convolution, whose
sub-grids share few products, is unfolded (one ``RᵀR`` product; measured faster on
ResNet-20's strided layers), its bias column still summed without a column of ones.

This module holds the entry point, the bias column's window sums and the unfolded product;
the segment path is :mod:`dkfac.blocks.conv_segments`, the shift path
:mod:`dkfac.blocks.conv_shifts` and the cost estimates behind ``"auto"``
:mod:`dkfac.blocks.conv_path_choice`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dkfac.blocks import conv_path_choice
from dkfac.blocks.conv_segments import output_size, segment_factor_sum
from dkfac.blocks.conv_shifts import flat_factor_sum

__all__ = ["conv_input_factor_sum", "window_sums"]


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
            rows of at most :data:`~dkfac.blocks.conv_path_choice.UNFOLD_MAX_BYTES`; else
            the one of the three with the smallest estimated cost
            (:func:`~dkfac.blocks.conv_path_choice.auto_path`).
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
        path = conv_path_choice.auto_path(
            shape, (kh, kw), (sh, sw), (dh, dw), padding, device, size
        )
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
            by_path = _unfolded_sum if path == "unfold" else segment_factor_sum
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
