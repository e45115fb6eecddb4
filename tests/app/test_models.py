"""Tests of dkfac.app.models: shapes, exact layouts and parameter counts, K-FAC friendliness."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from dkfac.app.models import (
    MLP,
    MODELS,
    DeepAutoencoder,
    ResNetCifar,
    SmallCNN,
    build_model,
    resnet20,
    resnet32,
    resnet50,
    resnet56,
    resnet110,
    resnet_cifar,
    vgg16_bn,
)

# (in_channels, image_size, num_classes) per registry model: small but valid inputs.
SHAPES: dict[str, tuple[int, int, int]] = {
    "mlp": (1, 8, 10),
    "cnn": (1, 8, 10),
    "resnet20": (3, 8, 5),
    "resnet32": (3, 8, 5),
    "resnet56": (3, 8, 5),
    "resnet110": (3, 8, 5),
    "resnet50": (3, 32, 4),
    "vgg16": (3, 32, 4),
    "autoencoder": (1, 8, 10),
}


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_registry_names() -> None:
    assert set(MODELS) == set(SHAPES)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_forward_backward(name: str) -> None:
    torch.manual_seed(0)
    c, s, k = SHAPES[name]
    model = build_model(name, in_channels=c, image_size=s, num_classes=k)
    x = torch.randn(2, c, s, s)
    out = model(x)
    expected = (2, c * s * s) if name == "autoencoder" else (2, k)
    assert out.shape == expected
    assert out.dtype == torch.float32
    out.square().sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", ["mlp", "cnn", "autoencoder", "vgg16", "resnet20"])
def test_other_input_shapes(name: str) -> None:
    # 3x8x8 for every model, 1x32x32 for the flat ones and the CNN.
    for c, s in [(3, 8), (1, 32)]:
        model = build_model(name, in_channels=c, image_size=s, num_classes=3)
        out = model(torch.randn(2, c, s, s))
        assert out.shape == ((2, c * s * s) if name == "autoencoder" else (2, 3))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_kfac_friendly(name: str) -> None:
    """Every Linear/Conv2d runs exactly once per forward and no ReLU is in-place."""
    c, s, k = SHAPES[name]
    model = build_model(name, in_channels=c, image_size=s, num_classes=k)
    calls: dict[str, int] = {}

    def count(module: nn.Module, inputs: object, output: object) -> None:
        calls[names[module]] += 1

    names = {m: n for n, m in model.named_modules()}
    for mname, m in model.named_modules():
        if isinstance(m, nn.ReLU):
            assert not m.inplace, mname
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            calls[mname] = 0
            m.register_forward_hook(count)
    model(torch.randn(2, c, s, s))
    assert calls and set(calls.values()) == {1}


def test_mlp_matches_manual_computation() -> None:
    torch.manual_seed(1)
    model = MLP(12, hidden=(5, 4), num_classes=3)
    l1, l2, l3 = (m for m in model.modules() if isinstance(m, nn.Linear))
    assert [(m.in_features, m.out_features) for m in (l1, l2, l3)] == [(12, 5), (5, 4), (4, 3)]
    x = torch.randn(6, 3, 2, 2)
    flat = x.reshape(6, 12)
    h = torch.relu(flat @ l1.weight.T + l1.bias)
    h = torch.relu(h @ l2.weight.T + l2.bias)
    torch.testing.assert_close(model(x), h @ l3.weight.T + l3.bias)


@pytest.mark.parametrize("batch_norm", [False, True])
def test_small_cnn_layout(batch_norm: bool) -> None:
    model = SmallCNN(in_channels=1, num_classes=10, image_size=8, batch_norm=batch_norm)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_channels, m.out_channels, m.kernel_size, m.padding) for m in convs] == [
        (1, 32, (3, 3), (1, 1)),
        (32, 64, (3, 3), (1, 1)),
        (64, 64, (3, 3), (1, 1)),
    ]
    assert [(m.in_features, m.out_features) for m in linears] == [(64 * 4 * 4, 128), (128, 10)]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == (3 if batch_norm else 0)
    assert all((m.bias is None) == batch_norm for m in convs)
    # conv 1*32*9+32, 32*64*9+64, 64*64*9+64, linear 1024*128+128, 128*10+10
    if not batch_norm:
        assert n_params(model) == 320 + 18496 + 36928 + 131200 + 1290


def test_small_cnn_caps_linear_input_for_large_images() -> None:
    model = SmallCNN(in_channels=3, num_classes=10, image_size=32)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    assert first.in_features == 64 * 4 * 4
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def resnet_cifar_param_count(depth: int, in_channels: int, num_classes: int) -> int:
    """Independent count: 3x3 convs without bias, BN (2 per channel), option-B projections."""
    n = (depth - 2) // 6
    total = in_channels * 16 * 9 + 2 * 16
    cin = 16
    for cout in (16, 32, 64):
        for _ in range(n):
            total += cin * cout * 9 + cout * cout * 9 + 4 * cout
            if cin != cout:
                total += cin * cout + 2 * cout
            cin = cout
    return total + 64 * num_classes + num_classes


@pytest.mark.parametrize(
    ("ctor", "depth"), [(resnet20, 20), (resnet32, 32), (resnet56, 56), (resnet110, 110)]
)
def test_resnet_cifar_structure(ctor: Callable[..., ResNetCifar], depth: int) -> None:
    model = ctor(in_channels=3, num_classes=10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    # depth = 3x3 convs + the classifier; two 1x1 projection shortcuts (stage 2 and 3).
    assert sum(m.kernel_size == (3, 3) for m in convs) + 1 == depth
    assert sum(m.kernel_size == (1, 1) for m in convs) == 2
    assert n_params(model) == resnet_cifar_param_count(depth, 3, 10)
    assert n_params(resnet_cifar(depth, in_channels=1, num_classes=7)) == (
        resnet_cifar_param_count(depth, 1, 7)
    )


def test_resnet20_matches_published_size() -> None:
    # 269,722 parameters with option-A shortcuts (He et al. 2016: "0.27M") plus the two
    # projections: 16*32 + 2*32 and 32*64 + 2*64.
    assert n_params(resnet20()) == 269_722 + (512 + 64) + (2048 + 128)


@pytest.mark.parametrize("depth", [0, 2, 14 - 1, 18, 21, 111, -4])
def test_resnet_depth_validation(depth: int) -> None:
    with pytest.raises(ValueError, match="6n\\+2"):
        resnet_cifar(depth)


@pytest.mark.parametrize("size", [8, 9, 33])
def test_resnet_cifar_any_spatial_size(size: int) -> None:
    model = resnet_cifar(8, in_channels=2, num_classes=3)  # smallest valid depth
    assert model(torch.randn(2, 2, size, size)).shape == (2, 3)


def test_resnet50_matches_torchvision_layout() -> None:
    model = resnet50()
    # torchvision.models.resnet50() has exactly 25,557,032 parameters.
    assert n_params(model) == 25_557_032
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 49 + 4  # 49 main-path convolutions and 4 projection shortcuts
    assert (convs[0].kernel_size, convs[0].stride, convs[0].padding) == ((7, 7), (2, 2), (3, 3))
    fc = model.fc
    assert (fc.in_features, fc.out_features) == (2048, 1000)
    strided = [m for m in convs if m.stride == (2, 2) and m.kernel_size == (3, 3)]
    assert len(strided) == 3  # stride on the 3x3 conv of the first block of stages 2-4


def test_resnet50_small_input_grayscale() -> None:
    model = resnet50(in_channels=1, num_classes=3)
    out = model(torch.randn(2, 1, 8, 8))
    assert out.shape == (2, 3)


def test_vgg16_bn_layout_and_small_inputs() -> None:
    model = vgg16_bn(in_channels=3, num_classes=10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [m.out_channels for m in convs] == [64, 64, 128, 128, 256, 256, 256] + [512] * 6
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 13
    # torchvision's vgg16_bn features hold 14,723,136 parameters; ours drop the 4,224 conv
    # biases (redundant before BatchNorm).
    assert n_params(model.features) == 14_723_136 - 4_224
    model.eval()
    for size in (8, 32):
        x = torch.randn(2, 3, size, size)
        assert model.features(x).shape == (2, 512, 1, 1)
        assert model(x).shape == (2, 10)


def test_autoencoder_shape_and_structure() -> None:
    model = DeepAutoencoder()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    sizes = [(m.in_features, m.out_features) for m in linears]
    assert sizes == [
        (64, 1000), (1000, 500), (500, 250), (250, 30),
        (30, 250), (250, 500), (500, 1000), (1000, 64),
    ]  # fmt: skip
    # Activations between layers only: 3 in the encoder, 3 in the decoder, none on the code.
    assert sum(isinstance(m, nn.ReLU) for m in model.modules()) == 6
    assert isinstance(model.encoder[-1], nn.Linear)
    assert isinstance(model.decoder[-1], nn.Linear)
    torch.manual_seed(0)
    x = torch.randn(5, 1, 8, 8)
    code = model.encode(x)
    assert code.shape == (5, 30)
    assert (code < 0).any()  # linear code layer
    out = model(x)
    assert out.shape == (5, 64)
    torch.testing.assert_close(out, model.decoder(model.encoder(x.reshape(5, 64))))


@pytest.mark.parametrize(("activation", "kind"), [("sigmoid", nn.Sigmoid), ("tanh", nn.Tanh)])
def test_autoencoder_activations(activation: str, kind: type[nn.Module]) -> None:
    model = DeepAutoencoder(10, widths=(6, 3), activation=activation)
    assert sum(isinstance(m, kind) for m in model.modules()) == 2
    assert model(torch.randn(4, 10)).shape == (4, 10)
    with pytest.raises(ValueError, match="unknown activation"):
        DeepAutoencoder(10, activation="gelu")


def test_build_model_flat_input_features() -> None:
    mlp = build_model("mlp", in_channels=3, image_size=4, num_classes=6)
    first = next(m for m in mlp.modules() if isinstance(m, nn.Linear))
    assert first.in_features == 48
    ae = build_model("autoencoder", in_channels=3, image_size=4, num_classes=6)
    assert ae(torch.randn(2, 3, 4, 4)).shape == (2, 48)


def test_build_model_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet18'") as info:
        build_model("resnet18", in_channels=3, image_size=32, num_classes=10)
    for name in MODELS:
        assert name in str(info.value)


def test_seeded_construction_is_deterministic() -> None:
    torch.manual_seed(3)
    a = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
    torch.manual_seed(3)
    b = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
    x = torch.randn(3, 1, 8, 8)
    assert torch.equal(a(x), b(x))
