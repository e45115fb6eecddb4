"""The sub-grid segment path of the convolution input factor (the derivation is in
:mod:`dkfac.blocks.conv_factor`), with the output-size arithmetic every path shares.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AxisGroup", "axis_groups", "output_size", "segment_factor_sum"]


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


def segment_factor_sum(
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
