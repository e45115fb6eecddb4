"""Unit-wise BatchNorm through the preconditioner (SP-NGD).

Oracles: per-sample gradients of (γ, β) from torch.func (vmap of grad of each sample's own
loss, with x̂ built from the batch moments by an explicit formula), a dense 2×2 solve per
channel, and, on 2 gloo ranks, a serial run that feeds the same per-rank shards as
micro-batches (so BatchNorm sees the same batch statistics), through
tests/serial_vs_distributed.py.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dkfac import KFACPreconditioner
from dkfac.blocks.unitwise_stats import (
    batch_moments,
    grouped_unit_fisher,
    per_sample_grads,
    unit_fisher,
)
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import assert_ranks_match, train_sharded

DT = torch.float64


def _conv_bn_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 16, 4),
    ).to(DT)
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.0, 1.5, -0.7]))  # γ = 0 must not matter
        model[1].bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return model


def _linear_bn_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3)).to(DT)


def _x_hat(x: torch.Tensor, eps: float) -> torch.Tensor:
    dims = [0, *range(2, x.dim())]
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def _oracle_update(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, bn_damping: float
) -> torch.Tensor:
    """(F_c + μI)^{-1}[∇γ_c, ∇β_c] with F_c from torch.func per-sample gradients."""
    bn = model[1]
    head = nn.Sequential(*list(model)[2:])
    bn_input = model[0](x).detach()
    x_hat = _x_hat(bn_input, bn.eps)
    view = [-1] + [1] * (x_hat.dim() - 2)
    params = {k: v.detach() for k, v in head.named_parameters()}

    def sample_loss(gamma: torch.Tensor, beta: torch.Tensor, xh: torch.Tensor, t: torch.Tensor):
        out = gamma.view(view) * xh + beta.view(view)
        logits = functional_call(head, params, (out.unsqueeze(0),))
        return F.cross_entropy(logits, t.unsqueeze(0))

    g_gamma, g_beta = vmap(grad(sample_loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(
        bn.weight.detach(), bn.bias.detach(), x_hat, y
    )
    per_sample = torch.stack([g_gamma, g_beta], dim=-1)  # (N, C, 2)
    fisher = torch.einsum("nci,ncj->cij", per_sample, per_sample) / x.shape[0]
    mean_grad = per_sample.mean(dim=0)  # the batch gradient of the mean loss
    eye = torch.eye(2, dtype=DT)
    return torch.stack(
        [
            torch.linalg.solve(fisher[c] + bn_damping * eye, mean_grad[c])
            for c in range(fisher.shape[0])
        ]
    )


@pytest.mark.parametrize("make,shape", [(_conv_bn_model, (6, 2, 4, 4)), (_linear_bn_model, (7, 5))])
def test_unitwise_update_equals_per_channel_solve_of_per_sample_fisher(make, shape) -> None:
    model = make()
    x = torch.randn(*shape, dtype=DT)
    y = torch.randint(0, model[-1].out_features, (shape[0],))
    expected = _oracle_update(model, x, y, bn_damping=0.05)
    pre = KFACPreconditioner(
        model, factor_decay=0.0, kl_clip=None, damping=1e-3, bn_damping=0.05, eigen_dtype=DT
    )
    assert pre.layers["1"].solver.name == "unitwise"
    F.cross_entropy(model(x), y).backward()
    pre.step()
    got = torch.stack([model[1].weight.grad, model[1].bias.grad], dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_bn_damping_defaults_to_damping_and_follows_schedule() -> None:
    x = torch.randn(6, 2, 4, 4, dtype=DT)
    y = torch.randint(0, 4, (6,))
    outs = {}
    for label, options in {
        "default": {"damping": 0.2},
        "explicit": {"damping": 1e-3, "bn_damping": lambda step: 0.2},
    }.items():
        model = _conv_bn_model()
        pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, **options)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        outs[label] = torch.stack([model[1].weight.grad, model[1].bias.grad], dim=1)
    torch.testing.assert_close(outs["default"], outs["explicit"])
    torch.testing.assert_close(outs["default"], _oracle_update(_conv_bn_model(), x, y, 0.2))


def test_unitwise_bn_can_be_turned_off_and_eval_mode_captures_nothing() -> None:
    model = _conv_bn_model()
    assert "1" not in KFACPreconditioner(model, unitwise_bn=False).layers
    with pytest.raises(TypeError, match="unitwise_bn"):
        KFACPreconditioner(model, unitwise_bn="yes")
    model = _conv_bn_model()
    pre = KFACPreconditioner(model, kl_clip=None)
    model.eval()
    F.cross_entropy(model(torch.randn(4, 2, 4, 4, dtype=DT)), torch.tensor([0, 1, 2, 3])).backward()
    raw = model[1].weight.grad.clone()
    pre.step()
    assert not pre.layers["1"].running  # no statistic without batch statistics
    torch.testing.assert_close(model[1].weight.grad, raw)  # plain gradient kept


def test_sync_batchnorm_in_one_process_is_preconditioned_like_batchnorm() -> None:
    """Without a process group SyncBatchNorm normalises by the local batch: same update.

    (Across ranks it needs CUDA, which CI lacks; the block's docstring says what it does
    there.)
    """
    grads = []
    for sync in (False, True):
        model = _conv_bn_model()
        if sync:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        assert isinstance(model[1], nn.SyncBatchNorm) == sync
        pre = KFACPreconditioner(model, damping=0.01, kl_clip=None)
        torch.manual_seed(1)
        x, y = torch.randn(6, 2, 4, 4, dtype=DT), torch.randint(0, 4, (6,))
        for _ in range(2):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
        assert "1" in pre.layers and pre.layers["1"].running
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, synced in zip(*grads, strict=True):
        torch.testing.assert_close(synced, plain, rtol=0, atol=0)


# ---------------------------------------------------------------- 2 ranks equal serial
PER_RANK = 6
STEPS = 3
OPTIONS: dict[str, Any] = {
    "inverse_update_interval": 2,
    "factor_decay": 0.9,
    "damping": 0.01,
    "bn_damping": 0.05,
    "kl_clip": 1e-3,
}


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(PER_RANK * world, 2, 4, 4, generator=gen, dtype=DT)
    return x, torch.randint(0, 4, (PER_RANK * world,), generator=gen)


STRATEGIES = ("replicated", "spngd")


def _train(rank: int | None, world: int, strategy: str) -> list[torch.Tensor]:
    """Rank ``rank``'s shard of ``world``; ``rank=None``: the serial twin, one process
    feeding each rank's shard as a micro-batch (so BatchNorm sees the same statistics)."""
    run = train_sharded(
        0 if rank is None else rank,
        1 if rank is None else world,
        micro=world if rank is None else 1,
        model_fn=_conv_bn_model,
        batch_fn=functools.partial(_batch, world=world),
        steps=STEPS,
        strategy=strategy,
        **OPTIONS,
    )
    return run.params()


def _rank_main(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    return {s: _train(rank, world, s) for s in STRATEGIES}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, list[torch.Tensor]]]:
    """Both strategies in one spawn of 2 ranks."""
    return run_distributed(_rank_main, 2, timeout=120)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batchnorm_two_ranks_equal_serial(
    strategy: str, two_ranks: list[dict[str, list[torch.Tensor]]]
) -> None:
    assert_ranks_match(
        [result[strategy] for result in two_ranks],
        _train(None, 2, strategy),
        label=strategy,
        rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize("shape", [(3, 7, 4), (3, 9, 4, 5, 6), (4, 9, 5)])
def test_grouped_unit_fisher_equals_each_layer_s(shape: tuple[int, ...]) -> None:
    """The group's sums (moments by one var_mean) equal each layer's own to rounding."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen, dtype=DT) * 2.0 + 1.5
    delta = torch.randn(shape, generator=gen, dtype=DT)
    got = grouped_unit_fisher(x, delta, 1e-5)
    assert got.shape == (shape[0], shape[2], 2, 2)
    for layer in range(shape[0]):
        mean, inv_std = batch_moments(x[layer], 1e-5)
        want = unit_fisher(*per_sample_grads(x[layer], mean, inv_std, delta[layer]))
        torch.testing.assert_close(got[layer], want, rtol=1e-12, atol=1e-12)
