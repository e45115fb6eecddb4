"""DistributedDataParallel's options and companions under dkfac (2 gloo ranks, float64).

Each rank trains on its half of every global batch with ``KFACOptimizer.for_model`` (or a
``KFACOptimizer`` over another inner optimizer). Oracles:

* ``static_graph``, ``gradient_as_bucket_view``, ``find_unused_parameters``: the serial
  run on the whole batch (the gradients DDP delivers are the global average, the factors
  K-FAC reduces are the global ones).
* communication hooks (fp16 compression, PowerSGD): they change the gradient DDP delivers,
  not K-FAC's statistics, so the run equals a serial run on the whole batch whose gradients
  are replaced by the ones the hook delivered (and the hook did change them).
* BatchNorm with ``broadcast_buffers`` on and off: each rank normalises with its own
  batch's moments, so the oracle is the same ranks without DDP, gradients averaged by hand.
* ``SyncBatchNorm``: registered as BatchNorm is (one process: it falls back to BatchNorm;
  distributed it needs a GPU).
* ``ZeroRedundancyOptimizer`` inside ``KFACOptimizer``: the serial run; a checkpoint by
  ZeRO's rule (``consolidate_state_dict`` on every rank, ``state_dict`` on one) resumes to
  the bit, and ``state_dict`` without it raises on every rank instead of hanging.
* ranks with different numbers of rows, under each strategy that averages the factors:
  the factors are the mean of each rank's own, as DDP's gradient is the mean of each
  rank's mean gradient (not the pooled rows').
* ``Join`` with uneven inputs: refused at the first step without
  ``throw_on_early_termination``; with it, every rank stops at the first exhausted one,
  equal to the serial run over the steps all ranks took.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import assert_ranks_match, average_gradients

DT = torch.float64
STEPS, ROWS, WORLD = 4, 8, 2
EXACT = {"rtol": 1e-10, "atol": 1e-12}


class _Net(nn.Module):
    """Linear, optional BatchNorm1d, Linear, Linear; ``use_b`` skips the middle layer."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8)
        self.bn: nn.Module = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.bn(self.a(x)))
        return self.c(h + torch.tanh(self.b(h)))


def _net(bn: bool = False) -> nn.Module:
    return _Net(bn).to(DT)


def _data(step: int, rank: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ROWS, 6, generator=gen, dtype=DT), torch.randint(
        0, 3, (ROWS,), generator=gen
    )


def _whole(step: int) -> tuple[Tensor, Tensor]:
    parts = [_data(step, r) for r in range(WORLD)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _serial(steps: int = STEPS, grads: list[list[Tensor]] | None = None) -> list[Tensor]:
    """``for_model`` on the whole batch; ``grads[s]``, if given, replace step ``s``'s
    gradients after the backward (the factors stay the whole batch's)."""
    model = _net()
    opt = KFACOptimizer.for_model(model, lr=0.01)
    for step in range(steps):
        x, y = _whole(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if grads is not None:
            for p, g in zip(model.parameters(), grads[step], strict=True):
                p.grad.copy_(g)  # type: ignore[union-attr]
        opt.step()
    return _params(model)


# -- DDP's own options ------------------------------------------------------------------

OPTIONS: dict[str, dict[str, Any]] = {
    "static_graph": {"static_graph": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph+bucket_view": {"static_graph": True, "gradient_as_bucket_view": True},
    "find_unused_parameters": {"find_unused_parameters": True, "gradient_as_bucket_view": True},
}


def _options_main(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, kwargs in OPTIONS.items():
        model = _net()
        ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
        opt = KFACOptimizer.for_model(ddp, lr=0.01)
        for step in range(STEPS):
            x, y = _data(step, rank)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        out[key] = {"params": _params(model), "overlap": opt.preconditioner.eager is not None}
    return out


def test_ddp_options_train_as_serial_kfac_on_the_whole_batch() -> None:
    results = run_distributed(_options_main, WORLD, timeout=90)
    want = _serial()
    for key, kwargs in OPTIONS.items():
        assert_ranks_match([r[key]["params"] for r in results], want, label=key, **EXACT)
        # overlap_comm="auto": on exactly when DDP promises every parameter every step
        assert results[0][key]["overlap"] is not kwargs.get("find_unused_parameters", False)


# -- communication hooks ------------------------------------------------------------------


def _hook_main(rank: int, world: int, hook: str) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    model = _net()
    ddp = nn.parallel.DistributedDataParallel(model)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:  # rank-1 factors from step 2 on (error feedback needs a start of at least 2)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = KFACOptimizer.for_model(ddp, lr=0.01)
    delivered = []
    for step in range(STEPS):
        x, y = _data(step, rank)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        delivered.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        opt.step()
    return {"params": _params(model), "delivered": delivered}


@pytest.mark.parametrize("hook", ["fp16", "powerSGD"])
def test_a_comm_hook_changes_the_gradient_kfac_preconditions_not_its_factors(hook: str) -> None:
    """K-FAC preconditions the averaged gradient the hook delivered (fp16-rounded, or
    PowerSGD's rank-1 approximation) with the whole batch's factors: equal to serial K-FAC
    whose gradients are replaced by the delivered ones."""
    results = run_distributed(_hook_main, WORLD, hook, timeout=90)
    delivered = results[0]["delivered"]
    for result in results:
        for got, want in zip(result["delivered"], delivered, strict=True):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert_ranks_match(
        [r["params"] for r in results], _serial(grads=delivered), label=hook, **EXACT
    )
    # The hook did change the gradients: the run is not the serial one.
    serial = _serial()
    gap = max(float((p - q).abs().max()) for p, q in zip(results[0]["params"], serial, strict=True))
    assert gap > 1e-8, hook
    if hook == "fp16":  # close to it: float16's rounding of the averaged gradient
        assert gap < 1e-2, gap
    assert all(bool(torch.isfinite(p).all()) for p in results[0]["params"])


# -- BatchNorm and DDP's buffers ----------------------------------------------------------


def _bn_main(rank: int, world: int) -> dict[str, Any]:
    """The BatchNorm model under DDP with ``broadcast_buffers`` on and off, and without DDP
    (gradients averaged by hand); per run the weights and the running statistics."""
    out: dict[str, Any] = {}
    for key in ("broadcast", "local", "by hand"):
        model = _net(bn=True)
        wrapped: nn.Module = model
        if key != "by hand":
            wrapped = nn.parallel.DistributedDataParallel(
                model, broadcast_buffers=key == "broadcast"
            )
        opt = KFACOptimizer.for_model(wrapped, lr=0.01, strategy="replicated")
        for step in range(STEPS):
            x, y = _data(step, rank)
            opt.zero_grad()
            F.cross_entropy(wrapped(x), y).backward()
            if key == "by hand":
                average_gradients(model, world)
            opt.step()
        out[key] = {"params": _params(model), "running_mean": model.bn.running_mean.clone()}
    return out


def test_batchnorm_under_ddp_equals_the_ranks_averaged_by_hand() -> None:
    """Each rank normalises with its own batch (no SyncBatchNorm), with or without DDP's
    buffer broadcast, which only moves the running statistics."""
    results = run_distributed(_bn_main, WORLD, timeout=90)
    for key in ("broadcast", "local"):
        want = results[0]["by hand"]["params"]
        assert_ranks_match([r[key]["params"] for r in results], want, label=key, **EXACT)
    # Broadcast: every forward starts from rank 0's statistics, so after one more local
    # update the ranks still differ (each updates them from its own batch), as without.
    means = [r["broadcast"]["running_mean"] for r in results]
    assert not torch.equal(means[0], means[1])


def test_sync_batchnorm_is_registered_as_batchnorm_and_trains_alike_on_one_process() -> None:
    """``convert_sync_batchnorm`` keeps the names; SyncBatchNorm gets the unit-wise block.
    On one process it normalises as BatchNorm does, so the run is the BatchNorm run."""
    plain = _net(bn=True)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(_net(bn=True))
    assert isinstance(synced.bn, nn.SyncBatchNorm)
    runs = []
    for model in (plain, synced):
        opt = KFACOptimizer.for_model(model, lr=0.01)
        rows = {r["name"]: (r["block"], r["method"]) for r in opt.preconditioner.describe()}
        assert rows["bn"] == ("BatchNormBlock", "unitwise")
        for step in range(STEPS):
            x, y = _whole(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        runs.append((rows, _params(model)))
    assert runs[0][0] == runs[1][0]
    for got, want in zip(runs[1][1], runs[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- ZeroRedundancyOptimizer ---------------------------------------------------------------


def _zero_build(wrap: bool) -> tuple[nn.Module, nn.Module, KFACOptimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _net()
    wrapped = nn.parallel.DistributedDataParallel(model) if wrap else model
    pre = KFACPreconditioner(wrapped, strategy="mem-opt", kl_clip=None, inverse_update_interval=2)
    params = model.parameters()
    inner: torch.optim.Optimizer
    if wrap:
        inner = ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
        )
    else:
        inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return model, wrapped, KFACOptimizer(inner, pre)


def _zero_train(wrapped: nn.Module, opt: KFACOptimizer, steps: range, rank: int | None) -> None:
    for step in steps:
        x, y = _whole(step) if rank is None else _data(step, rank)
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()


def _zero_main(rank: int, world: int) -> dict[str, Any]:
    model, ddp, opt = _zero_build(wrap=True)
    _zero_train(ddp, opt, range(3), rank)
    refused = []
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=r\) on every rank"):
        opt.state_dict()  # every rank, no collective: no rank waits
    opt.consolidate_state_dict(to=0)
    if rank == 0:  # a copy, as torch.save makes: the state holds the live momentum buffers
        state = copy.deepcopy(opt.state_dict())
    else:
        with pytest.raises(RuntimeError, match="consolidated on rank 0, not on this one"):
            opt.state_dict()
        refused.append(rank)
        state = None
    weights = copy.deepcopy(model.state_dict())
    box = [state]
    dist.broadcast_object_list(box, src=0)
    _zero_train(ddp, opt, range(3, 5), rank)
    model2, ddp2, opt2 = _zero_build(wrap=True)
    model2.load_state_dict(weights)
    opt2.load_state_dict(box[0])  # every rank, as ZeRO's
    _zero_train(ddp2, opt2, range(3, 5), rank)
    return {"params": _params(model), "resumed": _params(model2), "refused": refused}


def test_zero_redundancy_optimizer_inside_trains_as_serial_and_checkpoints() -> None:
    results = run_distributed(_zero_main, WORLD, timeout=90)
    model, wrapped, opt = _zero_build(wrap=False)
    _zero_train(wrapped, opt, range(5), None)
    assert_ranks_match([r["params"] for r in results], _params(model), label="zero", **EXACT)
    assert_ranks_match(
        [r["resumed"] for r in results], results[0]["params"], label="resumed", rtol=0, atol=0
    )
    assert results[1]["refused"] == [1]


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _consolidated_main(rank: int, world: int) -> bool | None:
    """Any inner optimizer: ``consolidate_state_dict(to=0)`` on every rank, then
    ``state_dict()`` on rank 0 alone (as Lightning and Fabric save an optimizer that has the
    method), under ``mem-opt`` (the factors gathered from their owners)."""
    model = _net()
    ddp = nn.parallel.DistributedDataParallel(model)
    pre = KFACPreconditioner(ddp, strategy="mem-opt", kl_clip=None, inverse_update_interval=2)
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), pre)
    _zero_train(ddp, opt, range(3), rank)
    everywhere = copy.deepcopy(opt.state_dict())  # gathered on every rank
    opt.consolidate_state_dict(to=0)
    if rank != 0:
        return None
    return _same_state(copy.deepcopy(opt.state_dict()), everywhere)  # no collective here


def test_consolidate_state_dict_gathers_on_one_rank_for_any_inner_optimizer() -> None:
    assert run_distributed(_consolidated_main, WORLD, timeout=60)[0] is True
    opt = KFACOptimizer.for_model(_net())
    with pytest.raises(TypeError, match="to must be a rank"):
        opt.consolidate_state_dict(to="0")  # type: ignore[arg-type]


# -- Join with uneven inputs ---------------------------------------------------------------


def _join_main(rank: int, world: int, throw: bool, find_unused: bool) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join

    model = _net()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    opt = KFACOptimizer.for_model(ddp, lr=0.01)
    done, error = 0, ""
    try:
        with Join([ddp], throw_on_early_termination=throw):
            for step in range(3 - rank):  # rank 1 has one batch fewer
                x, y = _data(step, rank)
                opt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                done += 1
    except RuntimeError as err:
        error = str(err)
    return {"done": done, "error": error, "params": _params(model)}


@pytest.mark.parametrize("find_unused", [False, True], ids=["overlapped", "agreed"])
def test_join_without_throw_is_refused_at_the_first_step_on_every_rank(find_unused: bool) -> None:
    """A joined rank would shadow DDP's collectives, not K-FAC's: a crash or a hang."""
    results = run_distributed(_join_main, WORLD, False, find_unused, timeout=30)
    for result in results:
        assert result["done"] == 0
        assert "throw_on_early_termination=True" in result["error"]


def test_join_with_throw_stops_every_rank_at_the_first_exhausted_one() -> None:
    results = run_distributed(_join_main, WORLD, True, False, timeout=30)
    assert [r["done"] for r in results] == [2, 2]
    assert all("exhausted" in r["error"] for r in results)
    assert_ranks_match([r["params"] for r in results], _serial(steps=2), label="join", **EXACT)


# -- ranks with different numbers of rows ---------------------------------------------------


def _uneven_rows(rank: int) -> tuple[Tensor, Tensor]:
    """Rank 0's 8 rows, rank 1's first 4 (a bucketed or unpadded last batch)."""
    x, y = _data(0, rank)
    rows = ROWS // (rank + 1)
    return x[:rows], y[:rows]


def _factors_after_one_step(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Any]:
    pre = KFACPreconditioner(model, method="eigen")
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return {name: [t.clone() for t in pair] for name, pair in pre.factors().items()}


def _uneven_main(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """One step of :func:`_uneven_rows` under ``options``' strategy: the factors this rank
    keeps (an owner's only, where the strategy shards them)."""
    model = _net()
    spngd = options.get("strategy") == "spngd"  # reduces the gradients itself: no DDP
    wrapped = model if spngd else nn.parallel.DistributedDataParallel(model)
    pre = KFACPreconditioner(wrapped, method="eigen", **options)
    x, y = _uneven_rows(rank)
    F.cross_entropy(wrapped(x), y).backward()
    pre.step()
    return {name: [t.clone() for t in pair] for name, pair in pre.factors().items()}


UNEVEN_STRATEGIES = {
    "replicated": {"strategy": "replicated"},  # the overlapped reduction (DDP's default)
    "replicated-after-backward": {"strategy": "replicated", "overlap_comm": "off"},
    "kaisa": {"strategy": "kaisa", "grad_worker_fraction": 0.5},
    "mem-opt": {"strategy": "mem-opt"},
    "spngd": {"strategy": "spngd"},
}


@pytest.mark.parametrize("options", UNEVEN_STRATEGIES.values(), ids=UNEVEN_STRATEGIES.keys())
def test_ranks_with_different_rows_weigh_alike_in_the_factors_as_in_ddps_gradient(
    options: dict[str, Any],
) -> None:
    """Rank 0 with 8 rows and rank 1 with 4: the factors are the mean of each rank's own
    factors (each rank's mean counting once, as in DDP's averaged gradient), not those of
    the 12 rows together, in which rank 0's would weigh twice; under every strategy that
    averages the factors (each owner's, where they are sharded)."""
    results = run_distributed(_uneven_main, WORLD, options, timeout=90)
    own = [_factors_after_one_step(_net(), *_uneven_rows(r)) for r in range(WORLD)]
    rows = [_uneven_rows(r) for r in range(WORLD)]
    pooled = _factors_after_one_step(
        _net(), torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])
    )
    kept = {name: pair for factors in results for name, pair in factors.items()}
    assert set(kept) == set(own[0])  # every layer's factors are on some rank
    for factors in results:
        for name, (a, g) in factors.items():
            torch.testing.assert_close(a, (own[0][name][0] + own[1][name][0]) / 2, **EXACT)
            torch.testing.assert_close(g, (own[0][name][1] + own[1][name][1]) / 2, **EXACT)
            assert not torch.allclose(a, pooled[name][0], **EXACT), name
