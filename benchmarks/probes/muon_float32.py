"""Probe: ``dkfac bench`` with ``torch.optim.Muon``'s Newton–Schulz steps in float32.

``torch.optim.Muon`` runs its iteration in bfloat16 whatever the machine. On a CPU without
bf16 instructions (an AVX2 machine) PyTorch emulates bf16 products, and they cost many times
float32 ones (BENCHMARKS.md section 24: a 512 × 512 product 206 ms against 4.7 ms, Muon's
language-model step 1.75 s against 0.72 s for the K-FAC recipe, whose ``"auto"``
precisions run in float32 there). That makes the benchmark's Muon peer slow on such a
machine for a reason that is not Muon's algorithm. This probe runs ``dkfac bench TASK
...`` (any task: ``lm``, ``autoencoder``, ``tta``) with the peer's iteration replaced by
:func:`dkfac.solvers.polar.newton_schulz` in float32 (the same coefficients,
steps and products; the input divided by ``‖G‖_F + 1e-7`` instead of by
``max(‖G‖_F, eps)``), so that the recipe can be compared with the Muon a user could write
for that machine. The patch applies to every Muon run of the process; the other peers are
untouched.

    python benchmarks/probes/muon_float32.py lm --threads 1 --seeds 3 --no-sweep \\
        --seconds 60 --eval-every 25 --optimizers muon kfac --muon-lrs 0.05 \\
        --kfac-lrs 0.006 --recipe benchmarks/recipes/gpt-text.toml --name lm_muon_float32
"""

from __future__ import annotations

import sys

import torch.optim._muon as torch_muon

from dkfac import bench
from dkfac.bench.muon_float32 import float32_newton_schulz


def patch() -> None:
    """Makes every ``torch.optim.Muon`` of this process iterate in float32."""
    torch_muon._zeropower_via_newtonschulz = float32_newton_schulz


if __name__ == "__main__":
    patch()
    sys.exit(bench.main(sys.argv[1:]))
