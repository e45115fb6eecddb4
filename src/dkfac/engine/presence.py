"""Agreement on what exists this step, so every rank runs the same collectives.

A layer in a branch that only some ranks used this step (data-dependent control flow,
unused heads) has statistics and gradients on those ranks only. Collectives are matched by
position, so ranks that disagreed on the list of tensors would hang or mix tensors up. One
small all-reduce settles it before any reduction:

* a statistic is reduced only if every rank that captures it this step has it; otherwise it
  is skipped on every rank for this step (logged), like a factor update that never happened;
* a gradient (of a K-FAC layer or of any other parameter) that exists on some rank exists on
  every rank: the others contribute zeros, which is what the averaged gradient needs;
* a layer that got no rows on a rank (an empty batch, an expert no token was routed to)
  takes part with zero statistics (:meth:`~dkfac.engine.capture.FactorCapture.take_layer`);
  where it got none on every rank, its statistics are skipped everywhere, as one process
  skips a step without rows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

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
    empty: AbstractSet[str] = frozenset(),
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
        empty: The layers whose statistics in ``stats`` are the zeros of no rows on this
            rank; skipped where every rank has them so.

    Returns:
        The layers with a due statistic that no rank or not every capturing rank has, the
        same on every rank (:func:`uncaptured` on one rank; empty without ``statistics``).
    """
    if not comm.active:
        return uncaptured(layers, stats) if statistics else set()
    all_keys = [(n, k) for n, layer in layers.items() for k in sorted(layer.due) if statistics]
    # A rank that does not capture a layer votes True for its statistics; "absent" and
    # "empty" flags are AND-ed too, so False means the gradient exists on some rank, and
    # True that no rank had a row of the layer.
    stat_flags = [not layers[n].captures or k in stats.get(n, {}) for n, k in all_keys]
    empty_flags = [n in empty for n, _ in all_keys]
    grad_absent = [grads[name] is None for name in layers]
    other_absent = [p.grad is None for p in other_params]
    device = layers_device(layers)
    flags = stat_flags + empty_flags + grad_absent + other_absent
    local = torch.tensor(flags, dtype=torch.bool, device=device)
    agreed = comm.all_true(local).tolist()
    present = agreed[: len(all_keys)]
    nowhere = agreed[len(all_keys) : 2 * len(all_keys)]  # no rows on any rank
    skipped = set()
    for (name, key), ok, no_rows in zip(all_keys, present, nowhere, strict=True):
        if ok and not no_rows:
            continue
        skipped.add(name)
        if key in stats.get(name, {}):
            if not no_rows:  # (a step without rows anywhere is skipped as in one process)
                logger.warning(
                    "%s/%s missing on some rank this step; its update is skipped", name, key
                )
            del stats[name][key]
            if not stats[name]:
                del stats[name]
    offset = 2 * len(all_keys)
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
