"""One cheap test that a tensor holds no NaN or Inf, for the checks of every step.

``torch.isfinite(t).all()`` builds a boolean tensor of ``t``'s size through four kernels
(2.2 ms for a million float32 entries on one CPU thread: a tenth of a K-FAC step of the
digits autoencoder, whose step checks its factors, gradients and parameters). A sum is one
pass and no temporary (0.05 ms): a NaN anywhere makes it NaN, an Inf makes it Inf or NaN.
Its only false alarm is a sum of finite entries that overflows: the sum is taken in float32
at least (float16 overflows at 65504), so that takes entries whose total passes 3·10³⁸,
which a training step should stop on anyway. :func:`finite_each` checks many tensors with
one sum each and a single test of the stacked sums (a step checks about two tensors per
parameter: a few small calls each add up). On a CUDA device, where a small model's step is
bound by kernel launches, it takes the 1-norms of all of them in one multi-tensor call
instead (``torch._foreach_norm``: a few launches for any number of tensors, the same
answer, in float32 at least); on a CPU that call is one pass per tensor and 2.3× slower than
the sums (measured), so the sums stay there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.engine import launches

__all__ = ["all_finite", "finite_each"]


def all_finite(tensor: Tensor) -> Tensor:
    """A 0-d bool tensor on ``tensor``'s device: no entry is NaN or ±Inf (see the module).

    Integer and bool tensors are finite by construction.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(_total(tensor))


def _total(tensor: Tensor) -> Tensor:
    """The sum of a floating tensor, in float32 at least (see the module notes)."""
    wide = tensor.dtype in (torch.float16, torch.bfloat16)
    return tensor.sum(dtype=torch.float32) if wide else tensor.sum()


def _real_total(tensor: Tensor) -> Tensor:
    """A real 0-d tensor that is finite exactly when :func:`all_finite` says so."""
    if tensor.is_complex():
        total = _total(tensor)
        return total.real + total.imag  # a NaN or Inf in either part stays non-finite
    if not tensor.is_floating_point():
        return torch.zeros((), dtype=torch.float64, device=tensor.device)
    return _total(tensor)


def finite_each(
    tensors: Sequence[Tensor], device: torch.device, fused: bool | None = None
) -> Tensor:
    """A bool vector on ``device``: entry ``i`` says whether ``tensors[i]`` is finite (the
    test of :func:`all_finite`, the sums stacked and tested at once).

    Args:
        tensors: The tensors to check.
        device: Where the answer lives.
        fused: Take the 1-norms in one multi-tensor call (module notes); ``None`` (the
            default): on a launch-bound ``device`` (:mod:`~dkfac.engine.launches`) when
            every tensor is a float32, float16 or bfloat16 one there.

    Raises:
        ValueError: For no tensors, or ``fused`` with a tensor of another dtype than
            float16, bfloat16 or float32.
    """
    if not tensors:
        raise ValueError("finite_each needs at least one tensor")
    if fused and any(t.dtype not in _FUSED_DTYPES for t in tensors):
        dtypes = sorted({str(t.dtype) for t in tensors if t.dtype not in _FUSED_DTYPES})
        allowed = "float16, bfloat16 and float32 tensors"
        raise ValueError(f"finite_each(fused=True) takes {allowed}, got {', '.join(dtypes)}")
    if fused is None:
        fused = launches.launch_bound(device) and all(
            t.device == device and t.dtype in _FUSED_DTYPES for t in tensors
        )
    if fused:
        norms = torch._foreach_norm(list(tensors), 1, dtype=torch.float32)
        return torch.isfinite(torch.stack(norms)).to(device)
    totals = [_real_total(t) for t in tensors]
    if any(t.dtype != totals[0].dtype or t.device != device for t in totals):
        totals = [t.to(device, torch.float64) for t in totals]
    return torch.isfinite(torch.stack(totals))


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes whose 1-norm :func:`finite_each` takes in float32 (a float64 tensor keeps its sum)."""
