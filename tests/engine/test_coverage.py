"""describe() lists every trainable parameter once: with the layer whose block preconditions
it, or as "inner optimizer" with the reason; registration warns once about weights left out
by no choice of the user."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner


class Mixed(nn.Module):
    """A Linear, a LayerNorm, a grouped conv (unit-wise), a frozen Linear and a raw 2-D
    parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4, 6))  # held by the model itself
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.grouped = nn.Conv2d(2, 4, 1, groups=2)
        self.frozen = nn.Linear(6, 6)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``(N, 4, 6)``."""
        y = self.norm(self.fc(x + self.pos))
        z = self.grouped(y.reshape(-1, 2, 2, 6)).reshape(y.shape[0], 4, -1)[..., :6]
        return self.head(self.frozen(y + z).mean(dim=1))


def _rows(pre: KFACPreconditioner) -> dict[str, dict]:
    return {row["name"]: row for row in pre.describe()}


def test_every_trainable_parameter_is_listed_once_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Mixed()
    with caplog.at_level(logging.WARNING):
        pre = KFACPreconditioner(model)
    rows = _rows(pre)
    listed = [name for row in rows.values() for name in row["parameters"]]
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert sorted(listed) == sorted(trainable)
    preconditioned = [n for n, r in rows.items() if r["block"] != "inner optimizer"]
    assert preconditioned == ["fc", "grouped", "head"]
    assert rows["grouped"]["parameters"] == ["grouped.weight", "grouped.bias"]
    assert rows["grouped"]["method"] == "unitwise" and rows["grouped"]["a_dim"] == 2  # 1·1 + 1
    assert rows["fc"]["parameters"] == ["fc.weight", "fc.bias"]
    assert rows["fc"]["method"] == "eigen" and rows["fc"]["a_dim"] == 7  # old keys kept
    reasons = {n: r["reason"] for n, r in rows.items() if r["block"] == "inner optimizer"}
    assert reasons == {
        "pos": "a raw parameter of Mixed, used by its own forward, not through a layer",
        "norm.weight": "LayerNorm has no K-FAC block",
        "norm.bias": "LayerNorm has no K-FAC block",
        "frozen.bias": "its layer's weight does not require a gradient",
    }
    assert rows["pos"]["numel"] == 24
    # One warning, naming the weights left out by no choice of the user and their share.
    warnings = [r for r in caplog.records if "to the inner optimizer" in r.getMessage()]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"{100 * 24 / total:.1f}%" in message
    assert "K-FAC leaves 1 parameter(s) of two or more dimensions" in message
    assert "pos (a raw parameter of Mixed, used by its own forward" in message
    assert "grouped.weight" not in message
    assert "norm.weight" not in message  # one dimension: nothing to precondition anyway


def test_the_users_own_choices_are_reported_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(
        nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)
    )
    with caplog.at_level(logging.WARNING):
        pre = KFACPreconditioner(model, skip_layers=["^2$"], unitwise_bn=False)
    assert "inner optimizer" not in caplog.text
    reasons = {r["name"]: r.get("reason") for r in pre.describe()}
    assert reasons["2.weight"] == "skip_layers pattern '^2$'"
    assert reasons["1.weight"] == "declined by its block: unitwise_bn=False"
    assert reasons["3.weight"] == "LayerNorm has no K-FAC block"


def test_a_layer_whose_hooks_never_fire_is_not_listed_as_registered() -> None:
    """The attention's out_proj is called functionally by torch: it is listed only because
    dkfac's forward calls it as a module, and it does get factors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))
    pre = KFACPreconditioner(model)
    model(torch.randn(2, 3, 4)).sum().backward()
    pre.step()
    registered = [r["name"] for r in pre.describe() if r["block"] != "inner optimizer"]
    assert set(registered) == set(pre.factors())
    assert "1.self_attn.out_proj" in registered


def test_every_row_has_the_same_keys() -> None:
    """Code that reads a layer key (owner, method) from every row keeps working."""
    pre = KFACPreconditioner(Mixed())
    rows = pre.describe()
    assert all(row.keys() == rows[0].keys() for row in rows)
    fc, pos = rows[0], next(row for row in rows if row["name"] == "pos")
    assert fc["reason"] is None and fc["numel"] == 6 * 7  # weight and bias
    assert pos["owner"] is None and pos["method"] is None and pos["a_dim"] is None


def test_a_reparametrised_weight_is_left_to_the_inner_optimizer_with_its_reason() -> None:
    """``weight_norm`` / ``spectral_norm`` (and the old hook-based ``weight_norm``) compute
    the weight from other parameters at each forward: its hooks would fail (the weight is
    not a leaf) and its gradient is not theirs. Declined, named, and the rest trains."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)
    )
    parametrizations.weight_norm(model[2])
    parametrizations.spectral_norm(model[4])
    with pytest.warns(FutureWarning):
        nn.utils.weight_norm(model[5])
    opt = KFACOptimizer.for_model(model)
    reasons = {r["name"]: r.get("reason") for r in opt.preconditioner.describe()}
    assert set(opt.preconditioner.layers) == {"0"}
    assert reasons["2.parametrizations.weight.original0"] == (
        "declined by its block: its weight is computed by _WeightNorm from other parameters "
        "(a parametrization): K-FAC's update of a computed tensor is not an update of them"
    )
    assert (
        "its weight is computed by _SpectralNorm" in reasons["4.parametrizations.weight.original"]
    )
    assert "computed, not a parameter" in reasons["5.weight_v"]
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(16, 4)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), torch.arange(16) % 2).backward()
        opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_a_pruned_weight_is_left_to_the_inner_optimizer_with_its_reason() -> None:
    """``torch.nn.utils.prune`` computes the weight as ``weight_orig * weight_mask`` in a
    forward pre-hook: declined, the reason naming it, and the pruned entries stay zero."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    opt = KFACOptimizer.for_model(model, lr=0.01)
    reasons = {r["name"]: r.get("reason") for r in opt.preconditioner.describe()}
    assert set(opt.preconditioner.layers) == {"2"}
    assert "torch.nn.utils.prune" in reasons["0.weight_orig"]
    x = torch.randn(16, 4)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), torch.arange(16) % 2).backward()
        opt.step()
    assert bool((model[0].weight[model[0].weight_mask == 0] == 0).all())


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).T


class _LowRank(nn.Module):
    """A LoRA adapter written as a parametrization: ``W + B A`` with its own parameters."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(torch.randn(2, cols))
        self.lora_b = nn.Parameter(torch.zeros(rows, 2))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.lora_b @ self.lora_a


class _Negated(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -x


def test_each_computed_tensor_and_what_computes_it_is_named() -> None:
    """A symmetric weight, a low-rank adapter whose parameters live in the parametrization,
    a bias-only parametrization: the reason names the tensor (the bias, not the weight)
    and the parametrizations, for every parameter the layer holds; no K-FAC update is built
    for a computed tensor, and each of those parameters trains."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 6))
    parametrize.register_parametrization(model[2], "weight", _Symmetric())
    parametrize.register_parametrization(model[2], "weight", _LowRank(6, 6))
    parametrize.register_parametrization(model[3], "bias", _Negated())
    opt = KFACOptimizer.for_model(model)
    rows = {r["name"]: r for r in opt.preconditioner.describe()}
    assert set(opt.preconditioner.layers) == {"0"}
    low_rank = (
        "declined by its block: its weight is computed by _Symmetric then _LowRank from "
        "other parameters (a parametrization): K-FAC's update of a computed tensor is not an "
        "update of them"
    )
    for name in (
        "2.bias",
        "2.parametrizations.weight.original",
        "2.parametrizations.weight.1.lora_a",
        "2.parametrizations.weight.1.lora_b",
    ):
        assert rows[name]["reason"] == low_rank and rows[name]["method"] == "adam"
    for name in ("3.weight", "3.parametrizations.bias.original"):
        assert rows[name]["reason"].startswith(
            "declined by its block: its bias is computed by _Negated "
        )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(16, 4)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    ("method", "takes"), [("eigen_adam", "Adam's direction"), ("eigen", "its plain gradient")]
)
def test_a_declined_layer_is_logged_with_the_update_it_takes(
    method: str, takes: str, caplog: pytest.LogCaptureFixture
) -> None:
    """weight_norm's parametrized Linear is declined by its block; the log says what its
    parameters get (``leftover_update``): Adam's direction under ``eigen_adam``."""
    normed = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), normed)
    with caplog.at_level(logging.INFO, logger="dkfac.engine.registration"):
        KFACPreconditioner(model, method=method)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping 2")]
    assert len(logged) == 1 and logged[0].endswith(f"; it takes {takes}")


def test_a_layer_of_width_zero_is_declined_and_named() -> None:
    """A Linear with no outputs (or no inputs) has an empty weight: nothing to precondition,
    factors 0 wide. It is declined with its reason (not a ValueError about a 0-wide
    ``g_dim`` naming no layer), and the model trains as the same step of the others."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 0), nn.Linear(0, 3), nn.Linear(3, 2))
    nn.init.ones_(model[1].bias)  # its initialisation (fan-in 0) leaves it at zero
    opt = KFACOptimizer.for_model(model)
    reasons = {r["name"]: r.get("reason") for r in opt.preconditioner.describe()}
    declined = "declined by its block: a parameter with no entries (a layer of width 0)"
    assert reasons["0.weight"] == reasons["1.weight"] == reasons["1.bias"] == declined
    assert reasons["2"] is None  # the layer with entries is preconditioned
    before = model[2].weight.detach().clone()
    model(torch.randn(8, 6)).pow(2).sum().backward()
    opt.step()
    assert torch.isfinite(model[2].weight).all() and not torch.equal(model[2].weight, before)


class _AppliedByParent(nn.Module):
    """A layer called as a module, one whose weight the parent applies itself (a cosine
    head's ``F.linear``), one run through ``.forward`` (no hook runs either way), and a head
    tied to an embedding that the parent applies through the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.direct = nn.Linear(8, 8)
        self.tokens = nn.Embedding(3, 8)
        self.tied = nn.Linear(8, 3, bias=False)
        self.tied.weight = self.tokens.weight

    def forward(self, x: Tensor) -> Tensor:
        h = self.direct.forward(torch.tanh(self.body(x)))
        return torch.nn.functional.linear(h, self.head.weight, self.head.bias) + h @ (
            self.tokens.weight.T
        )


def test_a_layer_whose_weight_its_parent_applies_takes_the_leftover_update() -> None:
    # Its forward never runs, so K-FAC would capture nothing for it and its gradient would
    # reach the inner SGD plain for good: the graph shows it at the build, and it takes the
    # leftover update, as if listed in skip_layers. A tied layer is left to the tie.
    def run(**options: object) -> tuple[KFACOptimizer, list[Tensor]]:
        torch.manual_seed(0)
        model = _AppliedByParent()
        opt = KFACOptimizer.for_model(model, lr=0.01, **options)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            opt.zero_grad()
            x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return opt, [p.detach().clone() for p in model.parameters()]

    found, weights = run()
    rows = _rows(found.preconditioner)
    assert set(found.preconditioner.layers) == {"body", "tied"}
    for name in ("head.weight", "head.bias", "direct.weight", "direct.bias"):
        assert "its forward never runs" in rows[name]["reason"]
    named, expected = run(skip_layers=["^head$", "^direct$"])
    assert set(named.preconditioner.layers) == {"body", "tied"}
    for p, q in zip(weights, expected, strict=True):
        assert torch.equal(p, q)
