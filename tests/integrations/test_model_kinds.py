"""The default (``KFACOptimizer.for_model`` with nothing set) on kinds of model no recipe
and no other test was written for: a mixture of experts, a LoRA adapter, a ConvNeXt block,
a squeeze-and-excitation block, a graph network, layers that read 3-D and 4-D inputs,
layers without a block (grouped, dilated, circular, bilinear, 3-D), BatchNorm after a
bias-free layer, and a tied autoencoder.

Each trains a few steps and is checked as a user would: every trainable parameter is in
``describe()`` (a layer's, or the inner optimizer's with a reason), the weights stay
finite, and a checkpoint taken mid-run resumes bit for bit (the oracle: the run that did
not stop).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from tests.integrations.twins import covers_trains_and_resumes, train_steps

Batch = tuple[Tensor, Tensor]


class _Experts(nn.Module):
    """A router sends each token to its top 2 of 4 expert MLPs; an expert runs on its
    tokens only (none some steps: no gradient then)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.router = nn.Linear(width, 4)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 16), nn.GELU(), nn.Linear(16, width)) for _ in range(4)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        flat = torch.relu(self.inp(x)).reshape(-1, self.router.in_features)
        weight, chosen = self.router(flat).softmax(-1).topk(2, -1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, slot, None])
        return self.head(flat + out).reshape(*x.shape[:-1], -1)


class _LoRA(nn.Module):
    """A frozen linear layer plus a trainable rank-2 adapter, ``B`` zero at the start."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, 2, bias=False)
        self.lora_B = nn.Linear(2, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + 2.0 * self.lora_B(self.lora_A(x))


def _lora() -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU())
    return nn.Sequential(_LoRA(model[0]), nn.ReLU(), _LoRA(model[2]), nn.ReLU(), nn.Linear(12, 3))


class _ConvNeXtBlock(nn.Module):
    """Depthwise 7×7, LayerNorm over channels last, a 4× pointwise MLP, a layer scale."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 2, stride=2)
        self.dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.pw1, self.pw2 = nn.Linear(channels, 4 * channels), nn.Linear(4 * channels, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 0.1))
        self.head = nn.Linear(channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        y = self.pw2(F.gelu(self.pw1(self.norm(self.dw(x).permute(0, 2, 3, 1)))))
        return self.head((x + (self.gamma * y).permute(0, 3, 1, 2)).mean((2, 3)))


class _MobileNetBlock(nn.Module):
    """Depthwise-separable convolutions with BatchNorm: a depthwise 3×3 with a channel
    multiplier of 2 (no bias), a pointwise 1×1, a strided depthwise 1-D view of the rows."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())  # fmt: skip
        self.dw = nn.Conv2d(channels, 2 * channels, 3, padding=1, groups=channels, bias=False)
        self.dw_norm = nn.BatchNorm2d(2 * channels)
        self.pw = nn.Conv2d(2 * channels, channels, 1, bias=False)
        self.pw_norm = nn.BatchNorm2d(channels)
        self.rows = nn.Conv1d(channels, channels, 3, stride=2, groups=channels)
        self.head = nn.Linear(channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        y = self.pw_norm(self.pw(torch.relu(self.dw_norm(self.dw(x)))))
        z = torch.relu(x + y).mean(2)  # (N, C, W)
        return self.head(self.rows(z).mean(2))


class _SqueezeExcite(nn.Module):
    """A residual block whose output channels are gated by two linear layers."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)
        self.fc1, self.fc2 = nn.Linear(channels, 2), nn.Linear(2, channels)
        self.head = nn.Linear(channels * 16, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.stem(x))
        y = self.norm(self.conv(x))
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(y.mean((2, 3))))))
        out = F.max_pool2d(torch.relu(x + y * gate[:, :, None, None]), 2)
        return self.head(out.view(out.size(0), -1))


_EDGES = torch.randint(0, 10, (2, 30), generator=torch.Generator().manual_seed(3))


class _Graph(nn.Module):
    """Messages over an edge list summed into the nodes (``index_add_``); nodes are rows."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.msg, self.upd = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.inp(x))
        agg = torch.zeros_like(h).index_add_(0, _EDGES[1], self.msg(h)[_EDGES[0]])
        return self.head(torch.relu(self.upd(torch.cat([h, agg], -1))))


class _Unsupported(nn.Module):
    """Layers without a block: a transposed 3-D convolution, a bilinear layer; beside them a
    grouped dilated 1-D convolution (unit-wise) and a circular one."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = nn.Conv1d(2, 4, 3, padding=2, dilation=2, groups=2)
        self.circular = nn.Conv1d(4, 4, 3, padding=1, padding_mode="circular")
        self.volume = nn.ConvTranspose3d(1, 2, 3, padding=1)
        self.bilinear = nn.Bilinear(4, 4, 4)
        self.head = nn.Linear(4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        y = self.circular(torch.relu(self.grouped(x)))
        z = self.volume(x.reshape(x.shape[0], 1, 2, 2, 4)).mean(1).reshape(x.shape[0], 4, 4)
        return self.head(self.bilinear(y[..., :4].mT, z.mT).flatten(1))


class _TiedAutoencoder(nn.Module):
    """The decoder is the encoder's transpose (``F.linear`` on ``enc.weight.t()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 3)
        self.dec_bias = nn.Parameter(torch.zeros(6))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.enc(x)), self.enc.weight.t(), self.dec_bias)


def _bias_free_batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _channels_last_and_tokens() -> nn.Module:
    """Linear layers over the last dimension of ``(B, H, W, C)`` and ``(B, T, C)``."""
    return nn.Sequential(nn.Unflatten(1, (2, 3, 1)), nn.Linear(1, 8), nn.GELU(), nn.Flatten(1, 2),
                         nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3), nn.Flatten())  # fmt: skip


def _tokens(gen: torch.Generator) -> Batch:
    return torch.randn(4, 5, 6, generator=gen), torch.randint(0, 3, (4, 5), generator=gen)


def _images(gen: torch.Generator) -> Batch:
    return torch.randn(8, 1, 8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _vectors(gen: torch.Generator) -> Batch:
    return torch.randn(12, 6, generator=gen), torch.randint(0, 3, (12,), generator=gen)


def _nodes(gen: torch.Generator) -> Batch:
    return torch.randn(10, 6, generator=gen), torch.randint(0, 3, (10,), generator=gen)


def _sequences(gen: torch.Generator) -> Batch:
    return torch.randn(6, 2, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)


def _six(gen: torch.Generator) -> Batch:
    x = torch.randn(12, 6, generator=gen)
    return x, x


def _class_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _unflattened_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(out.shape[0], 6, 3).mean(1), y)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Batch], Callable]] = {
    "experts": (_Experts, _tokens, _class_loss),
    "lora": (_lora, _vectors, _class_loss),
    "convnext": (_ConvNeXtBlock, _images, _class_loss),
    "mobilenet": (_MobileNetBlock, _images, _class_loss),
    "squeeze_excite": (_SqueezeExcite, _images, _class_loss),
    "graph": (_Graph, _nodes, _class_loss),
    "unsupported_layers": (_Unsupported, _sequences, _class_loss),
    "tied_autoencoder": (_TiedAutoencoder, _six, F.mse_loss),
    "bias_free_batchnorm": (_bias_free_batchnorm, _vectors, _class_loss),
    "channels_last_and_tokens": (_channels_last_and_tokens, _vectors, _unflattened_loss),
}


def _train(model: nn.Module, opt: KFACOptimizer, case: str, steps: range) -> None:
    _, batch, loss = CASES[case]
    train_steps(model, opt, batch, loss, steps)


def _fresh(case: str) -> tuple[nn.Module, KFACOptimizer]:
    torch.manual_seed(0)
    model = CASES[case][0]()
    return model, KFACOptimizer.for_model(model)


@pytest.mark.parametrize("case", list(CASES))
def test_the_default_covers_trains_and_resumes_bit_for_bit(case: str) -> None:
    covers_trains_and_resumes(*CASES[case])


def _reasons(case: str) -> dict[str, str]:
    model, opt = _fresh(case)
    _train(model, opt, case, range(1))
    return {r["name"]: r["reason"] for r in opt.preconditioner.describe() if r["reason"]}


def test_layers_without_a_block_are_named_with_why() -> None:
    reasons = _reasons("unsupported_layers")
    assert "grouped.weight" not in reasons  # unit-wise, its 1·3 weights and bias a unit
    assert reasons["volume.weight"] == "ConvTranspose3d has no K-FAC block"
    assert reasons["bilinear.weight"] == "Bilinear has no K-FAC block"
    assert "circular.weight" not in reasons  # a circular padding is a plain convolution's


def test_convnext_and_lora_decisions() -> None:
    reasons = _reasons("convnext")
    assert "dw.weight" not in reasons and "dw.bias" not in reasons  # unit-wise, d = 49 + 1
    assert reasons["gamma"].startswith("a raw parameter of _ConvNeXtBlock")
    _, opt = _fresh("lora")
    layers = set(opt.preconditioner.layers)
    assert {"0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B", "4"} <= layers
    # the frozen bases are registered (preconditioned once unfrozen) and capture nothing
    assert {"0.base", "2.base"} <= layers


@pytest.mark.parametrize(
    ("case", "units"),
    [("convnext", {"dw": (4, 50)}), ("mobilenet", {"dw": (8, 9), "rows": (4, 4)})],
)
def test_depthwise_layers_get_adam_in_their_units_eigenbases(case: str, units: dict) -> None:
    """Under the default's eigen_adam a grouped convolution takes unitwise_adam: a basis and
    Adam's moments per output channel."""
    model, opt = _fresh(case)
    _train(model, opt, case, range(2))
    rows = {r["name"]: r for r in opt.preconditioner.describe()}
    for name, (channels, dim) in units.items():
        assert rows[name]["method"] == "unitwise_adam"
        assert (rows[name]["g_dim"], rows[name]["a_dim"]) == (channels, dim)
        assert rows[name]["a_factor"] == rows[name]["g_factor"] == "unit-wise"
        layer = opt.preconditioner.layers[name]
        assert layer.solver_state["q"].shape == (channels, dim, dim)
        assert {k: tuple(v.shape) for k, v in layer.moments.items()} == {
            "m": (channels, dim),
            "v": (channels, dim),
            "t": (1,),
        }


def test_the_squeeze_excite_heads_map_is_found_from_its_view() -> None:
    """``out.view(out.size(0), -1)`` of the 4-channel pooled map: the head reads 4 × 16."""
    _, opt = _fresh("squeeze_excite")
    assert dict(opt.preconditioner.config.flattened_inputs) == {"head": (4, 16)}
