"""Grouped and depthwise convolutions: a unit-wise Fisher per output channel.

Oracles: per-sample gradients from torch.func (vmap of grad of each sample's own loss)
arranged per output channel, a dense solve of ``(F_o + λ I)`` per unit, the registry's
decline reasons, and, on 2 gloo ranks, the serial run on the same global batch (through
tests/serial_vs_distributed.py) with DDP, with ``spngd``'s own reduction and sharded by
FSDP2, under ``eigen`` and under ``eigen_adam`` (whose ``unitwise_adam`` update is
tests/solvers/test_unitwise_adam.py's).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.blocks.grouped_conv import MAX_UNIT_DIM, GroupedConvBlock
from dkfac.blocks.registry import block_or_reason
from tests.distributed_utils import run_distributed
from tests.oracles import SumSink, per_sample_unit_grads, unitwise_update
from tests.serial_vs_distributed import assert_ranks_match, shard_children, train_sharded

DT = torch.float64

# (module, one sample's input shape)
CONVS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "depthwise": (lambda: nn.Conv2d(3, 3, 3, padding=1, groups=3), (3, 5, 5)),
    "multiplier": (lambda: nn.Conv2d(3, 6, 3, stride=2, groups=3, bias=False), (3, 7, 6)),
    "groups2": (
        lambda: nn.Conv2d(4, 6, (2, 3), dilation=(2, 1), padding=(1, 2), groups=2),
        (4, 6, 5),
    ),
    "same_reflect": (
        lambda: nn.Conv2d(4, 4, 4, padding="same", groups=2, padding_mode="reflect"),
        (4, 6, 6),
    ),
    "conv1d": (lambda: nn.Conv1d(4, 8, 3, stride=2, padding=2, dilation=2, groups=4), (4, 11)),
    "conv1d_groups2": (lambda: nn.Conv1d(4, 2, 5, groups=2, bias=False), (4, 9)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONVS))
def test_the_fisher_is_each_output_channel_s_per_sample_gradients(case: str) -> None:
    make, shape = CONVS[case]
    torch.manual_seed(0)
    conv = make().to(DT)
    block = GroupedConvBlock("conv", conv)
    x = torch.randn(5, *shape, dtype=DT)
    delta = torch.randn_like(conv(x))
    sink = SumSink()
    context = block.capture_input(x, {"F": sink})
    block.capture_grad(context, delta, {"F": sink}, scale=4.0)
    units = per_sample_unit_grads(conv, x, delta)  # (N, C, d)
    out_channels, dim = units.shape[1], units.shape[2]
    assert dim == math.prod(conv.weight.shape[1:]) + int(conv.bias is not None) == block.a_dim
    assert block.statistic_shapes() == {"F": (out_channels, dim, dim)}
    assert sink.total is not None and sink.count == 5
    for o in range(out_channels):
        torch.testing.assert_close(sink.total[o], 4.0 * units[:, o].T @ units[:, o])
    # the gradient matrix's rows are the units, in the same order
    conv.zero_grad()
    (conv(x) * delta).sum().backward()
    torch.testing.assert_close(block.weight_grad(), units.sum(dim=0))


def _model(case: str) -> nn.Module:
    make, shape = CONVS[case]
    torch.manual_seed(0)
    conv = make()
    with torch.no_grad():
        out = conv(torch.zeros(1, *shape))
    return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(out.numel(), 3)).to(DT)


@pytest.mark.parametrize("case", ["depthwise", "multiplier", "groups2", "conv1d_groups2"])
def test_the_update_is_a_dense_solve_per_output_channel(case: str) -> None:
    model = _model(case)
    x = torch.randn(6, *CONVS[case][1], dtype=DT)
    y = torch.randint(0, 3, (6,))
    expected = unitwise_update(model, x, y, damping=0.05)
    pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, damping=0.05, bn_damping=9.0)
    assert pre.layers["0"].solver.name == "unitwise"
    F.cross_entropy(model(x), y).backward()
    pre.step()
    got = pre.layers["0"].block.weight_grad()
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_declines_and_registry() -> None:
    wide = nn.Conv2d(64, 8, 3, groups=2)  # d = 32·9 + 1 = 289
    assert MAX_UNIT_DIM == 256
    assert block_or_reason("w", wide) == (
        "grouped convolution (groups=2) with 289 parameters per output channel: its "
        "unit-wise Fisher takes at most 256"
    )
    assert block_or_reason("t", nn.ConvTranspose2d(4, 4, 3, groups=2)) == (
        "grouped transposed convolution (groups=2) is not supported"
    )
    assert isinstance(block_or_reason("d", nn.Conv1d(4, 4, 3, groups=4)), GroupedConvBlock)
    assert type(block_or_reason("p", nn.Conv2d(4, 4, 3))).__name__ == "Conv2dBlock"
    with pytest.raises(ValueError, match="groups=1"):
        GroupedConvBlock("p", nn.Conv2d(4, 4, 3))
    with pytest.raises(TypeError, match=r"nn\.Conv1d or nn\.Conv2d"):
        GroupedConvBlock("l", nn.Linear(4, 4))
    block = GroupedConvBlock("d", nn.Conv2d(8, 16, 7, groups=8))  # d = 49 + 1
    assert block.placement_cost("compute") == 16 * 50**3
    assert block.placement_cost("memory") == 16 * 50**2
    cost = block.cost_description()
    assert (cost.kind, cost.a_dim, cost.g_dim, cost.unitwise) == ("grouped_conv", 50, 16, True)


def test_the_optimizer_state_round_trips_through_a_checkpoint() -> None:
    def fresh() -> tuple[nn.Module, KFACOptimizer]:
        model = _model("multiplier")
        return model, KFACOptimizer.for_model(model, lr=0.01)

    def train(model: nn.Module, opt: KFACOptimizer, steps: range) -> None:
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(8, 3, 7, 6, generator=gen, dtype=DT)
            opt.zero_grad()
            F.cross_entropy(model(x), torch.randint(0, 3, (8,), generator=gen)).backward()
            opt.step()

    model, opt = fresh()
    train(model, opt, range(3))
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, range(3, 6))
    assert "0" in opt.preconditioner.layers
    twin, twin_opt = fresh()
    twin.load_state_dict(state["model"])
    twin_opt.load_state_dict(state["opt"])
    train(twin, twin_opt, range(3, 6))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- 2 ranks equal serial
PER_RANK = 4
STEPS = 3
OPTIONS: dict[str, Any] = {
    "inverse_update_interval": 2,
    "factor_decay": 0.9,
    "damping": 0.01,
    "kl_clip": 1e-3,
}


def _dw_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, groups=2),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 16, 3),
    ).to(DT)


def _batch(step: int, world: int, per_rank: int = PER_RANK) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(200 + step)
    x = torch.randn(per_rank * world, 2, 4, 4, generator=gen, dtype=DT)
    return x, torch.randint(0, 3, (per_rank * world,), generator=gen)


CONFIGS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "replicated-ddp": ("replicated", True, {}),
    "spngd": ("spngd", False, {}),
    # unitwise_adam, the moments on every rank that preconditions the layer. Adam in a basis
    # is not invariant to rotations inside a degenerate eigenspace, which rounding picks (as
    # in tests/engine/test_moments_dist.py): 80 rows make every factor and unit-wise Fisher
    # full-rank (the Linear's A is 65 wide), and ε is large against the gradient's rounding.
    "mem-opt-eigen_adam": ("mem-opt", True, {"method": "eigen_adam", "moment_eps": 1e-6}),
    # sharded by FSDP2 (every layer with parameters, then the root): the units' weights cut
    # on dim 0, the output channels
    "fsdp": ("replicated", False, {"fsdp": True}),
    "fsdp-eigen_adam": (
        "replicated",
        False,
        {"fsdp": True, "method": "eigen_adam", "moment_eps": 1e-6},
    ),
}
ADAM_PER_RANK = 40


def _train(rank: int | None, world: int, config: str) -> list[Tensor]:
    strategy, ddp, options = CONFIGS[config]
    options = dict(options)
    fsdp = options.pop("fsdp", False)
    per_rank = ADAM_PER_RANK if options else PER_RANK
    run = train_sharded(
        rank,
        world,
        model_fn=_dw_model,
        batch_fn=functools.partial(_batch, world=world, per_rank=per_rank),
        steps=STEPS,
        ddp=ddp and rank is not None,
        shard=shard_children if fsdp and rank is not None else None,
        strategy=strategy,
        **OPTIONS,
        **options,
    )
    assert {"0", "2"} <= set(run.pre.layers)
    expected = "unitwise_adam" if options.get("method") == "eigen_adam" else "unitwise"
    assert {run.pre.layers[n].solver.name for n in ("0", "2")} == {expected}
    return run.params()


def _rank_main(rank: int, world: int) -> dict[str, list[Tensor]]:
    return {config: _train(rank, world, config) for config in CONFIGS}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, list[Tensor]]]:
    """Both configurations in one spawn of 2 ranks."""
    return run_distributed(_rank_main, 2, timeout=120)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_grouped_convs_on_two_ranks_equal_serial(
    config: str, two_ranks: list[dict[str, list[Tensor]]]
) -> None:
    assert_ranks_match(
        [result[config] for result in two_ranks],
        _train(None, 2, config),
        label=config,
        # eigen_adam's Linear: test_moments_dist.py's tolerance (Adam divides by the
        # rounding of small moments)
        **(
            {"rtol": 1e-9, "atol": 1e-11}
            if "method" in CONFIGS[config][2]
            else {"rtol": 1e-10, "atol": 1e-12}
        ),
    )
