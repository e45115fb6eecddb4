"""Probe: the inner SGD in two groups, the second with its own decay or learning rate.

``dkfac bench lm`` with every K-FAC optimizer's inner SGD rebuilt with two groups. Which
parameters form the first group (``DKFAC_SPLIT``):

- ``blocks`` (default): the transformer blocks' 2-D weights;
- ``taken``: every parameter of a layer the preconditioner takes (the rest are those
  ``leftover_update`` gives Adam's direction: the embeddings and head under the LM recipe's
  ``skip-layers``, and the LayerNorms).

The first group keeps the recipe's lr and weight decay; the second gets the weight decay
``DKFAC_OTHER_DECAY`` (default: the recipe's) and the lr ``lr · DKFAC_OTHER_LR_SCALE``
(default 1; Muon's AdamW part runs the embeddings, head and LayerNorms at 0.001 against the
recipe's 0.006).

Measured (``benchmarks/results/lm_leftover_tuning.json``, BENCHMARKS.md section 21): with
``blocks``, a decay of 0 and 1.0 on the rest lose 0.02-0.03 per step at 125 steps against
0.5 everywhere, 2.0 loses 0.13. (``benchmarks/results/lm_batched_tuning.json``, section
22): with ``taken``, the lr scaled by 0.5 is level per step and by 0.25 loses 0.02-0.04.

    DKFAC_OTHER_DECAY=0.0 python benchmarks/probes/lm_decay_split.py --threads 1 --seeds 3 \\
        --first-seed 100 --no-sweep --seconds 75 --eval-every 25 --optimizers kfac \\
        --recipe benchmarks/recipes/gpt-text.toml --name probe_decay_other0.0
    DKFAC_SPLIT=taken DKFAC_OTHER_LR_SCALE=0.5 python benchmarks/probes/lm_decay_split.py \\
        ... --seconds 80 ... --name probe_left_lr0.5
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from dkfac.bench import lm, peers
from dkfac.optimizer import KFACOptimizer

SPLIT = os.environ.get("DKFAC_SPLIT", "blocks")
OTHER_DECAY = os.environ.get("DKFAC_OTHER_DECAY")
OTHER_LR_SCALE = float(os.environ.get("DKFAC_OTHER_LR_SCALE", "1.0"))
_build = peers.build_optimizer


def first_group(opt: KFACOptimizer, model: nn.Module) -> list[torch.Tensor]:
    """The parameters of the first group (``DKFAC_SPLIT``)."""
    if SPLIT == "taken":
        taken = {
            id(p) for layer in opt.preconditioner.layers.values() for p in layer.block.parameters()
        }
        return [p for p in model.parameters() if p.requires_grad and id(p) in taken]
    if SPLIT != "blocks":
        raise SystemExit(f"DKFAC_SPLIT must be 'blocks' or 'taken', got {SPLIT!r}")
    return [
        p
        for n, p in model.named_parameters()
        if p.requires_grad and n.startswith("blocks.") and p.dim() == 2
    ]


def build(spec: peers.OptimizerSpec, model: nn.Module, lr: float, momentum: float) -> Any:
    """The bench's optimizer; a K-FAC one with its inner SGD split in two groups."""
    opt = _build(spec, model, lr, momentum)
    if not isinstance(opt, KFACOptimizer):
        return opt
    decay = opt.inner.param_groups[0]["weight_decay"]
    first = first_group(opt, model)
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    other = {
        "params": rest,
        "weight_decay": decay if OTHER_DECAY is None else float(OTHER_DECAY),
        "lr": lr * OTHER_LR_SCALE,
    }
    inner = torch.optim.SGD([{"params": first, "weight_decay": decay}, other], lr=lr, momentum=0.0)
    return KFACOptimizer(inner, opt.preconditioner)


if __name__ == "__main__":
    torch.set_num_threads(1)
    lm.build_optimizer = build  # type: ignore[assignment]
    sys.exit(lm.main(sys.argv[1:]))
