"""Lightning Fabric with ``KFACOptimizer``, for real, against the hand-written loop Fabric
stands for: ``fabric.setup(model, optimizer)`` (the optimizer built on the bare model first)
and ``setup_module`` then ``setup_optimizers`` (the optimizer built on Fabric's module), with
``fabric.backward``, in float32 and under ``bf16-mixed`` (inputs cast to bfloat16, the
forward under autocast, outputs back in float32, as Fabric documents it). The layers keep the bare
model's names (Fabric's ``_FabricModule`` is unwrapped as DDP is), so a checkpoint moves
between a Fabric run and a bare one."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed
from tests.integrations.twins import max_difference

lightning = pytest.importorskip("lightning")
Fabric = lightning.fabric.Fabric

STEPS = 5


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.LayerNorm(16),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 3),
    )


def _batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)


def _hand(autocast: bool, steps: int = STEPS) -> tuple[nn.Module, KFACOptimizer]:
    model = _net()
    opt = KFACOptimizer.for_model(model, overhead=None)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        if autocast:  # Fabric's bf16-mixed: inputs cast, autocast, float32 outputs
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x.to(torch.bfloat16))
            F.cross_entropy(out.float(), y).backward()
        else:
            F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _fabric(precision: str, order: str) -> tuple[nn.Module, object]:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = _net()
    if order == "setup":
        model, opt = fabric.setup(model, KFACOptimizer.for_model(model, overhead=None))
    else:
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(KFACOptimizer.for_model(model, overhead=None))
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        fabric.backward(F.cross_entropy(model(x), y))
        opt.step()
    return model, opt


@pytest.mark.parametrize("order", ["setup", "setup_module"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_trains_as_the_hand_loop(precision: str, order: str) -> None:
    model, _ = _fabric(precision, order)
    twin, _ = _hand(autocast=precision == "bf16-mixed")
    assert max_difference(model, twin) == 0.0


def test_fabric_layers_keep_the_bare_names_and_a_checkpoint_moves_to_a_bare_run() -> None:
    model, opt = _fabric("32-true", "setup_module")
    names = [row["name"] for row in opt.preconditioner.describe()]  # type: ignore[attr-defined]
    assert names[:3] == ["0", "3", "5"]
    assert not any("_forward_module" in name for name in names)
    saved = opt.state_dict()  # type: ignore[attr-defined]
    bare, bare_opt = _hand(autocast=False, steps=0)
    bare.load_state_dict(
        {k.removeprefix("_forward_module."): v for k, v in model.state_dict().items()}
    )
    bare_opt.load_state_dict(saved)
    twin, twin_opt = _hand(autocast=False)  # the same five steps, then both go on
    for step in range(STEPS, STEPS + 3):
        for net, optimizer in ((bare, bare_opt), (twin, twin_opt)):
            x, y = _batch(step)
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
    assert max_difference(bare, twin) == 0.0


def _ddp_rank(rank: int, world: int) -> dict[str, float]:
    """Fabric's ``ddp`` strategy in a process group already started (as ``torchrun`` leaves
    one): both setup orders, this rank's half of each batch, against serial K-FAC on the
    whole batch."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # unused: the group is already there
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
    fabric.launch()
    serial = _net().double()
    serial_opt = KFACOptimizer.for_model(serial, overhead=None)
    gaps: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for order in ("setup", "setup_module"):
        model = _net().double()
        if order == "setup":
            models[order] = fabric.setup(model, KFACOptimizer.for_model(model, overhead=None))
        else:
            model = fabric.setup_module(model)
            models[order] = (
                model,
                fabric.setup_optimizers(KFACOptimizer.for_model(model, overhead=None)),
            )
    half = slice(16 * rank, 16 * (rank + 1))
    for step in range(STEPS):
        x, y = _batch(step)
        x = x.double()
        for model, opt in models.values():
            opt.zero_grad()
            fabric.backward(F.cross_entropy(model(x[half]), y[half]))
            opt.step()
        serial_opt.zero_grad()
        F.cross_entropy(serial(x), y).backward()
        serial_opt.step()
    for order, (model, _) in models.items():
        gaps[order] = max_difference(model, serial)
    return gaps


def test_fabric_ddp_on_two_ranks_trains_as_serial_kfac() -> None:
    for gaps in run_distributed(_ddp_rank, 2, timeout=120):
        assert gaps["setup"] < 1e-12 and gaps["setup_module"] < 1e-12, gaps
