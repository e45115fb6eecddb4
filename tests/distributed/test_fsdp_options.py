"""``fully_shard``'s options under ``KFACOptimizer.for_model`` (gloo, float64).

Each rank trains on its part of every global batch with dkfac's default, ``for_model``
(``eigen_adam`` under its overhead budget), the model sharded with FSDP2; the oracle is
``for_model`` on the unsharded model and the whole batch, in one process: the weights
(1e-9), ``describe()``'s rows and the budget's choice. Covered, on 2 ranks:
``fully_shard`` per child and on the root, on the root only, ``reshard_after_forward``
``False`` and an int, ``OffloadPolicy()`` and ``CPUOffloadPolicy(pin_memory=False)`` (the
offloaded shards stay on the CPU, as the model is), layer widths that 2 does not divide, a
weight tied between an embedding and a head in one FSDP unit (``fully_shard([emb, head])``
or the root's), accumulation with ``set_requires_gradient_sync(False)`` on the first
micro-batch; on 4: widths below the world size (a rank holds no row of a layer) under
``replicated``, ``mem-opt`` and ``kaisa`` with a fraction of 1/2, HSDP (2 × 2) under
``replicated`` and ``mem-opt``.

``shard_exchange="local"``: serial K-FAC with a block-diagonal ``G`` for the input and head
layers, the hidden layer (whose update ``for_model`` orthogonalises: its polar factor
couples all rows) preconditioned whole; on 4 ranks with a rank that holds no row.
``MixedPrecisionPolicy(reduce_dtype=bfloat16)``: the serial run whose gradients are rounded
as FSDP2 reduces them (every rank's in bfloat16, summed in bfloat16).

What torch refuses itself (``CPUOffloadPolicy()``'s pinned memory without an accelerator,
in ``fully_shard``; a tied weight split over two FSDP units, at the first forward) is
refused the same way under dkfac. Every case of a world size runs in one process group."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from dkfac import KFACOptimizer
from tests.distributed.test_fsdp import _block_diagonal_g
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import assert_ranks_match, once_per_key

STEPS, ROWS, MICRO = 4, 8, 2
TOL = {"rtol": 1e-9, "atol": 1e-11}
CHOSEN = (
    "factor_batch_size",
    "factor_update_interval",
    "inverse_update_interval",
    "within_budget",
    "orthogonal_steps",
    "basis_max_dims",
)
"""The budget's choice; its ``overhead`` and ``reason`` price a rank's own batch."""


class _Net(nn.Module):
    """Three Linear layers ``widths[0] → widths[1] → widths[2] → widths[3]``."""

    def __init__(self, widths: tuple[int, int, int, int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(widths[0], widths[1])
        self.b = nn.Linear(widths[1], widths[2])
        self.c = nn.Linear(widths[2], widths[3])

    def forward(self, x: Tensor) -> Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class _Tied(nn.Module):
    """An embedding whose table is the head's weight, a Linear between."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "net": lambda: _Net((6, 8, 8, 3)).double(),
    "uneven": lambda: _Net((7, 5, 5, 3)).double(),  # 5 rows: 3 + 2, 2 + 2 + 1 + 0
    "tiny": lambda: _Net((3, 3, 3, 3)).double(),  # 3 rows on 4 ranks: one holds none
    "tied": lambda: _Tied().double(),
    "net32": lambda: _Net((6, 8, 8, 3)),
}


def _batch(model: str, step: int, part: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 * step + part)
    if model == "tied":
        return torch.randint(0, 6, (ROWS,), generator=gen), torch.randint(
            0, 6, (ROWS,), generator=gen
        )
    dtype = torch.float32 if model == "net32" else torch.float64
    inputs = 3 if model == "tiny" else 7 if model == "uneven" else 6
    x = torch.randn(ROWS, inputs, generator=gen, dtype=dtype)
    return x, torch.randint(0, 3, (ROWS,), generator=gen)


def _micro_batches(model: str, step: int, rank: int | None, world: int, micro: int) -> Any:
    """This rank's micro-batches of a step; ``rank=None``: the serial twin's, whose
    micro-batch ``k`` is every rank's ``k`` in rank order."""
    parts = [_batch(model, step, r) for r in (range(world) if rank is None else [rank])]
    return [
        (
            torch.cat([x.chunk(micro)[k] for x, _ in parts]),
            torch.cat([y.chunk(micro)[k] for _, y in parts]),
        )
        for k in range(micro)
    ]


# -- how a case shards its model --------------------------------------------------------


def _per_child(model: nn.Module, **kwargs: Any) -> None:
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kwargs)
    fully_shard(model, **kwargs)


def _root_only(model: nn.Module) -> None:
    fully_shard(model)


def _tied_unit(model: nn.Module) -> None:
    fully_shard([model.emb, model.head])  # type: ignore[list-item]
    fully_shard(model.mid)
    fully_shard(model)


def _hsdp(model: nn.Module) -> None:
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    _per_child(model, mesh=mesh)


BF16_REDUCE = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
Case = tuple[str, Callable[[nn.Module], None], dict[str, Any]]  # model, shard, options
CASES: dict[int, dict[str, Case]] = {
    2: {
        "children": ("net", _per_child, {}),
        "root-only": ("net", _root_only, {}),
        "kept-unsharded": ("net", functools.partial(_per_child, reshard_after_forward=False), {}),
        "reshard-int": ("net", functools.partial(_per_child, reshard_after_forward=1), {}),
        "no-offload": (
            "net",
            functools.partial(_per_child, offload_policy=OffloadPolicy()),
            {},
        ),
        "cpu-offload": (
            "net",
            functools.partial(_per_child, offload_policy=CPUOffloadPolicy(pin_memory=False)),
            {},
        ),
        "uneven": ("uneven", _per_child, {}),
        "uneven-mem-opt": ("uneven", _per_child, {"strategy": "mem-opt"}),
        "tied-root": ("tied", _root_only, {}),
        "tied-unit-mem-opt": ("tied", _tied_unit, {"strategy": "mem-opt"}),
        "accumulated": ("net", _per_child, {"micro": MICRO}),
        "local": ("net", _per_child, {"shard_exchange": "local"}),
        "bf16-reduce": ("net32", functools.partial(_per_child, mp_policy=BF16_REDUCE), {}),
    },
    4: {
        "tiny": ("tiny", _per_child, {}),
        "tiny-mem-opt": ("tiny", _per_child, {"strategy": "mem-opt"}),
        "tiny-kaisa-half": ("tiny", _per_child, {"strategy": "kaisa", "grad_worker_fraction": 0.5}),
        "uneven": ("uneven", _per_child, {}),
        "hsdp": ("net", _hsdp, {}),
        "hsdp-mem-opt": ("net", _hsdp, {"strategy": "mem-opt"}),
        "hsdp-tiny-mem-opt": ("tiny", _hsdp, {"strategy": "mem-opt"}),
        # a rank holding no row preconditions nothing of its own; the hidden layer's
        # orthogonalised update (for_model's) is preconditioned whole
        "tiny-local": ("tiny", _per_child, {"shard_exchange": "local"}),
        "uneven-local": ("uneven", _per_child, {"shard_exchange": "local"}),
    },
}
SHARDED_ONLY = ("grad_worker_fraction", "shard_exchange")  # one process: no meaning


def _params(model: nn.Module) -> list[Tensor]:
    return [
        p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for p in model.parameters()
    ]


def _train(rank: int | None, world: int, case: Case) -> dict[str, Any]:
    """``for_model`` on the case's model for STEPS steps: sharded on ``rank``, or the serial
    twin (``rank=None``) on the whole batch."""
    name, shard, options = case
    options = dict(options)
    micro = options.pop("micro", 1)
    if rank is None:
        options = {k: v for k, v in options.items() if k not in SHARDED_ONLY}
    model = MODELS[name]()
    if rank is not None:
        shard(model)
    opt = KFACOptimizer.for_model(model, lr=0.01, accumulation_steps=micro, **options)
    for step in range(STEPS):
        opt.zero_grad()
        for k, (x, y) in enumerate(_micro_batches(name, step, rank, world, micro)):
            if rank is not None and micro > 1:
                model.set_requires_gradient_sync(k == micro - 1)  # type: ignore[operator]
            (F.cross_entropy(model(x), y) / micro).backward()
        opt.step()
    pre = opt.preconditioner
    assert pre.budget is not None and pre.budget.choice is not None
    rows = [
        {k: v for k, v in row.items() if k not in ("owner", "grad_workers")}
        for row in pre.describe()
        if row["name"] != "overhead budget"
    ]
    return {
        "params": _params(model),
        "describe": rows,
        "choice": {key: getattr(pre.budget.choice, key) for key in CHOSEN},
        "strategy": type(pre.strategy).name,
        "local rows": sorted(pre.layout.local_rows()) if pre.layout is not None else [],
    }


def _refused(build: Callable[[], Any]) -> str:
    try:
        build()
    except (RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _tied_split() -> None:
    """The tied model with ``emb`` and ``head`` in two FSDP units: built, then one step."""
    model = MODELS["tied"]()
    _per_child(model)
    opt = KFACOptimizer.for_model(model, lr=0.01)
    x, y = _batch("tied", 0, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {key: _train(rank, world, case) for key, case in CASES[world].items()}
    if world == 2:
        pinned = functools.partial(_per_child, offload_policy=CPUOffloadPolicy())
        out["refused"] = {
            "pinned-offload": _refused(lambda: pinned(MODELS["net"]())),
            "tied-split": _refused(_tied_split),
        }
    return out


_spawned = once_per_key(lambda world: run_distributed(_rank_main, world, timeout=120))


def _exact_keys(world: int) -> list[tuple[int, str]]:
    return [(world, key) for key in CASES[world] if "local" not in key and "bf16" not in key]


@pytest.mark.parametrize(("world", "key"), _exact_keys(2) + _exact_keys(4))
def test_for_model_under_the_option_trains_as_serial_for_model(world: int, key: str) -> None:
    results = [r[key] for r in _spawned(world)]
    serial = _train(None, world, CASES[world][key])
    label = f"{world} ranks, {key}"
    assert_ranks_match([r["params"] for r in results], serial["params"], label=label, **TOL)
    for rank, result in enumerate(results):
        assert result["describe"] == serial["describe"], f"{label}, rank {rank}"
        assert result["choice"] == serial["choice"], f"{label}, rank {rank}"
    options = CASES[world][key][2]
    assert results[0]["strategy"] == options.get("strategy", "replicated")


@pytest.mark.parametrize(("world", "key"), [(2, "local"), (4, "tiny-local"), (4, "uneven-local")])
def test_local_mode_is_serial_with_a_block_diagonal_g_but_for_orthogonalised_layers(
    world: int, key: str
) -> None:
    # each rank its own rows of the input and head layers (a rank holding none on 4: 3 rows
    # are cut 1 + 1 + 1 + 0, 5 rows 2 + 2 + 1 + 0, torch.chunk's cut and the oracle's);
    # for_model orthogonalises the hidden layer's update, whose polar factor couples all of
    # its rows: it is preconditioned whole, as under "exact"
    results = _spawned(world)
    for rank, result in enumerate(results):
        assert result[key]["local rows"] == ["a", "c"], f"rank {rank}"
    with _block_diagonal_g(world, whole=frozenset({"b"})):
        oracle = _train(None, world, CASES[world][key])
    got = [r[key]["params"] for r in results]
    assert_ranks_match(got, oracle["params"], label=f"{world} ranks, {key}", **TOL)


def _bf16_reduced_serial(world: int) -> list[Tensor]:
    """for_model on the whole batch in one process, each step's gradient replaced by what
    FSDP2 reduces in bfloat16: every rank's gradient (its rows' mean loss over ``world``,
    an exact power-of-two division) rounded to bfloat16, summed in bfloat16. The factors
    are the whole batch's (float32 activations and output gradients)."""
    model = MODELS["net32"]()
    opt = KFACOptimizer.for_model(model, lr=0.01, accumulation_steps=world)
    for step in range(STEPS):
        opt.zero_grad()
        reduced = [torch.zeros_like(p, dtype=torch.bfloat16) for p in model.parameters()]
        for rank in range(world):
            x, y = _batch("net32", step, rank)
            model.zero_grad()
            (F.cross_entropy(model(x), y) / world).backward()
            for total, p in zip(reduced, model.parameters(), strict=True):
                total += p.grad.bfloat16()  # type: ignore[union-attr]
        for total, p in zip(reduced, model.parameters(), strict=True):
            p.grad = total.float()
        opt.step()
    return _params(model)


def test_bf16_gradient_reduction_is_serial_with_the_gradients_rounded_as_fsdp_rounds_them() -> None:
    # MixedPrecisionPolicy(reduce_dtype=bfloat16): K-FAC preconditions the gradient FSDP2
    # delivers (reduce-scattered in bfloat16) with the whole batch's float32 factors
    want = _bf16_reduced_serial(2)
    got = [r["bf16-reduce"]["params"] for r in _spawned(2)]
    assert_ranks_match(got, want, label="bf16 reduce", rtol=1e-5, atol=1e-6)
    exact = _train(None, 2, CASES[2]["bf16-reduce"])["params"]  # the rounding mattered
    assert max(float((p - q).abs().max()) for p, q in zip(got[0], exact, strict=True)) > 1e-3


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("pinned-offload", "RuntimeError: .*accelerator"),
        ("tied-split", r"ValueError: .*shared.*fully_shard\(\[module_a, module_b\]\)"),
    ],
)
def test_what_torch_refuses_is_refused_as_torch_says(case: str, pattern: str) -> None:
    import re

    for rank, result in enumerate(_spawned(2)):
        assert re.search(pattern, result["refused"][case]), (
            f"rank {rank}: {result['refused'][case]}"
        )
