"""``torch.compile`` (the eager and aot_eager backends, no compiler toolchain needed) with
the preconditioner built before or after compiling: the same weights as the eager run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def _train(compile_with: str | None, build_first: bool = False) -> nn.Module:
    net = _net()
    model: nn.Module = net
    if build_first:
        opt = KFACOptimizer.for_model(net)
    if compile_with is not None:
        model = torch.compile(net, backend=compile_with)
    if not build_first:
        opt = KFACOptimizer.for_model(model)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return net


@pytest.mark.parametrize(("backend", "build_first"), [("eager", True), ("aot_eager", False)])
def test_compiled_equals_eager(backend: str, build_first: bool) -> None:
    torch._dynamo.reset()
    compiled, eager = _train(backend, build_first), _train(None)
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


class _ConvNet(nn.Module):
    """A convolution read flattened by a linear head: ``for_model`` finds the map."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(4 * 9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


@pytest.mark.parametrize("part", [False, True])
def test_a_compiled_model_finds_the_eager_models_flattened_map(part: bool) -> None:
    """``flattened_inputs="graph"`` traces the module ``torch.compile`` wraps (the whole
    model, or a part of it), so the compiled run takes the eager run's steps."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        net = _ConvNet()
        model: nn.Module = net
        if compiled and part:
            net.features = torch.compile(net.features, backend="eager")  # type: ignore[assignment]
        elif compiled:
            model = torch.compile(net, backend="eager")
        opt = KFACOptimizer.for_model(model)
        assert opt.preconditioner.config.flattened_inputs == {"head": (4, 9)}
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            x, y = torch.randn(8, 2, 6, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        runs.append(net.head.weight.detach())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=1e-7)


def _normed() -> nn.Sequential:
    """A LayerNorm among the layers: its parameters get Adam's direction, by name too."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 3)
    )


def _steps(model: nn.Module, opt: KFACOptimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(10 + step)
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize(
    "saved_compiled", [True, False], ids=["compiled-to-eager", "eager-to-compiled"]
)
def test_a_checkpoint_moves_between_the_compiled_and_the_eager_model(saved_compiled: bool) -> None:
    """The layers of ``for_model(torch.compile(model))`` are named as the eager model's, so
    its checkpoint loads into ``for_model(model)`` (and back), and the resumed run takes the
    steps the uninterrupted one takes (the eager backend's forward is the eager forward,
    bit for bit)."""
    torch._dynamo.reset()

    def build(compiled: bool) -> tuple[nn.Module, nn.Module, KFACOptimizer]:
        net = _normed()
        model = torch.compile(net, backend="eager") if compiled else net
        return net, model, KFACOptimizer.for_model(model, lr=0.01)

    net, model, opt = build(saved_compiled)
    _steps(model, opt, range(3))
    saved = {"model": net.state_dict(), "opt": opt.state_dict()}
    assert sorted(opt.preconditioner.layers) == ["0", "2", "4"]
    other_net, other_model, other = build(not saved_compiled)
    other_net.load_state_dict(saved["model"])
    other.load_state_dict(saved["opt"])
    _steps(model, opt, range(3, 6))
    _steps(other_model, other, range(3, 6))
    for p, q in zip(net.parameters(), other_net.parameters(), strict=True):
        assert torch.equal(p, q)


def test_layer_name_options_take_the_eager_names_on_a_compiled_model() -> None:
    """``orthogonal_layers`` and ``skip_layers`` by the eager model's names pick the same
    layers on the compiled model, and ``describe()`` names them so."""
    torch._dynamo.reset()
    rows = []
    for compiled in (False, True):
        net = _normed()
        model = torch.compile(net, backend="eager") if compiled else net
        opt = KFACOptimizer.for_model(model, orthogonal_layers=["^2$"], skip_layers=["^4$"])
        assert list(opt.preconditioner.layers) == ["0", "2"]
        rows.append([(r["name"], r["method"]) for r in opt.preconditioner.describe()])
        _steps(model, opt, range(2))
    assert rows[0] == rows[1]
    assert any(name == "2" and "orthogonal" in method for name, method in rows[1])


def test_a_compiled_model_captures_at_every_step() -> None:
    """Factors every step (``overhead=None``) on a model compiled after the optimizer was
    built (as the Trainer's ``torch_compile=True`` does): every step captures its batch, and
    the weights are the eager run's. The capture hooks run eagerly (a traced gradient
    hook on an intermediate tensor would drop their statistics: nothing captured, 1e-2
    apart after one step)."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        net = _normed()
        opt = KFACOptimizer.for_model(net, lr=0.01, overhead=None)
        model = torch.compile(net, backend="aot_eager") if compiled else net
        captured = []
        for step in range(4):
            gen = torch.Generator().manual_seed(10 + step)
            x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            captured.append(opt.preconditioner.capture.captured_batch)
            opt.step()
        assert captured == [8] * 4
        runs.append(net)
    for p, q in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _warmed(other_instance: bool) -> tuple[nn.Module, nn.Module]:
    """``(net, compiled net)``, a graph already compiled without dkfac's hooks: by a forward
    of the compiled net itself, or of another compiled instance of its class."""
    torch._dynamo.reset()
    net = _net()
    model = torch.compile(net, backend="aot_eager")
    warm = torch.compile(_net(), backend="aot_eager") if other_instance else model
    warm(torch.randn(8, 6)).sum()  # a forward with gradients on: a training-mode graph
    return net, model


@pytest.mark.parametrize("other_instance", [False, True])
def test_a_graph_compiled_before_the_hooks_is_refused(other_instance: bool) -> None:
    """Dynamo does not look for module hooks added after it compiled a graph, and reuses a
    graph of another instance of the class: a compiled model that ran before the optimizer
    was built (or whose class did) ran without the hooks, silently, each layer's gradient
    reaching the inner SGD plain. Its second step is refused, before anything changes, and
    the remedy the message gives (``torch.compiler.reset()``) makes every step capture."""
    net, model = _warmed(other_instance)
    opt = KFACOptimizer.for_model(model, lr=0.01, overhead=None)
    gen = torch.Generator().manual_seed(3)

    def backward() -> int:
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        return opt.preconditioner.capture.captured_batch

    assert backward() == 0  # the first step: its forward may have run before the build
    opt.step()
    assert backward() == 0
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match=r"torch\.compiler\.reset\(\)"):
        opt.step()
    for p, q in zip(net.parameters(), before, strict=True):
        assert torch.equal(p, q)
    torch.compiler.reset()
    for _ in range(3):
        assert backward() == 8
        opt.step()
    assert all(layer.solver_state is not None for layer in opt.preconditioner.layers.values())


class _Functional(nn.Module):
    """Applies its only layer's weight itself; ``branchy``: behind a data-dependent
    condition, which fx cannot trace."""

    def __init__(self, branchy: bool) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 3)
        self.branchy = branchy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branchy and bool(x.sum() > 1e9):
            x = x / 2
        return F.linear(x, self.inner.weight, self.inner.bias)


def test_layers_applied_without_being_called_are_refused() -> None:
    """A model whose parent applies every registered layer's weight itself (no hook ever
    runs) would get no K-FAC at all: refused when it is built where its graph shows it,
    else at its second step, naming skip_layers."""
    with pytest.raises(ValueError, match=r"inner\.weight \(its forward never runs"):
        KFACOptimizer.for_model(_Functional(branchy=False), lr=0.01)
    model = _Functional(branchy=True)
    opt = KFACOptimizer.for_model(model, lr=0.01)
    for step in range(2):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        if step:
            with pytest.raises(RuntimeError, match="skip_layers"):
                opt.step()
        else:
            opt.step()
