"""``KFACOptimizer`` where frameworks treat it as a ``torch.optim.Optimizer``: step hooks,
``add_param_group``, ``zero_grad(set_to_none=False)`` and state dicts that load with
``torch.load(weights_only=True)``, each against a twin run."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from tests.integrations.twins import max_difference


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randn(12, 4, generator=gen), torch.randint(0, 3, (12,), generator=gen)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, none: bool = True) -> None:
    x, y = _batch(step)
    opt.zero_grad(set_to_none=none)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_step_pre_and_post_hooks_fire_around_each_step() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model)
    calls: list[tuple[str, int]] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o.preconditioner.steps)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o.preconditioner.steps)))
    for step in range(2):
        _step(model, opt, step)
    assert calls == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]


def test_global_step_hooks_fire_once_a_step_and_the_inner_optimizers_own_hooks_still_fire() -> None:
    """torch's global hooks see one step per user step (the wrapper's, not also the inner
    SGD's); hooks registered on the inner optimizer itself still fire, and the run equals
    one without hooks."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model, twin = _mlp(), _mlp()
    opt, twin_opt = KFACOptimizer.for_model(model), KFACOptimizer.for_model(twin)
    seen: list[tuple[str, str]] = []
    inner_calls: list[str] = []
    opt.inner.register_step_pre_hook(lambda o, a, k: inner_calls.append("pre"))
    opt.inner.register_step_post_hook(lambda o, a, k: inner_calls.append("post"))
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("pre", type(o).__name__))),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append(("post", type(o).__name__))),
    ]
    try:
        for step in range(2):
            _step(model, opt, step)
            _step(twin, twin_opt, step)
    finally:
        for handle in handles:
            handle.remove()
    assert [s for s in seen if s[1] != "KFACOptimizer"] == []
    assert seen.count(("pre", "KFACOptimizer")) == 4  # two optimizers, two steps each
    assert seen.count(("post", "KFACOptimizer")) == 4
    assert inner_calls == ["pre", "post", "pre", "post"]
    assert _same(model, twin)


def test_zero_grad_keeping_the_tensors_equals_setting_them_to_none() -> None:
    kept, dropped = _mlp(), _mlp()
    opt_kept, opt_dropped = KFACOptimizer.for_model(kept), KFACOptimizer.for_model(dropped)
    for step in range(3):
        _step(kept, opt_kept, step, none=False)
        _step(dropped, opt_dropped, step)
    assert all(p.grad is not None for p in kept.parameters())
    assert _same(kept, dropped)


class WithOffset(nn.Module):
    """The MLP with an extra output offset held by the model from the start."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()
        self.offset = nn.Parameter(torch.full((3,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) + self.offset


def test_a_group_added_later_is_stepped_as_the_models_other_parameters() -> None:
    """An offset added with add_param_group gets Adam's direction (``leftover_update``) as
    the same offset held by the model from the start does."""
    held = WithOffset()
    model = _mlp()
    offset = nn.Parameter(torch.full((3,), 0.5))
    opt_held = KFACOptimizer.for_model(held)
    opt = KFACOptimizer.for_model(model)
    opt.add_param_group({"params": [offset]})
    assert opt.inner.param_groups[-1]["params"] == [offset]
    for step in range(3):
        x, y = _batch(step)
        opt_held.zero_grad()
        F.cross_entropy(held(x), y).backward()
        opt_held.step()
        opt.zero_grad()
        F.cross_entropy(model(x) + offset, y).backward()
        opt.step()
    assert _same(held.net, model)
    assert torch.equal(held.offset, offset) and not torch.equal(offset, torch.full((3,), 0.5))
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[0].weight]})
    fresh = KFACOptimizer.for_model(_mlp())  # without the added group: named as torch does
    with pytest.raises(ValueError, match="has 2 parameter groups, this optimizer 1"):
        fresh.load_state_dict(opt.state_dict())


@pytest.mark.parametrize(
    "options",
    [{}, {"method": "eigen"}, {"method": "auto"}, {"method": "ekfac", "refresh": "adaptive"}],
    ids=["default", "eigen", "auto", "ekfac-adaptive"],
)
def test_state_dict_loads_with_weights_only_and_resumes_exactly(options: dict) -> None:
    straight, resumed = _mlp(), _mlp()
    opt_straight = KFACOptimizer.for_model(straight, **options)
    opt_first = KFACOptimizer.for_model(resumed, **options)
    for step in range(3):
        _step(straight, opt_straight, step)
        _step(resumed, opt_first, step)
    buffer = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "optimizer": opt_first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    opt_first.preconditioner.remove_hooks()
    fresh = _mlp(seed=1)
    fresh.load_state_dict(saved["model"])
    opt_fresh = KFACOptimizer.for_model(fresh, **options)
    opt_fresh.load_state_dict(saved["optimizer"])
    for step in range(3, 6):
        _step(straight, opt_straight, step)
        _step(fresh, opt_fresh, step)
    assert _same(straight, fresh)


def _state_dict_events(opt: torch.optim.Optimizer) -> tuple[list[str], dict, float]:
    """The hooks torch.optim.Optimizer offers around state dicts, each logged: a prepended
    one, a post hook that returns a new dict, a load pre hook that returns one with another
    learning rate. ``(events, the saved dict, the learning rate after the load)``."""
    events: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: events.append("save pre"))
    opt.register_state_dict_pre_hook(lambda o: events.append("save pre first"), prepend=True)

    def tag(o: torch.optim.Optimizer, sd: dict) -> dict:
        events.append("save post")
        return {**sd, "tag": "saved"}

    def relearn(o: torch.optim.Optimizer, sd: dict) -> dict:
        events.append(f"load pre {sd.get('tag')}")
        groups = [{**group, "lr": 0.25} for group in sd["param_groups"]]
        return {"state": sd["state"], "param_groups": groups}

    opt.register_state_dict_post_hook(tag)
    opt.register_load_state_dict_pre_hook(relearn)
    opt.register_load_state_dict_post_hook(lambda o: events.append("load post"))
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    return events, saved, opt.param_groups[0]["lr"]


def test_state_dict_hooks_run_as_torchs_optimizers_run_them() -> None:
    """The hooks registered on the wrapper fire in the order they fire on AdamW, a post hook's
    dict is what ``state_dict()`` returns, and a load pre hook's dict is what loads."""
    model, twin = _mlp(), _mlp()
    opt = KFACOptimizer.for_model(model, lr=0.01)
    adamw = torch.optim.AdamW(twin.parameters(), lr=0.01)
    _step(model, opt, 0)
    _step(twin, adamw, 0)
    events, saved, lr = _state_dict_events(opt)
    expected, adamw_saved, adamw_lr = _state_dict_events(adamw)
    assert events == expected
    assert events == ["save pre first", "save pre", "save post", "load pre saved", "load post"]
    assert saved["tag"] == adamw_saved["tag"] == "saved"
    assert lr == adamw_lr == 0.25
    assert opt.inner.param_groups[0]["lr"] == 0.25
    _step(model, opt, 1)  # the rewritten dict loaded whole: it still steps


def test_copying_or_pickling_the_optimizer_is_refused_with_what_to_do() -> None:
    """A copy or pickle of the optimizer would keep only torch's groups and state (no
    preconditioner) and fail at its first call; one of the preconditioner would capture
    nothing (its hooks inert): both refused, pointing at ``state_dict()``; the optimizer
    itself is untouched and steps as a twin does."""
    model, twin = _mlp(), _mlp()
    opt, twin_opt = KFACOptimizer.for_model(model), KFACOptimizer.for_model(twin)
    _step(model, opt, 0)
    _step(twin, twin_opt, 0)
    copies = {
        "copy": lambda: copy.copy(opt),
        "deepcopy": lambda: copy.deepcopy(opt),
        "deepcopy with the model": lambda: copy.deepcopy((model, opt)),
        "pickle": lambda: pickle.dumps(opt),
        "torch.save": lambda: torch.save(opt, io.BytesIO()),
    }
    for name, attempt in copies.items():
        with pytest.raises(TypeError, match=r"cannot be copied or pickled.*opt\.state_dict\(\)"):
            attempt()
            pytest.fail(f"{name} was not refused")
    pre = opt.preconditioner
    for attempt in (lambda: copy.copy(pre), lambda: copy.deepcopy(pre), lambda: pickle.dumps(pre)):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled.*pre\.state_dict\(\)"):
            attempt()
    _step(model, opt, 1)
    _step(twin, twin_opt, 1)
    assert _same(model, twin)


def test_a_checkpoint_round_trip_warns_nothing_under_warnings_as_errors() -> None:
    # Test suites often run with -W error; state_dict() once imported torch.distributed.optim
    # (to recognise ZeRO), whose import warns that torch.jit.script is deprecated. A fresh
    # interpreter: the suite's other tests may have imported it already.
    script = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from dkfac import KFACOptimizer\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))\n"
        "opt = KFACOptimizer.for_model(model)\n"
        "model(torch.randn(5, 4)).sum().backward()\n"
        "opt.step()\n"
        "KFACOptimizer.for_model(model).load_state_dict(opt.state_dict())\n"
        "assert 'torch.distributed.optim' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_step_with_no_gradient_is_a_batch_never_seen() -> None:
    """``step(closure)`` whose closure runs the forward and no backward (Lightning's
    skipped batch): K-FAC's step counter, factors and moments stay, and what the forward
    captured is forgotten (each forward's input square under ``orthogonal_input_rms``, a
    Monte-Carlo backward's statistics): the run equals the loop that skips the batch."""

    def run(options: dict[str, Any], skip_inside: bool) -> tuple[nn.Module, int]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        ).double()  # a hidden layer: orthogonalised, scaled by its input's RMS
        opt = KFACOptimizer.for_model(model, lr=0.01, overhead=None, **options)
        gen = torch.Generator().manual_seed(1)
        for index in range(5):
            x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 3, (8,), generator=gen)
            if index == 2 and not skip_inside:
                continue

            def closure(x: Tensor = x, y: Tensor = y, index: int = index) -> Tensor | None:
                out = model(x)
                if options.get("fisher") == "mc":
                    opt.preconditioner.sample_fisher(out)
                opt.zero_grad()
                if index == 2:
                    return None
                loss = F.cross_entropy(out, y)
                loss.backward()
                return loss

            opt.step(closure)  # type: ignore[arg-type]
        return model, opt.preconditioner.steps

    for options in ({}, {"fisher": "mc"}, {"orthogonal_input_rms": True}):
        (inside, steps), (skipped, want) = run(options, True), run(options, False)
        assert steps == want == 4
        assert max_difference(inside, skipped) == 0.0, options
