"""Agreement on what exists this step, so every rank runs the same collectives.

A layer in a branch that only some ranks used this step (data-dependent control flow,
unused heads) has statistics and gradients on those ranks only. Collectives are matched by
position, so ranks that disagreed on the list of tensors would hang or mix tensors up. One
small all-reduce settles it before any reduction:

* a statistic is reduced only if every rank that captures it this step has it; otherwise it
  is skipped on every rank for this step (logged), like a factor update that never happened;
* a gradient (of a K-FAC layer or of any other parameter) that exists on some rank exists on
  every rank: the others contribute zeros, which is what the averaged gradient needs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from dkfac.distributed.comm import Communicator
from dkfac.engine.layer_state import LayerState, layers_device

logger = logging.getLogger(__name__)


def agree_presence(
    comm: Communicator,
    layers: Mapping[str, LayerState],
    stats: dict[str, dict[str, Tensor]],
    grads: dict[str, Tensor | None],
    other_params: Sequence[Tensor],
    *,
    statistics: bool = True,
) -> set[str]:
    """Makes ``stats``, ``grads`` and the other parameters' ``.grad`` agree across ranks.

    Args:
        comm: The communicator of the ranks that train together (a no-op on one rank).
        layers: The registered layers.
        stats: This step's statistics by layer; entries missing elsewhere are removed.
        grads: Gradient matrices by layer; ``None`` entries present elsewhere become zeros
            (and the layer's parameters get zero ``.grad``).
        other_params: Parameters not handled by a block; a missing ``.grad`` present
            elsewhere becomes zeros.
        statistics: ``False``: agree on the gradients only (the statistics were already
            launched by the overlapped path, :mod:`dkfac.engine.eager`).

    Returns:
        The layers with a due statistic that no rank or not every capturing rank has, the
        same on every rank (:func:`uncaptured` on one rank; empty without ``statistics``).
    """
    if not comm.active:
        return uncaptured(layers, stats) if statistics else set()
    all_keys = [(n, k) for n, layer in layers.items() for k in sorted(layer.due) if statistics]
    # A rank that does not capture a layer votes True for its statistics; "absent" flags
    # of gradients are AND-ed, so False means the gradient exists on some rank.
    stat_flags = [not layers[n].captures or k in stats.get(n, {}) for n, k in all_keys]
    grad_absent = [grads[name] is None for name in layers]
    other_absent = [p.grad is None for p in other_params]
    device = layers_device(layers)
    local = torch.tensor(stat_flags + grad_absent + other_absent, dtype=torch.bool, device=device)
    agreed = comm.all_true(local).tolist()
    skipped = set()
    for (name, key), ok in zip(all_keys, agreed[: len(all_keys)], strict=True):
        if not ok:
            skipped.add(name)
        if not ok and key in stats.get(name, {}):
            logger.warning("%s/%s missing on some rank this step; its update is skipped", name, key)
            del stats[name][key]
            if not stats[name]:
                del stats[name]
    offset = len(all_keys)
    for i, name in enumerate(layers):
        if grads[name] is None and not agreed[offset + i]:
            block = layers[name].block
            for param in block.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            grads[name] = block.weight_grad()
    offset += len(layers)
    for i, param in enumerate(other_params):
        if param.grad is None and not agreed[offset + i]:
            param.grad = torch.zeros_like(param)
    return skipped


def uncaptured(
    layers: Mapping[str, LayerState], stats: Mapping[str, Mapping[str, Tensor]]
) -> set[str]:
    """The layers this rank captures that lack a due statistic in ``stats`` (a layer in eval
    mode, or not run this step): :func:`agree_presence`'s answer on one rank."""
    return {
        name
        for name, layer in layers.items()
        if layer.captures and any(key not in stats.get(name, {}) for key in layer.due)
    }
