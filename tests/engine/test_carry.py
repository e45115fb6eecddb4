"""A training run whose refreshes carry the moments of the layers of one shape together
(:func:`dkfac.engine.carry.carry_all`) equals its twin that carries each layer alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dkfac import KFACPreconditioner
from dkfac.solvers.eigen_moments import EigenMomentsSolver
from tests.solvers.test_compute_batch import _model, _train


def _run(
    options: dict[str, Any], batched: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    sizes: list[int] = []
    if batched:
        original = EigenMomentsSolver.carry_batch

        def spy(self: Any, olds: Any, news: Any, moments: Any) -> Any:
            sizes.append(len(olds))
            return original(self, olds, news, moments)

        monkeypatch.setattr(EigenMomentsSolver, "carry_batch", spy)
    else:
        monkeypatch.setattr(EigenMomentsSolver, "carry_key", lambda self, o, n, m: None)
    model = _model()
    pre = KFACPreconditioner(
        model,
        damping=0.05,
        method="eigen_adam",
        inverse_update_interval=2,
        eigen_dtype=torch.float64,
        kl_clip=None,
        moment_eps=1e-3,
        **options,
    )
    _train(model, pre)
    monkeypatch.undo()
    assert (max(sizes, default=0) == 3) == batched  # the three 12 x 12 layers, together
    moments = [dict(layer.moments or {}) for layer in pre.layers.values()]
    return [p.detach().clone() for p in model.parameters()], moments


@pytest.mark.parametrize(
    "options",
    [
        {"basis_refresh": "power", "moment_carry": "rotate"},
        {"basis_refresh": "eigh", "moment_carry": "keep_v"},
        {"basis_refresh": "power", "moment_carry": "reset"},
    ],
)
def test_training_with_batched_carries_equals_carrying_each_layer(
    options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    alone, alone_moments = _run(options, batched=False, monkeypatch=monkeypatch)
    batched, batched_moments = _run(options, batched=True, monkeypatch=monkeypatch)
    for left, right in zip(alone, batched, strict=True):
        torch.testing.assert_close(left, right, rtol=1e-10, atol=1e-12)
    for left_m, right_m in zip(alone_moments, batched_moments, strict=True):
        assert left_m.keys() == right_m.keys()
        for key in left_m:
            torch.testing.assert_close(left_m[key], right_m[key], rtol=1e-10, atol=1e-12)
