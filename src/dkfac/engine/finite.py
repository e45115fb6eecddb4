"""One cheap test that a tensor holds no NaN or Inf, nor (a gradient) values whose squares
overflow.

The test is that the sum of the tensor's squares is finite, taken in one pass with no
temporary (``torch.dot`` of the flattened tensor with itself, accumulated in float32 at
least: 0.14 ms for a million float32 entries on one CPU thread, where
``torch.isfinite(t).all()`` builds a boolean tensor through four kernels in 2.2 ms). A NaN
anywhere makes it NaN, an Inf makes it Inf. It also refuses a finite tensor whose squares
sum past the dtype's largest value (float32's: a 2-norm above 1.8·10¹⁹): a gradient that
large would make Adam's second moment Inf, and the moments would stay Inf ever after, so
such a gradient is handled as a NaN one (the layer zeroed, the step skipped). A float16
tensor's squares cannot reach float32's largest (65504² times any size a tensor has), so its
plain sum in float32 is the same test. :func:`finite_each` checks many tensors with one dot
each and a single test of the stacked results (a step checks about two tensors per
parameter: a few small calls each add up). On a CUDA device, where a small model's step is
bound by kernel launches, it takes the 2-norms of all of them in one multi-tensor call
instead (``torch._foreach_norm``: a few launches for any number of tensors, in float32 at
least, overflowing as the squares do); on a CPU that call is one pass per tensor and slower
than the dots, so the dots stay there.

A statistic (a factor, a solver's state) feeds no second moment: its test
(``squares=False``) is that the plain sum is finite (the 1-norm on the fused path), which any
NaN or Inf still fails, and which holds for a factor of entries up to float32's largest over
its size. Its squares would overflow already for inputs near 10¹⁰ (a raw Unix time: 1.7·10⁹,
a factor entry 3·10¹⁸, the squares' sum past 3.4·10³⁸ at 16 features), where its
eigendecomposition and the update it gives are finite (tested: such inputs train).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dkfac.engine import launches

__all__ = ["all_finite", "finite_each", "gradients_finite"]


def all_finite(tensor: Tensor) -> Tensor:
    """A 0-d bool tensor on ``tensor``'s device: no entry is NaN or ±Inf, and the sum of
    the squares does not overflow (see the module).

    Integer and bool tensors are finite by construction.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(_total(tensor))


def _total(tensor: Tensor, squares: bool = True) -> Tensor:
    """The sum of a floating tensor's squares, accumulated in float32 at least; a float16
    tensor's plain sum in float32, and any tensor's without ``squares`` (see the module
    notes). A sparse tensor (the gradient of ``nn.Embedding(sparse=True)``) is tested on its
    summed values."""
    if tensor.is_sparse:
        tensor = tensor.coalesce().values()
    if not squares or tensor.dtype == torch.float16:
        return tensor.sum(dtype=torch.promote_types(tensor.dtype, torch.float32))
    flat = tensor.reshape(-1)
    return torch.dot(flat, flat)


def _real_total(tensor: Tensor, squares: bool) -> Tensor:
    """A real 0-d tensor that is finite exactly when :func:`all_finite` says so."""
    if tensor.is_complex():
        total = tensor.sum()  # a NaN or Inf in either part stays non-finite
        return total.real + total.imag
    if not tensor.is_floating_point():
        return torch.zeros((), dtype=torch.float64, device=tensor.device)
    return _total(tensor, squares)


def finite_each(
    tensors: Sequence[Tensor],
    device: torch.device,
    fused: bool | None = None,
    *,
    squares: bool = True,
) -> Tensor:
    """A bool vector on ``device``: entry ``i`` says whether ``tensors[i]`` is finite (the
    test of :func:`all_finite`, the dots stacked and tested at once).

    Args:
        tensors: The tensors to check.
        device: Where the answer lives.
        fused: Take the norms (2-norms; 1-norms without ``squares``) in one multi-tensor
            call (module notes); ``None`` (the default): on a launch-bound ``device``
            (:mod:`~dkfac.engine.launches`) when every tensor is a dense float32, float16
            or bfloat16 one there.
        squares: Also refuse a tensor whose squares' sum overflows (a gradient);
            ``False``: a statistic's test, its plain sum (module notes).

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
            t.device == device and t.dtype in _FUSED_DTYPES and not t.is_sparse for t in tensors
        )
    if fused:
        norms = torch._foreach_norm(list(tensors), 2 if squares else 1, dtype=torch.float32)
        return torch.isfinite(torch.stack(norms)).to(device)
    totals = [_real_total(t, squares) for t in tensors]
    if any(t.dtype != totals[0].dtype or t.device != device for t in totals):
        totals = [t.to(device, torch.float64) for t in totals]
    return torch.isfinite(torch.stack(totals))


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes whose 2-norm :func:`finite_each` takes in float32 (a float64 tensor keeps its dot)."""


def gradients_finite(grads: Sequence[Tensor | None]) -> tuple[Tensor, bool] | None:
    """``(flag, sharded)``: a 0-d bool tensor, every gradient present is finite (the test
    of :func:`finite_each`, on this rank's shard of a ``DTensor``), and whether any is a
    shard (FSDP2's: the ranks then agree on the flag, since each tested its own rows);
    ``None`` where no gradient is present."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    local = [g.to_local() if isinstance(g, DTensor) else g for g in present]
    sharded = any(isinstance(g, DTensor) for g in present)
    return finite_each(local, local[0].device).all(), sharded
