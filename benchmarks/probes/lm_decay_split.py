"""Probe: the inner SGD's weight decay split between the blocks' 2-D weights and the rest.

``dkfac bench lm`` with every K-FAC optimizer's inner SGD rebuilt with two groups: the
transformer blocks' 2-D weights keep the recipe's ``weight-decay`` (0.5), every other
parameter (embeddings, head, LayerNorms, biases) gets ``DKFAC_OTHER_DECAY`` (default 0).

Measured (BENCHMARKS.md section 21, ``benchmarks/results/lm_leftover_tuning.json``): 0 and
1.0 on the rest lose 0.02-0.03 per step at 125 steps against 0.5 everywhere, 2.0 loses 0.13.

    DKFAC_OTHER_DECAY=0.0 python benchmarks/probes/lm_decay_split.py --threads 1 --seeds 3 \\
        --first-seed 100 --no-sweep --seconds 75 --eval-every 25 --optimizers kfac \\
        --recipe benchmarks/recipes/gpt-text.toml --name probe_decay_other0.0
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from dkfac.bench import lm, peers
from dkfac.optimizer import KFACOptimizer

OTHER = float(os.environ.get("DKFAC_OTHER_DECAY", "0.0"))
_build = peers.build_optimizer


def build(spec: peers.OptimizerSpec, model: nn.Module, lr: float, momentum: float) -> Any:
    """The bench's optimizer; a K-FAC one with its inner SGD split in two decay groups."""
    opt = _build(spec, model, lr, momentum)
    if not isinstance(opt, KFACOptimizer):
        return opt
    group = opt.inner.param_groups[0]
    decay = group["weight_decay"]
    hidden = [
        p
        for n, p in model.named_parameters()
        if p.requires_grad and n.startswith("blocks.") and p.dim() == 2
    ]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    inner = torch.optim.SGD(
        [{"params": hidden, "weight_decay": decay}, {"params": rest, "weight_decay": OTHER}],
        lr=lr,
        momentum=0.0,
    )
    return KFACOptimizer(inner, opt.preconditioner)


if __name__ == "__main__":
    torch.set_num_threads(1)
    lm.build_optimizer = build  # type: ignore[assignment]
    sys.exit(lm.main(sys.argv[1:]))
