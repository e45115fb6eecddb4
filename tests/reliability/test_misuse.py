"""Red team, library misuse that silently corrupted (issue 20, class 6).

Before: ``step()`` twice after one backward preconditioned the already preconditioned
gradients again; ``step()`` after ``remove_hooks()``, two preconditioners on one model and
``step(lr=nan)`` (NaN through the KL-clip into the gradients) went unnoticed. Now each
raises a clear error before anything changes (of two preconditioners, the earlier one),
and the legitimate neighbours (gradient accumulation, an unused branch, gradients set by
hand, DDP) keep working.
"""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from tests.distributed_utils import run_distributed


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def _backward(model: nn.Module, seed: int = 1) -> None:
    x, y = _batch(seed)
    F.cross_entropy(model(x), y).backward()


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _forward_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


# ----------------------------------------------------------------- step() twice


def test_second_step_without_backward_raises_and_leaves_the_gradients() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, damping=0.1)
    _backward(model)
    pre.step()
    once = _grads(model)
    with pytest.raises(RuntimeError, match=r"step\(\) without a new backward: .*\['0', '2'\]"):
        pre.step()
    assert all(torch.equal(a, b) for a, b in zip(once, _grads(model), strict=True))
    assert pre.steps == 1
    model.zero_grad()
    _backward(model)
    pre.step()  # the next real step works
    assert pre.steps == 2


def test_optimizer_step_twice_raises_and_leaves_the_weights() -> None:
    model = _mlp()
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), KFACPreconditioner(model))
    _backward(model)
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="without a new backward"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


def test_gradient_accumulation_equals_the_unaccumulated_step() -> None:
    """Two micro-batches (each loss halved) then one step equal one step on both at once;
    nothing declares the two: the preconditioner counts the backward passes."""
    accumulated, full = _mlp(), _mlp()
    pre_a = KFACPreconditioner(accumulated, damping=0.1)
    pre_f = KFACPreconditioner(full, damping=0.1)
    for step in range(2):
        accumulated.zero_grad()
        full.zero_grad()
        (x1, y1), (x2, y2) = _batch(1 + 2 * step), _batch(2 + 2 * step)
        for x, y in ((x1, y1), (x2, y2)):
            (F.cross_entropy(accumulated(x), y) / 2).backward()
        F.cross_entropy(full(torch.cat([x1, x2])), torch.cat([y1, y2])).backward()
        pre_a.step()
        pre_f.step()
        for a, s in zip(_grads(accumulated), _grads(full), strict=True):
            torch.testing.assert_close(a, s, rtol=1e-5, atol=1e-6)


def test_unused_branch_and_hand_set_gradients_are_fresh() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})
    pre = KFACPreconditioner(model, damping=0.1)
    x = torch.randn(8, 4)
    (model["a"](x).square().mean() + model["b"](x).square().mean()).backward()
    pre.step()
    model.zero_grad(set_to_none=True)  # b gets no gradient this step: fine
    model["a"](x).square().mean().backward()
    pre.step()
    model.zero_grad(set_to_none=False)  # zeroed in place: a new (zero) gradient for b
    model["a"](x).square().mean().backward()
    pre.step()
    for p in model.parameters():  # gradients set by hand are new tensors
        p.grad = torch.ones_like(p)
    pre.step()
    assert pre.steps == 4


def test_a_model_converted_with_swapped_tensors_after_a_step_trains_on() -> None:
    """``model.to()`` swaps each parameter and its gradient in place where torch swaps
    tensors (``set_swap_module_params_on_conversion``; always for a tensor subclass such as
    ``DTensor``), which fails for a tensor something holds a weak reference to: converting
    the model between ``step()`` and the next ``zero_grad()`` works, the run continues as
    one never converted (float32 to float64 and back is exact)."""
    runs = []
    for convert in (False, True):
        model = _mlp()
        opt = KFACOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), KFACPreconditioner(model, damping=0.1)
        )
        swapping = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            for step in range(3):
                opt.zero_grad()
                _backward(model, seed=1 + step)
                opt.step()
                if convert:
                    model.to(torch.float64)
                    model.to(torch.float32)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swapping)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("replace", ["to_empty", "assign", "tie"])
def test_parameters_replaced_after_the_build_are_refused_at_the_step(replace: str) -> None:
    """A module given new parameter tensors after the optimizer was built (a model built on
    the meta device then materialised, a checkpoint loaded with ``assign=True``, a weight
    tied afterwards) would train nothing: the inner optimizer steps the old tensors and the
    hooks take no statistics for the new ones. The step says so and moves nothing."""
    if replace == "to_empty":
        with torch.device("meta"):
            model = _mlp()
    else:
        model = _mlp()
    opt = KFACOptimizer.for_model(model, lr=0.01)
    if replace == "to_empty":
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        names = r"\['0', '2'\]"
    elif replace == "assign":
        model.load_state_dict(_mlp(seed=1).state_dict(), assign=True)
        names = r"\['0', '2'\]"
    else:
        model[2].weight = nn.Parameter(torch.zeros(3, 8))
        names = r"\['2'\]"
    weights = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    with pytest.raises(RuntimeError, match=names + " hold other parameters than when"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


@pytest.mark.parametrize("moved", [True, False])
def test_a_model_moved_after_the_build_is_named_at_the_first_step(
    moved: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Converting the model after the optimizer was built keeps the parameters (it works)
    but not the choices made for their device and dtype (the factors stay float32 here): the
    first step says so; a model moved and moved back before it has nothing to say."""
    model = _mlp()
    opt = KFACOptimizer.for_model(model, lr=0.01)
    model.double()
    if not moved:
        model.float()
    x, y = _batch()
    with caplog.at_level("WARNING", logger="dkfac.engine.guards"):
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x.to(model[0].weight.dtype)), y).backward()
            opt.step()
    warned = [r.getMessage() for r in caplog.records if "moved after the optimizer" in r.message]
    if moved:
        assert len(warned) == 1
        assert "'0': 'cpu float32 -> cpu float64'" in warned[0]
        assert opt.preconditioner.factors()["0"][0].dtype == torch.float32
    else:
        assert warned == []


def test_a_copied_gradient_is_fresh() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, damping=0.1)
    _backward(model)
    pre.step()
    for p in model.parameters():  # a copy of the preconditioned gradient, set by hand
        p.grad = copy.deepcopy(p.grad)
    pre.step()
    assert pre.steps == 2


def test_a_layer_left_with_its_preconditioned_gradient_is_named() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})
    pre = KFACPreconditioner(model, damping=0.1)
    x = torch.randn(8, 4)
    (model["a"](x).square().mean() + model["b"](x).square().mean()).backward()
    pre.step()
    model["a"](x).square().mean().backward()  # no zero_grad: b still holds step 1's result
    with pytest.raises(RuntimeError, match=r"the gradients of \['b'\] are the ones"):
        pre.step()


def _ddp_double_step(rank: int, world_size: int) -> list[str]:
    model = nn.parallel.DistributedDataParallel(_mlp())
    pre = KFACPreconditioner(model, damping=0.1)
    events = []
    for step in range(3):
        model.zero_grad(set_to_none=step % 2 == 0)
        _backward(model, seed=10 + rank)
        pre.step()
        events.append("step")
    try:
        pre.step()
    except RuntimeError as err:
        events.append(str(err).split(":")[0])
    return events


def test_ddp_steps_are_fresh_and_a_second_step_raises_on_every_rank() -> None:
    results = run_distributed(_ddp_double_step, 2, timeout=120)
    assert results == [["step"] * 3 + ["step() without a new backward"]] * 2


# ----------------------------------------------------------------- remove_hooks()


def test_step_after_remove_hooks_raises() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, fisher="mc")
    assert _forward_hooks(model) == 2
    pre.remove_hooks()
    assert _forward_hooks(model) == 0
    _backward(model)
    grads = _grads(model)
    with pytest.raises(RuntimeError, match=r"step\(\) after remove_hooks\(\).*build a new"):
        pre.step()
    with pytest.raises(RuntimeError, match=r"sample_fisher\(\) after remove_hooks\(\)"):
        pre.sample_fisher(model(_batch()[0]))
    assert all(torch.equal(a, b) for a, b in zip(grads, _grads(model), strict=True))
    assert set(pre.state_dict()["layers"]) == {"0", "2"}  # reading the state still works


# ----------------------------------------------------------------- two preconditioners


def test_a_second_preconditioner_takes_the_layers_over() -> None:
    """The one built last on a model is the one used (a framework builds a new optimizer
    for each run while it still holds the last one): the first one's hooks are all
    detached and its step raises before changing anything."""
    model = _mlp()
    first = KFACPreconditioner(model)
    second = KFACPreconditioner(model)
    assert _forward_hooks(model) == 2  # only the second one's
    _backward(model)
    grads = _grads(model)
    with pytest.raises(RuntimeError, match=r"step\(\) on a preconditioner whose layers a newer"):
        first.step()
    assert all(torch.equal(a, b) for a, b in zip(grads, _grads(model), strict=True))
    second.step()
    third = KFACPreconditioner(model, skip_layers=["^0$"])  # one of its layers: all of it goes
    assert _forward_hooks(model) == 1
    with pytest.raises(RuntimeError, match="took over"):
        second.step()
    KFACPreconditioner(copy.deepcopy(model))  # a copy is another model
    assert _forward_hooks(model) == 1
    third.remove_hooks()
    assert _forward_hooks(model) == 0


def test_an_optimizer_over_a_preconditioner_that_no_longer_captures_is_refused() -> None:
    """Wrapping a preconditioner that a newer one took over, or whose hooks were removed,
    raises where the optimizer is built, not at its first step."""
    model = _mlp()
    first = KFACPreconditioner(model)
    second = KFACPreconditioner(model)
    with pytest.raises(RuntimeError, match=r"KFACOptimizer\(\) on a preconditioner whose layers"):
        KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), first)
    second.remove_hooks()
    with pytest.raises(RuntimeError, match=r"KFACOptimizer\(\) after remove_hooks\(\)"):
        KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), second)
    KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), KFACPreconditioner(model))


def test_a_preconditioner_that_fails_to_build_leaves_the_other_in_charge() -> None:
    """The takeover happens once the new one is built: one refused after its layers were
    found (a sparse embedding under the leftover Adam) leaves the first one stepping."""

    class Tagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 6, sparse=True)
            self.mlp = _mlp()

        def forward(self, x: Tensor) -> Tensor:
            return self.mlp(self.emb(x).mean(1))

    model = Tagged()
    first = KFACPreconditioner(model, method="eigen")
    with pytest.raises(ValueError, match="sparse=True embedding"):
        KFACPreconditioner(model, method="eigen_adam")
    gc.collect()
    assert _forward_hooks(model) == 2  # the first one's
    x = torch.randint(0, 10, (16, 4), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(x), _batch()[1]).backward()
    first.step()  # still in charge
    assert first.steps == 1


def test_a_collected_preconditioner_frees_its_layers_and_hooks() -> None:
    model = _mlp()
    first = KFACPreconditioner(model)
    first.cycle = first  # type: ignore[attr-defined]  # only the cycle collector frees it
    del first
    second = KFACPreconditioner(model)  # the registry collects the cycle, then succeeds
    assert _forward_hooks(model) == 2  # only the second one's
    del second
    assert _forward_hooks(model) == 0


# ----------------------------------------------------------------- the inner optimizer


def test_an_inner_optimizer_without_the_layers_parameters_is_refused() -> None:
    """An inner optimizer over another model (or part of this one) would step the layers
    unpreconditioned, or not at all: refused, naming the layers it misses."""
    model = _mlp()
    pre = KFACPreconditioner(model)
    other = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"does not hold .* layers '0', '2': .*model\.parameters"):
        KFACOptimizer(other, pre)
    part = torch.optim.SGD(model[2].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"layers '0': "):
        KFACOptimizer(part, pre)
    bias_only = torch.optim.SGD([model[0].bias, *model[2].parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"layers '0': "):
        KFACOptimizer(bias_only, pre)


def test_an_inner_optimizer_without_a_frozen_layers_parameters_is_accepted() -> None:
    """``filter(lambda p: p.requires_grad, ...)`` leaves a frozen (still registered) layer
    out: accepted, and it steps as the optimizer over every parameter does."""
    model, twin = _mlp(), _mlp()
    for m in (model, twin):
        m[0].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = KFACOptimizer(torch.optim.SGD(trainable, lr=0.1), KFACPreconditioner(model))
    twin_opt = KFACOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1), KFACPreconditioner(twin))
    assert list(opt.preconditioner.layers) == ["0", "2"]
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        _backward(m)
        o.step()
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )


class _NeedsClosure(torch.optim.SGD):
    """An optimizer of no known class whose step re-evaluates a closure, as LBFGS's does."""

    def step(self, closure):  # type: ignore[no-untyped-def, override]
        for _ in range(2):
            closure()
            super().step()


class _TakesClosure(torch.optim.SGD):
    """An optimizer whose step may take a closure, as every optimizer's may."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        return super().step(closure)


def test_an_inner_optimizer_whose_step_requires_a_closure_is_refused() -> None:
    """LBFGS (and any optimizer whose ``step`` requires a closure) evaluates several gradients
    a step, which K-FAC cannot precondition: refused at construction, not a ``TypeError``
    at the first step; one whose closure is optional is accepted."""
    model = _mlp()
    pre = KFACPreconditioner(model)
    for inner in (
        torch.optim.LBFGS(model.parameters(), lr=0.1),
        _NeedsClosure(model.parameters(), lr=0.1),
    ):
        name = type(inner).__name__
        with pytest.raises(ValueError, match=rf"{name} requires a closure in step\(\).*SGD"):
            KFACOptimizer(inner, pre)
    opt = KFACOptimizer(_TakesClosure(model.parameters(), lr=0.1), pre)
    opt.zero_grad()
    _backward(model)
    opt.step()
    assert pre.steps == 1


# ----------------------------------------------------------------- bad values


@pytest.mark.parametrize("lr", [math.nan, math.inf, -0.1])
def test_bad_lr_raises_before_anything_changes(lr: float) -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, damping=0.1)
    _backward(model)
    grads = _grads(model)
    with pytest.raises(ValueError, match=r"step\(\): lr must be in \[0.0, inf\), got"):
        pre.step(lr=lr)
    assert all(torch.equal(a, b) for a, b in zip(grads, _grads(model), strict=True))
    assert pre.steps == 0
    pre.step(lr=0.0)  # the gradients are still fresh; lr 0 turns the KL-clip off
    assert all(torch.isfinite(g).all() for g in _grads(model))


def test_non_number_lr_is_a_type_error() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model)
    _backward(model)
    with pytest.raises(TypeError, match="step\\(\\): lr must be a number, got str"):
        pre.step(lr="0.1")  # type: ignore[arg-type]


def test_a_misspelt_option_names_the_closest_ones() -> None:
    """An unknown keyword option is refused where it enters, with the fields it resembles
    (not the dataclass's bare "unexpected keyword argument"), and no hook is left."""
    model = _mlp()
    hint = r"unknown option 'dampin' \(did you mean damping or bn_damping\?\); every option"
    with pytest.raises(TypeError, match=hint):
        KFACOptimizer.for_model(model, lr=0.1, dampin=0.1)
    with pytest.raises(TypeError, match="unknown option 'no_such_option'; every option"):
        KFACPreconditioner(model, no_such_option=1)
    KFACPreconditioner(model, damping=0.1)  # the model was left unhooked


def test_optimizer_lr_nan_reaches_no_gradient() -> None:
    model = _mlp()
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), KFACPreconditioner(model))
    opt.param_groups[0]["lr"] = math.nan  # e.g. a broken scheduler
    _backward(model)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="lr must be in"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


# A group edited between steps reached the inner step as it was: a NaN weight decay or
# momentum put NaN in the weights; a string lr or weight decay, or a removed lr, failed
# inside torch (or with KeyError 'lr') after the preconditioner had stepped.
GROUP_EDITS: dict[str, tuple[str, object, type[Exception], str]] = {
    "NaN weight decay": ("weight_decay", math.nan, ValueError, "weight_decay must be in"),
    "negative weight decay": ("weight_decay", -1.0, ValueError, "weight_decay must be in"),
    "string weight decay": ("weight_decay", "0", TypeError, "weight_decay must be a number"),
    "NaN momentum": ("momentum", math.nan, ValueError, "momentum must be a finite number"),
    "string lr": ("lr", "0.1", TypeError, "lr must be a number, got str"),
    "bool lr": ("lr", True, TypeError, "lr must be a number, got bool"),
    "lr past float32": ("lr", 1e39, ValueError, r"lr must be in \[0.0, 3.40.*\], got 1e\+39"),
    "no lr": ("lr", None, ValueError, "a parameter group must hold 'lr'"),
}


@pytest.mark.parametrize("case", list(GROUP_EDITS))
def test_a_group_edited_to_a_bad_value_is_refused_before_the_step_changes_anything(
    case: str,
) -> None:
    key, value, error, message = GROUP_EDITS[case]
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5, weight_decay=0.01)
    opt = KFACOptimizer(inner, KFACPreconditioner(model))
    _backward(model)
    opt.step()
    group = opt.param_groups[0]
    if value is None:
        del group[key]
    else:
        group[key] = value
    opt.zero_grad()
    _backward(model, seed=2)
    weights, grads = [p.detach().clone() for p in model.parameters()], _grads(model)
    with pytest.raises(error, match=rf"param_groups\[0\]: {message}"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads, _grads(model), strict=True))
    assert opt.preconditioner.steps == 1
    group.update(lr=0.1, weight_decay=0.01, momentum=0.5)
    opt.step()  # the gradients are still fresh
    assert opt.preconditioner.steps == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("group", "error", "message"),
    [
        ({"lr": math.nan}, ValueError, r"param_groups\[1\]: lr must be in"),
        ({"lr": -1.0}, ValueError, r"param_groups\[1\]: lr must be in"),
        ({"weight_decay": math.nan}, ValueError, r"param_groups\[1\]: weight_decay must be in"),
        ({"betas": (2.0, 0.9)}, ValueError, r"param_groups\[1\]: betas\[0\] must be in"),
        ({"params": None}, ValueError, "a parameter group must hold 'params'"),
    ],
)
def test_add_param_group_refuses_a_bad_group_and_adds_nothing(
    group: dict[str, object], error: type[Exception], message: str
) -> None:
    # A NaN lr in a new group reached the new parameters' weights; a group without
    # "params" was KeyError 'params' from inside torch.
    model, extra = _mlp(), nn.Linear(3, 3)
    opt = KFACOptimizer.for_model(model)
    params = {} if group.get("params", 0) is None else {"params": list(extra.parameters())}
    with pytest.raises(error, match=message):
        opt.add_param_group({**params, **{k: v for k, v in group.items() if k != "params"}})
    assert len(opt.param_groups) == len(opt.inner.param_groups) == 1
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.01})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("count", [-3, 1.5, True, "2"])
def test_skipped_steps_takes_only_a_count(count: object) -> None:
    # -3 was kept and read back; "2" made the next skip a TypeError inside the step.
    opt = KFACOptimizer.for_model(_mlp())
    with pytest.raises(ValueError, match=f"skipped_steps must be an integer >= 0, got {count!r}"):
        opt.skipped_steps = count  # type: ignore[assignment]
    assert opt.skipped_steps == 0
    opt.skipped_steps = 4
    assert opt.skipped_steps == 4


@pytest.mark.parametrize("lr", [math.nan, -0.1])
def test_an_inner_optimizer_with_a_bad_lr_is_refused_when_wrapped(lr: float) -> None:
    # Accepted, and refused only at the first step.
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    inner.param_groups[0]["lr"] = lr
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr must be in"):
        KFACOptimizer(inner, KFACPreconditioner(model))


@pytest.mark.parametrize("damping", [math.nan, 0.0, -1.0])
def test_update_inverses_refuses_a_bad_damping(damping: float) -> None:
    pre = KFACPreconditioner(_mlp())
    with pytest.raises(ValueError, match="damping must be in"):
        pre.update_inverses(damping)


def test_the_registry_does_not_keep_models_alive() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model)
    pre.remove_hooks()
    ref = weakref.ref(model)
    del pre, model
    gc.collect()
    assert ref() is None


def test_a_lazy_module_before_its_first_forward_is_refused_with_what_to_do() -> None:
    """A lazy layer has no shape until its first forward; the factors are sized by it. The
    error says so (it was torch's own, from counting the elements of the uninitialised
    weight); after one forward the same model trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.LazyLinear(3))
    message = "parameters 0.weight, 0.bias, 2.weight, 2.bias are not initialised yet"
    with pytest.raises(ValueError, match=message):
        KFACOptimizer.for_model(model)
    with pytest.raises(ValueError, match="run the model once on a batch"):
        KFACPreconditioner(model)
    x, y = _batch()
    model(x)
    opt = KFACOptimizer.for_model(model)
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert set(opt.preconditioner.layers) == {"0", "2"}
    assert not torch.equal(before, model[0].weight)
