"""Probe: ``dkfac bench lm`` with an early schedule of the factor or basis intervals.

Every K-FAC run of ``dkfac bench lm`` gets its ``inverse_update_interval`` (``DKFAC_INV``)
and/or ``factor_update_interval`` (``DKFAC_FAC``) replaced by a two-phase schedule
``EVERY:UNTIL,LATER``: every ``EVERY`` steps before step ``UNTIL``, every ``LATER`` steps
after (a callable of the step, which a recipe file cannot hold). ``DKFAC_INV=5:20,20`` on
the LM recipe refreshes the basis at steps 0, 5, 10, 15, then every 20, as the recipe does.

Measured (BENCHMARKS.md section 25, seeds 100-102, 80 s, median validation loss after 25 /
50 / 75 / 100 steps): ``DKFAC_INV=5:20,20`` 2.75 / 2.52 / 2.37 / 2.20 against the
recipe's 2.74 / 2.52 / 2.36 / 2.18: the early refreshes change nothing.

    DKFAC_INV=5:20,20 python benchmarks/probes/lm_refresh_schedule.py --threads 1 --seeds 3 \\
        --first-seed 100 --no-sweep --seconds 80 --eval-every 25 --optimizers kfac \\
        --kfac-lrs 0.006 --recipe benchmarks/recipes/gpt-text.toml --name probe_inv_early
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dkfac.bench import lm, peers


def two_phase(name: str) -> Callable[[int], int] | None:
    """The schedule in the environment variable ``name`` (``EVERY:UNTIL,LATER``), if set."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        early, later = text.split(",")
        every, until = (int(part) for part in early.split(":"))
        late = int(later)
    except ValueError:
        raise SystemExit(f"{name} must read EVERY:UNTIL,LATER (integers), got {text!r}") from None
    if min(every, until, late) < 1:
        raise SystemExit(f"{name}: every number must be >= 1, got {text!r}")
    return lambda step: every if step < until else late


SCHEDULES = {
    "inverse_update_interval": two_phase("DKFAC_INV"),
    "factor_update_interval": two_phase("DKFAC_FAC"),
}
_build = peers.build_optimizer


def build(spec: peers.OptimizerSpec, model: nn.Module, lr: float, momentum: float) -> Any:
    """The bench's optimizer; a K-FAC one with the schedules of the environment."""
    if spec.kind == "kfac":
        extra = {key: value for key, value in SCHEDULES.items() if value is not None}
        spec = dataclasses.replace(spec, options={**spec.options, **extra})
    return _build(spec, model, lr, momentum)


if __name__ == "__main__":
    torch.set_num_threads(1)
    lm.build_optimizer = build
    sys.exit(lm.main(sys.argv[1:]))
