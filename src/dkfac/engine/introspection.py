"""What a preconditioner reports about itself: ``describe()``, ``memory_usage()``, ``factors()``.

Pure functions over the registered layers and the parts beside them (the coverage of the
model's parameters, the strategy's placement, the leftover optimizer, the overhead
budget); :class:`dkfac.KFACPreconditioner` documents the rows and the kinds of bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from dkfac.distributed.strategy_base import Strategy
from dkfac.engine.capture import FactorCapture
from dkfac.engine.coverage import Coverage
from dkfac.engine.eager import EagerReducer
from dkfac.engine.layer_state import LayerState
from dkfac.engine.leftover import LeftoverAdam
from dkfac.engine.overhead import OverheadBudget

__all__ = ["describe_table", "memory_usage", "running_factors"]


def describe_table(
    layers: Mapping[str, LayerState],
    roles: Mapping[str, str],
    strategy: Strategy,
    coverage: Coverage,
    leftover: LeftoverAdam | None,
    budget: OverheadBudget | None,
) -> list[dict[str, Any]]:
    """One row per layer, one per parameter left to the inner optimizer, then the budget's.

    Args:
        layers: The registered layers, in registration order.
        roles: Layer name -> its role in Muon's split (absent: none).
        strategy: Says each layer's owner and workers.
        coverage: The parameters no layer takes, and why.
        leftover: Adam for the parameters left out (their rows' ``method`` is ``"adam"``).
        budget: The overhead budget, if any: a last row says what it chose and why.
    """
    rows = {
        name: {**x.summary(), "role": roles.get(name), **strategy.describe(name)}
        for name, x in layers.items()
    }
    table = coverage.table(rows)
    if leftover is not None:
        for row in table:
            if row["block"] == "inner optimizer" and row["name"] in leftover.params:
                row["method"] = "adam"
    if budget is not None and table:
        choice = budget.choice
        reason = choice.reason if choice else "chosen after the first step"
        row = dict.fromkeys(table[0])
        table.append({**row, "name": "overhead budget", "block": "cost", "reason": reason})
    return table


def memory_usage(
    layers: Mapping[str, LayerState],
    capture: FactorCapture,
    eager: EagerReducer | None,
    leftover: LeftoverAdam | None,
) -> dict[str, int]:
    """Bytes held on this rank by kind: the layers' ``factors``, ``inverses`` and ``moments``,
    the capture's (and the overlapped reduction's) ``accumulators`` and the leftover
    optimizer's moments."""
    usage = {"factors": 0, "inverses": 0, "moments": 0, "accumulators": 0}
    for layer in layers.values():
        for kind, nbytes in layer.memory().items():
            usage[kind] += nbytes
    usage["accumulators"] += capture.held_bytes()
    if eager is not None:  # statistics already handed to the overlapped reduction
        usage["accumulators"] += eager.pending_bytes()
    if leftover is not None:
        usage["moments"] += leftover.nbytes()
    return usage


def running_factors(layers: Mapping[str, LayerState]) -> dict[str, tuple[Tensor, Tensor]]:
    """``name -> (A, G)`` of the layers that keep both running factors on this rank."""
    return {
        name: (layer.a, layer.g)
        for name, layer in layers.items()
        if layer.a is not None and layer.g is not None
    }
