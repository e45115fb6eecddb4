"""Probe: the language model's wide factors masked to block-diagonal before their basis.

``dkfac bench lm`` with every eigenbasis-moment solver patched so that a factor at least
``DKFAC_WIDE`` wide (default 512: the MLP's 512-wide sides and the 513-wide input side of
its second layer) has its off-diagonal blocks (blocks of ``DKFAC_BLOCK``, default 128)
zeroed before its eigenbasis is computed (the first one by a full ``eigh``, so that the
basis keeps the block structure; later ones by the recipe's power step, which keeps it).
The loss per step of a block-diagonal basis, before the library had one: no time is saved
(the whole factors are still captured and the rotations are dense products). Superseded by
the ``basis_block_size`` option (BENCHMARKS.md section 20), which the LM recipe now uses.

    DKFAC_BLOCK=128 python benchmarks/probes/lm_block_diagonal_mask.py --threads 1 --seeds 3 \\
        --first-seed 100 --no-sweep --seconds 60 --eval-every 25 --optimizers kfac \\
        --kfac-lrs 0.006 --recipe RECIPE --name probe_bd128

with RECIPE the recipe of b97a1ce (``benchmarks/recipes/gpt-text.toml`` without
``basis-block-size`` and ``weight-decay``); ``DKFAC_WIDE=128 DKFAC_BLOCK=64`` for the second
probe of ``benchmarks/results/lm_block_tuning.json``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

from dkfac.bench.lm import main
from dkfac.solvers import eigen_moments

BLOCK = int(os.environ.get("DKFAC_BLOCK", "128"))
WIDE = int(os.environ.get("DKFAC_WIDE", "512"))
_side = eigen_moments.EigenMomentsSolver._side


def masked(factor: Tensor) -> Tensor:
    """``factor`` with the blocks off its diagonal (blocks of ``BLOCK``) set to zero."""
    index = torch.arange(factor.shape[0], device=factor.device) // BLOCK
    return factor * (index[:, None] == index[None, :]).to(factor.dtype)


def side(
    self: eigen_moments.EigenMomentsSolver,
    factor: Tensor,
    previous: Tensor | None,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """The solver's basis of one factor, of the masked factor where it is wide."""
    if factor.shape[0] < WIDE:
        return _side(self, factor, previous, dtype)
    if previous is None or previous.shape != factor.shape:
        return eigen_moments.descending_eigh(masked(factor), dtype)
    return _side(self, masked(factor), previous, dtype)


if __name__ == "__main__":
    torch.set_num_threads(1)
    eigen_moments.EigenMomentsSolver._side = side  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
