"""Probe: a lower learning rate for what K-FAC leaves to Adam (embeddings, head, LayerNorms).

``dkfac bench lm`` with every K-FAC optimizer's inner SGD rebuilt with two groups: the
parameters of the preconditioned layers keep the recipe's lr, every other parameter (the
ones ``leftover_update`` gives Adam's direction: the embeddings and head under the LM
recipe's ``skip-layers``, the LayerNorms) gets ``lr · DKFAC_LEFT_LR_SCALE`` (default 0.5),
its decoupled decay scaled alike. Muon's AdamW part runs those at 0.001 against the
recipe's 0.006.

    DKFAC_LEFT_LR_SCALE=0.5 python benchmarks/probes/lm_leftover_lr.py --threads 1 --seeds 3 \\
        --first-seed 100 --no-sweep --seconds 75 --eval-every 25 --optimizers kfac \\
        --recipe benchmarks/recipes/gpt-text.toml --name probe_left_lr0.5
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from dkfac.bench import lm, peers
from dkfac.optimizer import KFACOptimizer

SCALE = float(os.environ.get("DKFAC_LEFT_LR_SCALE", "0.5"))
_build = peers.build_optimizer


def build(spec: peers.OptimizerSpec, model: nn.Module, lr: float, momentum: float) -> Any:
    """The bench's optimizer; a K-FAC one with the leftover parameters at a scaled lr."""
    opt = _build(spec, model, lr, momentum)
    if not isinstance(opt, KFACOptimizer):
        return opt
    group = opt.inner.param_groups[0]
    taken = {id(p) for layer in opt.preconditioner.layers.values() for p in layer.block.parameters()}
    mine = [p for p in model.parameters() if p.requires_grad and id(p) in taken]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    inner = torch.optim.SGD(
        [{"params": mine}, {"params": rest, "lr": lr * SCALE}],
        lr=lr,
        momentum=0.0,
        weight_decay=group["weight_decay"],
    )
    return KFACOptimizer(inner, opt.preconditioner)


if __name__ == "__main__":
    torch.set_num_threads(1)
    lm.build_optimizer = build  # type: ignore[assignment]
    sys.exit(lm.main(sys.argv[1:]))
