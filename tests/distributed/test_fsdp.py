"""Models sharded with FSDP2 / HSDP (``fully_shard``) train exactly as serial K-FAC.

``fully_shard`` on every block, then on the root (with and without
``reshard_after_forward``), the model handed to the preconditioner as a DDP model would be:
after several steps with refreshes the weights equal the serial twin's on the same global
batch (float64, 1e-9), for ``eigen``, ``cholesky``, ``smw`` and ``eigen_adam`` and the
``replicated``, ``mem-opt`` and ``kaisa`` strategies (and with a bfloat16
``MixedPrecisionPolicy``, within its rounding), with Conv2d, Linear, LayerNorm,
Embedding (an unbatched position lookup too), MultiheadAttention and HF Conv1D layers, on
2 and 4 ranks; HSDP (a 2 × 2 mesh, replicate × shard) on 4. ``dp`` (owner-local factors,
another estimator) equals serial where it should: every rank given the same rows.

BatchNorm (unit-wise blocks, ``γ`` and ``β`` DTensors cut over the ranks): a rank's
BatchNorm normalises with its own batch's moments and keeps its own running statistics, as
under DDP without ``SyncBatchNorm`` (FSDP2 neither shards nor synchronises buffers). So with
every rank given the same rows the run is the serial run on those rows, running statistics
included; with different rows it is the DDP run (buffers not broadcast), rank by rank.

Under ``mem-opt``, ``dp`` and ``kaisa`` with a fraction below 1 (the owner exchange: rows
to the ranks that precondition a layer, each rank's rows of the results back) they equal
serial too, on 2 and 4 ranks and HSDP, with Linear, Conv2d, attention, embeddings and HF
Conv1D layers.

The gradient exchange is exact in bytes: under ``replicated``, per step, one all-gather per
bucket of every rank's padded rows (``ceil(rows / P)`` of each sharded weight and bias,
float64), on the ledger as ``"gradients"``; under the owner exchange, the bytes of its pure
formula (:func:`~dkfac.distributed.shard_plan.exchange_bytes`) as ``"gradients"`` and
``"preconditioned"``, all in ``all_to_all``. Every configuration of a world size runs inside
one spawned process group (spawning is the slow part). Bad models are refused at
construction with
an error naming the parameter and what is allowed.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from dkfac import KFACPreconditioner
from dkfac.distributed.assignment import serving_worker
from dkfac.distributed.shard_plan import LayerRows, ShardedParam, exchange_bytes
from dkfac.engine.layer_state import LayerState
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import (
    assert_ranks_match,
    assert_tensors_close,
    once_per_key,
    train_sharded,
)
from tests.strategy_cases import OPTIONS, global_batch, make_bn_model, make_model
from tests.transformer_cases import gpt_batch, make_gpt

STEPS = 4  # inverse_update_interval=2: refreshes at steps 0 and 2
TOL = {"rtol": 1e-9, "atol": 1e-11}
MOMENTS = {"basis_refresh": "power", "moment_carry": "rotate", "moment_eps": 1e-6}
HALF = {"grad_worker_fraction": 0.5}
LOCAL = {"shard_exchange": "local"}
# the orthogonalised updates divided by their inputs' RMS, averaged over the ranks
INPUT_RMS = {"orthogonal_layers": ("Conv2d", "^3$"), "orthogonal_input_rms": True}


def _shard_children(reshard: bool, hsdp: bool, bf16: bool, model: nn.Module) -> None:
    """``fully_shard`` on every child holding parameters, then on the root; with ``hsdp``
    on a 2-D mesh (replicate over 2 groups × shard within each); with ``bf16`` under a
    ``MixedPrecisionPolicy`` of bfloat16 parameters and float32 gradient reduction."""
    mesh = None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw: dict[str, Any] = (
        {"reshard_after_forward": reshard, "mp_policy": policy}
        if bf16
        else {"reshard_after_forward": reshard}
    )
    if hsdp:
        world = torch.distributed.get_world_size()
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    blocks = getattr(model, "blocks", None)
    children = list(blocks) if isinstance(blocks, nn.Sequential) else list(model.children())
    for child in children:
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


BN_LAYERS = {"1", "5"}  # make_bn_model's BatchNorm2d(3) and BatchNorm1d(6): cut 2 + 1, 3 + 3


def _make_hf() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), Conv1D(5, 32), nn.Tanh(), Conv1D(3, 5)).double()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, int], Any]]] = {
    "cnn": (make_model, lambda step, world: global_batch(step, world)),
    "gpt": (make_gpt, lambda step, world: gpt_batch(step, 4 * world)),
    "hf": (_make_hf, lambda step, world: global_batch(step, world)),
    # 64 rows: full-rank factors, so Adam in the eigenbasis does not depend on how rounding
    # picks a basis inside a degenerate eigenspace (tests/engine/test_moments_dist.py)
    "cnn64": (make_model, lambda step, world: global_batch(step, 8)),
    "gpt32": (lambda: make_gpt().float(), lambda step, world: gpt_batch(step, 4 * world)),
    # every rank the same 8 rows (the global batch their copies): dp's owner-local factors
    # are then the serial ones
    "cnn-same": (make_model, lambda step, world: _repeated(global_batch(step, 1), world)),
    "bn": (make_bn_model, lambda step, world: global_batch(step, world)),
    "bn-same": (make_bn_model, lambda step, world: _repeated(global_batch(step, 1), world)),
}


def _repeated(batch: tuple[torch.Tensor, torch.Tensor], world: int) -> Any:
    x, y = batch
    return x.repeat(world, 1, 1, 1), y.repeat(world)


Case = tuple[str, dict[str, Any]]  # (model, options)
CASES: dict[int, dict[str, Case]] = {
    2: {
        "cnn-eigen": ("cnn", {"method": "eigen"}),
        "cnn-eigen-kept-unsharded": ("cnn", {"method": "eigen", "reshard": False}),
        "cnn-eigen-micro2": ("cnn", {"method": "eigen", "micro": 2}),
        "cnn-cholesky-mem-opt": ("cnn", {"method": "cholesky", "strategy": "mem-opt"}),
        "cnn-smw-kaisa": ("cnn", {"method": "smw", "strategy": "kaisa"}),
        "cnn-same-eigen-dp": ("cnn-same", {"method": "eigen", "strategy": "dp"}),
        "cnn-eigen_adam": ("cnn64", {"method": "eigen_adam", **MOMENTS}),
        "gpt-eigen": ("gpt", {"method": "eigen", "damping": 1e-3}),
        "hf-eigen": ("hf", {"method": "eigen"}),
        "gpt32-eigen-bf16": ("gpt32", {"method": "eigen", "damping": 1e-3, "bf16": True}),
        "bn-same-eigen": ("bn-same", {"method": "eigen"}),
        "bn-same-cholesky-mem-opt": ("bn-same", {"method": "cholesky", "strategy": "mem-opt"}),
        "bn-eigen": ("bn", {"method": "eigen"}),
        "bn-eigen-ddp": ("bn", {"method": "eigen", "ddp": {"broadcast_buffers": False}}),
        # the owner exchange: rows to the ranks that precondition, results' rows back
        "cnn-eigen-mem-opt": ("cnn", {"method": "eigen", "strategy": "mem-opt"}),
        "cnn-eigen-kaisa-half": ("cnn", {"method": "eigen", "strategy": "kaisa", **HALF}),
        "gpt-eigen-mem-opt": ("gpt", {"method": "eigen", "damping": 1e-3, "strategy": "mem-opt"}),
        "hf-cholesky-mem-opt": ("hf", {"method": "cholesky", "strategy": "mem-opt"}),
        # shard_exchange="local": each rank its own rows, its own diagonal block of G
        "cnn-eigen-local": ("cnn", {"method": "eigen", **LOCAL}),
        "cnn64-eigen_adam-local": ("cnn64", {"method": "eigen_adam", **MOMENTS, **LOCAL}),
        "gpt-eigen-local": ("gpt", {"method": "eigen", "damping": 1e-3, **LOCAL}),
        "cnn-eigen_adam-mem-opt": (
            "cnn64",
            {"method": "eigen_adam", "strategy": "mem-opt", **MOMENTS},
        ),
        "cnn64-eigen_adam-input-rms": ("cnn64", {"method": "eigen_adam", **MOMENTS, **INPUT_RMS}),
        "cnn64-eigen_adam-input-rms-ddp": (
            "cnn64",
            {"method": "eigen_adam", **MOMENTS, **INPUT_RMS, "ddp": True},
        ),
    },
    4: {
        "cnn-eigen": ("cnn", {"method": "eigen"}),
        "cnn-cholesky-mem-opt": ("cnn", {"method": "cholesky", "strategy": "mem-opt"}),
        "gpt-eigen": ("gpt", {"method": "eigen", "damping": 1e-3}),
        "cnn-eigen-hsdp": ("cnn", {"method": "eigen", "hsdp": True}),
        "gpt-cholesky-hsdp-mem-opt": (
            "gpt",
            {"method": "cholesky", "damping": 1e-3, "hsdp": True, "strategy": "mem-opt"},
        ),
        "cnn-eigen-mem-opt": ("cnn", {"method": "eigen", "strategy": "mem-opt"}),
        "cnn-eigen-kaisa-half": ("cnn", {"method": "eigen", "strategy": "kaisa", **HALF}),
        "cnn-same-eigen-dp": ("cnn-same", {"method": "eigen", "strategy": "dp"}),
        "cnn-eigen-hsdp-kaisa-half": (
            "cnn",
            {"method": "eigen", "strategy": "kaisa", "hsdp": True, **HALF},
        ),
        "cnn-eigen-hsdp-local": ("cnn", {"method": "eigen", "hsdp": True, **LOCAL}),
        "cnn-same-eigen-hsdp-dp": ("cnn-same", {"method": "eigen", "strategy": "dp", "hsdp": True}),
        "cnn64-eigen_adam-input-rms-hsdp": (
            "cnn64",
            {"method": "eigen_adam", **MOMENTS, **INPUT_RMS, "hsdp": True},
        ),
    },
}


def _train(rank: int | None, world: int, case: Case) -> Any:
    model, options = case
    options = {**OPTIONS, **options}
    reshard = options.pop("reshard", True)
    hsdp = options.pop("hsdp", False)
    bf16 = options.pop("bf16", False)
    ddp = options.pop("ddp", False)
    if rank is None:  # one process: every fraction is 1, nothing is sharded
        options.pop("grad_worker_fraction", None)
        options.pop("shard_exchange", None)
    model_fn, batch_fn = MODELS[model]
    sharded = rank is not None and ddp is False
    return train_sharded(
        rank,
        world,
        model_fn=model_fn,
        batch_fn=functools.partial(batch_fn, world=world),
        steps=STEPS,
        ddp=ddp if rank is not None else False,
        shard=functools.partial(_shard_children, reshard, hsdp, bf16) if sharded else None,
        **options,
    )


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, case in CASES[world].items():
        run = _train(rank, world, case)
        out[key] = {
            "params": run.params(),
            "buffers": [b.clone() for b in run.model.buffers()],
            "layers": set(run.pre.layers),
            "stats": run.pre.comm_stats(),
            "workers": {n: p.grad_workers for n, p in run.pre.strategy.placement.items()},
            "factor_dtypes": {a.dtype for a, g in run.pre.factors().values()}
            | {g.dtype for a, g in run.pre.factors().values()},
        }
        if key == "cnn-eigen-local":
            out["local-checkpoint"] = _local_checkpoint(run)
        if key == "cnn-eigen-mem-opt":
            out[key]["full"] = _full_here(run)
    if world == 2:
        out["errors"] = _refusals()
        out["graph rules"] = _graph_rules(sharded=True)
    return out


def _graph_rules(sharded: bool) -> dict[str, Any]:
    """The graph's rules (flattened maps, roles) of the digits CNN and of a model whose map
    is read back through a BatchNorm, each ``fully_shard`` per child when ``sharded``."""
    from dkfac.engine.roles import flattened_conv_inputs, layer_roles
    from tests.engine.test_roles import _cnn, _Functional

    found = {}
    for name, model in (("cnn", _cnn()), ("functional", _Functional())):
        if sharded:
            _shard_children(True, False, False, model)
        found[name] = (flattened_conv_inputs(model), layer_roles(model))
    return found


_spawned = once_per_key(lambda world: run_distributed(_rank_main, world, timeout=300))


@pytest.mark.parametrize(
    ("world", "key"),
    [
        (world, key)
        for world, cases in CASES.items()
        for key in cases
        if "bf16" not in key and "local" not in key and not key.startswith("bn")
    ],
)
def test_sharded_model_trains_as_serial(world: int, key: str) -> None:
    results = _spawned(world)
    serial = _train(None, world, CASES[world][key])
    assert_ranks_match(
        [r[key]["params"] for r in results], serial.params(), label=f"{world} ranks, {key}", **TOL
    )


def test_bf16_parameters_with_float32_reduction_stay_within_bf16_rounding_of_serial() -> None:
    # MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): the layers compute
    # in bfloat16, so the run is the serial float32 run up to bfloat16 rounding (measured:
    # 6% of how far a tensor moved in 4 steps); the factors are kept in float32.
    key = "gpt32-eigen-bf16"
    serial = _train(None, 2, CASES[2][key])
    start = [p.detach() for p in make_gpt().float().parameters()]
    for rank, result in enumerate(_spawned(2)):
        assert result[key]["factor_dtypes"] == {torch.float32}
        for index, (got, want, init) in enumerate(
            zip(result[key]["params"], serial.params(), start, strict=True)
        ):
            moved = (want - init).norm()
            assert (got - want).norm() <= 0.25 * moved, f"rank {rank}, tensor {index}"


@pytest.mark.parametrize("key", ["bn-same-eigen", "bn-same-cholesky-mem-opt"])
def test_batchnorm_trains_as_serial_running_statistics_included(key: str) -> None:
    # every rank the same 8 rows: its batch moments are the global batch's, so the run is
    # the serial run on those 8 rows once (the running variance's n / (n - 1) included)
    _, options = CASES[2][key]
    serial = train_sharded(
        None,
        1,
        model_fn=make_bn_model,
        batch_fn=lambda step: global_batch(step, 1),
        steps=STEPS,
        **{**OPTIONS, **options},
    )
    buffers = [b.clone() for b in serial.model.buffers()]
    for rank, result in enumerate(_spawned(2)):
        assert result[key]["layers"] >= BN_LAYERS, f"rank {rank}: {result[key]['layers']}"
        assert_tensors_close(
            result[key]["params"], serial.params(), label=f"{key}, rank {rank}", **TOL
        )
        assert_tensors_close(
            result[key]["buffers"], buffers, label=f"{key} buffers, rank {rank}", **TOL
        )


def test_batchnorm_on_rank_local_batches_equals_ddp_rank_by_rank() -> None:
    # different rows per rank: each BatchNorm normalises with its rank's moments (serial
    # K-FAC on the global batch is another function); DDP without buffer broadcasts does the
    # same, so FSDP2 equals it in the weights and in each rank's running statistics, which
    # differ between ranks
    results = _spawned(2)
    for rank, result in enumerate(results):
        sharded, ddp = result["bn-eigen"], result["bn-eigen-ddp"]
        assert sharded["layers"] >= BN_LAYERS
        label = f"rank {rank}"
        assert_tensors_close(sharded["params"], ddp["params"], label=label, **TOL)
        assert_tensors_close(sharded["buffers"], ddp["buffers"], label=f"{label} buffers", **TOL)
    running_means = [r["bn-eigen"]["buffers"][0] for r in results]
    assert not torch.allclose(*running_means)


@pytest.mark.parametrize("world", [2, 4])
def test_the_gradient_exchange_is_on_the_ledger(world: int) -> None:
    # Conv (3, 2, 3, 3) + bias, Linear (6, 48) + bias, Linear (3, 6) + bias: every rank
    # sends ceil(rows / P) rows of each, all ranks' padded rows are gathered.
    shapes = [(3, 18), (3, 1), (6, 48), (6, 1), (3, 6), (3, 1)]
    padded = sum(math.ceil(rows / world) * cols for rows, cols in shapes)
    stats = _spawned(world)[0]["cnn-eigen"]["stats"]
    assert stats["total"]["gradients"] == STEPS * world * padded * 8
    assert stats["total"]["preconditioned"] == 0  # replicated: every rank preconditions


def _cnn_exchange(world: int, workers: dict[str, tuple[int, ...]], hsdp: bool) -> Any:
    """The owner exchange's bytes a step for the CNN (weights and biases of its three
    layers, float64) under a placement: :func:`exchange_bytes` of its shapes."""
    shard_group = world // 2 if hsdp else world
    shapes = {"0": (3, 18), "3": (6, 48), "6": (3, 6)}  # conv (3, 2, 3, 3), linear, linear
    params: list[ShardedParam] = []
    layers: list[LayerRows] = []
    for name, (rows, cols) in shapes.items():
        first = len(params)
        params += [ShardedParam(rows, cols, 8, shard_group), ShardedParam(rows, 1, 8, shard_group)]
        sources = tuple(serving_worker(workers[name], world, d) for d in range(world))
        layers.append(LayerRows(((first, 0, rows), (first + 1, 0, rows)), workers[name], sources))
    shard = [rank % shard_group for rank in range(world)]
    replica = [rank // shard_group for rank in range(world)]
    return exchange_bytes(params, layers, shard, replica)


def _full_here(run: Any) -> dict[str, list[str]]:
    """The parameters whose full gradient this rank holds in a step, and the parameters of
    the layers it preconditions."""
    layout = run.pre.layout
    everything = frozenset(range(len(layout.params)))
    full = sorted(layout.params[i].name for i in layout.exchange.needed(everything))
    owned = sorted(
        name
        for layer, state in run.pre.layers.items()
        if run.pre.strategy.preconditions(layer)
        for name in (f"{layer}.weight", f"{layer}.bias")
    )
    return {"full": full, "owned": owned}


@pytest.mark.parametrize("world", [2, 4])
def test_under_the_owner_exchange_a_rank_holds_only_its_layers_full_gradients(world: int) -> None:
    held = [r["cnn-eigen-mem-opt"]["full"] for r in _spawned(world)]
    for rank, here in enumerate(held):
        assert here["full"] == here["owned"], f"rank {rank}"
    every = [name for here in held for name in here["full"]]
    assert len(every) == len(set(every)) == 6  # each of the 3 layers' 2 tensors, once


@pytest.mark.parametrize(
    ("world", "key"),
    [
        (2, "cnn-eigen-mem-opt"),
        (2, "cnn-eigen-kaisa-half"),
        (4, "cnn-eigen-mem-opt"),
        (4, "cnn-eigen-kaisa-half"),
        (4, "cnn-eigen-hsdp-kaisa-half"),
    ],
)
def test_the_owner_exchange_moves_the_bytes_of_its_formula(world: int, key: str) -> None:
    # rows to the grad workers ("gradients") and each rank's rows of the results back
    # ("preconditioned"), one all_to_all per bucket each way, and nothing else of them
    for rank, result in enumerate(_spawned(world)):
        stats = result[key]["stats"]
        want = _cnn_exchange(world, result[key]["workers"], "hsdp" in key)
        assert want["gradients"] > 0 and want["preconditioned"] > 0
        assert stats["total"]["gradients"] == STEPS * want["gradients"], f"rank {rank}"
        assert stats["total"]["preconditioned"] == STEPS * want["preconditioned"], f"rank {rank}"
        assert stats["by_collective"]["all_to_all"] == STEPS * sum(want.values()), f"rank {rank}"
        assert stats["by_collective"]["all_gather"] == 0


def _local_checkpoint(run: Any) -> dict[str, Any]:
    """What a local-mode checkpoint saves, and the solver states' shapes before and after
    loading it (each rank's own rows' block of G, recomputed from the saved factors)."""

    def shapes() -> dict[str, list[tuple[int, ...]]]:
        return {
            name: sorted(tuple(t.shape) for t in (layer.solver_state or {}).values())
            for name, layer in run.pre.layers.items()
        }

    before = shapes()
    state = run.pre.state_dict(include_inverses=True)
    run.pre.load_state_dict(state)
    return {
        "saved": {name: sorted(entry) for name, entry in state["layers"].items()},
        "before": before,
        "after": shapes(),
        "rows": {name: (r.start, r.stop) for name, r in run.pre.layout.local_rows().items()},
    }


def test_a_local_mode_checkpoint_keeps_the_factors_and_recomputes_each_ranks_states() -> None:
    # the solver states differ by rank (each its rows' block of G): none is saved, and
    # each rank recomputes its own at load
    results = [r["local-checkpoint"] for r in _spawned(2)]
    assert results[0]["rows"] != results[1]["rows"]
    for result in results:
        assert all(keys == ["A", "G"] for keys in result["saved"].values()), result["saved"]
        assert result["after"] == result["before"]
        assert all(result["after"].values())
    assert results[0]["before"] != results[1]["before"]  # e.g. conv: 2 and 1 rows of 3


def _block_diagonal_g(parts: int, whole: frozenset[str] = frozenset()) -> Any:
    """Serial K-FAC with each Linear / Conv2d layer's ``G`` block-diagonal: the blocks of
    the rows ``torch.chunk`` gives ``parts`` shards, the rest zeroed (the oracle of the
    local mode); the layers in ``whole`` keep their ``G`` whole."""
    original = LayerState.solver_inputs

    def solver_inputs(self: LayerState) -> dict[str, Any]:
        inputs = original(self)
        if not self.block.rows_are_outputs or self.name in whole:
            return inputs
        g = inputs["G"]
        chunk = math.ceil(g.shape[0] / parts)
        mask = torch.zeros_like(g)
        for start in range(0, g.shape[0], chunk):
            mask[start : start + chunk, start : start + chunk] = 1.0
        return {**inputs, "G": g * mask}

    return mock.patch.object(LayerState, "solver_inputs", solver_inputs)


@pytest.mark.parametrize(
    ("world", "key"),
    [(world, key) for world, cases in CASES.items() for key in cases if "local" in key],
)
def test_local_mode_is_serial_kfac_with_a_block_diagonal_g(world: int, key: str) -> None:
    # each rank its own rows: the full A, its rows' diagonal block of G; embeddings and
    # attention (rows that are not output rows) whole, as under "exact"
    shard_group = world // 2 if "hsdp" in key else world
    with _block_diagonal_g(shard_group):
        oracle = _train(None, world, CASES[world][key])
    results = [r[key]["params"] for r in _spawned(world)]
    assert_ranks_match(results, oracle.params(), label=f"{world} ranks, {key}", **TOL)
    exact = _train(None, world, CASES[world][key])  # the serial update, G whole
    moved = max((a - b).abs().max().item() for a, b in zip(results[0], exact.params(), strict=True))
    assert moved > 1e-6  # the off-diagonal blocks matter: not the exact run


def test_local_mode_moves_no_gradient_and_no_solver_state() -> None:
    # the CNN's layers are all Linear / Conv2d: only the factors' all-reduce travels
    for world, key in ((2, "cnn-eigen-local"), (4, "cnn-eigen-hsdp-local")):
        for result in _spawned(world):
            total = result[key]["stats"]["total"]
            assert total["factors"] > 0
            assert total["gradients"] == total["preconditioned"] == total["inverses"] == 0


# ---------------------------------------------------------------- refusals
def _message(build: Callable[[], Any]) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    return "no error"


def _refusals() -> dict[str, str]:
    """The construction errors of bad sharded models (run on every rank)."""
    mixed = make_model()
    fully_shard(mixed[0])  # a block only: the other layers stay plain tensors
    ignored = make_model()
    fully_shard(ignored, ignored_params=set(ignored[3].parameters()))
    tensor_parallel = make_model()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    layer = tensor_parallel[3]
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(1)]))
    layer.bias = nn.Parameter(distribute_tensor(layer.bias.detach(), mesh, [Shard(0)]))
    for other in (tensor_parallel[0], tensor_parallel[4], tensor_parallel[6]):
        fully_shard(other)
    sharded = make_model()
    _shard_children(True, False, False, sharded)
    auto = KFACPreconditioner(sharded, strategy="auto")
    auto.remove_hooks()
    return {
        "auto": type(auto.strategy).name,
        "mixed": _message(lambda: KFACPreconditioner(mixed)),
        "ignored": _message(lambda: KFACPreconditioner(ignored)),
        "shard1": _message(lambda: KFACPreconditioner(tensor_parallel)),
        "spngd": _message(lambda: KFACPreconditioner(sharded, strategy="spngd")),
        "local-mem-opt": _message(
            lambda: KFACPreconditioner(sharded, strategy="mem-opt", shard_exchange="local")
        ),
        "local-plain": _message(lambda: KFACPreconditioner(make_model(), shard_exchange="local")),
        "local-blocks": _message(
            lambda: KFACPreconditioner(
                sharded, method="eigen_adam", shard_exchange="local", basis_block_size=2
            )
        ),
        "fsdp1": _message(_fsdp1),
    }


def _fsdp1() -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return KFACPreconditioner(FullyShardedDataParallel(make_model(), device_id=torch.device("cpu")))


def test_a_sharded_model_gets_the_graph_rules_of_the_unsharded_one() -> None:
    # for_model's flattened_inputs="graph": the same maps, hence the same config, under FSDP2
    unsharded = _graph_rules(sharded=False)
    assert unsharded["cnn"][0] == {"classifier.0": (64, 16)}
    assert unsharded["functional"][0] == {"head": (5, 16)}
    for rank, result in enumerate(_spawned(2)):
        assert result["graph rules"] == unsharded, f"rank {rank}"


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        (
            "mixed",
            r"parameter '3.weight' is a plain tensor while '0.weight' is a DTensor.*"
            r"apply fully_shard to the root",
        ),
        ("ignored", r"parameter '3.weight' is a plain tensor .*among fully_shard's ignored_params"),
        ("shard1", r"parameter '3.weight' has placements \(Shard\(dim=1\),\).*not supported"),
        ("spngd", r'strategy="spngd" cannot apply .* use one of'),
        ("fsdp1", r"FSDP1's FullyShardedDataParallel .*fully_shard on each block"),
        ("local-mem-opt", r'shard_exchange="local" .*strategy="mem-opt" cannot.*"replicated"'),
        ("local-plain", r'shard_exchange="local" .*plain tensors.*shard_exchange="exact"'),
        ("local-blocks", r'shard_exchange="local" .*basis_block_size'),
    ],
)
def test_unsupported_sharding_is_refused_at_construction(case: str, pattern: str) -> None:
    # and strategy="auto" never picks spngd for a sharded model
    assert {r["errors"]["auto"] for r in _spawned(2)} <= {"replicated", "kaisa", "mem-opt"}
    for rank, result in enumerate(_spawned(2)):
        assert re.search(pattern, result["errors"][case]), f"rank {rank}: {result['errors'][case]}"
