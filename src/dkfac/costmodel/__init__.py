"""Analytic cost model of distributed K-FAC: bytes, memory and time per strategy.

Pure functions of layer shapes, world size and device rates (no process group):

- :func:`extract_layers`: an ``nn.Module`` -> :class:`ModelSpec` (K-FAC layer dimensions).
- :func:`predict_ledger_bytes`: ``{rank: {kind: bytes}}`` exactly as the
  :class:`~dkfac.distributed.ledger.CommLedger` counts them, for one step.
- :func:`predict_memory`: ``{rank: {kind: bytes}}`` of K-FAC state.
- :func:`predict`: time by phase, bytes and memory of one strategy; :func:`recommend` picks
  the fastest that fits a memory budget (used by ``dkfac plan`` and ``strategy="auto"``).

The per-strategy traffic choices are the strategies' own rules (:func:`rule_of`, read from
:data:`dkfac.distributed.strategies.STRATEGIES`); solver state sizes and speeds come from the
solver classes (:data:`dkfac.solvers.SOLVERS`); layers from the blocks' cost descriptions.
"""

from dkfac.costmodel.auto import AUTO_BATCH_PER_RANK, auto_candidates, select_strategy
from dkfac.costmodel.layers import (
    BNLayer,
    KFACLayer,
    ModelSpec,
    extract_layers,
    spec_from_blocks,
)
from dkfac.costmodel.predict import (
    PHASES,
    DeviceRates,
    StrategyPrediction,
    calibrate,
    candidate_strategies,
    predict,
    recommend,
)
from dkfac.costmodel.traffic import (
    KINDS,
    METHODS,
    STRATEGIES,
    DtypeBytes,
    StrategyRule,
    ddp_gradient_bytes,
    element_counts,
    placement_for,
    predict_ledger_bytes,
    predict_memory,
    priced_solver,
    rule_of,
)

__all__ = [
    "AUTO_BATCH_PER_RANK",
    "KINDS",
    "METHODS",
    "PHASES",
    "STRATEGIES",
    "BNLayer",
    "DeviceRates",
    "DtypeBytes",
    "KFACLayer",
    "ModelSpec",
    "StrategyPrediction",
    "StrategyRule",
    "auto_candidates",
    "calibrate",
    "candidate_strategies",
    "ddp_gradient_bytes",
    "element_counts",
    "extract_layers",
    "placement_for",
    "predict",
    "predict_ledger_bytes",
    "predict_memory",
    "priced_solver",
    "recommend",
    "rule_of",
    "select_strategy",
    "spec_from_blocks",
]
