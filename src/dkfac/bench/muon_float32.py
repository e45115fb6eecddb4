"""``torch.optim.Muon`` with its Newton–Schulz iteration in float32, for CPUs without bf16.

``torch.optim.Muon`` runs its iteration in bfloat16 whatever the machine; on a CPU without
bf16 instructions (AVX2) PyTorch emulates the products at many times the cost of float32
ones, which is not Muon's algorithm but the machine. :func:`float32_newton_schulz` is the
same iteration (the same coefficients, steps and products) in float32, and
:class:`MuonFloat32` a :class:`~dkfac.bench.peers.MuonWithAdamW` that uses it during its own
steps only, so the shipped Muon and this one run side by side in one process.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim._muon as torch_muon
from torch import Tensor, nn

from dkfac.bench.peers import MuonWithAdamW
from dkfac.solvers.polar import NS_COEFFICIENTS, newton_schulz

__all__ = ["MuonFloat32", "float32_iteration", "float32_newton_schulz"]


def float32_newton_schulz(
    grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """Muon's iteration (its default coefficients only) in float32.

    The input is divided by ``‖G‖_F + 1e-7`` (:func:`~dkfac.solvers.polar.newton_schulz`)
    instead of by ``max(‖G‖_F, eps)``.

    Raises:
        ValueError: For coefficients other than Muon's defaults.
    """
    del eps
    default = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    if tuple(ns_coefficients) != default or default != NS_COEFFICIENTS:
        raise ValueError(f"float32 Muon runs Muon's default coefficients, got {ns_coefficients}")
    return newton_schulz(grad, ns_steps, torch.float32)


@contextmanager
def float32_iteration() -> Iterator[None]:
    """Within the block, every ``torch.optim.Muon`` step iterates in float32."""
    shipped = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = float32_newton_schulz
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = shipped


class MuonFloat32(MuonWithAdamW):
    """:class:`~dkfac.bench.peers.MuonWithAdamW` whose Muon iterates in float32."""

    def __init__(self, model: nn.Module, lr: float, options: Mapping[str, Any]) -> None:
        super().__init__(model, lr, options)

    @torch.no_grad()
    def step(self) -> None:
        """One float32-Muon step on the hidden matrices and one AdamW step on the rest."""
        with float32_iteration():
            super().step()
