"""Peer optimizers of ``dkfac bench``: each trains, Muon's split by name, its conv views."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.models import build_model
from dkfac.bench.peers import (
    KINDS,
    MuonWithAdamW,
    OptimizerSpec,
    build_optimizer,
    muon_split,
    resolve_options,
    unavailable_reason,
)

LRS = {"sgd": 0.5, "adam": 0.01, "adamw": 0.01, "muon": 0.05, "soap": 0.03, "kfac": 0.1}
HAS_HEAVYBALL = unavailable_reason("soap") is None


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_each_peer_reduces_the_loss_of_a_tiny_model(kind: str) -> None:
    if kind == "soap" and not HAS_HEAVYBALL:
        pytest.skip("heavyball is not installed (the bench extra)")
    model = _mlp()
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    options = resolve_options(kind, {"adamw_lr": 0.01} if kind == "muon" else None)
    if kind == "kfac":
        options = {"factor_update_interval": 1, "inverse_update_interval": 1}
    optimizer = build_optimizer(
        OptimizerSpec(kind, kind, [LRS[kind]], options), model, LRS[kind], 0.9
    )
    losses = []
    for _ in range(20):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_muon_split_of_the_small_cnn_by_name() -> None:
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
    split = muon_split(model)
    # conv(1→32) is the input layer and Linear(128→10) the head: both to AdamW with biases
    assert split.muon == ["features.2.weight", "features.5.weight", "classifier.0.weight"]
    assert split.adamw == [
        "features.0.weight",
        "features.0.bias",
        "features.2.bias",
        "features.5.bias",
        "classifier.0.bias",
        "classifier.2.weight",
        "classifier.2.bias",
    ]


class _TiedLM(nn.Module):
    """Embedding, three hidden matrices around a LayerNorm, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.mid = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.norm(torch.relu(self.inp(self.emb(tokens))))
        return self.head(self.out(torch.relu(self.mid(h))))


def test_muon_split_sends_embeddings_norms_tied_heads_and_ends_to_adamw() -> None:
    split = muon_split(_TiedLM())
    # the embedding is the input layer: the first Linear is hidden like the others
    assert split.muon == ["inp.weight", "mid.weight", "out.weight"]
    assert split.adamw == [
        "emb.weight",  # also the head's weight: listed once, under its first name
        "inp.bias",
        "norm.weight",
        "norm.bias",
        "out.bias",
    ]  # the frozen parameter is in neither
    with pytest.raises(ValueError, match="no hidden weight matrix"):
        muon_split(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="no hidden weight matrix"):
        muon_split(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)))


def _set_grads(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_muon_steps_conv_weights_as_flattened_matrices_and_adamw_the_rest() -> None:
    """Oracle: each parameter moves exactly as Muon (on its 2-D view) or AdamW alone would."""
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _set_grads(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opts = resolve_options("muon", {"adamw_lr": 0.003})
    optimizer = MuonWithAdamW(model, 0.02, opts)
    optimizer.step()
    split = muon_split(model)
    for name, param in model.named_parameters():
        ref = before[name].clone()
        ref_view = ref.view(ref.shape[0], -1) if name in split.muon else ref
        ref_view.grad = grads[name].view(ref_view.shape)
        if name in split.muon:
            torch.optim.Muon([ref_view], lr=0.02, weight_decay=0.1, momentum=0.95).step()
        else:
            torch.optim.AdamW([ref_view], lr=0.003, weight_decay=0.01).step()
        assert torch.equal(param.detach(), ref), name
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_muon_without_flatten_conv_gives_conv_weights_to_adamw() -> None:
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
    opts = resolve_options("muon", {"flatten_conv": 0})
    optimizer = MuonWithAdamW(model, 0.02, opts)
    assert optimizer.split.muon == ["classifier.0.weight"]
    assert "features.2.weight" in optimizer.split.adamw
    adamw_ids = {id(p) for g in optimizer.adamw.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert adamw_ids == {id(named[n]) for n in optimizer.split.adamw}
    assert optimizer.muon.param_groups[0]["params"] == [named["classifier.0.weight"]]


def test_resolve_options_merges_defaults_and_rejects_unknown_ones() -> None:
    options = resolve_options("muon", {"adamw_lr": 0.01}, {"momentum": 0.9})
    assert options["adamw_lr"] == 0.01 and options["momentum"] == 0.9
    assert options["weight_decay"] == 0.1  # torch.optim.Muon's default, written out
    with pytest.raises(ValueError, match="adamw takes no option betas; allowed: eps, weight_decay"):
        resolve_options("adamw", {"betas": 0.9})
    with pytest.raises(ValueError, match="unknown optimizer kind 'lion'"):
        resolve_options("lion")


def test_soap_is_unavailable_without_heavyball(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "heavyball", None)  # import heavyball now fails
    reason = unavailable_reason("soap")
    assert reason is not None and "pip install 'dkfac[bench]'" in reason
    assert unavailable_reason("muon") is None


def test_muon_split_of_the_autoencoder_keeps_the_six_hidden_matrices() -> None:
    model = build_model("autoencoder", in_channels=1, image_size=8, num_classes=0)
    split = muon_split(model)
    shapes = [tuple(dict(model.named_parameters())[n].shape) for n in split.muon]
    # 64-1000-500-250-30-250-500-1000-64: all but the 64→1000 input and 1000→64 output layers
    assert shapes == [(500, 1000), (250, 500), (30, 250), (250, 30), (500, 250), (1000, 500)]
    assert {"encoder.0.weight", "decoder.6.weight"} <= set(split.adamw)
    assert all(
        n.endswith(".bias") for n in set(split.adamw) - {"encoder.0.weight", "decoder.6.weight"}
    )
