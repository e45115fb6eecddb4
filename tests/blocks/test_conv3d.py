"""``nn.Conv3d``: factors equal the patch formula (patches read by the convolution itself
with one-hot kernels), a depth-1 convolution equals its 2-D twin under every convention,
the update equals the dense solve where K-FAC is exact, grouped 3-D convolutions get the
exact per-channel Fisher, and the default trains and resumes a small 3-D CNN."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.blocks import conv3d
from dkfac.blocks.conv3d import Conv3dBlock, GroupedConv3dBlock
from dkfac.blocks.registry import block_or_reason
from dkfac.solvers.statistics import FactorAccumulator
from tests.integrations.twins import covers_trains_and_resumes
from tests.oracles import (
    SumSink,
    dense_eigen_solve,
    per_sample_unit_grads,
    unitwise_update,
    weight_grad_matrix,
    with_ones,
)

DT = torch.float64

CASES = {
    "stride2": {"kernel_size": 3, "stride": 2, "padding": 1},
    "dilation": {"kernel_size": (2, 3, 2), "dilation": (2, 1, 2), "padding": (1, 2, 0)},
    "same": {"kernel_size": 3, "padding": "same"},
    "same_even": {"kernel_size": (2, 3, 4), "padding": "same"},  # asymmetric
    "valid_no_bias": {"kernel_size": (1, 2, 3), "padding": "valid", "bias": False},
    "reflect": {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
    "replicate": {"kernel_size": 3, "stride": (1, 2, 1), "padding": 1, "padding_mode": "replicate"},
    "circular": {"kernel_size": 2, "padding": 1, "padding_mode": "circular"},
}  # fmt: skip


def _conv(case: dict) -> nn.Conv3d:
    torch.manual_seed(0)
    return nn.Conv3d(2, 3, **case).to(DT)


def _patches_by_one_hot(conv: nn.Conv3d, x: Tensor) -> Tensor:
    """Oracle: ``(B, T, C_in·kd·kh·kw)`` patches, read by the convolution itself (torch's
    padding included) with one one-hot kernel per patch entry."""
    dim = math.prod(conv.weight.shape[1:])
    reader = nn.Conv3d(
        conv.in_channels,
        dim,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        bias=False,
        padding_mode=conv.padding_mode,
    ).to(DT)
    with torch.no_grad():
        reader.weight.copy_(torch.eye(dim, dtype=DT).reshape(reader.weight.shape))
        out = reader(x if x.dim() == 5 else x.unsqueeze(0))
    return out.flatten(2).transpose(1, 2)


def _capture(conv: nn.Module, x: Tensor, **options: object) -> tuple[Tensor, Tensor, Tensor]:
    """One step with ``factor_decay=0``; the factors and the output's gradient."""
    pre = KFACPreconditioner(conv, factor_decay=0.0, kl_clip=None, **options)
    out = conv(x)
    loss = out.pow(2).sum(dim=tuple(range(out.dim() - 4, out.dim()))).mean()
    delta = torch.autograd.grad(loss, out, retain_graph=True)[0]
    loss.backward()
    pre.step()
    a, g = pre.factors()[""]
    return a, g, delta


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("reduction", [None, "sum"])
def test_factors_equal_the_patch_formula(case: str, reduction: str | None) -> None:
    """Expand: ``A = (1/(B·T)) Σ ā āᵀ``, ``G = (1/B) Σ (B·δ)(B·δ)ᵀ``; Reduce Sum: the mean
    patch and the summed gradient of each volume, over ``B``."""
    conv = _conv(CASES[case])
    x = torch.randn(3, 2, 5, 6, 5, dtype=DT)
    a, g, delta = _capture(conv, x, conv_reduction=reduction)
    patches = _patches_by_one_hot(conv, x)
    weight = conv.weight.reshape(3, -1)
    rebuilt = patches @ weight.T + (conv.bias if conv.bias is not None else 0)
    torch.testing.assert_close(rebuilt, conv(x).detach().flatten(2).transpose(1, 2))
    grads = (delta * 3).flatten(2).transpose(1, 2)  # (B, T, C_out), on the per-sample scale
    if reduction == "sum":
        rows, grows = patches.mean(dim=1), grads.sum(dim=1)
    else:
        rows, grows = patches.reshape(-1, patches.shape[-1]), grads.reshape(-1, 3)
    rows = with_ones(rows) if conv.bias is not None else rows
    torch.testing.assert_close(a, rows.T @ rows / rows.shape[0])
    torch.testing.assert_close(g, grows.T @ grows / 3)


def test_subsampled_factors_are_the_drawn_positions_rows() -> None:
    """``A = (1/(B·s)) Σ ā āᵀ`` and ``G = (T/(B·s)) Σ g gᵀ`` over the drawn positions, the
    same for both; with ``s ≥ T`` the expand factors."""
    conv = _conv(CASES["stride2"])
    x = torch.randn(4, 2, 5, 6, 5, dtype=DT)
    a, g, delta = _capture(conv, x, conv_reduction="subsample", subsample_positions=5, seed=7)
    block = Conv3dBlock("", conv, reduction="subsample", positions=5, seed=7)
    patches = with_ones(_patches_by_one_hot(conv, x))  # (B, T, D)
    total = patches.shape[1]
    index = block.subsample_indices(4, total)
    assert index.shape == (4, 5) and len({tuple(row.tolist()) for row in index}) > 1
    rows = torch.cat([patches[n, index[n]] for n in range(4)])
    grads = (delta * 4).flatten(2).transpose(1, 2)
    grows = torch.cat([grads[n, index[n]] for n in range(4)])
    torch.testing.assert_close(a, rows.T @ rows / 20)
    torch.testing.assert_close(g, grows.T @ grows * total / 20)
    every = _capture(_conv(CASES["stride2"]), x, conv_reduction="subsample", subsample_positions=99)
    expand = _capture(_conv(CASES["stride2"]), x)
    torch.testing.assert_close(every[0], expand[0])
    torch.testing.assert_close(every[1], expand[1])


def test_unbatched_input_is_a_batch_of_one() -> None:
    conv = _conv(CASES["same_even"])
    x = torch.randn(2, 4, 5, 3, dtype=DT)
    a, g, delta = _capture(conv, x)
    a1, g1, _ = _capture(_conv(CASES["same_even"]), x.unsqueeze(0))
    torch.testing.assert_close(a, a1)
    torch.testing.assert_close(g, g1)
    rows = with_ones(_patches_by_one_hot(conv, x)[0])
    torch.testing.assert_close(a, rows.T @ rows / rows.shape[0])
    grows = delta.flatten(1).T  # batch of one: the gradient as it comes
    torch.testing.assert_close(g, grows.T @ grows)
    block = Conv3dBlock("", conv)
    assert block.batch_size(x) == 1 and block.batch_size(x.unsqueeze(0)) == 1
    assert block.output_positions(conv(x)) == 4 * 5 * 3


@pytest.mark.parametrize("dtypes", [(None, None), (torch.float32, torch.float64)])
def test_the_dense_capture_sums_groups_of_volumes_as_the_rows_would_add(
    monkeypatch: pytest.MonkeyPatch, dtypes: tuple[torch.dtype | None, torch.dtype | None]
) -> None:
    """Into a dense accumulator the expand capture unfolds a group of volumes at a time
    (one each here): the sum and count of the rows' own ``add``, in its precisions."""
    product_dtype, dtype = dtypes
    conv = _conv(CASES["dilation"])
    x = torch.randn(3, 2, 5, 6, 5, dtype=DT)
    block = Conv3dBlock("", conv)
    monkeypatch.setattr(conv3d, "ROWS_MAX_BYTES", 1)
    grouped = FactorAccumulator(dtype=dtype, product_dtype=product_dtype)
    block.capture_input(x, {"A": grouped})
    whole = FactorAccumulator(dtype=dtype, product_dtype=product_dtype)
    whole.add(block.a_rows(x))
    assert grouped.normaliser == whole.normaliser == 3 * 5 * 6 * 4
    assert grouped.total is not None and whole.total is not None
    assert grouped.total.dtype == whole.total.dtype == (dtype or DT)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if product_dtype else {}
    torch.testing.assert_close(grouped.total, whole.total, **tolerance)


class _Mean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(2).mean(-1)


TWIN_CASES = [
    {"kernel_size": 3},
    {"kernel_size": 3, "stride": 2, "padding": 1, "bias": False},
    {"kernel_size": 2, "dilation": 2, "padding": "same"},
    {"kernel_size": 3, "padding": 2, "padding_mode": "reflect"},
]


def _twins(case: dict) -> tuple[nn.Module, nn.Module]:
    """A network with a depth-1-kernel Conv3d and the same network with the Conv2d."""
    torch.manual_seed(0)
    flat = nn.Conv2d(3, 4, **case).to(DT)
    padding = case.get("padding", 0)
    volume_case = {
        **case,
        "kernel_size": (1, case["kernel_size"], case["kernel_size"]),
        "padding": padding if isinstance(padding, str) else (0, padding, padding),
    }
    volume = nn.Conv3d(3, 4, **volume_case).to(DT)
    with torch.no_grad():
        volume.weight.copy_(flat.weight.unsqueeze(2))
        if flat.bias is not None:
            volume.bias.copy_(flat.bias)
    head = nn.Linear(4, 2).to(DT)
    twin_head = nn.Linear(4, 2).to(DT)
    twin_head.load_state_dict(head.state_dict())
    return nn.Sequential(volume, nn.Tanh(), _Mean(), head), nn.Sequential(
        flat, nn.Tanh(), _Mean(), twin_head
    )


@pytest.mark.parametrize("case", TWIN_CASES)
@pytest.mark.parametrize("reduction", [None, "sum", "subsample"])
@pytest.mark.parametrize("method", ["eigen", "cholesky"])
def test_depth_one_equals_the_conv2d_twin(case: dict, reduction: str | None, method: str) -> None:
    """Factors and preconditioned gradients of every layer (the subsampled positions drawn
    alike: same seed, step and counts)."""
    model, twin = _twins(case)
    x = torch.randn(5, 3, 1, 7, 6, dtype=DT)
    y = torch.arange(5) % 2
    options = {"conv_reduction": reduction, "subsample_positions": 4, "seed": 3}
    pres = []
    for net, inputs in ((model, x), (twin, x.squeeze(2))):
        pre = KFACPreconditioner(
            net, method=method, factor_decay=0.0, kl_clip=None, damping=0.01, **options
        )
        F.cross_entropy(net(inputs), y).backward()
        pre.step()
        pres.append(pre)
    assert isinstance(pres[0].layers["0"].block, Conv3dBlock)
    for (a1, g1), (a2, g2) in zip(
        pres[0].factors().values(), pres[1].factors().values(), strict=True
    ):
        torch.testing.assert_close(a1, a2)
        torch.testing.assert_close(g1, g2)
    for p1, p2 in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad.reshape(p1.grad.shape))


def test_one_position_per_sample_is_a_linear_layer() -> None:
    """A 1×1×1 convolution on 1×1×1 volumes: the factors and the preconditioned gradient
    of the Linear layer on the channel vectors."""
    torch.manual_seed(0)
    conv, linear = nn.Conv3d(5, 3, 1).to(DT), nn.Linear(5, 3).to(DT)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.flatten(1))
        linear.bias.copy_(conv.bias)
    x, y = torch.randn(6, 5, dtype=DT), torch.arange(6) % 3
    pres = []
    for net, inputs in ((conv, x.reshape(6, 5, 1, 1, 1)), (linear, x)):
        pre = KFACPreconditioner(net, factor_decay=0.0, kl_clip=None, damping=0.01)
        F.cross_entropy(net(inputs).reshape(6, 3), y).backward()
        pre.step()
        pres.append(pre)
    for one, two in zip(pres[0].factors()[""], pres[1].factors()[""], strict=True):
        torch.testing.assert_close(one, two)
    torch.testing.assert_close(weight_grad_matrix(conv), weight_grad_matrix(linear))


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 2, 3)])
def test_one_sample_one_position_update_is_the_dense_fisher_solve(
    shape: tuple[int, int, int],
) -> None:
    """One sample, one output position (a kernel as large as the volume): ``A ⊗ G`` is the
    exact Fisher ``vec(∇W) vec(∇W)ᵀ``, and the eigen method's update is its damped solve."""
    torch.manual_seed(1)
    conv = nn.Conv3d(2, 3, shape).to(DT)
    x = torch.randn(1, 2, *shape, dtype=DT)
    pre = KFACPreconditioner(conv, method="eigen", factor_decay=0.0, kl_clip=None, damping=0.1)
    out = conv(x)
    (out.pow(2).sum() + out.sum()).backward()
    grad = weight_grad_matrix(conv).clone()
    pre.step()
    a, g = pre.factors()[""]
    fisher = torch.outer(grad.reshape(-1), grad.reshape(-1))
    torch.testing.assert_close(torch.kron(g, a), fisher)
    eye = torch.eye(fisher.shape[0], dtype=DT)
    expected = torch.linalg.solve(fisher + 0.1 * eye, grad.reshape(-1)).reshape(grad.shape)
    torch.testing.assert_close(weight_grad_matrix(conv), expected)
    torch.testing.assert_close(expected, dense_eigen_solve(a, g, grad, 0.1))


GROUPED = {
    "depthwise": (lambda: nn.Conv3d(3, 3, 3, padding=1, groups=3), (3, 4, 5, 4)),
    "groups2_strided": (
        lambda: nn.Conv3d(4, 6, (2, 3, 2), stride=2, dilation=(1, 1, 2), groups=2, bias=False),
        (4, 5, 7, 6),
    ),
    "same_even_reflect": (
        lambda: nn.Conv3d(2, 4, 2, padding="same", groups=2, padding_mode="reflect"),
        (2, 3, 4, 3),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GROUPED))
def test_grouped_fisher_is_each_output_channel_s_per_sample_gradients(case: str) -> None:
    make, shape = GROUPED[case]
    torch.manual_seed(0)
    conv = make().to(DT)
    block = block_or_reason("conv", conv)
    assert isinstance(block, GroupedConv3dBlock)
    x = torch.randn(4, *shape, dtype=DT)
    delta = torch.randn_like(conv(x))
    sink = SumSink()
    block.capture_grad(block.capture_input(x, {"F": sink}), delta, {"F": sink}, scale=4.0)
    units = per_sample_unit_grads(conv, x, delta)  # (N, C_out, d)
    assert block.statistic_shapes() == {"F": (units.shape[1], units.shape[2], units.shape[2])}
    assert sink.total is not None and sink.count == 4
    torch.testing.assert_close(sink.total, 4.0 * torch.einsum("nci,ncj->cij", units, units))
    assert block.output_positions(conv(x)) == math.prod(conv(x).shape[2:])
    one = SumSink()
    block.capture_grad(block.capture_input(x[0], {"F": one}), delta[0], {"F": one}, scale=1.0)
    torch.testing.assert_close(one.total, torch.einsum("ci,cj->cij", units[0], units[0]))


def test_grouped_update_is_a_dense_solve_per_output_channel() -> None:
    make, shape = GROUPED["depthwise"]
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 5 * 4, 3)).to(DT)
    x, y = torch.randn(5, *shape, dtype=DT), torch.randint(0, 3, (5,))
    expected = unitwise_update(model, x, y, damping=0.05)
    pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, damping=0.05)
    assert pre.layers["0"].solver.name == "unitwise"
    F.cross_entropy(model(x), y).backward()
    pre.step()
    torch.testing.assert_close(pre.layers["0"].block.weight_grad(), expected)


def test_declines_and_errors_name_what_is_allowed() -> None:
    assert block_or_reason("w", nn.Conv3d(32, 8, 3, groups=2)) == (
        "grouped convolution (groups=2) with 433 parameters per output channel: its "
        "unit-wise Fisher takes at most 256"
    )
    assert Conv3dBlock.declines(nn.Conv3d(4, 4, 3, groups=4)) is not None
    with pytest.raises(ValueError, match="groups=1 only"):
        Conv3dBlock("g", nn.Conv3d(4, 4, 3, groups=2))
    with pytest.raises(TypeError, match=r"must be an nn\.Conv3d"):
        Conv3dBlock("c", nn.Conv2d(4, 4, 3))
    with pytest.raises(TypeError, match=r"must be an nn\.Conv3d"):
        GroupedConv3dBlock("c", nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(ValueError, match="reduction must be one of"):
        Conv3dBlock("c", nn.Conv3d(4, 4, 3), reduction="mean")
    block = Conv3dBlock("c", nn.Conv3d(4, 6, (2, 3, 1)))
    assert (block.a_dim, block.g_dim) == (4 * 6 + 1, 6)
    cost = block.cost_description()
    assert (cost.kind, cost.a_dim, cost.g_dim, cost.unitwise) == ("conv3d", 25, 6, False)


class _VolumeNet(nn.Module):
    """A small 3-D CNN: a stem, a depthwise and a strided convolution, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 6, 3, padding=1)
        self.depthwise = nn.Conv3d(6, 6, 3, padding=1, groups=6)
        self.down = nn.Conv3d(6, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8 * 2 * 2 * 2, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.depthwise(torch.relu(self.stem(x))))
        return self.head(torch.relu(self.down(x)).flatten(1))


def _teacher_batch(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random 4×4×4 volumes labelled by a fixed random teacher."""
    x = torch.randn(32, 1, 4, 4, 4, generator=gen)
    teacher = torch.randn(64, 3, generator=torch.Generator().manual_seed(99))
    return x, (x.flatten(1) @ teacher).argmax(dim=1)


def test_the_default_trains_a_3d_cnn_without_leaving_a_convolution_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = _VolumeNet()
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        opt = KFACOptimizer.for_model(model, lr=0.003)
    assert not [r for r in caplog.records if "Conv3d" in r.getMessage()]
    rows = {row["name"]: row for row in opt.preconditioner.describe()}
    assert {name: rows[name]["block"] for name in ("stem", "depthwise", "down", "head")} == {
        "stem": "Conv3dBlock",
        "depthwise": "GroupedConv3dBlock",
        "down": "Conv3dBlock",
        "head": "LinearBlock",
    }
    assert [rows[name]["role"] for name in ("stem", "down", "head")] == ["input", "hidden", "head"]
    assert rows["depthwise"]["method"] == "unitwise_adam"
    assert not [row for row in rows.values() if row["block"] == "inner optimizer"]
    losses = []
    x, y = _teacher_batch(torch.Generator().manual_seed(0))
    for _ in range(40):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_the_default_covers_trains_and_resumes_a_3d_cnn_bit_for_bit() -> None:
    covers_trains_and_resumes(_VolumeNet, _teacher_batch, F.cross_entropy)
