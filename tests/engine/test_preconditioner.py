"""Update intervals, schedules, validation, robustness, MC Fisher and state round trips."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACConfig, KFACOptimizer, KFACPreconditioner
from dkfac.blocks.linear import LinearBlock
from dkfac.solvers.eigen import EigenSolver
from tests.oracles import dense_eigen_solve, dense_factored_solve, with_ones


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.randint(0, 3, (n,))


def _train_step(model: nn.Module, pre: KFACPreconditioner, x, y) -> None:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()


# ---------------------------------------------------------------- intervals and schedules
def test_hooks_do_no_work_on_non_factor_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"a": 0, "g": 0, "eig": 0}
    real_a, real_g, real_eig = LinearBlock.a_rows, LinearBlock.g_rows, EigenSolver._states

    def count(key, real, layers=lambda args: 1):
        def wrapper(*args, **kwargs):
            calls[key] += layers(args)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(LinearBlock, "a_rows", count("a", real_a))
    monkeypatch.setattr(LinearBlock, "g_rows", count("g", real_g))
    # the layers decomposed, alone or in a batch
    monkeypatch.setattr(EigenSolver, "_states", count("eig", real_eig, lambda a: len(a[1])))
    model = _mlp()
    pre = KFACPreconditioner(model, factor_update_interval=3, inverse_update_interval=4)
    x, y = _batch()
    for _ in range(12):
        _train_step(model, pre, x, y)
    # factor steps 0,3,6,9 -> 4 per layer; inverse steps 0,4,8 -> 3 per layer
    assert calls == {"a": 8, "g": 8, "eig": 6}


def test_callable_schedules_are_used_per_step() -> None:
    model = _mlp()
    seen: list[int] = []

    def damping(step: int) -> float:
        seen.append(step)
        return 1e-2 if step < 2 else 1e-1

    pre = KFACPreconditioner(model, damping=damping, factor_update_interval=lambda s: 1 + s // 2)
    x, y = _batch()
    for _ in range(4):
        _train_step(model, pre, x, y)
    assert seen == [0, 1, 2, 3]


@pytest.mark.parametrize("method", ["eigen", "cholesky", "smw"])
def test_a_damping_schedule_acts_as_options_md_says(method: str) -> None:
    """eigen reads the damping at every step; cholesky and smw fold it into their inverses,
    so between inverse updates they keep the value of the last one (docs/options.md)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False)).double()
    pre = KFACPreconditioner(
        model,
        method=method,
        damping=lambda s: 1e-3 if s == 0 else 10.0,
        kl_clip=None,
        factor_decay=0.0,
        inverse_update_interval=10,
    )
    layer = model[0]
    for step in range(2):
        x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
        model.zero_grad()
        F.cross_entropy(layer(x), y).backward()
        grad = layer.weight.grad.clone()
        pre.step()
        if step == 0:
            a, g = (f.clone() for f in pre.factors()["0"])  # the inverses' factors
    solve = dense_eigen_solve if method == "eigen" else dense_factored_solve
    damping = 10.0 if method == "eigen" else 1e-3
    torch.testing.assert_close(layer.weight.grad, solve(a, g, grad, damping))


def test_bad_schedule_value_names_argument_and_step() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, damping=lambda s: 1e-3 if s == 0 else -1.0)
    x, y = _batch()
    _train_step(model, pre, x, y)
    with pytest.raises(ValueError, match=r"damping .* step 1"):
        _train_step(model, pre, x, y)


@pytest.mark.parametrize("field", ["damping", "factor_decay", "kl_clip", "inverse_update_interval"])
def test_a_schedule_that_cannot_take_the_step_is_refused_when_built(field: str) -> None:
    # damping=lambda: 0.01 was accepted and failed at the first step, factor_decay's from
    # inside registration, with "<lambda>() takes 0 positional arguments but 1 was given".
    with pytest.raises(TypeError, match=rf"{field} must be a number or a callable of the step"):
        KFACPreconditioner(_mlp(), **{field: lambda: 1})
    with pytest.raises(TypeError, match=rf"{field} must be a number or a callable of the step"):
        KFACPreconditioner(_mlp(), **{field: lambda step, rate: 1})
    model = _mlp()  # a callable that takes the step (and keyword defaults) is one
    interval = field.endswith("interval")
    pre = KFACPreconditioner(
        model, **{field: lambda step, scale=1: scale * (1 if interval else 0.5)}
    )
    x, y = _batch()
    _train_step(model, pre, x, y)
    _train_step(model, pre, x, y)
    assert pre.steps == 2


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"damping": 0.0}, ValueError, "damping"),
        ({"damping": -1.0}, ValueError, "damping"),
        ({"damping": float("nan")}, ValueError, "damping"),
        ({"factor_decay": 1.0}, ValueError, "factor_decay"),
        ({"factor_decay": -0.1}, ValueError, "factor_decay"),
        ({"factor_update_interval": 0}, ValueError, "factor_update_interval"),
        ({"inverse_update_interval": 2.5}, ValueError, "inverse_update_interval"),
        ({"kl_clip": 0.0}, ValueError, "kl_clip"),
        ({"method": "svd"}, ValueError, "method"),
        ({"fisher": "true"}, ValueError, "fisher"),
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps"),
        ({"eigen_dtype": torch.float16}, ValueError, "eigen_dtype"),
        ({"damping": "big"}, TypeError, "damping"),
        ({"not_an_option": 1}, TypeError, "not_an_option"),
    ],
)
def test_bad_arguments_are_rejected(options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KFACPreconditioner(_mlp(), **options)


@pytest.mark.parametrize(
    "option", ["factor_dtype", "capture_dtype", "rotation_dtype", "gradient_rotation_dtype"]
)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_precision_is_refused_when_built(option: str, dtype: torch.dtype) -> None:
    # float8 is a floating dtype to torch: factor_dtype failed at the first step (no
    # products in it), capture_dtype and rotation_dtype ran on 2-3 significant bits.
    with pytest.raises(ValueError, match=rf"{option} must be .*torch\.float32.*, got {dtype}"):
        KFACOptimizer.for_model(_mlp(), **{option: dtype})


def test_model_without_supported_layer_is_rejected() -> None:
    with pytest.raises(ValueError, match="no layer K-FAC can precondition"):
        KFACPreconditioner(
            nn.Sequential(nn.ReLU(), nn.LayerNorm(3), nn.BatchNorm1d(3, affine=False))
        )
    with pytest.raises(TypeError, match=r"nn\.Module"):
        KFACPreconditioner("model")  # type: ignore[arg-type]


@pytest.mark.parametrize("config", [{"damping": 0.1}, "eigen", 0.1])
def test_a_config_that_is_no_kfac_config_is_refused(config: object) -> None:
    # It was an AttributeError ('dict' object has no attribute 'skip_layers').
    with pytest.raises(
        TypeError, match=f"config must be a KFACConfig or None, got {type(config).__name__}"
    ):
        KFACPreconditioner(_mlp(), config=config)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["no", 0, None])
def test_skip_nonfinite_must_be_a_bool(flag: object) -> None:
    # "no" was taken as true: the one word that asks for no skipping turned it on.
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="skip_nonfinite must be a bool, got"):
        KFACOptimizer(inner, KFACPreconditioner(model), skip_nonfinite=flag)  # type: ignore[arg-type]


def test_update_inverses_and_state_dict_check_their_arguments() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pre = KFACPreconditioner(model)
    F.cross_entropy(model(torch.randn(8, 4)), torch.arange(8) % 2).backward()
    pre.step()
    # A KeyError from deep inside; a string was read as its characters ("02": layers 0, 2).
    with pytest.raises(ValueError, match=r"names \['9'\] are not registered layers; they are"):
        pre.update_inverses(0.1, ["0", "9"])
    with pytest.raises(TypeError, match="names must be a list of layer names or None"):
        pre.update_inverses(0.1, "02")  # type: ignore[arg-type]
    pre.update_inverses(0.1, ["2"])  # a list of registered names is fine
    # "no" was read as true.
    with pytest.raises(TypeError, match="include_inverses must be a bool, got 'no'"):
        pre.state_dict(include_inverses="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gather must be a bool, got 0"):
        pre.state_dict(gather=0)  # type: ignore[arg-type]
    pre.remove_hooks()


def test_a_skip_pattern_that_matches_nothing_is_named(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with caplog.at_level(logging.WARNING, logger="dkfac.engine.registration"):
        pre = KFACPreconditioner(model, skip_layers=["^1$", "Linaer", "^9$"])
    assert list(pre.layers) == ["0", "2"]
    pre.remove_hooks()
    warned = [r.getMessage() for r in caplog.records if "skip_layers" in r.getMessage()]
    assert warned == [
        "skip_layers patterns ['Linaer', '^9$'] match no module of the model (its names: "
        "0, 1, 2): they skip nothing"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dkfac.engine.registration"):
        KFACPreconditioner(model, skip_layers=["ReLU", "^2$"])  # each matches a module
    assert not [r for r in caplog.records if "skip_layers" in r.getMessage()]


def test_skip_layers_by_name_and_class() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2), nn.Linear(2, 2))
    assert list(KFACPreconditioner(model, skip_layers="^2$").layers) == ["0", "3"]
    assert list(KFACPreconditioner(model, skip_layers=["Conv2d"]).layers) == ["2", "3"]


def test_a_grouped_conv_is_unit_wise_and_one_with_too_wide_units_is_skipped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 2))
    pre = KFACPreconditioner(model)
    assert list(pre.layers) == ["0", "2"]
    assert pre.layers["0"].solver.name == "unitwise"
    wide = nn.Sequential(nn.Conv1d(64, 4, 9, groups=2), nn.Flatten(), nn.Linear(4, 2))
    with caplog.at_level(logging.WARNING):
        pre = KFACPreconditioner(wide)  # d = 32·9 + 1 = 289
    assert list(pre.layers) == ["2"]
    assert "grouped convolution (groups=2) with 289 parameters per output channel" in caplog.text


def test_frozen_layer_is_not_registered() -> None:
    model = _mlp()
    model[0].weight.requires_grad_(False)
    assert list(KFACPreconditioner(model).layers) == ["2"]


# ---------------------------------------------------------------- robustness
def test_nonfinite_gradient_never_reaches_weights(caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), KFACPreconditioner(model))
    x, y = _batch()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    good = {k: v.clone() for k, v in model.state_dict().items()}
    factors = {k: (a.clone(), g.clone()) for k, (a, g) in opt.preconditioner.factors().items()}
    opt.zero_grad()
    bad = x.clone()
    bad[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING):
        F.cross_entropy(model(bad), y).backward()
        opt.step()
    assert "non-finite" in caplog.text and "0" in caplog.text
    for key, value in model.state_dict().items():
        assert torch.isfinite(value).all(), key
        torch.testing.assert_close(value, good[key])
    for name, (a, g) in opt.preconditioner.factors().items():
        torch.testing.assert_close(a, factors[name][0])
        torch.testing.assert_close(g, factors[name][1])
    assert opt.skipped_steps == 1


def test_nonfinite_gradient_zeroed_by_preconditioner_alone() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model)
    x, y = _batch()
    _train_step(model, pre, x, y)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    model[2].weight.grad[0, 0] = float("inf")
    pre.step()
    assert torch.count_nonzero(model[2].weight.grad) == 0
    assert torch.isfinite(model[0].weight.grad).all()


# ---------------------------------------------------------------- Monte-Carlo Fisher
def test_mc_fisher_leaves_training_gradients_untouched_and_equals_formula() -> None:
    torch.manual_seed(3)
    model = nn.Linear(4, 3).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    pre = KFACPreconditioner(model, fisher="mc", factor_decay=0.0, seed=7, kl_clip=None)
    model.zero_grad()
    out = model(x)
    pre.sample_fisher(out, loss="cross_entropy")
    F.cross_entropy(out, y).backward()
    for p, expected in zip(model.parameters(), plain, strict=True):
        torch.testing.assert_close(p.grad, expected)
    pre.step()
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(out.detach().float(), dim=-1)
    sampled = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    per_sample = torch.softmax(out.detach(), -1) - F.one_hot(sampled, 3).double()
    torch.testing.assert_close(pre.factors()[""][1], per_sample.T @ per_sample / 6)
    rows = with_ones(x)
    torch.testing.assert_close(pre.factors()[""][0], rows.T @ rows / 6)


def test_mc_fisher_backward_computes_no_weight_gradient_and_equals_formula() -> None:
    """Three layers: each G is the sampled loss's output gradients (×B), and the sampled
    backward stops at the captured outputs without computing any parameter gradient."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
    model = model.double()
    x = torch.randn(6, 4, dtype=torch.float64)
    pre = KFACPreconditioner(model, fisher="mc", factor_decay=0.0, seed=2, kl_clip=None)
    parameter_grads = []
    for p in model.parameters():
        p.register_hook(lambda g: parameter_grads.append(g))
    outputs = {}
    for index in (0, 2, 4):
        model[index].register_forward_hook(lambda m, i, o, k=index: outputs.__setitem__(k, o))
    out = model(x)
    pre.sample_fisher(out)
    assert parameter_grads == []  # no weight or bias gradient was computed
    out.sum().backward(retain_graph=True)
    pre.step()
    gen = torch.Generator().manual_seed(2)
    sampled = torch.multinomial(torch.softmax(out.detach().float(), -1), 1, generator=gen)
    sampled_loss = F.cross_entropy(out, sampled.squeeze(1))
    wanted = torch.autograd.grad(sampled_loss, [outputs[k] for k in (0, 2, 4)])
    for index, grad in zip((0, 2, 4), wanted, strict=True):
        per_sample = 6 * grad
        torch.testing.assert_close(pre.factors()[str(index)][1], per_sample.T @ per_sample / 6)


def test_mc_fisher_survives_an_in_place_op_after_a_captured_layer() -> None:
    """ReLU(inplace=True) rewrites the first layer's output: its G must still be captured,
    equal to that of the same network with an out-of-place ReLU."""

    def factors(inplace: bool) -> dict:
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=inplace), nn.Linear(5, 3))
        pre = KFACPreconditioner(model, fisher="mc", factor_decay=0.0, seed=3)
        out = model(torch.randn(6, 4))
        pre.sample_fisher(out)
        out.sum().backward()
        pre.step()
        return pre.factors()

    in_place, out_of_place = factors(True), factors(False)
    assert set(in_place) == set(out_of_place) == {"0", "2"}
    for name, pair in out_of_place.items():
        for got, want in zip(in_place[name], pair, strict=True):
            torch.testing.assert_close(got, want)


def test_mc_fisher_mse_gradient_is_unit_gaussian_noise() -> None:
    model = nn.Linear(3, 2).double()
    pre = KFACPreconditioner(model, fisher="mc", factor_decay=0.0, seed=1)
    out = model(torch.randn(4, 3, dtype=torch.float64))
    pre.sample_fisher(out, loss="mse")
    out.sum().backward()
    pre.step()
    noise = torch.randn((4, 2), generator=torch.Generator().manual_seed(1)).double()
    torch.testing.assert_close(pre.factors()[""][1], noise.T @ noise / 4)


def test_mc_fisher_requires_sample_call() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, fisher="mc")
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="sample_fisher"):
        pre.step()
    with pytest.raises(RuntimeError, match='fisher="mc"'):
        KFACPreconditioner(_mlp()).sample_fisher(model(x))


def test_the_largest_seed_samples_the_fisher_and_a_larger_one_is_refused() -> None:
    # seed=2**70 was accepted and failed at the first sample_fisher, inside torch
    # ("Overflow when unpacking long long").
    from dkfac.config.estimation import SEED_END

    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\), got"):
        KFACPreconditioner(_mlp(), fisher="mc", seed=SEED_END)
    model = _mlp()
    pre = KFACPreconditioner(model, fisher="mc", seed=SEED_END - 1)
    x, y = _batch()
    out = model(x)
    pre.sample_fisher(out)
    F.cross_entropy(out, y).backward()
    pre.step()
    assert all(torch.isfinite(g).all() for _, g in pre.factors().values())


# ---------------------------------------------------------------- state and memory
def _run(model, pre, batches):
    for x, y in batches:
        _train_step(model, pre, x, y)


@pytest.mark.parametrize("steps,include_inverses", [(4, False), (6, True)])
def test_state_dict_round_trip_reproduces_next_step(steps: int, include_inverses: bool) -> None:
    batches = [_batch() for _ in range(steps + 1)]
    model = _mlp()
    clone = _mlp()
    clone.load_state_dict(model.state_dict())
    options = dict(inverse_update_interval=4, factor_decay=0.9, damping=lambda s: 0.01 * (s + 1))
    pre = KFACPreconditioner(model, **options)
    _run(model, pre, batches[:steps])
    saved = pre.state_dict(include_inverses=include_inverses)
    clone.load_state_dict(model.state_dict())
    restored = KFACPreconditioner(clone, **options)
    restored.load_state_dict(saved)
    assert restored.steps == steps
    _run(model, pre, batches[steps:])
    _run(clone, restored, batches[steps:])
    for p, q in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize(
    ("saved", "loaded"), [(torch.float32, torch.float64), (torch.float64, torch.float32)]
)
def test_a_state_of_another_precision_loads_in_the_models(
    saved: torch.dtype, loaded: torch.dtype
) -> None:
    """Factors and solver states saved by a model of another dtype are kept in this model's
    factor dtype, as a fresh run keeps them (they kept the saved dtype through the next
    steps: a float64 model's state held float64 curvature in a float32 run)."""
    torch.manual_seed(0)
    model = _mlp().to(saved)
    pre = KFACPreconditioner(model, method="eigen_adam", inverse_update_interval=2)
    x, y = _batch()
    for _ in range(3):
        _train_step(model, pre, x.to(saved), y)
    state = pre.state_dict(include_inverses=True)
    clone = _mlp().to(loaded)
    restored = KFACPreconditioner(clone, method="eigen_adam", inverse_update_interval=2)
    restored.load_state_dict(state)
    for _ in range(2):
        for layer in restored.layers.values():
            held = [*layer.running.values(), *(layer.solver_state or {}).values()]
            assert {t.dtype for t in held if t.is_floating_point()} == {loaded}
        _train_step(clone, restored, x.to(loaded), y)
    a, _ = restored.factors()["0"]
    assert a.dtype == loaded


def test_load_state_dict_rejects_mismatch() -> None:
    pre = KFACPreconditioner(_mlp())
    other = KFACPreconditioner(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5)))
    x, y = _batch()
    _train_step(pre.model, pre, x, y)
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict(pre.state_dict())
    with pytest.raises(ValueError, match="missing"):
        KFACPreconditioner(nn.Linear(4, 3)).load_state_dict(pre.state_dict())


@pytest.mark.parametrize("part", ["A", "moments"])
def test_a_state_with_integer_statistics_is_refused_and_changes_nothing(part: str) -> None:
    # An int64 A (or moment) loaded as it was: the factor truncated, the basis refreshed
    # from it, silently.
    torch.manual_seed(0)
    model = _mlp()
    pre = KFACPreconditioner(model, method="eigen_adam", kl_clip=None)
    x, y = _batch()
    _train_step(model, pre, x, y)
    state = pre.state_dict(include_inverses=True)
    entry = state["layers"]["0"]
    if part == "A":
        entry["A"] = entry["A"].round().to(torch.int64)
    else:
        entry["moments"]["v"] = entry["moments"]["v"].to(torch.int64)
    before = {n: (a.clone(), g.clone()) for n, (a, g) in pre.factors().items()}
    with pytest.raises(ValueError, match=r"0: saved (A|moments) must be .*floating"):
        pre.load_state_dict(state)
    for name, (a, g) in pre.factors().items():
        assert torch.equal(a, before[name][0]) and torch.equal(g, before[name][1])


def test_memory_usage_counts_factor_bytes() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model)
    x, y = _batch()
    _train_step(model, pre, x, y)
    usage = pre.memory_usage()
    assert usage["factors"] == 4 * (5 * 5 + 8 * 8 + 9 * 9 + 3 * 3)
    assert usage["inverses"] == usage["factors"] + 4 * (5 + 8 + 9 + 3)  # Q's and λ's
    assert usage["accumulators"] == 0


def test_a_per_layer_lr_names_every_layer() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, kl_clip=1e-6)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    names = list(pre.layers)
    with pytest.raises(ValueError, match=r"step\(\): a per-layer lr must name every .* missing"):
        pre.step(lr={name: 0.1 for name in names[1:]})
    with pytest.raises(ValueError, match=r"step\(\): lr must be"):
        pre.step(lr={**{name: 0.1 for name in names}, names[0]: float("nan")})
    pre.step(lr={name: 0.1 for name in names})


# ---------------------------------------------------------------- KFACOptimizer
def test_the_kl_clip_takes_each_layer_s_group_rate_in_any_order() -> None:
    """Two groups, the first layer at lr 0 (held still), the second at 0.1: ν is the
    clip of the second layer alone, ``min(1, √(κ / |0.1² ⟨V, ∇W⟩|))``, whichever group
    comes first (the first group's rate used to stand for every layer)."""
    scales = []
    for first_still in (True, False):
        torch.manual_seed(0)
        model = _mlp()
        still = {"params": list(model[0].parameters()), "lr": 0.0}
        moving = {"params": list(model[2].parameters()), "lr": 0.1}
        groups = [still, moving] if first_still else [moving, still]
        pre = KFACPreconditioner(model, kl_clip=1e-6)
        opt = KFACOptimizer(torch.optim.SGD(groups, lr=0.1), pre)
        torch.manual_seed(1)
        x, y = _batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = pre.layers["2"].block.weight_grad().clone()  # type: ignore[union-attr]
        opt.step()
        final = pre.layers["2"].block.weight_grad()
        scale = pre.last_kl_scale
        assert scale is not None and final is not None
        product = float((final / scale * raw).sum())
        assert scale == pytest.approx(min(1.0, (1e-6 / abs(0.01 * product)) ** 0.5), rel=1e-5)
        scales.append(scale)
    assert scales[0] == scales[1]


def test_optimizer_shares_param_groups_and_feeds_lr() -> None:
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt = KFACOptimizer(inner, KFACPreconditioner(model, kl_clip=1e-6))
    assert opt.param_groups is inner.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _batch()
    lrs = []
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = {
            n: layer.block.weight_grad().clone() for n, layer in opt.preconditioner.layers.items()
        }
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        lrs.append(lr)
        pre = opt.preconditioner
        vg = sum((pre.layers[n].block.weight_grad() * raw[n]).sum() for n in raw)
        # The clipped update is ν·V with ν = sqrt(κ / (lr² ⟨V, g⟩)) < 1 for this tiny κ, so
        # lr² ⟨ν V, g⟩ · ν = κ holds exactly when the optimizer's current lr was used.
        assert pre.last_kl_scale < 1
        assert lr**2 * float(vg) * pre.last_kl_scale == pytest.approx(1e-6, rel=1e-4)
    assert lrs == [0.5, 0.25, 0.125]


def test_optimizer_state_dict_round_trip() -> None:
    batches = [_batch() for _ in range(4)]
    model, clone = _mlp(), _mlp()
    clone.load_state_dict(model.state_dict())

    def make(m):
        return KFACOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            KFACPreconditioner(m, inverse_update_interval=3),
        )

    opt = make(model)
    for x, y in batches[:3]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    restored = make(clone)
    clone.load_state_dict(model.state_dict())
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for m, o in ((model, opt), (clone, restored)):
        x, y = batches[3]
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(p, q)


def test_config_object_and_overrides() -> None:
    config = KFACConfig(damping=0.1)
    pre = KFACPreconditioner(_mlp(), config=config, method="cholesky")
    assert pre.config.damping == 0.1 and pre.config.method == "cholesky"
    with pytest.raises(Exception, match=r"frozen|cannot assign"):
        config.damping = 1.0  # type: ignore[misc]
    assert math.isclose(KFACConfig().factor_decay, 0.95)


def test_a_layer_whose_output_misses_the_loss_captures_nothing(caplog) -> None:
    """Statistics come only from outputs that are backpropagated: a layer computed but not
    part of the loss is an unused branch (no factors, no gradient, nothing held)."""
    torch.manual_seed(0)
    stem, used, unused = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 3)
    model = nn.ModuleDict({"stem": stem, "used": used, "unused": unused})
    pre = KFACPreconditioner(model, factor_decay=0.0)
    with caplog.at_level("WARNING", logger="dkfac"):
        for _ in range(2):
            h = torch.tanh(stem(torch.randn(6, 4)))
            unused(h)  # computed, never part of the loss
            F.cross_entropy(used(h), torch.randint(0, 3, (6,))).backward()
            held = {
                n: any(a.has_data for a in x.accumulators.values()) for n, x in pre.layers.items()
            }
            assert held == {"stem": True, "used": True, "unused": False}
            pre.step()
    assert "unused" not in caplog.text
    assert set(pre.factors()) == {"stem", "used"}
