"""``nn.Conv1d``: equal to its hand-written 2-D twin (kernel ``(1, k)`` on height-1 inputs)
under every convention, and its input factor equal to the patch formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.blocks.conv1d import Conv1dBlock

DT = torch.float64
CASES = [
    {"kernel_size": 3},
    {"kernel_size": 3, "stride": 2, "padding": 1, "bias": False},
    {"kernel_size": 2, "dilation": 2, "padding": "same"},
    {"kernel_size": 3, "padding": 2, "padding_mode": "reflect"},
    {"kernel_size": 3, "padding": 1, "padding_mode": "circular"},
]


def _twins(case: dict) -> tuple[nn.Module, nn.Module]:
    """A Conv1d network and the same network written with Conv2d over height-1 images."""
    torch.manual_seed(0)
    conv = nn.Conv1d(3, 4, **case).to(DT)
    twin_case = {
        **case,
        "kernel_size": (1, case["kernel_size"]),
        "stride": (1, case.get("stride", 1)),
        "dilation": (1, case.get("dilation", 1)),
    }
    padding = case.get("padding", 0)
    twin_case["padding"] = padding if isinstance(padding, str) else (0, padding)
    twin = nn.Conv2d(3, 4, **twin_case).to(DT)
    with torch.no_grad():
        twin.weight.copy_(conv.weight.unsqueeze(2))
        if conv.bias is not None:
            twin.bias.copy_(conv.bias)
    head = nn.Linear(4, 2).to(DT)
    return nn.Sequential(conv, nn.Tanh(), _Mean(), head), nn.Sequential(
        twin, nn.Tanh(), _Mean(), _copy(head)
    )


class _Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).mean(-1)


def _copy(module: nn.Linear) -> nn.Linear:
    twin = nn.Linear(module.in_features, module.out_features).to(DT)
    twin.load_state_dict(module.state_dict())
    return twin


def _step(model: nn.Module, x: torch.Tensor, **options: object) -> KFACPreconditioner:
    pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, damping=0.01, **options)
    F.cross_entropy(model(x), torch.arange(x.shape[0]) % 2).backward()
    pre.step()
    return pre


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("reduction", [None, "sum", "subsample"])
def test_conv1d_equals_its_2d_twin(case: dict, reduction: str | None) -> None:
    """Factors and the preconditioned gradient of every layer, under each convention (the
    subsampled positions drawn alike: same seed, same step, same counts)."""
    model, twin = _twins(case)
    x = torch.randn(5, 3, 11, dtype=DT)
    options = {"conv_reduction": reduction, "subsample_positions": 4, "seed": 3}
    one, two = _step(model, x, **options), _step(twin, x.unsqueeze(2), **options)
    assert isinstance(one.layers["0"].block, Conv1dBlock)
    for (a1, g1), (a2, g2) in zip(one.factors().values(), two.factors().values(), strict=True):
        torch.testing.assert_close(a1, a2)
        torch.testing.assert_close(g1, g2)
    for p1, p2 in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad.reshape(p1.grad.shape))


def test_input_factor_equals_the_patch_formula() -> None:
    """``A = (1/(B·T)) Σ ā ā^T`` over the padded input's windows (``Tensor.unfold``: no
    shared code with the block), the bias column appended."""
    conv = nn.Conv1d(2, 3, 3, stride=2, padding=1).to(DT)
    x = torch.randn(4, 2, 9, dtype=DT)
    pre = _step(nn.Sequential(conv, _Mean()), x)
    windows = F.pad(x, (1, 1)).unfold(-1, 3, 2)  # (B, C, T, k)
    rows = windows.permute(0, 2, 1, 3).reshape(-1, 2 * 3)  # channel-major, then kernel
    rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=DT)], dim=1)
    torch.testing.assert_close(pre.factors()["0"][0], rows.T @ rows / rows.shape[0])


def test_unbatched_input_equals_a_batch_of_one() -> None:
    block = Conv1dBlock("", nn.Conv1d(2, 3, 3).to(DT))
    x, g = torch.randn(2, 7, dtype=DT), torch.randn(3, 5, dtype=DT)
    torch.testing.assert_close(block.a_rows(x).rows, block.a_rows(x.unsqueeze(0)).rows)
    torch.testing.assert_close(block.g_rows(g).rows, block.g_rows(g.unsqueeze(0)).rows)
    assert block.batch_size(x) == 1 and block.batch_size(x.unsqueeze(0)) == 1


def test_grouped_conv1d_is_unit_wise_and_the_default_trains_a_conv1d_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(3, 8, 3, padding=1),
        nn.GELU(),
        nn.Conv1d(8, 8, 3, padding=1, groups=2),
        nn.GELU(),
        nn.Conv1d(8, 8, 3, padding=1),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(8 * 16, 2),
    )
    opt = KFACOptimizer.for_model(model)
    layers = opt.preconditioner.layers
    assert set(layers) == {"0", "2", "4", "7"}
    assert layers["2"].solver.name == "unitwise_adam"  # the grouped one: a basis per channel
    assert layers["4"].solver.options.orthogonal_rms is not None  # a hidden layer
    assert opt.preconditioner.config.flattened_inputs == {"7": (8, 16)}  # read off the graph
    x = torch.randn(64, 3, 16)
    y = (x[:, 0, :8].mean(-1) > x[:, 1, 8:].mean(-1)).long()  # learnable from the sequence
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.75 * losses[0]
    with pytest.raises(TypeError, match=r"nn\.Conv1d"):
        Conv1dBlock("", nn.Conv2d(1, 1, 1))
