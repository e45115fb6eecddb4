"""docs/adding-a-strategy.md, tried with a throwaway strategy: nothing outside distributed/
changes. The config accepts its name, the engine builds it and the cost model prices it by
its rule."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.costmodel import KFACLayer, ModelSpec, predict_ledger_bytes, rule_of
from dkfac.distributed.strategies import STRATEGIES, Strategy, register_strategy


class OwnerKeepsStrategy(Strategy):
    """The recipe's strategy: a name and a rule (here KAISA's, with every rank a worker)."""

    name = "owner-keeps"
    rule = dataclasses.replace(STRATEGIES["kaisa"].rule, fraction="one")


def _update(strategy: str) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    pre = KFACPreconditioner(model, strategy=strategy, kl_clip=None, factor_decay=0.0)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    pre.step()
    pre.remove_hooks()
    assert type(pre.strategy) is STRATEGIES[strategy]
    return torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]


def test_a_registered_strategy_is_built_and_priced() -> None:
    register_strategy(OwnerKeepsStrategy)
    try:
        # One rank: every strategy is the serial engine.
        torch.testing.assert_close(_update("owner-keeps"), _update("replicated"))
        assert rule_of("owner-keeps") is OwnerKeepsStrategy.rule
        spec = ModelSpec(layers=(KFACLayer(name="fc", a_dim=5, g_dim=3),))
        ours = predict_ledger_bytes(spec, 2, "owner-keeps")
        assert ours == predict_ledger_bytes(spec, 2, "kaisa", grad_worker_fraction=1.0)
    finally:
        STRATEGIES.pop("owner-keeps")
