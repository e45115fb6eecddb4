"""Models for the dkfac app, written in plain PyTorch (no torchvision).

Every model is an ordinary :class:`torch.nn.Module` built from ``nn.Linear`` / ``nn.Conv2d``
layers (the layers K-FAC preconditions) plus normalisation, pooling and activations. Each
``Linear`` / ``Conv2d`` module is called exactly once per forward pass, and every activation is
``nn.ReLU(inplace=False)`` so that module hooks always see unmodified tensors.

:func:`build_model` builds any model of :data:`MODELS` from a dataset's shape, the GPT of
:mod:`dkfac.app.gpt` (``"gpt"``) or a user's model from ``"package.module:factory"``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dkfac.app.factory import ModelError, build_from_factory, load_factory

logger = logging.getLogger(__name__)


def _relu() -> nn.ReLU:
    return nn.ReLU(inplace=False)


def _init_weights(model: nn.Module) -> None:
    """He (fan-out) initialisation for convolutions, unit/zero BatchNorm, zero biases."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class MLP(nn.Module):
    """Fully connected classifier for flat (or flattened) inputs.

    Args:
        in_features: Number of input features after flattening.
        hidden: Widths of the hidden layers, each followed by a ReLU.
        num_classes: Number of output logits.
    """

    def __init__(
        self, in_features: int, hidden: Sequence[int] = (256, 128), num_classes: int = 10
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), _relu()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Returns logits of shape ``(N, num_classes)`` for input ``(N, ...)``."""
        return self.net(torch.flatten(x, 1))


class SmallCNN(nn.Module):
    """Three 3x3 convolutions and two linear layers, sized for the 8x8 digits images.

    Layout: conv(in→32) → conv(32→64) → 2x2 max-pool → conv(64→64) → average-pool to at most
    4x4 → linear(→128) → linear(→classes). The average pool is the identity for 8x8 inputs and
    keeps the first linear layer (and so its K-FAC factor) at 1024 inputs for larger images.

    Args:
        in_channels: Input channels.
        num_classes: Number of output logits.
        image_size: Input height and width (at least 2).
        batch_norm: Adds ``BatchNorm2d`` after each convolution when true.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 8,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if image_size < 2:
            raise ValueError(f"SmallCNN needs image_size >= 2, got {image_size}")

        def block(cin: int, cout: int) -> list[nn.Module]:
            conv = nn.Conv2d(cin, cout, 3, padding=1, bias=not batch_norm)
            norm: list[nn.Module] = [nn.BatchNorm2d(cout)] if batch_norm else []
            return [conv, *norm, _relu()]

        side = min(image_size // 2, 4)
        self.features = nn.Sequential(
            *block(in_channels, 32),
            *block(32, 64),
            nn.MaxPool2d(2),
            *block(64, 64),
            nn.AdaptiveAvgPool2d(side),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 128), _relu(), nn.Linear(128, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        """Returns logits of shape ``(N, num_classes)`` for input ``(N, C, H, W)``."""
        return self.classifier(torch.flatten(self.features(x), 1))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, relu: bool = True) -> nn.Sequential:
    """Bias-free ``kernel x kernel`` convolution ("same" padding), BatchNorm, optional ReLU."""
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(cout), *([_relu()] if relu else []))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """Identity, or a 1x1 conv + BN projection when the shape changes (option B)."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return _conv_bn(cin, cout, 1, stride, relu=False)


class _BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity or 1x1 conv + BN projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(
            _conv_bn(cin, cout, 3, stride), _conv_bn(cout, cout, 3, relu=False)
        )
        self.shortcut = _shortcut(cin, cout, stride)
        self.relu = _relu()

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.branch(x) + self.shortcut(x))


class ResNetCifar(nn.Module):
    """CIFAR ResNet of He et al. (2016), section 4.2, with projection (option B) shortcuts.

    A 3x3 stem with 16 channels, three stages of ``n = (depth - 2) / 6`` basic blocks with 16,
    32 and 64 channels (stride 2 at the start of stages 2 and 3), global average pooling and a
    linear classifier. Works for any input of at least 8x8 pixels.

    Args:
        depth: Total number of weighted layers; ``(depth - 2) % 6 == 0`` and ``depth >= 8``.
        in_channels: Input channels.
        num_classes: Number of output logits.

    Raises:
        ValueError: If ``depth`` is not of the form ``6n + 2`` with ``n >= 1``.
    """

    def __init__(self, depth: int, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(
                f"CIFAR ResNet depth must be 6n+2 with n >= 1 (20, 32, 44, 56, 110, ...), "
                f"got {depth}"
            )
        n = (depth - 2) // 6
        self.depth = depth
        self.stem = _conv_bn(in_channels, 16, 3)
        blocks: list[nn.Module] = []
        cin = 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(_BasicBlock(cin, cout, stride))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        _init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        """Returns logits of shape ``(N, num_classes)`` for input ``(N, C, H, W)``."""
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def resnet_cifar(depth: int, in_channels: int = 3, num_classes: int = 10) -> ResNetCifar:
    """A CIFAR ResNet of the given depth; see :class:`ResNetCifar`."""
    return ResNetCifar(depth, in_channels=in_channels, num_classes=num_classes)


def resnet20(in_channels: int = 3, num_classes: int = 10) -> ResNetCifar:
    """ResNet-20 for CIFAR (3 blocks per stage, about 0.27M parameters)."""
    return ResNetCifar(20, in_channels, num_classes)


def resnet32(in_channels: int = 3, num_classes: int = 10) -> ResNetCifar:
    """ResNet-32 for CIFAR (5 blocks per stage)."""
    return ResNetCifar(32, in_channels, num_classes)


def resnet56(in_channels: int = 3, num_classes: int = 10) -> ResNetCifar:
    """ResNet-56 for CIFAR (9 blocks per stage)."""
    return ResNetCifar(56, in_channels, num_classes)


def resnet110(in_channels: int = 3, num_classes: int = 10) -> ResNetCifar:
    """ResNet-110 for CIFAR (18 blocks per stage, about 1.7M parameters)."""
    return ResNetCifar(110, in_channels, num_classes)


class _Bottleneck(nn.Module):
    """1x1 → 3x3 (strided) → 1x1 bottleneck with expansion 4 and projection shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.branch = nn.Sequential(
            _conv_bn(cin, width, 1),
            _conv_bn(width, width, 3, stride),
            _conv_bn(width, cout, 1, relu=False),
        )
        self.shortcut = _shortcut(cin, cout, stride)
        self.relu = _relu()

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.branch(x) + self.shortcut(x))


class ResNet50(nn.Module):
    """ImageNet ResNet-50 (bottleneck blocks [3, 4, 6, 3], stride on the 3x3 conv).

    7x7 stride-2 stem, 3x3 stride-2 max-pool, four bottleneck stages of widths 64, 128, 256,
    512 (expansion 4), adaptive average pooling and a linear classifier; runs on inputs as small
    as 32x32.

    Args:
        in_channels: Input channels.
        num_classes: Number of output logits.
        zero_init_residual: Zero-initialises the last BatchNorm scale of every block.
    """

    def __init__(
        self, in_channels: int = 3, num_classes: int = 1000, zero_init_residual: bool = False
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(in_channels, 64, 7, 2), nn.MaxPool2d(3, 2, padding=1))
        blocks: list[nn.Module] = []
        cin = 64
        for stage, (width, count) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            for i in range(count):
                blocks.append(_Bottleneck(cin, width, 2 if stage > 0 and i == 0 else 1))
                cin = width * _Bottleneck.expansion
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        _init_weights(self)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, _Bottleneck):
                    norms = [n for n in m.branch.modules() if isinstance(n, nn.BatchNorm2d)]
                    nn.init.zeros_(norms[-1].weight)

    def forward(self, x: Tensor) -> Tensor:
        """Returns logits of shape ``(N, num_classes)`` for input ``(N, C, H, W)``."""
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def resnet50(in_channels: int = 3, num_classes: int = 1000) -> ResNet50:
    """ResNet-50 with the ImageNet layout; see :class:`ResNet50`."""
    return ResNet50(in_channels, num_classes)


class _SafeMaxPool2d(nn.Module):
    """2x2 stride-2 max-pool that is skipped when the input is already smaller than 2x2.

    This lets the VGG feature stack (five pools, i.e. a factor of 32) run on 8x8 inputs: the
    spatial size goes 8 → 4 → 2 → 1 and the remaining pools pass the 1x1 map through.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-2] < 2 or x.shape[-1] < 2:
            return x
        return nn.functional.max_pool2d(x, 2, 2)


_VGG16_CFG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


class VGG(nn.Module):
    """VGG with BatchNorm, sized for small images (CIFAR, digits).

    The 13 (bias-free) convolutions are each followed by BatchNorm and ReLU; the
    max-pools skip themselves once the map is 1x1 (see :class:`_SafeMaxPool2d`), then an
    adaptive average pool to 1x1 feeds a 512-512-classes classifier with dropout.

    Args:
        cfg: Channel counts, with ``"M"`` for a max-pool.
        in_channels: Input channels.
        num_classes: Number of output logits.
        dropout: Dropout probability after each hidden classifier layer.
    """

    def __init__(
        self,
        cfg: Sequence[int | str] = _VGG16_CFG,
        in_channels: int = 3,
        num_classes: int = 10,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for item in cfg:
            if item == "M":
                layers.append(_SafeMaxPool2d())
            else:
                cout = int(item)
                layers.append(_conv_bn(cin, cout, 3))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(cin, 512),
            _relu(),
            nn.Dropout(dropout),
            nn.Linear(512, 512),
            _relu(),
            nn.Dropout(dropout),
            nn.Linear(512, num_classes),
        )
        _init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        """Returns logits of shape ``(N, num_classes)`` for input ``(N, C, H, W)``."""
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def vgg16_bn(in_channels: int = 3, num_classes: int = 10) -> VGG:
    """VGG-16 with BatchNorm; see :class:`VGG`."""
    return VGG(_VGG16_CFG, in_channels, num_classes)


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": _relu,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
}


class DeepAutoencoder(nn.Module):
    """The deep autoencoder of Hinton & Salakhutdinov (2006) used in the K-FAC paper.

    Encoder ``in-1000-500-250-30`` and the mirrored decoder ``30-250-500-1000-in``. Every
    hidden layer is followed by the activation; the 30-unit code layer and the output layer are
    linear. The classic network uses logistic sigmoid units with a sigmoid cross-entropy loss on
    [0, 1] pixels; the default here is ReLU, which trains faster on standardised inputs. Pair the
    linear output with ``MSELoss`` (or ``BCEWithLogitsLoss`` for [0, 1] targets).

    Args:
        in_features: Size of the flattened input (and of the reconstruction).
        widths: Encoder widths; the last one is the code size.
        activation: ``"relu"``, ``"sigmoid"`` or ``"tanh"``.

    Raises:
        ValueError: If ``widths`` is empty or ``activation`` is unknown.
    """

    def __init__(
        self,
        in_features: int = 64,
        widths: Sequence[int] = (1000, 500, 250, 30),
        activation: str = "relu",
    ) -> None:
        super().__init__()
        if not widths:
            raise ValueError("DeepAutoencoder needs at least one width")
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"unknown activation {activation!r}; choose from {sorted(_ACTIVATIONS)}"
            )
        act = _ACTIVATIONS[activation]
        enc_sizes = [in_features, *widths]
        dec_sizes = enc_sizes[::-1]

        def stack(sizes: list[int]) -> nn.Sequential:
            layers: list[nn.Module] = []
            for i, (a, b) in enumerate(itertools.pairwise(sizes)):
                layers.append(nn.Linear(a, b))
                if i < len(sizes) - 2:
                    layers.append(act())
            return nn.Sequential(*layers)

        self.encoder = stack(enc_sizes)
        self.decoder = stack(dec_sizes)

    def encode(self, x: Tensor) -> Tensor:
        """Returns the linear code of shape ``(N, widths[-1])``."""
        return self.encoder(torch.flatten(x, 1))

    def forward(self, x: Tensor) -> Tensor:
        """Returns the reconstruction, shape ``(N, in_features)``, of the flattened input."""
        return self.decoder(self.encode(x))


def _adapt(ctor: Callable[[int, int], nn.Module]) -> Callable[..., nn.Module]:
    """Wraps ``ctor(in_channels, num_classes)`` as a registry builder."""

    def build(*, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
        return ctor(in_channels, num_classes)

    return build


def _build_mlp(*, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    return MLP(in_channels * image_size**2, num_classes=num_classes)


def _build_cnn(*, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    return SmallCNN(in_channels, num_classes, image_size)


def _build_autoencoder(*, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    return DeepAutoencoder(in_channels * image_size**2)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": _build_mlp,
    "cnn": _build_cnn,
    "resnet20": _adapt(resnet20),
    "resnet32": _adapt(resnet32),
    "resnet56": _adapt(resnet56),
    "resnet110": _adapt(resnet110),
    "resnet50": _adapt(resnet50),
    "vgg16": _adapt(vgg16_bn),
    "autoencoder": _build_autoencoder,
}
"""Model name → builder called as ``builder(in_channels=..., image_size=..., num_classes=...)``.

``"autoencoder"`` ignores ``num_classes``: its output has ``in_channels * image_size**2``
features (a reconstruction of the flattened input).
"""


LANGUAGE_MODELS = ("gpt",)
"""Built-in models on token ids ``(N, T)`` (``--data text``): :class:`~dkfac.app.gpt.GPT`."""


def model_names() -> list[str]:
    """Every built-in model name: :data:`MODELS` and :data:`LANGUAGE_MODELS`."""
    return sorted([*MODELS, *LANGUAGE_MODELS])


def check_model_name(name: str) -> str:
    """``name`` when it is a built-in model or an importable ``package.module:factory``.

    Raises:
        ModelError: Otherwise, saying what is allowed.
    """
    if ":" in name:
        load_factory(name)
    elif name not in MODELS and name not in LANGUAGE_MODELS:
        raise ModelError(
            f"unknown model {name!r}; choose from {', '.join(model_names())} "
            "or give package.module:factory"
        )
    return name


def build_model(
    name: str, *, in_channels: int, image_size: int, num_classes: int, **options: Any
) -> nn.Module:
    """Builds model ``name`` for inputs of shape ``(in_channels, size, size)`` or tokens.

    Args:
        name: A key of :data:`MODELS`, ``"gpt"`` or ``"package.module:factory"``.
        in_channels: Input channels.
        image_size: Input height and width; ``"mlp"`` and ``"autoencoder"`` take
            ``in_channels * image_size**2`` flat features; ``"gpt"``'s context length.
        num_classes: Number of output logits (ignored by ``"autoencoder"``); ``"gpt"``'s
            vocabulary.
        options: ``"gpt"``: ``layers``, ``width``, ``heads``. A factory is offered these
            and the three sizes above as keywords, and gets those its signature names.

    Returns:
        The freshly initialised model.

    Raises:
        ModelError: If ``name`` is unknown, a factory fails to load or returns no module, or
            a registered image model is given options.
    """
    check_model_name(name)
    sizes = {"in_channels": in_channels, "image_size": image_size, "num_classes": num_classes}
    model: nn.Module
    if ":" in name:
        model = build_from_factory(name, **sizes, **options)
    elif name == "gpt":
        from dkfac.app.gpt import GPT

        model = GPT(vocab_size=num_classes, context=image_size, **options)
    elif options:
        raise ModelError(f"model {name!r} takes no options, got {sorted(options)}")
    else:
        model = MODELS[name](**sizes)
    logger.debug("built %s: %d parameters", name, sum(p.numel() for p in model.parameters()))
    return model
