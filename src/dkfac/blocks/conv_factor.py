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
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
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
    padded: Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    bias: bool,
) -> tuple[Tensor, float]:
    """``Σ_{n,t} ā ā^T`` over the im2col patches of a padded input, without unfolding it.

    Args:
        padded: The input after padding, ``(N, C, Hp, Wp)``.
        kernel_size: ``(kh, kw)``.
        stride: ``(s_h, s_w)``.
        dilation: ``(d_h, d_w)``.
        bias: Whether a column of ones (the folded-in bias) ends every patch.

    Returns:
        The ``(D, D)`` sum (``D = C·kh·kw + bias``, in ``F.unfold`` order) in the input's
        dtype (autocast is disabled inside), and the number of patches ``N·Ho·Wo`` (the
        expand normaliser).

    Raises:
        ValueError: If ``padded`` is not 4-D or leaves no output position.
    """
    if padded.dim() != 4:
        raise ValueError(f"padded must be (N, C, H, W), got shape {tuple(padded.shape)}")
    # Every product is in the input's dtype (an enclosing autocast would mix dtypes).
    with torch.autocast(padded.device.type, enabled=False):
        return _factor_sum(padded, kernel_size, stride, dilation, bias)


def _factor_sum(
    padded: Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    bias: bool,
) -> tuple[Tensor, float]:
    """:func:`conv_input_factor_sum` outside autocast."""
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    batch, channels, height, width = padded.shape
    out_h = output_size(height, kh, sh, dh)
    out_w = output_size(width, kw, sw, dw)
    if out_h < 1 or out_w < 1:
        raise ValueError(f"padded input {tuple(padded.shape)} leaves no output position")
    # Channels last: a window's copy is then a few long contiguous runs, and a product over
    # it one (C × N·h·w) @ (N·h·w × C) matmul.
    channels_last = padded.permute(0, 2, 3, 1).contiguous()
    blocks = padded.new_zeros(kh, kw, kh, kw, channels, channels)
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
            member_h = torch.tensor(gh.membership, dtype=padded.dtype, device=padded.device)
            member_w = torch.tensor(gw.membership, dtype=padded.dtype, device=padded.device)
            per_pair = torch.einsum("ps,qt,stcd->pqcd", member_h, member_w, sums)
            i1 = torch.tensor([p[0] for p in gh.pairs]).view(-1, 1)
            i2 = torch.tensor([p[1] for p in gh.pairs]).view(-1, 1)
            j1 = torch.tensor([p[0] for p in gw.pairs]).view(1, -1)
            j2 = torch.tensor([p[1] for p in gw.pairs]).view(1, -1)
            blocks[i1, j1, i2, j2] = per_pair
            if transposed != key:
                blocks[i2, j2, i1, j1] = per_pair.transpose(-1, -2)
    dim = channels * kh * kw
    # blocks[i, j, i', j'][c, c'] is entry ((c, i, j), (c', i', j')) of the factor.
    patch_sum = blocks.permute(4, 0, 1, 5, 2, 3).reshape(dim, dim)
    count = batch * out_h * out_w
    if not bias:
        return patch_sum, float(count)
    entry_sums = padded.new_empty(channels, kh, kw)
    for i in range(kh):
        rows = slice(i * dh, i * dh + sh * (out_h - 1) + 1, sh)
        for j in range(kw):
            cols = slice(j * dw, j * dw + sw * (out_w - 1) + 1, sw)
            entry_sums[:, i, j] = channels_last[:, rows, cols].sum(dim=(0, 1, 2))
    total = padded.new_empty(dim + 1, dim + 1)
    total[:dim, :dim] = patch_sum
    total[:dim, dim] = entry_sums.reshape(dim)
    total[dim, :dim] = entry_sums.reshape(dim)
    total[dim, dim] = count
    return total, float(count)
