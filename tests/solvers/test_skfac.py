"""SKFAC through the preconditioner: SMW equals the dense factored solve, auto, reductions.

Oracles: the dense factored π-damped solve (tests/oracles.py) on factors built by hand, a
``method="cholesky"`` preconditioner run side by side (same factored damping, dense ``d×d``
factors), hand-built reduced convolution factors, and ``choose_method`` for ``"auto"``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.solvers.lowrank.auto import choose_method
from dkfac.solvers.lowrank.factor import default_max_rank
from tests.oracles import conv_patches_by_hand, dense_factored_solve, weight_grad_matrix, with_ones

DT = torch.float64
BATCH = 4
OPTIONS: dict[str, Any] = {
    "damping": 0.05,
    "kl_clip": None,
    "eigen_dtype": DT,
    "inverse_update_interval": 1,
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 32), nn.Tanh(), nn.Linear(32, 6)).double()


def _batch(step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 40, generator=gen, dtype=DT), torch.randint(
        0, 6, (batch,), generator=gen
    )


def _train_step(model: nn.Module, pre: KFACPreconditioner, step: int, opt: Any = None) -> None:
    x, y = _batch(step)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    if opt is not None:
        opt.step()


def _grad_spy(seen: dict[str, torch.Tensor]) -> Any:
    """A forward hook that keeps the gradient of the module's output as ``seen["g"]``."""

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: seen.update(g=grad.detach()))

    return hook


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("decay", [0.0, 0.5])
def test_smw_preconditioner_equals_cholesky_preconditioner_over_steps(decay: float) -> None:
    """Low-rank running concatenation vs the dense running average, 3 steps, no truncation."""
    models = {m: _mlp() for m in ("smw", "cholesky")}
    pres = {
        m: KFACPreconditioner(models[m], method=m, factor_decay=decay, **OPTIONS) for m in models
    }
    opts = {m: torch.optim.SGD(models[m].parameters(), lr=0.1) for m in models}
    rank = default_max_rank(BATCH, decay)
    assert rank < 32  # both sides of layer 0 and A of layer 2 go low-rank
    for step in range(3):
        for m in models:
            _train_step(models[m], pres[m], step, opts[m])
        for got, want in zip(_grads(models["smw"]), _grads(models["cholesky"]), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        u_a, u_g = pres["smw"].factors()["0"]
        a, g = pres["cholesky"].factors()["0"]
        cols = BATCH if decay == 0 else BATCH * (step + 1)
        assert u_a.shape == (41, cols) and u_g.shape == (32, cols)
        torch.testing.assert_close(u_a @ u_a.T, a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(u_g @ u_g.T, g, rtol=1e-10, atol=1e-12)
    rows = {row["name"]: row for row in pres["smw"].describe()}
    assert rows["0"]["method"] == "smw(A=lowrank,G=lowrank)"
    g_kind = "lowrank" if rank < 6 else "dense"  # rank 4 (decay 0) or 28 (decay 0.5)
    assert rows["2"]["method"] == f"smw(A=lowrank,G={g_kind})"
    assert (rows["2"]["a_factor"], rows["2"]["g_factor"]) == ("lowrank", g_kind)


def test_a_step_with_more_rows_than_the_first_keeps_them_all() -> None:
    """The rank bound comes from the first micro-batch: a later step with more rows (here
    larger micro-batches, two a step with ``accumulation_steps`` left at 1: 32 rows, past
    the bound of 4) keeps every row of its factor, so smw (decay 0: exact) still equals
    cholesky and the state loads again; the truncation dropped rows of the newest factor,
    leaving it on the wrong scale."""
    models = {m: _mlp() for m in ("smw", "cholesky")}
    pres = {m: KFACPreconditioner(models[m], method=m, factor_decay=0.0, **OPTIONS) for m in models}
    for step in range(3):
        for m in models:
            models[m].zero_grad()
            for micro in range(1 if step == 0 else 2):  # 4 rows, then 32 a step
                x, y = _batch(10 * step + micro, BATCH if step == 0 else 4 * BATCH)
                (F.cross_entropy(models[m](x), y) / 2).backward()
            pres[m].step()
        for got, want in zip(_grads(models["smw"]), _grads(models["cholesky"]), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    u_a, _ = pres["smw"].factors()["0"]
    a, _ = pres["cholesky"].factors()["0"]
    torch.testing.assert_close(u_a @ u_a.T, a, rtol=1e-10, atol=1e-12)
    assert pres["smw"].describe()[0]["method"] == "smw(A=lowrank,G=lowrank)"
    clone = _mlp()
    restored = KFACPreconditioner(clone, method="smw", factor_decay=0.0, **OPTIONS)
    restored.load_state_dict(pres["smw"].state_dict())
    torch.testing.assert_close(restored.factors()["0"][0], u_a)


def test_smw_first_step_equals_dense_factored_solve_on_hand_factors() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, method="smw", factor_decay=0.0, **OPTIONS)
    seen: dict[str, torch.Tensor] = {}
    first = model[0]
    first.register_forward_hook(lambda m, i, o: seen.update(x=i[0].detach()))
    first.register_forward_hook(_grad_spy(seen))
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    grad = weight_grad_matrix(first).clone()
    pre.step()
    a_rows = with_ones(seen["x"])
    g_rows = seen["g"] * BATCH
    a = a_rows.T @ a_rows / BATCH
    g = g_rows.T @ g_rows / BATCH
    want = dense_factored_solve(a, g, grad, OPTIONS["damping"])
    torch.testing.assert_close(weight_grad_matrix(first), want, rtol=1e-9, atol=1e-12)


def test_memory_usage_holds_u_not_dense() -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, method="smw", factor_decay=0.0, **OPTIONS)
    _train_step(model, pre, 0)
    # layer 0: U_A 41×4, U_G 32×4; layer 2: U_A 33×4, U_G 6×4 (rank 4 < 6; float64)
    want = (41 + 32 + 33 + 6) * BATCH * 8
    assert pre.memory_usage()["factors"] == want
    dense = KFACPreconditioner(_mlp(), method="cholesky", factor_decay=0.0, **OPTIONS)
    assert want < (41**2 + 32**2 + 33**2 + 36) * 8
    del dense


def test_grad_scaler_scales_u_by_one_over_s() -> None:
    class FakeScaler:
        def get_scale(self) -> float:
            return 8.0

        def is_enabled(self) -> bool:
            return True

    models = [_mlp(), _mlp()]
    plain = KFACPreconditioner(models[0], method="smw", factor_decay=0.0, **OPTIONS)
    scaled = KFACPreconditioner(
        models[1], method="smw", factor_decay=0.0, grad_scaler=FakeScaler(), **OPTIONS
    )
    x, y = _batch(0)
    F.cross_entropy(models[0](x), y).backward()
    (8.0 * F.cross_entropy(models[1](x), y)).backward()
    for p in models[1].parameters():
        p.grad /= 8.0  # scaler.unscale_()
    plain.step()
    scaled.step()
    for got, want in zip(_grads(models[1]), _grads(models[0]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_auto_follows_choose_method_and_describe_shows_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 150), nn.Tanh(), nn.Linear(150, 4), nn.Linear(4, 3))
    model = model.double()
    pre = KFACPreconditioner(model, method="auto", factor_decay=0.0, **OPTIONS)
    assert {row["method"] for row in pre.describe()} == {"auto (pending)"}
    x = torch.randn(8, 200, dtype=DT)
    F.cross_entropy(model(x), torch.randint(0, 3, (8,))).backward()
    pre.step()
    rows = {row["name"]: row for row in pre.describe()}
    for name, (a_dim, g_dim) in {"0": (201, 150), "2": (151, 4), "3": (5, 3)}.items():
        choice = choose_method(a_dim, g_dim, 8, 8)
        assert rows[name]["method"] == choice.describe()
        assert (rows[name]["a_factor"], rows[name]["g_factor"]) == (choice.a, choice.g)
    assert rows["0"]["method"] == "smw(A=lowrank,G=lowrank)"
    assert rows["2"]["method"] == "smw(A=lowrank,G=dense)"
    assert rows["3"]["method"] == "eigen"
    assert pre.layers["3"].solver.name == "eigen"


def test_auto_with_decay_counts_the_running_rank() -> None:
    """With factor_decay 0.95 the bounded rank 90·m is too large: the layer stays dense."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 150)).double()
    pre = KFACPreconditioner(model, method="auto", factor_decay=0.95, **OPTIONS)
    model(torch.randn(8, 200, dtype=DT)).pow(2).sum().backward()
    pre.step()
    rank = default_max_rank(8, 0.95)
    assert pre.describe()[0]["method"] == choose_method(201, 150, rank, rank).describe() == "eigen"


# ---------------------------------------------------------------- conv reductions
def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten()).double()


def _conv_step(model: nn.Module, pre: KFACPreconditioner, step: int) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    conv = model[0]
    handles = [
        conv.register_forward_hook(lambda m, i, o: seen.update(x=i[0].detach())),
        conv.register_forward_hook(_grad_spy(seen)),
    ]
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(3, 2, 4, 5, generator=gen, dtype=DT)
    model.zero_grad()
    model(x).pow(2).sum(dim=1).mean().backward()
    pre.step()
    for handle in handles:
        handle.remove()
    return seen


def _positions(seed: int, batch: int, total: int, count: int) -> torch.Tensor:
    """The documented rule: CPU generator seeded seed + step, rand(B, T).argsort()[:, :s]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, total, generator=gen).argsort(dim=1)[:, :count]


@pytest.mark.parametrize("method", ["cholesky", "eigen", "smw"])
def test_conv_reduce_sum_through_preconditioner(method: str) -> None:
    model = _conv_model()
    pre = KFACPreconditioner(
        model, method=method, conv_reduction="sum", factor_decay=0.0, **OPTIONS
    )
    seen = _conv_step(model, pre, 0)
    patches = with_ones(conv_patches_by_hand(model[0], seen["x"]))  # (B, T, D)
    batch, total = patches.shape[:2]
    a_rows = patches.sum(dim=1) / total
    g_rows = (seen["g"] * batch).flatten(2).sum(dim=2)
    a_want = a_rows.T @ a_rows / batch
    g_want = g_rows.T @ g_rows / batch
    a, g = pre.factors()["0"]
    if method == "smw":  # rank B = 3 < 19 (A) but not < 3 (G)
        assert a.shape == (19, 3) and g.shape == (3, 3)
        a = a @ a.T
    torch.testing.assert_close(a, a_want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, g_want, rtol=1e-10, atol=1e-12)


def test_conv_subsample_through_preconditioner_uses_seed_plus_step() -> None:
    model = _conv_model()
    pre = KFACPreconditioner(
        model,
        method="cholesky",
        conv_reduction="subsample",
        subsample_positions=4,
        seed=7,
        factor_decay=0.0,
        **OPTIONS,
    )
    for step in range(2):
        seen = _conv_step(model, pre, step)
        patches = with_ones(conv_patches_by_hand(model[0], seen["x"]))
        batch, total, dim = patches.shape
        index = _positions(7 + step, batch, total, 4)
        a_rows = patches.gather(1, index.unsqueeze(2).expand(batch, 4, dim)).reshape(-1, dim)
        g_flat = (seen["g"] * batch).flatten(2).transpose(1, 2)  # (B, T, C)
        g_rows = g_flat.gather(1, index.unsqueeze(2).expand(batch, 4, 3)).reshape(-1, 3)
        a, g = pre.factors()["0"]
        torch.testing.assert_close(a, a_rows.T @ a_rows / (batch * 4), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            g, g_rows.T @ g_rows * total / (batch * 4), rtol=1e-10, atol=1e-12
        )


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("method", ["smw", "auto"])
def test_checkpoint_round_trip_reproduces_next_step(method: str) -> None:
    model = _mlp()
    pre = KFACPreconditioner(model, method=method, factor_decay=0.5, **OPTIONS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        _train_step(model, pre, step, opt)
    state = pre.state_dict()
    if method == "smw":
        assert state["layers"]["0"]["A"].shape == (41, 2 * BATCH)
        assert state["layers"]["0"]["plan"] == {"solver": "smw", "lowrank": {"A": 28, "G": 28}}
    else:  # bounded rank 28 > margin · d on every side: dense, eigen
        assert state["layers"]["0"]["plan"] == {"solver": "eigen", "lowrank": {}}
    clone = _mlp()
    clone.load_state_dict(model.state_dict())
    restored = KFACPreconditioner(clone, method=method, factor_decay=0.5, **OPTIONS)
    restored.load_state_dict(state)
    assert restored.describe() == pre.describe()
    _train_step(model, pre, 2)
    _train_step(clone, restored, 2)
    for got, want in zip(_grads(clone), _grads(model), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    if method == "smw":  # low-rank sides need a planning method to load into
        with pytest.raises(ValueError, match="low-rank"):
            KFACPreconditioner(_mlp(), method="cholesky", **OPTIONS).load_state_dict(state)
    bad = {**state, "layers": {**state["layers"]}}
    bad["layers"]["0"] = {**state["layers"]["0"], "A": torch.zeros(40, 8, dtype=DT)}
    with pytest.raises(ValueError, match=r"expected \(41, r\)" if method == "smw" else "expected"):
        KFACPreconditioner(_mlp(), method=method, **OPTIONS).load_state_dict(bad)


def test_dense_factors_do_not_load_into_decided_low_rank_sides() -> None:
    """A cholesky state (dense ``41 × 41`` A, no plan) loaded into an smw preconditioner
    whose sides the first step decided low-rank is refused: read as ``U`` it would make the
    factor ``A Aᵀ``. The same state loads before the first step (test above)."""
    dense = KFACPreconditioner(_mlp(), method="cholesky", **OPTIONS)
    model = _mlp()
    pre = KFACPreconditioner(model, method="smw", factor_decay=0.5, **OPTIONS)
    for p in (dense, pre):
        _train_step(p.model, p, 0)
    assert "A=lowrank" in pre.describe()[0]["method"]
    with pytest.raises(
        ValueError, match=r"shape \(41, 41\), a dense factor .*\(at most 28 columns\)"
    ):
        pre.load_state_dict(dense.state_dict())


def test_an_auto_states_eigen_decision_does_not_replace_smw() -> None:
    """``auto`` decided ``eigen`` (dense sides, test above); smw never decides ``eigen``:
    loaded into a fresh smw preconditioner, the layers are smw with dense sides, and the
    next step is the one from the same factors without the plans (the saved decision used
    to be installed, so the smw preconditioner ran eigen for the rest of the run). After
    smw's first step decided low-rank sides, those dense factors are refused."""
    model = _mlp()
    pre = KFACPreconditioner(model, method="auto", factor_decay=0.5, **OPTIONS)
    for step in range(2):
        _train_step(model, pre, step)
    state = pre.state_dict()
    assert state["layers"]["0"]["plan"]["solver"] == "eigen"
    planless = {
        **state,
        "layers": {
            n: {k: v for k, v in e.items() if k != "plan"} for n, e in state["layers"].items()
        },
    }
    runs = []
    for loaded in (state, planless):
        clone = _mlp()
        clone.load_state_dict(model.state_dict())
        smw = KFACPreconditioner(clone, **OPTIONS, method="smw", factor_decay=0.5)
        smw.load_state_dict(loaded)
        assert {d["method"] for d in smw.describe()} == {"smw(A=dense,G=dense)"}
        _train_step(clone, smw, 2)
        runs.append(_grads(clone))
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    stepped = KFACPreconditioner(_mlp(), **OPTIONS, method="smw", factor_decay=0.5)
    _train_step(stepped.model, stepped, 0)
    with pytest.raises(ValueError, match=r"\(41, 41\), a dense factor \(no plan this method"):
        stepped.load_state_dict(state)


def test_lowrank_sink_rejects_sums() -> None:
    from dkfac.solvers.lowrank.factor import LowRankRowsAccumulator

    with pytest.raises(TypeError, match="dense factor side"):
        LowRankRowsAccumulator().add_sum(torch.eye(2), 1.0)
    assert math.isclose(default_max_rank(4, 0.5), 28)


@pytest.mark.parametrize("method", ["smw", "auto"])
def test_dense_factors_load_into_an_undecided_deferred_solver(method: str) -> None:
    """A state of a solver that decides nothing (cholesky: dense factors, no plan) loads into
    a fresh ``smw``/``auto`` preconditioner, whose layers then decide dense sides (there are
    no rows to take a rank from); smw's next step equals cholesky's (the same factored
    solve). Loading used to end in ``KeyError: 'A'`` after the factors were installed."""
    model = _mlp()
    pre = KFACPreconditioner(model, method="cholesky", **OPTIONS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        _train_step(model, pre, step, opt)
    state = pre.state_dict()
    clone = _mlp()
    clone.load_state_dict(model.state_dict())
    restored = KFACPreconditioner(clone, method=method, **OPTIONS)
    restored.load_state_dict(state)
    saved = restored.state_dict()["layers"]
    assert all(not entry["plan"]["lowrank"] for entry in saved.values())
    _train_step(model, pre, 2)
    _train_step(clone, restored, 2)
    for got, want in zip(_grads(clone), _grads(model), strict=True):
        if method == "smw":
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert bool(torch.isfinite(got).all())
