"""The default (``KFACOptimizer.for_model`` with nothing set) on more kinds of model no
recipe was written for: blocks under activation checkpointing, a ``channels_last`` CNN with
non-square, dilated, strided, reflect-padded and ``padding="same"`` convolutions, a 1-D
audio-like CNN, whole models in float64 and bfloat16, ``nn.Transformer`` and a
pre-norm ``nn.TransformerDecoderLayer`` with cross-attention, attention whose keys and
values are narrower than its queries, a model with a main and an auxiliary head, one with
data-dependent control flow, stochastic depth, and sequences whose length and batch change
from step to step (down to one sample). Each is checked as
:func:`~tests.integrations.twins.covers_trains_and_resumes` checks a user's model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dkfac import KFACOptimizer
from tests.integrations.twins import covers_trains_and_resumes, train_steps


class _Checkpointed(nn.Module):
    """Two pre-norm MLP blocks, each under ``checkpoint(use_reentrant=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            for _ in range(2)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=True)
        return self.head(h)


class _OddConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, (1, 3), padding="same")
        self.wide = nn.Conv2d(4, 4, (3, 1), dilation=2, padding="same", padding_mode="reflect")
        self.down = nn.Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0))
        self.norm = nn.BatchNorm2d(6)
        self.head = nn.Linear(6 * 4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.wide(torch.relu(self.stem(x))))
        return self.head(torch.relu(self.norm(self.down(x))).flatten(1))


def _channels_last() -> nn.Module:
    return _OddConvs().to(memory_format=torch.channels_last)


def _audio() -> nn.Module:
    """Strided, dilated and reflect-padded 1-D convolutions over a waveform-like signal."""
    return nn.Sequential(
        nn.Conv1d(2, 4, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv1d(4, 4, 3, dilation=2, padding="same", padding_mode="reflect"), nn.ReLU(),
        nn.Conv1d(4, 6, 4, stride=3, dilation=2), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(6, 3),
    )  # fmt: skip


class _Mixed(nn.Module):
    """An embedding, linear layers, a LayerNorm, a 1-D convolution and BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.codes, self.norm = nn.Embedding(5, 8), nn.LayerNorm(8)
        self.conv, self.bn = nn.Conv1d(1, 2, 3, padding=1), nn.BatchNorm1d(2)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.inp(x)) + self.codes((x[:, 0].abs() * 2).long().clamp(max=4))
        h = h + F.gelu(self.mid(self.norm(h)))
        return self.head(h + self.bn(self.conv(h[:, None])).mean(1))


class _Seq2Seq(nn.Module):
    """Shared token table, ``nn.Transformer`` (or one encoder and one pre-norm decoder
    layer) with a causal target mask, batch first."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.whole = whole
        self.tokens = nn.Embedding(7, 8)
        if whole:
            self.core = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)
        else:
            self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.dec = nn.TransformerDecoderLayer(
                8, 2, 16, dropout=0.0, batch_first=True, norm_first=True
            )
        self.head = nn.Linear(8, 7)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        src, tgt = (self.tokens(t) for t in pair)
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        if self.whole:
            out = self.core(src, tgt, tgt_mask=mask, tgt_is_causal=True)
        else:
            out = self.dec(tgt, self.enc(src), tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


class _NarrowKeys(nn.Module):
    """Learned queries attend to inputs whose keys (10 wide) and values (6) are narrower
    than the queries (16): separate q/k/v weights, a bias on the keys and values, and a
    padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(3, 16) * 0.1)
        self.keys = nn.Linear(6, 10)
        self.attention = nn.MultiheadAttention(16, 2, kdim=10, vdim=6, batch_first=True,
                                               add_bias_kv=True)  # fmt: skip
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[:, -1] = True
        queries = self.queries.expand(x.shape[0], -1, -1)
        out, _ = self.attention(queries, self.keys(x), x, key_padding_mask=padding)
        return self.head(out.mean(1))


class _TwoHeads(nn.Module):
    """A main head and an auxiliary one on an earlier layer; the losses are summed."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid = nn.Linear(6, 8), nn.Linear(8, 8)
        self.main, self.aux = nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        early = torch.relu(self.inp(x))
        return self.main(torch.relu(self.mid(early))), self.aux(early)


class _Branching(nn.Module):
    """Data-dependent control flow, the head defined first; stochastic depth (a residual
    branch skipped on about half of the training steps, drawn from the batch so that a
    resumed run draws the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.inp, self.left, self.right = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.deep = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.inp(x))
        h = h + (self.left(h) if h.mean() > 0.4 else self.right(h))
        if not self.training or x[0, 0] > 0:
            h = h + torch.relu(self.deep(h))
        return self.head(h)


def _vectors(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    return torch.randn(12, 6, generator=gen, dtype=dtype), torch.randint(0, 3, (12,), generator=gen)


def _images(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(8, 1, 8, 8, generator=gen).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 3, (8,), generator=gen)


def _signals(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(8, 2, 40, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _sequences(gen: torch.Generator) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """A length of 2 to 6 and a batch of 4, or of 1 on step 5 (a last, short batch)."""
    batch = 1 if gen.initial_seed() == 5 else 4
    length = int(torch.randint(2, 7, (), generator=gen))
    src = torch.randint(0, 7, (batch, length + 1), generator=gen)
    return (src, src[:, :length]), src[:, 1:]


def _tokens(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(6, 4, 6, generator=gen), torch.randint(0, 3, (6,), generator=gen)


def _class_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def _two_losses(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return F.cross_entropy(out[0], y) + 0.5 * F.cross_entropy(out[1], y % 2)


Case = tuple[Callable[[], nn.Module], Callable, Callable]
CASES: dict[str, Case] = {
    "checkpointed": (_Checkpointed, _vectors, _class_loss),
    "channels_last_odd_convs": (_channels_last, _images, _class_loss),
    "audio_conv1d": (_audio, _signals, _class_loss),
    "float64_model": (lambda: _Mixed().double(), lambda g: _vectors(g, torch.float64),
                      _class_loss),
    "bfloat16_model": (lambda: _Mixed().bfloat16(), lambda g: _vectors(g, torch.bfloat16),
                       _class_loss),
    "transformer": (lambda: _Seq2Seq(True), _sequences, _class_loss),
    "decoder_layer": (lambda: _Seq2Seq(False), _sequences, _class_loss),
    "narrow_keys": (_NarrowKeys, _tokens, _class_loss),
    "two_heads": (_TwoHeads, _vectors, _two_losses),
    "branching": (_Branching, _vectors, _class_loss),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_default_covers_trains_and_resumes_bit_for_bit(case: str) -> None:
    covers_trains_and_resumes(*CASES[case])


def _rows(case: str, steps: int = 2) -> dict[str, dict]:
    make, batch, loss = CASES[case]
    torch.manual_seed(0)
    model = make()
    opt = KFACOptimizer.for_model(model)
    train_steps(model, opt, batch, loss, range(steps))
    return {row["name"]: row for row in opt.preconditioner.describe()}


def test_the_roles_of_two_heads_and_of_branches() -> None:
    """Both heads keep Adam's update in their basis and the hidden layers are
    orthogonalised, with data-dependent control flow too."""
    for case, roles in (
        ("two_heads", {"inp": "input", "mid": "hidden", "main": "head", "aux": "head"}),
        ("branching", {"head": "head", "inp": "input", "left": "hidden", "right": "hidden",
                       "deep": "hidden"}),
    ):  # fmt: skip
        rows = _rows(case)
        assert {name: rows[name]["role"] for name in roles} == roles
        for name, role in roles.items():
            assert ("orthogonal" in rows[name]["method"]) == (role == "hidden"), name


def test_low_precision_models_keep_their_moments_in_float32() -> None:
    """A bfloat16 model's factors and bases are bfloat16 (its parameters' dtype) and
    finite; Adam's moments in the basis are float32, as the leftover parameters' are."""
    make, batch, loss = CASES["bfloat16_model"]
    torch.manual_seed(0)
    model = make()
    opt = KFACOptimizer.for_model(model)
    train_steps(model, opt, batch, loss, range(6))
    layer = opt.preconditioner.layers["mid"]
    assert layer.a is not None and layer.a.dtype == torch.bfloat16
    assert torch.isfinite(layer.a).all() and torch.isfinite(layer.solver_state["qa"]).all()
    assert layer.moments is not None and layer.moments["v"].dtype == torch.float32
