"""``torch.optim.Muon`` with its Newton–Schulz iteration in float32, for CPUs without bf16.

``torch.optim.Muon`` runs its iteration in bfloat16 whatever the machine; on a CPU without
bf16 instructions (AVX2) PyTorch emulates the products at many times the cost of float32
ones, which is not Muon's algorithm but the machine.
:func:`~dkfac.bench.muon_precision.float32_newton_schulz` is the same iteration (the same
coefficients, steps and products) in float32, and
:class:`MuonFloat32` a :class:`~dkfac.bench.peers.MuonWithAdamW` that uses it during its own
steps only, so the shipped Muon and this one run side by side in one process.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim._muon as torch_muon
from torch import nn

from dkfac.bench.muon_precision import float32_newton_schulz
from dkfac.bench.peers import MuonWithAdamW

__all__ = ["MuonFloat32", "float32_iteration", "float32_newton_schulz"]


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
