"""The model families of ``dkfac bench suite``: small models, fixed splits, one target each.

Every task is a model family the K-FAC recipes were not tuned on as a recipe would be (the
suite runs :meth:`~dkfac.KFACOptimizer.for_model`'s default, whatever the model), small
enough that every optimizer reaches the target in about a hundred steps on one CPU core:

* ``vit``: a vision transformer on digits (2×2 patches, two ``nn.TransformerEncoderLayer``);
* ``resnet``: a residual CNN with BatchNorm on digits;
* ``mlp``: an MLP with LayerNorm and GELU on digits;
* ``cnn``: the digits SmallCNN of ``dkfac train`` (``build_model("cnn")``);
* ``autoencoder``: a 64-256-64-16 autoencoder (mirrored) on digits, test MSE;
* ``gpt``: a two-layer byte-level GPT (:mod:`dkfac.app.gpt`) on the standard library's text,
  validation cross-entropy.

Splits are fixed by a split number: digits uses ``load_digits(seed=split)``; the text holds out
its last tenth on split 0 and its first tenth on split 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.data import load_digits
from dkfac.app.gpt import GPT
from dkfac.app.models import build_model
from dkfac.app.text import byte_tensor, default_text_path, read_text_bytes, windows

__all__ = [
    "FAMILIES",
    "MLPNorm",
    "ResNetBN",
    "SmallAutoencoder",
    "Task",
    "TinyViT",
    "load_task",
]

FAMILIES = ("vit", "resnet", "mlp", "cnn", "autoencoder", "gpt")
"""Every task of the suite, in the order it runs."""


class TinyViT(nn.Module):
    """A vision transformer for 8×8 images: 2×2 patches, a learned position table,
    ``depth`` pre-norm ``nn.TransformerEncoderLayer`` blocks (GELU), mean pooling, a head."""

    def __init__(self, width: int = 32, depth: int = 2, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Linear(4, width)
        self.positions = nn.Parameter(torch.randn(16, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(N, classes)`` for images ``(N, 1, 8, 8)``."""
        n = x.shape[0]
        patches = x.reshape(n, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(n, 16, 4)
        tokens = self.encoder(self.patch(patches) + self.positions)
        return self.head(self.norm(tokens.mean(dim=1)))


class _Residual(nn.Module):
    """``relu(x + bn(conv(relu(bn(conv(x))))))`` at a constant width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNetBN(nn.Module):
    """A residual CNN with BatchNorm: a stem, ``blocks`` residual blocks, average pooling."""

    def __init__(self, width: int = 16, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.blocks = nn.Sequential(*(_Residual(width) for _ in range(blocks)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(N, classes)`` for images ``(N, 1, H, W)``."""
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class MLPNorm(nn.Module):
    """Linear → LayerNorm → GELU, ``depth`` times, then a linear head, on flattened images."""

    def __init__(self, inputs: int = 64, width: int = 128, depth: int = 3, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for i in range(depth):
            layers += [nn.Linear(inputs if i == 0 else width, width), nn.LayerNorm(width)]
            layers.append(nn.GELU())
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(N, classes)``."""
        return self.net(x)


class SmallAutoencoder(nn.Module):
    """A ReLU autoencoder ``inputs-256-64-16`` and mirrored, sigmoid output (pixels in [0, 1])."""

    def __init__(self, inputs: int = 64, sizes: tuple[int, ...] = (256, 64, 16)) -> None:
        super().__init__()
        dims = [inputs, *sizes]
        encoder: list[nn.Module] = [nn.Flatten()]
        for a, b in itertools.pairwise(dims):
            encoder += [nn.Linear(a, b), nn.ReLU()]
        decoder: list[nn.Module] = []
        back = dims[::-1]
        for a, b in itertools.pairwise(back):
            decoder += [nn.Linear(a, b), nn.ReLU()]
        decoder[-1] = nn.Sigmoid()
        self.encoder = nn.Sequential(*encoder[:-1])  # a linear code
        self.decoder = nn.Sequential(*decoder)

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction ``(N, inputs)`` of ``x`` flattened."""
        return self.decoder(self.encoder(x))


@dataclass(frozen=True)
class Task:
    """One task: data, model, loss and the target the optimizers race to.

    Attributes:
        name: Its name in tables and file names.
        build: Builds the freshly initialised model (seeded by the caller).
        x_train: Training inputs.
        y_train: Training targets.
        x_test: Held-out inputs the metric is measured on.
        y_test: Held-out targets.
        batch_size: Samples per step.
        loss: ``loss(output, target)``, a mean.
        higher_is_better: The metric is an accuracy (else a loss).
        target: The metric value that counts as reached.
        eval_every: Steps between measurements of the metric (outside the clock).
        random_windows: Batches are drawn with replacement (the text), not epochs of a
            permutation.
    """

    name: str
    build: Callable[[], nn.Module]
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    batch_size: int
    loss: Callable[[Tensor, Tensor], Tensor]
    higher_is_better: bool
    target: float
    eval_every: int = 1
    random_windows: bool = False
    notes: dict[str, object] = field(default_factory=dict)

    def metric(self, model: nn.Module) -> float:
        """The held-out metric (accuracy or mean loss), eval mode, no gradients."""
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model(self.x_test)
            if self.higher_is_better:
                value = (out.argmax(dim=-1) == self.y_test).float().mean().item()
            else:
                value = self.loss(out, self.y_test).item()
        model.train(was_training)
        return float(value) if math.isfinite(value) else math.inf

    def batches(self, generator: torch.Generator) -> Callable[[], tuple[Tensor, Tensor]]:
        """An endless source of training batches drawn from ``generator``."""
        n = len(self.x_train)
        state: dict[str, Tensor | int] = {"order": torch.empty(0, dtype=torch.long), "at": n}

        def draw() -> tuple[Tensor, Tensor]:
            if self.random_windows:
                idx = torch.randint(n, (self.batch_size,), generator=generator)
                return self.x_train[idx], self.y_train[idx]
            if int(state["at"]) + self.batch_size > n:
                state["order"], state["at"] = torch.randperm(n, generator=generator), 0
            start = int(state["at"])
            order = state["order"]
            assert isinstance(order, Tensor)
            idx = order[start : start + self.batch_size]
            state["at"] = start + self.batch_size
            return self.x_train[idx], self.y_train[idx]

        return draw


def _cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _mse(out: Tensor, x: Tensor) -> Tensor:
    return F.mse_loss(out, x.flatten(1))


def _text(split: int, text_bytes: int, seq_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training windows (stride 1) and held-out windows (stride ``seq_len``) of the text:
    the last tenth held out on split 0, the first tenth on split 1."""
    stream = byte_tensor(read_text_bytes(default_text_path(), text_bytes))
    cut = len(stream) // 10
    if split == 0:
        train, held = stream[: len(stream) - cut], stream[len(stream) - cut :]
    else:
        train, held = stream[cut:], stream[:cut]
    x_train, y_train = windows(train, seq_len, 1)
    x_test, y_test = windows(held, seq_len, seq_len)
    return x_train, y_train, x_test[:64], y_test[:64]


def load_task(name: str, split: int = 0, *, tiny: bool = False) -> Task:
    """The task ``name`` of :data:`FAMILIES` on split ``split`` (0 or 1).

    Args:
        name: A family.
        split: Which fixed split of the data.
        tiny: Shrink the models and the text (for tests of the suite's mechanics).

    Raises:
        ValueError: For an unknown name or a split other than 0 and 1.
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown suite task {name!r}; choose from {', '.join(FAMILIES)}")
    if split not in (0, 1):
        raise ValueError(f"split must be 0 or 1, got {split}")
    if name == "gpt":
        seq = 16 if tiny else 64
        x_tr, y_tr, x_te, y_te = _text(split, 20_000 if tiny else 400_000, seq)
        width, layers = (16, 1) if tiny else (64, 2)
        return Task(
            name, lambda: GPT(256, seq, layers, width, 4), x_tr, y_tr, x_te, y_te, 32,
            _cross_entropy, False, 2.6, eval_every=5, random_windows=True,
        )  # fmt: skip
    data = load_digits(seed=split, normalize=name != "autoencoder")
    x_tr, y_tr, x_te, y_te = data.x_train, data.y_train, data.x_test, data.y_test
    builders: dict[str, Callable[[], nn.Module]] = {
        "vit": lambda: TinyViT(8 if tiny else 32, 1 if tiny else 2),
        "resnet": lambda: ResNetBN(4 if tiny else 16, 1 if tiny else 2),
        "mlp": lambda: MLPNorm(64, 16 if tiny else 128),
        "cnn": lambda: build_model("cnn", in_channels=1, image_size=8, num_classes=10),
        "autoencoder": lambda: SmallAutoencoder(64, (32, 8) if tiny else (256, 64, 16)),
    }
    if name == "autoencoder":
        return Task(name, builders[name], x_tr, x_tr, x_te, x_te, 256, _mse, False, 0.03)
    target = 0.93 if name == "vit" else 0.95  # the transformer learns digits more slowly
    return Task(name, builders[name], x_tr, y_tr, x_te, y_te, 256, _cross_entropy, True, target)
