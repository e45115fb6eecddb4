"""``--muon-dtype float32``: ``torch.optim.Muon``'s Newton–Schulz iteration in float32.

``torch.optim.Muon`` runs its iteration in bfloat16 whatever the machine. On a CPU without
bf16 instructions (AVX2) PyTorch emulates bf16 products at many times the cost of float32
ones, which makes the Muon peer slow for a reason that is not Muon's algorithm. With
``--muon-dtype float32`` every Muon run of the process iterates with
:func:`dkfac.solvers.polar.newton_schulz` in float32 instead: the same coefficients, steps and
products, the input divided by ``‖G‖_F + 1e-7`` instead of by ``max(‖G‖_F, eps)``.
"""

from __future__ import annotations

import torch
import torch.optim._muon as torch_muon
from torch import Tensor

from dkfac.solvers.polar import NS_COEFFICIENTS, newton_schulz

__all__ = ["float32_newton_schulz", "use_float32_muon"]


def float32_newton_schulz(
    grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """Muon's iteration (its default coefficients only) in float32.

    Raises:
        ValueError: For coefficients other than Muon's defaults.
    """
    del eps
    default = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    if tuple(ns_coefficients) != default or default != NS_COEFFICIENTS:
        raise ValueError(
            f"the float32 iteration runs Muon's default coefficients, got {ns_coefficients}"
        )
    return newton_schulz(grad, ns_steps, torch.float32)


def use_float32_muon() -> None:
    """Makes every ``torch.optim.Muon`` of this process iterate in float32."""
    torch_muon._zeropower_via_newtonschulz = float32_newton_schulz
