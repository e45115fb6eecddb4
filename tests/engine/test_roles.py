"""Rules without names: roles and flattened convolution maps read off the model, checked
against the values the recipes wrote by hand."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.app.gpt import GPT
from dkfac.app.models import build_model
from dkfac.bench.peers import muon_split
from dkfac.engine.roles import (
    basis_block_from_widths,
    flattened_conv_inputs,
    layer_roles,
    resolve_role_patterns,
)


def _cnn() -> nn.Module:
    return build_model("cnn", in_channels=1, image_size=8, num_classes=10)


def test_the_digits_cnn_map_is_the_recipes() -> None:
    # benchmarks/recipes/digits-cnn.toml wrote flattened-inputs = ["classifier.0=64x16"]
    assert flattened_conv_inputs(_cnn()) == {"classifier.0": (64, 16)}


class _Functional(nn.Module):
    """A conv, a residual addition, BatchNorm, a pool, then ``x.flatten(1)`` twice over."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.norm = nn.BatchNorm2d(5)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(5 * 16, 4)
        self.pooled = nn.Linear(5, 4)
        self.flat = nn.Flatten()

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        y = self.pool(torch.relu(self.norm(y) + y))
        z = nn.functional.adaptive_avg_pool2d(y, 1)
        return self.head(y.flatten(1)) + self.pooled(self.flat(z))


def test_maps_are_found_through_channel_keeping_operations() -> None:
    # the 1×1 pooled map has one position: no structure to use, no map
    assert flattened_conv_inputs(_Functional()) == {"head": (5, 16)}


class _Volumes(nn.Module):
    """A 3-D convolution pooled functionally (max, then average), then flattened."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.head = nn.Linear(3 * 8, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = F.avg_pool3d(F.dropout3d(F.max_pool3d(self.conv(x), 2), 0.0), 2)
        return self.head(y.flatten(1))


def test_maps_are_found_through_functional_pools_of_volumes() -> None:
    # (2, 8, 8, 8) volumes: 3 channels at 8·8·8 positions, pooled twice to 2·2·2 = 8
    model = _Volumes()
    assert model(torch.randn(1, 2, 8, 8, 8)).shape == (1, 4)
    assert flattened_conv_inputs(model) == {"head": (3, 8)}


class _NormsAndActivations(nn.Module):
    """Channel-keeping layers beyond BatchNorm and ReLU before the flatten: InstanceNorm,
    GroupNorm, SyncBatchNorm, ReLU6, Hardswish, upsampling and padding."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True))
        self.b = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.SyncBatchNorm(6), nn.ReLU6())
        self.c = nn.Sequential(nn.Conv2d(3, 2, 3), nn.GroupNorm(1, 2), nn.Hardswish())
        self.grow = nn.Upsample(scale_factor=2)
        self.fa, self.fb = nn.Linear(4 * 36, 2), nn.Linear(6 * 144, 2)
        self.fc = nn.Linear(2 * 36, 2)

    def forward(self, x: Tensor) -> Tensor:
        a = torch.flatten(self.a(x), 1)
        b = torch.flatten(self.grow(self.b(x)), 1)
        c = F.pad(nn.functional.mish(self.c(x)), (1, 1, 1, 1)).flatten(1)
        return self.fa(a) + self.fb(b) + self.fc(c)


def test_maps_are_found_through_other_norms_activations_and_resizing() -> None:
    assert flattened_conv_inputs(_NormsAndActivations()) == {
        "fa": (4, 36),
        "fb": (6, 144),
        "fc": (2, 36),
    }


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 36, 3)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # data-dependent: fx cannot trace it
            x = -x
        return self.fc(self.conv(x).flatten(1))


def test_an_untraceable_model_or_a_plain_mlp_gets_no_map() -> None:
    assert flattened_conv_inputs(_Untraceable()) == {}
    assert flattened_conv_inputs(nn.Sequential(nn.Flatten(), nn.Linear(64, 8))) == {}
    assert flattened_conv_inputs(GPT(256, 16, 1, 16, 4)) == {}


def test_the_gpt_roles_are_the_recipes_split() -> None:
    model = GPT(256, 16, 2, 16, 4)
    roles = layer_roles(model)
    hidden = resolve_role_patterns("orthogonal_layers", ["role:hidden"], model)
    skipped = resolve_role_patterns("skip_layers", ["role:embedding", "role:head"], model)
    # benchmarks/recipes/gpt-text.toml: orthogonal "^blocks\\.", skip tokens, positions, head
    names = [n for n, _ in model.named_modules()]
    by_recipe = {n for n in names if re.search("^blocks\\.", n) and n in roles}
    assert {n for n in roles if any(re.search(p, n) for p in hidden)} == by_recipe
    assert {n for n in roles if any(re.search(p, n) for p in skipped)} == {
        "tokens",
        "positions",
        "head",
    }


def test_roles_match_the_muon_split_of_the_peers() -> None:
    for model in (_cnn(), GPT(256, 16, 2, 16, 4)):
        roles = layer_roles(model)
        hidden = {f"{n}.weight" for n, r in roles.items() if r == "hidden"}
        assert hidden == set(muon_split(model).muon)


def test_role_patterns_reach_the_preconditioner_and_explicit_maps_win() -> None:
    model = _cnn()
    pre = KFACPreconditioner(
        model,
        method="eigen_adam",
        orthogonal_layers=["role:hidden"],
        skip_layers="role:head",
        flattened_inputs="graph",
    )
    assert set(pre.layers) == {"features.0", "features.2", "features.5", "classifier.0"}
    assert pre.config.flattened_inputs == {"classifier.0": (64, 16)}
    pre.remove_hooks()
    plain = KFACPreconditioner(_cnn(), method="eigen_adam")  # not asked: no map
    assert plain.config.flattened_inputs == {}
    plain.remove_hooks()
    with pytest.raises(ValueError, match="flattened_inputs needs method"):
        KFACPreconditioner(_cnn(), method="eigen", flattened_inputs="graph")


def _flattening_cnn(outputs: int = 10) -> nn.Sequential:
    """A convolution, then ``nn.Flatten`` into a linear layer (``"2"``), then a head."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Flatten(),
        nn.Linear(4 * 64, outputs),
        nn.Linear(outputs, 3),
    )


def _frozen_weight(model: nn.Module) -> dict[str, object]:
    model[2].weight.requires_grad_(False)  # type: ignore[index]  # BitFit: its bias trains
    return {}


def _spectral_norm(model: nn.Module) -> dict[str, object]:
    nn.utils.parametrizations.spectral_norm(model[2])  # type: ignore[index]
    return {}


@pytest.mark.parametrize(
    "leave",
    [lambda m: {"skip_layers": ["^2$"]}, _frozen_weight, _spectral_norm],
    ids=["skipped", "frozen-weight", "parametrized"],
)
def test_a_flattening_layer_k_fac_does_not_precondition_gets_no_graph_map(leave) -> None:
    # The graph shows "2" reading the convolution's map flattened; with no block it needs no
    # map (it used to be refused as if the user had named it), and its parameters train.
    torch.manual_seed(0)
    model = _flattening_cnn()
    opt = KFACOptimizer.for_model(model, lr=0.01, **leave(model))
    assert "2" not in opt.preconditioner.layers
    assert opt.preconditioner.config.flattened_inputs == {}
    before = [p.detach().clone() for p in model[2].parameters() if p.requires_grad]
    x = torch.randn(16, 1, 8, 8)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    after = [p for p in model[2].parameters() if p.requires_grad]
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    with pytest.raises(ValueError, match="flattened_inputs names '2', which is not a"):
        KFACOptimizer.for_model(
            _flattening_cnn(), skip_layers=["^2$"], flattened_inputs={"2": (4, 64)}
        )


def test_a_vocabulary_sized_head_reading_a_flattened_map_gets_adams_direction() -> None:
    # for_model leaves a head of more than 4096 outputs to Adam; the graph's map for it
    # is dropped, not refused, with no option given
    def model(outputs: int) -> nn.Module:
        convs = [nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)]
        return nn.Sequential(*convs, nn.Flatten(), nn.Linear(4 * 64, outputs))

    opt = KFACOptimizer.for_model(model(5000))
    assert set(opt.preconditioner.layers) == {"0", "1"}
    assert opt.preconditioner.config.flattened_inputs == {}
    kept = KFACOptimizer.for_model(model(10))  # the same model, narrower: mapped
    assert kept.preconditioner.config.flattened_inputs == {"3": (4, 64)}


class _Unsupported(nn.Module):
    """Hidden layers without a basis to orthogonalise: a depthwise convolution (unit-wise)
    beside a pointwise one, and (``volumes``) only transposed 3-D convolutions, which have no
    block."""

    def __init__(self, volumes: bool) -> None:
        super().__init__()
        if volumes:
            self.first = nn.ConvTranspose3d(3, 4, 3, padding=1)
            self.hidden = nn.ConvTranspose3d(4, 4, 3, padding=1)
        else:
            self.first, self.hidden = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, groups=4)
        self.pointwise = None if volumes else nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        y = self.hidden(torch.relu(self.first(x)))
        y = y if self.pointwise is None else self.pointwise(y)
        return self.head(y.flatten(2).mean(-1))


@pytest.mark.parametrize("volumes", [False, True])
def test_a_role_is_picked_among_the_preconditioned_layers(volumes: bool) -> None:
    """``for_model``'s ``role:hidden`` on hidden layers that have no block or a unit-wise
    one: the Kronecker hidden layers are orthogonalised (none when there is none) and the
    model trains; an explicit pattern that matches nothing, or a unit-wise layer, is still
    an error."""
    model = _Unsupported(volumes)
    opt = KFACOptimizer.for_model(model)
    orthogonal = {
        n
        for n, s in opt.preconditioner.layers.items()
        if getattr(getattr(s.solver, "options", None), "orthogonal_rms", None)
    }
    assert orthogonal == (set() if volumes else {"pointwise"})
    x = torch.randn(8, 3, 4, 4, 4) if volumes else torch.randn(8, 3, 6, 6)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), torch.arange(8) % 2).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    error = r"pattern '\^hidden\$' matches none" if volumes else "'unitwise_adam' has no eigenbasis"
    with pytest.raises(ValueError, match=error):
        KFACPreconditioner(
            _Unsupported(volumes), method="eigen_adam", orthogonal_layers=["^hidden$"]
        )


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown role 'hiden'.*roles: input, hidden"):
        KFACPreconditioner(_cnn(), method="eigen_adam", orthogonal_layers=["role:hiden"])


HAND_WRITTEN = {
    "digits-cnn": {"flattened_inputs": {"classifier.0": (64, 16)}},
    "gpt-text": {
        "orthogonal_layers": ("^blocks\\.",),
        "skip_layers": ("^tokens$", "^positions$", "^head$"),
    },
    "digits-autoencoder": {"orthogonal_layers": ("^encoder\\.[246]$", "^decoder\\.[024]$")},
}
"""What each recipe named by hand before its rules read the model."""


def _recipe_model(name: str) -> nn.Module:
    if name == "gpt-text":
        return GPT(256, 128, 4, 128, 4)
    model = "cnn" if name == "digits-cnn" else "autoencoder"
    return build_model(model, in_channels=1, image_size=8, num_classes=10)


def _picks(pre: KFACPreconditioner) -> tuple[object, ...]:
    orthogonal = {n for n, s in pre.layers.items() if s.solver.options.orthogonal_rms is not None}
    return set(pre.layers), orthogonal, dict(pre.config.flattened_inputs)


@pytest.mark.parametrize(("name", "block"), [("digits-autoencoder", 250), ("gpt-text", 128)])
def test_a_recipe_that_says_widths_gets_the_block_it_named(name: str, block: int) -> None:
    from dkfac.bench.peers import kfac_parts
    from dkfac.bench.recipes import load_recipe

    _, options = kfac_parts(load_recipe(f"benchmarks/recipes/{name}.toml").options)
    assert options["basis_block_size"] == "widths"
    by_rule = KFACPreconditioner(_recipe_model(name), **options)
    by_hand = KFACPreconditioner(_recipe_model(name), **{**options, "basis_block_size": block})
    assert by_rule.config == by_hand.config
    assert {n: s.solver.options for n, s in by_rule.layers.items()} == {
        n: s.solver.options for n, s in by_hand.layers.items()
    }


def test_widths_resolve_when_the_model_is_read_and_bad_values_are_refused() -> None:
    wide = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 600), nn.ReLU())
    wide.append(nn.Linear(600, 128)).append(nn.ReLU()).append(nn.Linear(128, 4))
    pre = KFACPreconditioner(wide, method="eigen_adam", basis_block_size="widths")
    assert pre.config.basis_block_size == basis_block_from_widths(wide) == 128
    assert {n: s.solver.options.block_size for n, s in pre.layers.items()} == dict.fromkeys(
        pre.layers, 128
    )
    narrow = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    pre = KFACPreconditioner(narrow, method="eigen_adam", basis_block_size="widths")
    assert pre.config.basis_block_size is None
    for bad in ("wide", 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="basis_block_size must be None, 'widths' or an"):
            KFACPreconditioner(narrow, method="eigen_adam", basis_block_size=bad)


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_each_shrunk_recipe_picks_what_its_names_picked(name: str) -> None:
    from dkfac.bench.peers import kfac_parts
    from dkfac.bench.recipes import load_recipe

    _, options = kfac_parts(load_recipe(f"benchmarks/recipes/{name}.toml").options)
    by_rule = KFACPreconditioner(_recipe_model(name), **options)
    by_name = KFACPreconditioner(_recipe_model(name), **{**options, **HAND_WRITTEN[name]})
    assert _picks(by_rule) == _picks(by_name)
    assert _picks(by_rule)[1] or _picks(by_rule)[2]  # the rule picked something


def test_block_sizes_from_widths_are_the_recipes() -> None:
    # the block sizes the recipes named before they said "widths": 250 and 128
    assert basis_block_from_widths(_recipe_model("digits-autoencoder")) == 250
    assert basis_block_from_widths(_recipe_model("gpt-text")) == 128
    # narrow models keep whole bases
    assert basis_block_from_widths(GPT(256, 16, 2, 32, 4)) is None
    assert basis_block_from_widths(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))) is None


class _Attending(nn.Module):
    """An attention module (four blocks under one layer) between a first layer and a head,
    and a LayerNorm (no role)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        return self.head(self.norm(self.attention(h, h, h)[0]))


def test_describe_shows_each_layers_role() -> None:
    pre = KFACOptimizer.for_model(_Attending()).preconditioner
    roles = {r["name"]: r["role"] for r in pre.describe()}
    projections = [f"attention.{p}_proj" for p in ("q", "k", "v", "out")]
    assert roles == {
        "first": "input",
        **dict.fromkeys(projections, "hidden"),
        "head": "head",
        "norm.weight": None,
        "norm.bias": None,
        "overhead budget": None,
    }


def test_transposed_convolutions_have_roles_widths_and_flattened_maps() -> None:
    """A decoder's transposed convolutions are matrix layers (hidden, head); their sides for
    the block width are the block's, ``C_out·kh·kw`` (outputs) and ``C_in``; a linear layer
    reading one flattened is found like one reading a convolution."""
    decoder = nn.Sequential(
        nn.Linear(16, 64 * 2 * 2),
        nn.Unflatten(1, (64, 2, 2)),
        nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1),  # sides 512 and 64
        nn.ReLU(),
        nn.ConvTranspose2d(32, 8, 4, stride=2, padding=1),  # sides 128 and 32
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )
    assert layer_roles(decoder) == {"0": "input", "2": "hidden", "4": "hidden", "6": "head"}
    # The narrowest hidden output side of at least 128 (C_out·k of "4"), under 512 > 2·128.
    assert basis_block_from_widths(decoder) == 128
    assert flattened_conv_inputs(decoder) == {"6": (8, 64)}


class _HeadFirst(nn.Module):
    """The head is defined before the layers it reads (module order: head, inp, mid)."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.inp = nn.Linear(5, 16)
        self.mid = nn.Linear(16, 16)
        self.branch = branch

    def forward(self, x: Tensor) -> Tensor:
        if self.branch and x.sum() > 0:  # data-dependent: fx cannot trace it
            x = -x
        return self.head(torch.relu(self.mid(torch.relu(self.inp(x)))))


def test_roles_follow_the_order_the_forward_calls_the_layers() -> None:
    """The layer that reads the data is the input layer and the one that writes the
    outputs the head, whatever order ``__init__`` defined them in (the head was called the
    input layer, and the hidden ``mid`` the head); so too with data-dependent control flow,
    which fx cannot trace (it kept module order): each path is traced."""
    model = _HeadFirst()
    assert layer_roles(model) == {"head": "head", "inp": "input", "mid": "hidden"}
    assert layer_roles(_HeadFirst(branch=True)) == {"head": "head", "inp": "input", "mid": "hidden"}
    rows = {r["name"]: r for r in KFACOptimizer.for_model(model).preconditioner.describe()}
    assert [rows[n]["role"] for n in ("head", "inp", "mid")] == ["head", "input", "hidden"]
    assert "orthogonal" in rows["mid"]["method"] and "orthogonal" not in rows["head"]["method"]
    compiled = torch.compile(model)
    assert layer_roles(compiled) == {
        "_orig_mod.head": "head",
        "_orig_mod.inp": "input",
        "_orig_mod.mid": "hidden",
    }


class _CompiledParts(nn.Module):
    """A convolution and a hidden linear layer each compiled on its own (``torch.compile``
    of the layer, a part of the model), the convolution's map flattened into the head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.compile(nn.Conv2d(1, 4, 3, padding=1))
        self.mid = torch.compile(nn.Linear(4 * 64, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.mid(self.conv(x).flatten(1))))


def test_a_compiled_part_is_traced_as_a_call_of_the_layer_it_compiles() -> None:
    # A compiled layer used to be traced through its own forward (F.linear of its weight):
    # it had no role, no flattened map, and was left out as applied by its parent.
    model = _CompiledParts()
    assert layer_roles(model) == {
        "conv._orig_mod": "input",
        "mid._orig_mod": "hidden",
        "head": "head",
    }
    assert flattened_conv_inputs(model) == {"mid._orig_mod": (4, 64)}
    pre = KFACOptimizer.for_model(model).preconditioner
    assert list(pre.layers) == ["conv._orig_mod", "mid._orig_mod", "head"]
    assert pre.config.flattened_inputs == {"mid._orig_mod": (4, 64)}


class _Padded(nn.Module):
    """Paddings between a convolution and the flatten: those of the spatial dimensions keep
    the channels, those that reach the channels (more dimensions than the map has spatial
    ones) change them: 4 channels padded to 6."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(2, 4, 3, padding=1), nn.Conv2d(2, 4, 3, padding=1)
        self.n2 = nn.BatchNorm2d(4)
        self.pad2d = nn.ZeroPad2d(1)
        self.spatial1 = nn.Linear(4 * 10, 2)  # F.pad(x, (1, 1)) of the 1-D map: 4 × 10
        self.channels1 = nn.Linear(6 * 10, 2)  # F.pad(x, (1, 1, 1, 1)) of it: 6 × 10
        self.spatial2 = nn.Linear(4 * 36, 2)  # ZeroPad2d of the normalised 2-D map: 4 × 36
        self.channels2 = nn.Linear(6 * 16, 2)  # F.pad(x, (0, 0, 0, 0, 1, 1)): 6 × 16
        self.module1 = nn.Linear(6 * 10, 2)  # ZeroPad2d(1) of the 1-D map: 6 × 10

    def forward(self, x: Tensor) -> Tensor:
        one, two = self.c1(x.flatten(2)[..., :8]), self.n2(self.c2(x))
        return (
            self.spatial1(F.pad(one, (1, 1)).flatten(1))
            + self.channels1(F.pad(one, (1, 1, 1, 1)).flatten(1))
            + self.spatial2(self.pad2d(torch.relu(two)).flatten(1))
            + self.channels2(F.pad(two, (0, 0, 0, 0, 1, 1)).flatten(1))
            + self.module1(self.pad2d(one).flatten(1))
        )


def test_a_padding_that_reaches_the_channels_gives_no_map() -> None:
    """A map of the wrong channel count (4 × 15 for a 6 × 10 input) was found before."""
    model = _Padded()
    assert model(torch.randn(3, 2, 4, 4)).shape == (3, 2)
    assert flattened_conv_inputs(model) == {"spatial1": (4, 10), "spatial2": (4, 36)}


class _TwoOutputs(nn.Module):
    """A main head and an auxiliary one on an earlier layer (both losses summed), a second
    input layer on another argument, and the features returned beside the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 2)  # defined first, called last
        self.inp, self.side = nn.Linear(5, 8), nn.Linear(3, 8)
        self.mid, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: Tensor, extra: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        early = torch.relu(self.inp(x)) + self.side(extra)
        features = torch.relu(self.mid(early))
        return self.head(features), features, self.aux(early)


def test_every_output_layer_is_a_head_and_every_layer_reading_the_data_an_input() -> None:
    """Read from the data flow: a layer no other matrix layer reads from is a head (the
    auxiliary head was a hidden layer, orthogonalised), one that reads only the forward's
    arguments an input layer (the second tower's was hidden); ``mid``, whose features are
    also returned, is hidden, for the head reads it."""
    model = _TwoOutputs()
    assert layer_roles(model) == {
        "aux": "head",
        "inp": "input",
        "side": "input",
        "mid": "hidden",
        "head": "head",
    }
    rows = {r["name"]: r for r in KFACOptimizer.for_model(model).preconditioner.describe()}
    assert [
        n for n in ("aux", "inp", "side", "mid", "head") if "orthogonal" in rows[n]["method"]
    ] == ["mid"]


class _PositionsFirst(nn.Module):
    """A vision transformer's patch layer defined after its position table (an
    ``nn.Embedding`` looked up with ``arange``): it still reads the data."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(4, 8)
        self.patches, self.mlp, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.patches(x) + self.positions(torch.arange(x.shape[1]))
        return self.head(torch.relu(self.mlp(h)).mean(1))


def test_a_patch_layer_after_a_position_table_is_the_input_layer() -> None:
    assert layer_roles(_PositionsFirst()) == {
        "positions": "embedding",
        "patches": "input",
        "mlp": "hidden",
        "head": "head",
    }
    # a language model's first layer reads its token table: hidden, as before
    assert layer_roles(GPT(256, 16, 1, 16, 4))["blocks.0.attention.query"] == "hidden"


class _Branches(nn.Module):
    """Two hidden layers behind the head, which is defined first. ``random=False``:
    data-dependent control flow (one of the two on each step, and a loop that halves the
    features while their norm is large, which never ends if the condition always holds);
    ``random=True``: stochastic depth, each a residual branch skipped on half of the
    training steps by a random draw (which fx runs concretely: a trace takes one draw's
    path)."""

    def __init__(self, random: bool = False) -> None:
        super().__init__()
        self.random = random
        self.head = nn.Linear(8, 3)
        self.inp, self.left, self.right = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.inp(x))
        if self.random:
            for branch in (self.left, self.right):
                if not self.training or torch.rand(()) < 0.5:
                    h = h + torch.relu(branch(h))
            return self.head(h)
        h = self.left(h) if h.mean() > 0.5 else self.right(h)
        while h.norm() > 10:
            h = h / 2
        return self.head(h)


def test_an_untraceable_forward_gets_its_roles_from_the_paths_it_may_take() -> None:
    """Every condition taken as true, then as false (the loop then ends): a layer's links
    are those of both paths, so the head defined first is still the head; a layer on
    neither path (called only through ``int()`` of a traced value) leaves module order."""
    model = _Branches()
    roles = {"head": "head", "inp": "input", "left": "hidden", "right": "hidden"}
    assert layer_roles(model) == roles
    assert flattened_conv_inputs(model) == {}  # maps only from a whole graph
    rows = {r["name"]: r for r in KFACOptimizer.for_model(model).preconditioner.describe()}
    assert {n: rows[n]["role"] for n in roles} == roles
    assert ["orthogonal" in rows[n]["method"] for n in roles] == [False, False, True, True]


def test_a_model_without_matrix_layers_has_only_embeddings() -> None:
    assert layer_roles(nn.Embedding(7, 3)) == {"": "embedding"}
    assert layer_roles(nn.Sequential(nn.Embedding(7, 3), nn.LayerNorm(3))) == {"0": "embedding"}


@pytest.mark.parametrize("seed", range(4))
def test_stochastic_depth_has_the_same_roles_whatever_the_draws(seed: int) -> None:
    """A branch the trace's draw skipped sent the roles back to module order (the head
    taken for the input layer, ``right`` for the head) on some seeds; the eval-mode
    forward, which calls every branch, completes them. Tracing draws from a fork of the
    random stream: building the optimizer leaves the user's draws as they were."""
    torch.manual_seed(seed)
    model = _Branches(random=True)
    expected = torch.rand(3, generator=torch.Generator().set_state(torch.get_rng_state()))
    roles = {"head": "head", "inp": "input", "left": "hidden", "right": "hidden"}
    assert layer_roles(model) == roles
    KFACOptimizer.for_model(model)
    assert torch.equal(torch.rand(3), expected)
    assert model.training and all(m.training for m in model.modules())


class _TiedDecoder(nn.Module):
    """A masked-token decoder tied to the token table, then a second head; a loop count
    read from the data (``int()`` of a traced value: no path can be traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.mid = nn.Embedding(11, 8), nn.Linear(8, 8)
        self.decoder, self.pair = nn.Linear(8, 11, bias=False), nn.Linear(8, 2)
        self.decoder.weight = self.tokens.weight

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        h = self.tokens(ids)
        for _ in range(int(ids.sum() > 0) + 1):
            h = torch.relu(self.mid(h))
        return self.decoder(h), self.pair(h.mean(1))


def test_a_layer_tied_to_an_embedding_is_a_head_in_module_order_too() -> None:
    heads = {"decoder": "head", "pair": "head"}
    assert layer_roles(_TiedDecoder()) == {"tokens": "embedding", "mid": "hidden", **heads}


def test_reading_the_roles_runs_no_parametrization() -> None:
    """spectral_norm advances its power iteration in place each time ``weight`` is read:
    building the default leaves every buffer and parameter as it was (so a resumed run
    equals the uninterrupted one), and a tied head is still found."""
    torch.manual_seed(0)
    normed = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), normed, nn.ReLU(), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    KFACOptimizer.for_model(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert layer_roles(_TiedDecoder())["decoder"] == "head"


class _SpareProjection(nn.Module):
    """A classifier that keeps a projection head it never calls (``proj``, defined last),
    or that reads its head's weight functionally (``functional``)."""

    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.proj = nn.Linear(16, 4)
        self.functional = functional

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.mid(torch.relu(self.inp(x))))
        if self.functional:
            return F.linear(h, self.proj.weight, self.proj.bias)
        return self.head(h)


def test_a_layer_the_forward_never_touches_changes_no_role() -> None:
    """An uncalled ``proj`` after the head made the graph unusable, and module order then
    took ``proj`` for the head and the real head for a hidden layer (orthogonalised). It is
    left out of the decision now (a head itself: it may be one the loop applies). A layer whose
    weight the forward reads functionally keeps module order: its place is not known."""
    roles = layer_roles(_SpareProjection())
    assert roles == {"inp": "input", "mid": "hidden", "head": "head", "proj": "head"}
    opt = KFACOptimizer.for_model(_SpareProjection())
    rows = {r["name"]: r for r in opt.preconditioner.describe()}
    assert "orthogonal" not in rows["head"]["method"]
    assert layer_roles(_SpareProjection(functional=True))["proj"] == "head"


class _EncoderLast(nn.Module):
    """Matrix layers inside a ``torch.nn`` leaf (fx calls the encoder as one module)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(self.in_proj(x))


class _SkippedLast(nn.Module):
    """A last residual block dropped at random in training (stochastic depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.body, self.refine = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(torch.relu(self.inp(x)))
        if not (self.training and torch.rand(()) < 0.5):
            h = h + self.refine(torch.relu(h))
        return h


class _TiedFunctional(nn.Module):
    """An output layer tied to the input layer and applied functionally: fx reads the shared
    weight under the input layer's name."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid, self.dec = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.relu(self.mid(torch.relu(self.enc(x)))), self.dec.weight)


def test_layers_the_forward_touches_otherwise_are_not_taken_for_untouched() -> None:
    """What the rule for a layer the forward never touches must not catch: a layer inside a
    module fx calls as a leaf (the encoder's last ``linear2`` stays the head, ``in_proj``
    the input layer), a layer a random draw skipped in the training trace but the eval
    trace calls (the head whatever the draw), and a tied layer applied functionally, read
    under its twin's name (its place unknown: module order, the head)."""
    roles = layer_roles(_EncoderLast())
    assert roles["in_proj"] == "input" and roles["encoder.layers.1.linear2"] == "head"
    assert roles["encoder.layers.0.linear2"] == "hidden"
    for seed in range(4):
        torch.manual_seed(seed)
        assert layer_roles(_SkippedLast()) == {"inp": "input", "body": "hidden", "refine": "head"}
    assert layer_roles(_TiedFunctional())["dec"] == "head"


class _LeafThenSpare(nn.Module):
    """Layers inside a module fx calls as a leaf (the graph's links then unknown) and an
    uncalled layer defined after the head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(self.inp(x)))


def test_an_untouched_layer_is_left_out_of_the_call_order_rule_too() -> None:
    """Where the links are unknown (layers inside a leaf) the roles fall back to the order
    of the calls, or of the modules: an uncalled layer last in module order was taken for
    the head there, and the real head for a hidden layer."""
    roles = layer_roles(_LeafThenSpare())
    assert roles["head"] == "head" and roles["spare"] == "head" and roles["inp"] == "input"


class _FeaturesOnly(nn.Module):
    """A forward that returns features; the training loop applies ``head`` to them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


def test_a_head_the_loop_applies_is_never_orthogonalised() -> None:
    """The graph cannot tell a head applied outside the forward (``model.head(model(x))``)
    from an unused layer: both are heads, and the layer before it is taken for a head too
    (its update Adam's, not orthogonalised), never the real head for a hidden layer."""
    roles = layer_roles(_FeaturesOnly())
    assert roles == {"fc1": "input", "fc2": "head", "head": "head"}
