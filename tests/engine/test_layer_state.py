"""The layers' statistics taken and averaged for all layers at once (``take_means_all``,
``update_running_all``): each equals its per-layer form bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.engine.layer_state import take_means_all, update_running_all
from dkfac.solvers.statistics import FactorAccumulator


def _captured(**options: object) -> KFACPreconditioner:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(3 * 16, 4)
    ).double()
    pre = KFACPreconditioner(model, damping=0.1, **options)
    x = torch.randn(6, 1, 6, 6, dtype=torch.float64)
    F.cross_entropy(model(x), torch.arange(6) % 4).backward()
    return pre


def test_the_means_of_all_layers_equal_each_accumulator_s_mean() -> None:
    pre = _captured(method="eigen")
    want = {
        name: {key: acc.mean() for key, acc in layer.accumulators.items()}
        for name, layer in pre.layers.items()
    }
    assert all(
        type(a) is FactorAccumulator for x in pre.layers.values() for a in x.accumulators.values()
    )
    got = take_means_all(pre.layers)
    assert list(got) == list(want)
    for name, means in want.items():
        assert list(got[name]) == list(means)
        for key, value in means.items():
            assert torch.equal(got[name][key], value), (name, key)
    assert not any(a.has_data for x in pre.layers.values() for a in x.accumulators.values())
    assert take_means_all(pre.layers) == {}


def test_the_means_leave_out_a_layer_without_statistics_and_keep_low_rank_ones() -> None:
    pre = _captured(method="smw", factor_decay=0.0)  # 6 rows of the linear layer: low rank
    kinds = {type(a) for x in pre.layers.values() for a in x.accumulators.values()}
    assert FactorAccumulator in kinds and len(kinds) > 1
    first = next(iter(pre.layers.values()))
    first.reset_accumulators()
    want = {
        name: {key: acc.mean() for key, acc in layer.accumulators.items() if acc.has_data}
        for name, layer in pre.layers.items()
        if layer is not first
    }
    got = take_means_all(pre.layers)
    assert list(got) == list(want)
    for name, means in want.items():
        for key, value in means.items():
            assert torch.equal(got[name][key], value), (name, key)


def test_a_decay_of_zero_copies_the_new_value_into_the_running_one() -> None:
    pre = _captured(method="eigen")
    new = take_means_all(pre.layers)
    update_running_all(pre.layers, new, 0.5)  # first values: taken as they are
    running = {n: dict(layer.running) for n, layer in pre.layers.items()}
    again = {n: {k: v * 2.0 + 1.0 for k, v in stats.items()} for n, stats in new.items()}
    update_running_all(pre.layers, again, 0.0)
    for name, stats in again.items():
        for key, value in stats.items():
            held = pre.layers[name].running[key]
            assert held is running[name][key]  # the same tensor, the new values
            assert torch.equal(held, value)
            assert held is not value
