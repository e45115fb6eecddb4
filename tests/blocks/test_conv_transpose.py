"""Transposed convolutions: the gradient view is the weight's gradient, the factors equal
patches built by hand over the input positions (every stride, padding, output padding,
dilation, 1-D and 2-D, with and without a bias), the exact Fisher where one input position
makes K-FAC exact, and twins of the Linear and Conv2d blocks where the layers coincide."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACPreconditioner
from dkfac.blocks.conv_transpose import ConvTranspose1dBlock, ConvTranspose2dBlock
from dkfac.blocks.registry import block_or_reason

DT = torch.float64


def transposed_patches_by_hand(conv: nn.Module, grad: Tensor, inputs: tuple[int, int]) -> Tensor:
    """(B, T_in, C_out·kh·kw) output-gradient patches with explicit loops: entry (o, i, j)
    at input position (a, b) is the gradient at the output position that kernel offset
    (i, j) of that input writes, ``(a, b)·s + (i, j)·d − p``, or 0 outside the output."""
    two_d = grad.dim() == 4
    pair = (lambda v: tuple(v)) if two_d else (lambda v: (1, v[0]) if len(v) == 1 else v)
    if not two_d:
        grad = grad.unsqueeze(2)
    (kh, kw), (sh, sw) = pair(conv.kernel_size), pair(conv.stride)
    (dh, dw), (ph, pw) = pair(conv.dilation), pair(conv.padding)
    if not two_d:
        ph = 0
    batch, channels, out_h, out_w = grad.shape
    rows = []
    for a in range(inputs[0]):
        for b in range(inputs[1]):
            patch = grad.new_zeros(batch, channels, kh, kw)
            for i in range(kh):
                for j in range(kw):
                    qh, qw = a * sh + i * dh - ph, b * sw + j * dw - pw
                    if 0 <= qh < out_h and 0 <= qw < out_w:
                        patch[:, :, i, j] = grad[:, :, qh, qw]
            rows.append(patch.reshape(batch, -1))
    return torch.stack(rows, dim=1)


CASES_2D = [
    dict(kernel_size=3),
    dict(kernel_size=4, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, output_padding=1),
    dict(kernel_size=(2, 3), stride=(2, 1), padding=(0, 1), bias=False),
    dict(kernel_size=3, stride=1, padding=2, dilation=2),
    dict(kernel_size=2, stride=1, dilation=3, output_padding=2),  # output padding ≥ stride
    dict(kernel_size=2, stride=3, output_padding=2, bias=False),  # rows no kernel reaches
    dict(kernel_size=5, stride=2, padding=3),  # padding wider than the output padding
]
CASES_1D = [
    dict(kernel_size=3),
    dict(kernel_size=4, stride=2, padding=1, output_padding=1),
    dict(kernel_size=3, stride=2, dilation=2, padding=2, bias=False),
]
IDS = [",".join(f"{k}={v}" for k, v in case.items()) for case in CASES_2D + CASES_1D]


def _layer_and_input(case: dict) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    if case in CASES_1D:
        return nn.ConvTranspose1d(3, 2, **case).to(DT), torch.randn(4, 3, 5, dtype=DT)
    return nn.ConvTranspose2d(3, 2, **case).to(DT), torch.randn(4, 3, 4, 5, dtype=DT)


def _capture(model: nn.Module, x: Tensor, **options: object) -> KFACPreconditioner:
    """One forward/backward (a mean over samples) and a step, factors not averaged."""
    pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, **options)
    out = model(x)
    (out.pow(2) + out).sum(dim=tuple(range(1, out.dim()))).mean().backward()
    pre.step()
    return pre


@pytest.mark.parametrize("case", CASES_2D + CASES_1D, ids=IDS)
def test_gradient_view_and_factors_equal_hand_built_patches(case: dict) -> None:
    conv, x = _layer_and_input(case)
    out = conv(x)
    loss = (out.pow(2) + out).sum(dim=tuple(range(1, out.dim()))).mean()
    delta = torch.autograd.grad(loss, out)[0]
    inputs = (1, x.shape[2]) if x.dim() == 3 else (x.shape[2], x.shape[3])
    patches = transposed_patches_by_hand(conv, delta * x.shape[0], inputs)  # (B, T, D)
    a_rows = x.reshape(x.shape[0], 3, -1).transpose(1, 2)  # (B, T, C_in)
    pre = KFACPreconditioner(conv, factor_decay=0.0, kl_clip=None)
    out = conv(x)
    (out.pow(2) + out).sum(dim=tuple(range(1, out.dim()))).mean().backward()
    block = pre.layers[""].block
    assert isinstance(block, ConvTranspose1dBlock if x.dim() == 3 else ConvTranspose2dBlock)
    # (1) The matrix the solvers precondition is the weight's gradient, (C_out·K) × C_in.
    view = block.weight_grad()
    torch.testing.assert_close(view, conv.weight.grad.reshape(3, -1).T)
    # ... and it is Σ g aᵀ over the input positions: the hand-built patches are its adjoint.
    torch.testing.assert_close(view * x.shape[0], torch.einsum("ntd,ntc->dc", patches, a_rows))
    pre.step()
    a, g = pre.factors()[""]
    batch, total = x.shape[0], a_rows.shape[1]
    flat_a, flat_g = a_rows.reshape(-1, 3), patches.reshape(-1, patches.shape[-1])
    # (2) Expand: A over every (sample, input position), G summed over positions.
    torch.testing.assert_close(a, flat_a.T @ flat_a / (batch * total))
    torch.testing.assert_close(g, flat_g.T @ flat_g / batch)
    # The row paths (a low-rank side keeps the rows) give the same factors.
    rows_a, rows_g = block.a_rows(x), block.g_rows(delta * batch)
    torch.testing.assert_close(rows_a.rows.T @ rows_a.rows / rows_a.normaliser, a)
    torch.testing.assert_close(rows_g.rows.T @ rows_g.rows / rows_g.normaliser, g)


@pytest.mark.parametrize("case", CASES_2D + CASES_1D, ids=IDS)
def test_sum_and_subsample_reductions_equal_their_formulas(case: dict) -> None:
    conv, x = _layer_and_input(case)
    out = conv(x)
    delta = torch.autograd.grad(out.pow(2).sum() / x.shape[0], out)[0] * x.shape[0]
    inputs = (1, x.shape[2]) if x.dim() == 3 else (x.shape[2], x.shape[3])
    patches = transposed_patches_by_hand(conv, delta, inputs)  # (B, T, D)
    a_rows = x.reshape(x.shape[0], 3, -1).transpose(1, 2)
    batch, total = patches.shape[0], patches.shape[1]
    kind = ConvTranspose1dBlock if x.dim() == 3 else ConvTranspose2dBlock
    summed = kind("", conv, reduction="sum")
    ra, rg = summed.a_rows(x), summed.g_rows(delta)
    torch.testing.assert_close(ra.rows, a_rows.mean(dim=1))
    torch.testing.assert_close(rg.rows, patches.sum(dim=1))
    assert ra.normaliser == rg.normaliser == batch
    sampled = kind("", conv, reduction="subsample", positions=3, seed=5)
    sampled.set_step(2)
    index = sampled.subsample_indices(batch, total)  # (B, s)
    picked = torch.arange(batch).unsqueeze(1), index
    ra, rg = sampled.a_rows(x), sampled.g_rows(delta)
    torch.testing.assert_close(ra.rows, a_rows[picked].reshape(-1, 3))
    torch.testing.assert_close(rg.rows, patches[picked].reshape(batch * index.shape[1], -1))
    assert ra.normaliser == batch * index.shape[1]
    assert rg.normaliser == pytest.approx(batch * index.shape[1] / total)


def test_output_size_chosen_at_the_forward_is_read_from_the_input() -> None:
    """``forward(x, output_size=...)`` picks an output padding the module does not hold: the
    backward takes the input positions from the forward (and from the stride without it)."""
    torch.manual_seed(1)
    conv = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1).to(DT)
    x = torch.randn(3, 2, 4, 4, dtype=DT)
    pre = KFACPreconditioner(conv, factor_decay=0.0, kl_clip=None)
    out = conv(x, output_size=[8, 8])  # output padding 1, the module's is 0
    assert out.shape[-2:] == (8, 8)
    delta = torch.autograd.grad(out.pow(2).sum() / 3, out, retain_graph=True)[0] * 3
    out.pow(2).sum().div(3).backward()
    pre.step()
    patches = transposed_patches_by_hand(conv, delta, (4, 4)).reshape(-1, 27)
    torch.testing.assert_close(pre.factors()[""][1], patches.T @ patches / 3)
    rows = pre.layers[""].block.g_rows(delta)  # no forward: the size is inferred
    torch.testing.assert_close(rows.rows, patches)


def test_one_input_position_equals_the_exact_fisher() -> None:
    """(3) A 1×1 input and a kernel as large as the output: one product ``g aᵀ`` per sample,
    so with one sample ``G ⊗ A`` is ``vec(∇W) vec(∇W)ᵀ`` (row-major vec of the g × a view)."""
    for conv, x in (
        (nn.ConvTranspose2d(3, 2, 4).to(DT), torch.randn(1, 3, 1, 1, dtype=DT)),
        (nn.ConvTranspose1d(3, 2, 5, bias=False).to(DT), torch.randn(1, 3, 1, dtype=DT)),
    ):
        pre = KFACPreconditioner(conv, factor_decay=0.0, kl_clip=None)
        out = conv(x)
        (out.pow(2).sum() + out.sum()).backward()
        grad = conv.weight.grad.reshape(3, -1).T.clone()
        pre.step()
        a, g = pre.factors()[""]
        fisher = torch.outer(grad.reshape(-1), grad.reshape(-1))
        torch.testing.assert_close(torch.kron(g, a), fisher)


def _copy_weights(conv: nn.ConvTranspose2d, twin: nn.Module) -> None:
    with torch.no_grad():
        weight = conv.weight[:, :, 0, 0]  # (C_in, C_out)
        twin.weight.copy_(weight.T.reshape(twin.weight.shape))


def test_one_by_one_kernel_twins_linear_and_conv2d() -> None:
    """(4) A 1×1 kernel at stride 1 is a Linear on the channel vectors and a 1×1 Conv2d:
    with a 1×1 image all three blocks give the same factors and update; on a 3×5 image the
    Conv2d (the same expand convention) still does, and A is the Linear's while the expand
    G is the Linear's (a mean over rows) times the 15 positions."""
    torch.manual_seed(2)
    for height, width in ((1, 1), (3, 5)):
        conv = nn.ConvTranspose2d(4, 3, 1, bias=False).to(DT)
        linear, conv2d = nn.Linear(4, 3, bias=False).to(DT), nn.Conv2d(4, 3, 1, bias=False).to(DT)
        _copy_weights(conv, linear)
        _copy_weights(conv, conv2d)
        x = torch.randn(5, 4, height, width, dtype=DT)
        as_rows = x.permute(0, 2, 3, 1)
        pres = {}
        for key, model, data in (("t", conv, x), ("l", linear, as_rows), ("c", conv2d, x)):
            pres[key] = _capture(model, data, damping=0.01)
        torch.testing.assert_close(conv(x).permute(0, 2, 3, 1), linear(as_rows))
        (a_t, g_t), (a_l, g_l) = pres["t"].factors()[""], pres["l"].factors()[""]
        a_c, g_c = pres["c"].factors()[""]
        torch.testing.assert_close(a_t, a_l)
        torch.testing.assert_close(a_t, a_c)
        torch.testing.assert_close(g_t, g_c)
        if height * width == 1:
            # One position: the linear per-sample scale too; the Linear of the 1×1 map
            # is the Linear of the batch (its loss was summed over the same terms).
            torch.testing.assert_close(g_t, g_l)
        else:
            positions = height * width
            torch.testing.assert_close(g_t, g_l * positions)
        update_t = conv.weight.grad[:, :, 0, 0].T
        torch.testing.assert_close(update_t, conv2d.weight.grad[:, :, 0, 0])
        if height * width == 1:
            torch.testing.assert_close(update_t, linear.weight.grad)


def test_the_bias_is_left_to_the_inner_optimizer_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bias is added at every output position: no column of the input-position pair
    is its gradient (a column of ones would give each output position's gradient once per
    kernel offset writing it), so describe() lists it with the inner optimizer."""
    torch.manual_seed(3)
    conv = nn.ConvTranspose2d(2, 3, 3, stride=2).to(DT)
    x = torch.randn(2, 2, 3, 3, dtype=DT)
    out = conv(x)
    delta = torch.autograd.grad(out.pow(2).sum(), out)[0]
    patches = transposed_patches_by_hand(conv, delta, (3, 3))
    ones_column = patches.sum(dim=(0, 1)).reshape(3, -1)  # per (channel, kernel offset)
    bias_grad = delta.sum(dim=(0, 2, 3))
    assert not torch.allclose(ones_column, bias_grad.unsqueeze(1).expand_as(ones_column))
    with caplog.at_level(logging.WARNING):
        pre = KFACPreconditioner(conv)
    assert not caplog.records  # a 1-D parameter: listed, not warned of
    rows = {row["name"]: row for row in pre.describe()}
    assert rows[""]["parameters"] == ["weight"]
    assert rows[""]["a_dim"] == 2 and rows[""]["g_dim"] == 27
    assert rows["bias"]["block"] == "inner optimizer"
    assert "added at every output position" in rows["bias"]["reason"]


def test_unbatched_inputs_and_grouped_or_wrong_modules() -> None:
    block = ConvTranspose2dBlock("", nn.ConvTranspose2d(2, 3, 3, stride=2).to(DT))
    x, g = torch.randn(2, 4, 4, dtype=DT), torch.randn(3, 9, 9, dtype=DT)
    torch.testing.assert_close(block.a_rows(x).rows, block.a_rows(x.unsqueeze(0)).rows)
    torch.testing.assert_close(block.g_rows(g).rows, block.g_rows(g.unsqueeze(0)).rows)
    assert block.batch_size(x) == 1
    line = ConvTranspose1dBlock("", nn.ConvTranspose1d(2, 3, 3).to(DT))
    assert line.batch_size(torch.randn(2, 5)) == 1 and line.a_dim == 2 and line.g_dim == 9
    grouped = nn.ConvTranspose2d(4, 4, 3, groups=2)
    assert block_or_reason("up", grouped) == (
        "grouped transposed convolution (groups=2) is not supported"
    )
    with pytest.raises(ValueError, match="groups=1 only, got 2"):
        ConvTranspose2dBlock("up", grouped)
    with pytest.raises(TypeError, match=r"nn\.ConvTranspose2d"):
        ConvTranspose2dBlock("up", nn.Conv2d(1, 1, 1))
    with pytest.raises(ValueError, match="reduction must be one of"):
        ConvTranspose2dBlock("up", nn.ConvTranspose2d(1, 1, 1), reduction="mean")


def test_accumulated_micro_batches_equal_the_whole_batch() -> None:
    def make() -> nn.Module:
        torch.manual_seed(4)
        return nn.Sequential(
            nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(3 * 8 * 8, 2),
        ).to(DT)

    model, clone = make(), make()
    x, y = torch.randn(8, 2, 4, 4, dtype=DT), torch.randint(0, 2, (8,))
    full = KFACPreconditioner(model, kl_clip=None)
    F.cross_entropy(model(x), y).backward()
    full.step()
    accum = KFACPreconditioner(clone, kl_clip=None, accumulation_steps=2)
    for part in (slice(0, 4), slice(4, 8)):
        (F.cross_entropy(clone(x[part]), y[part]) / 2).backward()
    accum.step()
    for name in full.factors():
        for got, want in zip(accum.factors()[name], full.factors()[name], strict=True):
            torch.testing.assert_close(got, want)
    for p, q in zip(model.parameters(), clone.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def conv_decoder_autoencoder() -> nn.Module:
    """Digits 8×8 through a 16-wide code and back: Linear → unflatten → ConvTranspose2d."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 16),
        nn.GELU(),
        nn.Linear(16, 32 * 2 * 2),
        nn.GELU(),
        nn.Unflatten(1, (32, 2, 2)),
        nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1),  # 4×4
        nn.GELU(),
        nn.ConvTranspose2d(16, 1, 4, stride=2, padding=1),  # 8×8
        nn.Sigmoid(),
    )


def test_the_default_registers_a_conv_decoder_and_trains_it_on_digits() -> None:
    from dkfac import KFACOptimizer
    from dkfac.app.data import load_digits

    torch.manual_seed(0)
    x = load_digits(normalize=False).x_train[:512]
    model = conv_decoder_autoencoder()
    opt = KFACOptimizer.for_model(model, lr=0.01)
    pre = opt.preconditioner
    assert set(pre.layers) == {"1", "3", "5", "8", "10"}
    rows = {row["name"]: row for row in pre.describe()}
    assert (rows["8"]["a_dim"], rows["8"]["g_dim"]) == (32, 16 * 16)
    assert (rows["10"]["a_dim"], rows["10"]["g_dim"]) == (16, 16)
    assert rows["8.bias"]["block"] == rows["10.bias"]["block"] == "inner optimizer"
    assert pre.layers["8"].solver.options.orthogonal_rms is not None  # a hidden layer
    assert pre.layers["10"].solver.options.orthogonal_rms is None  # the head
    losses = []
    for step in range(60):
        batch = x[(step * 64) % 512 :][:64]
        opt.zero_grad()
        loss = F.mse_loss(model(batch), batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8


@pytest.mark.parametrize("reduction", ["sum", "subsample"])
@pytest.mark.parametrize("method", ["eigen", "smw"])
def test_the_engine_takes_the_reduced_rows(reduction: str, method: str) -> None:
    """Under SKFAC's reductions the captured factors are the block's rows (the backward's
    positions the forward's), and the low-rank solver keeps them."""
    torch.manual_seed(5)
    conv = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1).to(DT)
    x = torch.randn(4, 3, 3, 3, dtype=DT)
    options = {"conv_reduction": reduction, "subsample_positions": 2, "method": method}
    pre = _capture(conv, x, **options)
    out = conv(x)
    delta = torch.autograd.grad((out.pow(2) + out).sum() / 4, out)[0] * 4
    block = pre.layers[""].block
    block.set_step(0)  # the step the capture ran at
    ra, rg = block.a_rows(x), block.g_rows(delta)
    # A low-rank side is kept as U (d × rank) with the factor U Uᵀ.
    a, g = (f if f.shape[0] == f.shape[1] else f @ f.T for f in pre.factors()[""])
    torch.testing.assert_close(a, ra.rows.T @ ra.rows / ra.normaliser)
    torch.testing.assert_close(g, rg.rows.T @ rg.rows / rg.normaliser)
    assert torch.isfinite(conv.weight.grad).all()
