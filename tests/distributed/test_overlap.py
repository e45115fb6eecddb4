"""Phase-1 traffic launched from the backward hooks (``overlap_comm``) against the plain path.

Oracles: the parameters after several steps equal those of ``overlap_comm="off"`` and of a
single process on the global batch (tests/strategy_cases.py's model and data, with two
micro-batches per step and factors every other step); the ledger's bytes per kind are the
same with and without overlap; and a spy in the backward sees exactly the bytes of the
layers the backward has already passed, launched before ``loss.backward()`` returns.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACConfig, KFACPreconditioner
from dkfac.app.cli import parse_args
from dkfac.app.runconfig import kfac_config_from_args
from dkfac.engine.eager import resolve_overlap
from dkfac.engine.refresh import AdaptiveRefresh
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import (
    Hooks,
    Run,
    assert_factors_close,
    assert_ranks_match,
    assert_tensors_close,
    train_sharded,
)
from tests.strategy_cases import DIMS, OPTIONS, global_batch, make_model

F64 = 8
STEPS = 4
MICRO = 2
WORLD = 2
BASE = {**OPTIONS, "factor_update_interval": 2}
# Layers "6" and "3" are behind the backward when it reaches layer "0"'s output gradient.
LATE = ("6", "3")
CASES = [  # (strategy, grad_worker_fraction, ddp)
    ("replicated", 1.0, True),
    ("kaisa", 0.5, True),
    ("mem-opt", 1.0, True),
    ("dp", 1.0, True),
    ("spngd", 1.0, False),
]
SCALED = [CASES[0], CASES[-1]]  # also run with a GradScaler


def _factor_bytes(names: tuple[str, ...], packed: bool) -> int:
    dims = [d for name in names for d in DIMS[name]]
    return sum((d * (d + 1) // 2 if packed else d * d) for d in dims) * F64


def _grad_bytes(names: tuple[str, ...]) -> int:
    return sum(a * g for name, (a, g) in DIMS.items() if name in names) * F64


# ---------------------------------------------------------------- pure resolution
def test_auto_resolves_on_only_where_ddp_guarantees_every_layer_ran() -> None:
    assert resolve_overlap("auto", world_size=2, ddp_find_unused=False)
    assert not resolve_overlap("auto", world_size=2, ddp_find_unused=True)
    assert not resolve_overlap("auto", world_size=4, ddp_find_unused=None)  # not DDP
    assert not resolve_overlap("auto", world_size=1, ddp_find_unused=False)  # nothing to overlap
    for world in (1, 2):
        for unused in (None, True, False):
            assert resolve_overlap("on", world_size=world, ddp_find_unused=unused)
            assert not resolve_overlap("off", world_size=world, ddp_find_unused=unused)
    with pytest.raises(ValueError, match="overlap_comm"):
        resolve_overlap("yes", world_size=2, ddp_find_unused=False)
    with pytest.raises(ValueError, match="world_size"):
        resolve_overlap("on", world_size=0, ddp_find_unused=None)


def test_config_field_and_cli_flag() -> None:
    assert KFACConfig().overlap_comm == "auto"
    with pytest.raises(ValueError, match="overlap_comm must be one of"):
        KFACConfig(overlap_comm="maybe")  # type: ignore[arg-type]
    args = parse_args(["train", "--optimizer", "kfac", "--overlap-comm", "off"])
    assert kfac_config_from_args(args).overlap_comm == "off"
    assert kfac_config_from_args(parse_args(["train"])).overlap_comm == "auto"
    with pytest.raises(SystemExit):
        parse_args(["train", "--overlap-comm", "sometimes"])


# ---------------------------------------------------------------- one process
def _one_process(mode: str) -> Run:
    return train_sharded(
        None,
        1,
        micro=MICRO,
        model_fn=make_model,
        batch_fn=functools.partial(global_batch, world_size=1),
        steps=STEPS,
        overlap_comm=mode,
        **BASE,
    )


def test_one_process_overlap_on_matches_off() -> None:
    """The eager machinery (hooks, buckets, leftovers) on one rank changes nothing."""
    on, off = _one_process("on"), _one_process("off")
    assert on.pre.eager is not None and off.pre.eager is None
    assert_tensors_close(on.params(), off.params(), label="on vs off", rtol=0, atol=0)
    assert_factors_close(on.factors(), off.factors(), label="on vs off", rtol=0, atol=0)


def test_on_raises_for_a_skipped_layer_and_extra_backward() -> None:
    model = make_model()
    pre = KFACPreconditioner(model, overlap_comm="on", accumulation_steps=1)
    x, y = global_batch(0, 1)
    # The last layer is skipped: its statistics and gradient are missing on this rank.
    model[:6](x).sum().backward()
    with pytest.raises(RuntimeError, match=r"layer 6 .*overlap_comm=\"off\""):
        pre.step()
    model = make_model()
    pre = KFACPreconditioner(model, overlap_comm="on", accumulation_steps=1)
    for _ in range(2):  # one backward more than accumulation_steps
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="more backward passes than accumulation_steps"):
        pre.step()


# ---------------------------------------------------------------- two ranks
def _by_kind(run: Run) -> dict[str, int]:
    """The ledger's bytes by kind so far in the current step."""
    return dict(run.pre.comm.ledger.stats()["current_step"]["by_kind"])


def _train(
    rank: int | None,
    strategy: str,
    *,
    fraction: float = 1.0,
    ddp: bool = False,
    mode: str = "off",
    spy: bool = False,
    scaled: bool = False,
) -> dict[str, Any]:
    """``rank``'s shard of 2 in ``MICRO`` micro-batches (``None``: the serial twin).

    ``spy``: one bucket per layer, and the ledger read whenever the backward reaches layer
    0's output gradient. Before every ``pre.step()`` the ledger is read too.
    """
    seen: list[dict[str, int]] = []
    before_step: list[dict[str, int]] = []

    def watch_layer_0(run: Run) -> None:
        def watch(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda _grad: seen.append(_by_kind(run)))

        run.model[0].register_forward_hook(watch)

    run = train_sharded(
        rank,
        WORLD,
        micro=MICRO,
        model_fn=make_model,
        batch_fn=functools.partial(global_batch, world_size=WORLD),
        steps=STEPS,
        ddp=ddp,
        grad_scale=2.0**10 if scaled else None,
        hooks=Hooks(
            setup=watch_layer_0 if spy else None,
            after_backward=lambda run: before_step.append(_by_kind(run)),
        ),
        strategy=strategy,
        grad_worker_fraction=fraction,
        overlap_comm=mode,
        bucket_bytes=1 if spy else 25 * 2**20,
        **BASE,
    )
    stats = run.pre.comm_stats()
    return {
        "params": run.params(),
        "per_step": [s["by_kind"] for s in stats["per_step"]],
        "by_collective": stats["by_collective"],
        "before_step": before_step,
        "spy": seen,
        "eager": run.pre.eager is not None,
    }


def _rank_main(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for strategy, fraction, ddp in CASES:
        config = {"fraction": fraction, "ddp": ddp}
        for mode in ("on", "off", "auto"):
            out[(strategy, mode)] = _train(rank, strategy, mode=mode, **config)
        out[(strategy, "spy")] = _train(rank, strategy, mode="on", spy=True, **config)
    for strategy, fraction, ddp in SCALED:
        for mode in ("on", "off"):
            run = _train(rank, strategy, fraction=fraction, ddp=ddp, mode=mode, scaled=True)
            out[(strategy, f"scaled-{mode}")] = run
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[Any, Any]]:
    """Every case, mode and spy in one spawn of 2 ranks."""
    return run_distributed(_rank_main, WORLD, timeout=120)


@pytest.fixture(scope="module")
def serial() -> list[torch.Tensor]:
    """One process on the global batch (every rank's micro-batch k is its micro-batch k)."""
    return _train(None, "replicated")["params"]


def _assert_ranks_agree(results: list[dict[Any, Any]], keys: list[Any]) -> None:
    """Every rank ends with the same parameters, bit for bit."""
    for key in keys:
        params = [res[key]["params"] for res in results]
        assert_ranks_match(params, params[0], label=f"{key}: ranks disagree", rtol=0, atol=0)


@pytest.mark.parametrize("strategy,fraction,ddp", CASES, ids=[c[0] for c in CASES])
def test_two_ranks_overlap_matches_off_serial_and_ledger(
    strategy: str,
    fraction: float,
    ddp: bool,
    two_ranks: list[dict[Any, Any]],
    serial: list[torch.Tensor],
) -> None:
    packed = strategy == "spngd"
    factor_steps = [step % 2 == 0 for step in range(STEPS)]
    for rank, res in enumerate(two_ranks):
        on, off, auto = (res[(strategy, m)] for m in ("on", "off", "auto"))
        label = f"{strategy}, rank {rank}"
        assert on["eager"] and not off["eager"], label
        assert auto["eager"] == ddp, label  # auto: on for DDP (find_unused=False) only
        assert_tensors_close(on["params"], off["params"], label=label, rtol=1e-12, atol=1e-14)
        if strategy != "dp":  # dp's factors are local: not the global-batch update
            assert_tensors_close(on["params"], serial, label=label, rtol=1e-9, atol=1e-11)
        # Same bytes per kind and collective, step by step (spngd: fused, same split).
        assert on["per_step"] == off["per_step"], label
        assert on["by_collective"] == off["by_collective"], label
        assert len(on["per_step"]) == STEPS
        # Before pre.step(): "on" has launched every statistic (and spngd gradient).
        all_layers = tuple(DIMS)
        for step, factor_step in enumerate(factor_steps):
            expect_f = _factor_bytes(all_layers, packed) if factor_step and strategy != "dp" else 0
            expect_g = _grad_bytes(all_layers) if strategy == "spngd" else 0
            assert on["before_step"][step]["factors"] == expect_f, (label, step)
            assert on["before_step"][step]["gradients"] == expect_g, (label, step)
            assert off["before_step"][step] == dict.fromkeys(off["before_step"][step], 0)
            assert on["per_step"][step]["factors"] == expect_f, (label, step)
        # The spy at layer 0's output gradient, during the backward of each micro-batch:
        # nothing on the first micro-batch, layers 6 and 3 already launched on the last.
        spy = res[(strategy, "spy")]["spy"]
        assert len(spy) == STEPS * MICRO, label
        for step, factor_step in enumerate(factor_steps):
            first, last = spy[step * MICRO], spy[(step + 1) * MICRO - 1]
            assert first["factors"] == first["gradients"] == 0, (label, step)
            late_f = _factor_bytes(LATE, packed) if factor_step and strategy != "dp" else 0
            late_g = _grad_bytes(LATE) if strategy == "spngd" else 0
            assert last["factors"] == late_f, (label, step)
            assert last["gradients"] == late_g, (label, step)
        if strategy in ("replicated", "spngd"):  # something to overlap on factor steps
            assert spy[MICRO - 1]["factors"] > 0, label
    _assert_ranks_agree(two_ranks, [(strategy, m) for m in ("on", "off", "auto", "spy")])


@pytest.mark.parametrize("strategy", [c[0] for c in SCALED])
def test_two_ranks_overlap_with_grad_scaler_matches_serial(
    strategy: str, two_ranks: list[dict[Any, Any]], serial: list[torch.Tensor]
) -> None:
    """GradScaler: G scaled after the reduction."""
    packed = strategy == "spngd"
    for rank, res in enumerate(two_ranks):
        on, off = res[(strategy, "scaled-on")], res[(strategy, "scaled-off")]
        label = f"{strategy} with GradScaler, rank {rank}"
        # Powers of two: exact.
        assert_tensors_close(on["params"], serial, label=label, rtol=1e-9, atol=1e-11)
        assert on["per_step"] == off["per_step"], label
        # spngd: gradients wait for unscale_() in step(); statistics still overlap.
        assert on["before_step"][0]["factors"] == _factor_bytes(tuple(DIMS), packed)
        assert on["before_step"][0]["gradients"] == 0, label
    _assert_ranks_agree(two_ranks, [(strategy, m) for m in ("scaled-on", "scaled-off")])


# ---------------------------------------------------------------- host synchronisations
def _syncs_in_step(depth: int, mode: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """Host reads of tensor values (item, tolist, float/int/bool) in one non-inverse step."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(4, 4), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(4, 3)).double()
    pre = KFACPreconditioner(
        model, overlap_comm=mode, refresh="adaptive", inverse_update_interval=10, kl_clip=1e-3
    )
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    for step in range(2):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == 0:  # the inverse step: solvers check each decomposition (not counted)
            pre.step(lr=0.1)
    counter = {"n": 0}
    for method in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, method)

        def counted(self: torch.Tensor, *args: Any, _original: Any = original) -> Any:
            counter["n"] += 1
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, method, counted)
    pre.step(lr=0.1)
    monkeypatch.undo()
    assert pre.refresh_stats()["refreshed"] > 0  # the counted step did refresh statistics
    return counter["n"]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_host_syncs_per_step_do_not_grow_with_layers(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finite flags, KL-clip scale, adaptive refresh: a fixed number of syncs per step."""
    shallow = _syncs_in_step(2, mode, monkeypatch)
    deep = _syncs_in_step(6, mode, monkeypatch)
    assert 0 < shallow == deep, (shallow, deep)


def test_adaptive_record_many_equals_record_one_by_one() -> None:
    gen = torch.Generator().manual_seed(3)
    one, many = AdaptiveRefresh(threshold=0.1), AdaptiveRefresh(threshold=0.1)
    for step in range(4):
        items: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []
        for i in range(5):
            old = torch.randn(3, 3, generator=gen) if step else None
            small = torch.randn(3, 3, generator=gen) * (0.01 if i % 2 else 1.0)
            new = small if old is None else old + small
            items.append((f"s{i}", old, new))
        items.append(("zero", torch.zeros(2) if step else None, torch.zeros(2)))
        for key, old, new in items:
            one.record(key, step, old, new)
        many.record_many(step, items)
        assert many.state_dict() == one.state_dict()
    intervals = {one.interval(f"s{i}") for i in range(5)}
    assert len(intervals) > 1  # both branches (doubled and halved) were taken


def test_buckets_launch_during_backward_with_a_frozen_bias() -> None:
    """Readiness counts only parameters that get gradients (a frozen bias never fires)."""
    model = make_model()
    model[6].bias.requires_grad_(False)
    pre = KFACPreconditioner(model, overlap_comm="on", bucket_bytes=1)
    assert pre.eager is not None and pre.eager.buckets == [["6"], ["3"], ["0"]]
    x, y = global_batch(0, 1)
    F.cross_entropy(model(x), y).backward()
    assert pre.eager.launched == 3  # all launched by the hooks, before step()
    pre.step(lr=0.1)
    assert sorted(pre.factors()) == sorted(DIMS)


def _synced_twice_main(rank: int, world: int) -> str:
    """DDP accumulation of two micro-batches without ``no_sync()`` under the default
    ``overlap_comm`` (on with DDP): the second synchronised backward is refused."""
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(make_model())
    pre = KFACPreconditioner(model)
    x, y = global_batch(0, world)
    for half in (x.chunk(2)[rank], x.chunk(2)[rank]):
        F.cross_entropy(model(half), y.chunk(2)[rank]).backward()
    try:
        pre.step()
    except RuntimeError as err:
        return str(err)
    return ""


def test_ddp_accumulation_without_no_sync_is_refused_with_the_way_out() -> None:
    """The message said "before step()" twice and not what to do; it now names both ways:
    ``no_sync()`` on all micro-batches but the last, or ``overlap_comm="off"``."""
    for message in run_distributed(_synced_twice_main, 2, timeout=120):
        assert "more synchronised backward passes than one" in message
        assert "model.no_sync()" in message and 'overlap_comm="off"' in message
        assert message.count("before step()") == 1
