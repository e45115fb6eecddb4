"""The orthogonalised updates of layers of several shapes as one batched iteration.

:func:`~dkfac.solvers.polar.orthogonal_update` takes a matrix or a stack of one shape; a
network's hidden layers come in several shapes (ResNet-20's: seven), and each shape's
Newton–Schulz iteration is a dozen or more small products, each a launch on a GPU, where a
small model's step is bound by its launches. Zero rows and columns change nothing that
the iteration computes: for ``X = [U 0; 0 0]``, ``X Xᵀ = [U Uᵀ 0; 0 0]`` and every step
keeps the block form, so the polar factor of the padded matrix is ``[O(U) 0; 0 0]``; its
Frobenius norm, which normalises the first step, is ``U``'s. So :func:`orthogonal_updates`
orients each update wide (``k <= n``, as the iteration does), pads the small ones with
zeros to the largest ``K × N`` among them and runs one batched iteration for all; each
layer's result is its block of the batched one, scaled by its own factor (the padded
entries add nothing to the squares its RMS entry is taken from). The values are those of
each update's own iteration to the rounding (the products may sum in another order).

Padding costs products: ``K²N`` per matrix instead of ``k²n``. It is taken only for updates
whose padded work is at most :data:`PAD_MAX_WORK` multiply-adds per product, where a GPU's
products take about a launch's time whatever their size; larger ones, and any update whose
iteration runs in another precision (:func:`~dkfac.solvers.polar.polar_dtype`), keep their
own iteration. Where to call it is the caller's rule: the flat pass of a launch-bound
device (:mod:`dkfac.solvers.flat_moments`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dkfac.solvers.polar import NS_STEPS, orthogonal_update, polar_dtype, polar_factor

__all__ = ["PAD_MAX_WORK", "orthogonal_updates"]

PAD_MAX_WORK = 256**3
"""The largest ``K² N`` (multiply-adds of the padded Gram matrix) an update is padded to."""


def _wide(update: Tensor) -> tuple[Tensor, bool]:
    """``update`` as a stack ``(L, k, n)`` with ``k <= n`` (a view), and whether it was
    transposed."""
    stack = update if update.dim() == 3 else update.unsqueeze(0)
    tall = stack.shape[-2] > stack.shape[-1]
    return (stack.mT if tall else stack), tall


def orthogonal_updates(
    updates: Sequence[Tensor], rms: float, steps: int = NS_STEPS, power: float = 0.0
) -> list[Tensor]:
    """:func:`~dkfac.solvers.polar.orthogonal_update` of each of ``updates`` (matrices or
    stacks of any shapes, one dtype and device), those small enough padded into one batched
    iteration per precision (module notes).

    Args:
        updates: The updates, each ``(m, n)`` or ``(L, m, n)``.
        rms: The RMS entry of each polar factor per unit of learning rate.
        steps: Newton–Schulz steps.
        power: As :func:`~dkfac.solvers.polar.orthogonal_update` takes it.

    Returns:
        Each update's orthogonalised update, in its shape and dtype.
    """
    results: list[Tensor | None] = [None] * len(updates)
    joint: dict[torch.dtype, list[int]] = {}
    for i, update in enumerate(updates):
        dtype = polar_dtype(update.dtype, update.device, update.shape)
        joint.setdefault(dtype, []).append(i)
    for dtype, members in joint.items():
        shapes = [sorted(updates[i].shape[-2:]) for i in members]  # (k, n) of _wide's view
        padded = _small_enough(members, shapes)
        if len(padded) < 2:
            padded = []
        for i in members:
            if i not in padded:
                results[i] = orthogonal_update(updates[i], rms, steps, power)
        if padded:
            outputs = _padded([updates[i] for i in padded], rms, steps, power, dtype)
            for i, result in zip(padded, outputs, strict=True):
                results[i] = result
    return results  # type: ignore[return-value]


def _small_enough(members: list[int], shapes: Sequence[Sequence[int]]) -> list[int]:
    """The members (indices, with their wide ``(k, n)``) padded together: from the least
    work up, each whose joining keeps the padded ``K² N`` within :data:`PAD_MAX_WORK`; in
    ``members``' order."""
    by_work = sorted(zip(members, shapes, strict=True), key=lambda m: m[1][0] ** 2 * m[1][1])
    chosen: set[int] = set()
    k_max = n_max = 0
    for i, (k, n) in by_work:
        k_pad, n_pad = max(k_max, k), max(n_max, n)
        if k_pad * k_pad * n_pad <= PAD_MAX_WORK:
            chosen.add(i)
            k_max, n_max = k_pad, n_pad
    return [i for i in members if i in chosen]


def _padded(
    updates: Sequence[Tensor], rms: float, steps: int, power: float, dtype: torch.dtype
) -> list[Tensor]:
    """:func:`orthogonal_updates` of ``updates`` as one zero-padded stack iterated in
    ``dtype``: one pad a smaller update, one scaling for all (each layer's factor from
    :func:`_layer_constants`), one split."""
    wides = [_wide(update) for update in updates]
    shapes = tuple((s.shape[0], s.shape[1], s.shape[2]) for s, _ in wides)
    k_max = max(k for _, k, _ in shapes)
    n_max = max(n for _, _, n in shapes)
    blocks = [
        stack if (k, n) == (k_max, n_max) else F.pad(stack, (0, n_max - n, 0, k_max - k))
        for (stack, _), (_, k, n) in zip(wides, shapes, strict=True)
    ]
    padded = torch.cat(blocks)
    polar = polar_factor(padded, steps, dtype)
    scale, entries = _layer_constants(shapes, float(rms), polar.device, polar.dtype)
    if power:  # each layer's RMS entry: its padded zeros add nothing to the squares
        own = padded.square().sum((-2, -1), keepdim=True).div_(entries).sqrt_()
        scale = own.div_(float(rms)).pow_(power).mul_(scale).to(polar.dtype)
    polar = polar * scale
    results = []
    parts = polar.split([count for count, _, _ in shapes])
    for update, part, (_, tall), (_, k, n) in zip(updates, parts, wides, shapes, strict=True):
        block = part if (k, n) == (k_max, n_max) else part[:, :k, :n]
        block = block.mT if tall else block
        results.append(block if update.dim() == 3 else block[0])
    return results


_CONSTANTS: dict[tuple[object, ...], tuple[Tensor, Tensor]] = {}


def _layer_constants(
    shapes: tuple[tuple[int, int, int], ...], rms: float, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Per matrix of the padded stack (``(count, k, n)`` per update), shaped ``(L, 1, 1)``:
    its scale ``rms · √n`` (``n = max`` of its sides) and its number of entries ``k · n``;
    made on the device from no host data (fills), once for each composition."""
    key = (shapes, rms, device, dtype)
    if key not in _CONSTANTS:
        scales, entries = [], []
        for count, k, n in shapes:
            scales.append(torch.full((count, 1, 1), rms * n**0.5, dtype=dtype, device=device))
            entries.append(torch.full((count, 1, 1), float(k * n), dtype=dtype, device=device))
        _CONSTANTS[key] = (torch.cat(scales), torch.cat(entries))
    return _CONSTANTS[key]
