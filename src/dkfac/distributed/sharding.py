"""Finding a model's parameter layout, and refusing the sharded models K-FAC cannot take.

:func:`find_layout` checks a model at construction: ``None`` for plain parameters (DDP, one
process), a :class:`~dkfac.distributed.layout.ShardedLayout` for FSDP2 / HSDP. It refuses,
naming the parameter and what is allowed: a model where some trainable parameters are
DTensors and others not, a placement other than ``Shard(0)`` / ``Replicate()`` (tensor
parallelism's ``Shard(1)``), DTensors on different meshes, FSDP1's
``FullyShardedDataParallel`` wrapper, and ``strategy="spngd"`` (which reduces unreduced
gradients itself; FSDP2 has already reduced them). :func:`refuse_late_sharding` refuses,
at a step, a model that ``fully_shard`` sharded after the preconditioner was built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from dkfac.distributed.layout import ShardedLayout
from dkfac.distributed.ledger import CommLedger

__all__ = ["find_layout", "refuse_fsdp1", "refuse_late_sharding"]

_STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp", "auto")
"""Strategies offered with the sharded layout (``auto`` never picks ``spngd`` here)."""


def _is_fsdp1(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a build without FSDP1
        return False
    return isinstance(module, FullyShardedDataParallel)


def _placement_problem(name: str, param: Any) -> str | None:
    placements = tuple(param.placements)
    allowed = all(p == Shard(0) or isinstance(p, Replicate) for p in placements)
    if allowed and sum(p == Shard(0) for p in placements) <= 1:
        return None
    return (
        f"parameter {name!r} has placements {placements}: K-FAC takes parameters sharded on "
        "dim 0 over at most one mesh dimension, Shard(0) and Replicate() (FSDP2's "
        "fully_shard, HSDP); tensor parallelism (Shard(1), or dim 0 cut twice) is not "
        "supported"
    )


def _under_fully_shard(model: nn.Module, name: str) -> bool:
    """Whether a module holding parameter ``name`` of ``model`` (the model itself included)
    was given to ``fully_shard``: a plain parameter there is one of its ``ignored_params``."""
    parts = name.split(".")[:-1]
    modules = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
    return any(isinstance(module, FSDPModule) for module in modules)


def refuse_fsdp1(model: nn.Module) -> None:
    """Refuses a model wrapped (anywhere) in FSDP1's ``FullyShardedDataParallel``.

    Raises:
        ValueError: Naming the wrapped module and what to use instead.
    """
    for name, module in [("", model), *model.named_modules()]:
        if _is_fsdp1(module):
            where = f" (at {name!r})" if name else ""
            raise ValueError(
                f"FSDP1's FullyShardedDataParallel{where} flattens parameters into flat "
                "buffers that K-FAC cannot see as layers; shard the model with FSDP2 "
                "(torch.distributed.fsdp.fully_shard on each block, then on the root), or "
                "use DistributedDataParallel"
            )


def refuse_late_sharding(params: Mapping[str, Sequence[Tensor]]) -> None:
    """Refuses DTensor parameters in a preconditioner built on plain ones.

    Args:
        params: Layer name -> the parameters its block preconditions (read now).

    Raises:
        RuntimeError: Naming the first layer whose trainable parameter is a DTensor, and
            the order that works.
    """
    for name, layer_params in params.items():
        if any(isinstance(p, DTensor) and p.requires_grad for p in layer_params):
            raise RuntimeError(
                f"layer {name!r} holds a DTensor parameter, but the model's parameters were "
                "plain tensors when the preconditioner was built: the model was sharded with "
                "fully_shard after the preconditioner was built; apply fully_shard to the "
                "blocks and the root first, then build KFACPreconditioner (or "
                "KFACOptimizer.for_model) on the sharded model"
            )


def find_layout(
    model: nn.Module,
    layer_params: Mapping[str, Sequence[Tensor]],
    *,
    strategy: str,
    ledger: CommLedger,
    bucket_bytes: int,
    shard_exchange: str = "exact",
) -> ShardedLayout | None:
    """The sharded layout of ``model``, ``None`` when its parameters are plain tensors.

    Args:
        model: The model handed to the preconditioner (wrappers included).
        layer_params: The parameters each preconditioned layer takes, by layer name.
        strategy: The configured strategy.
        ledger: Where the gradient exchange records its bytes (the preconditioner's).
        bucket_bytes: Size of one all-gather bucket.
        shard_exchange: The configured ``shard_exchange``.

    Raises:
        ValueError: For a mix of DTensor and plain parameters (FSDP1 is refused before the
            layers are registered: :func:`refuse_fsdp1`), a placement other
            than ``Shard(0)``/``Replicate()``, DTensors on different meshes, a strategy
            that cannot apply to sharded parameters, or ``shard_exchange="local"`` for a
            model that is not sharded.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sharded = [(n, p) for n, p in named if isinstance(p, DTensor)]
    if not sharded:
        if shard_exchange == "local":
            raise ValueError(
                'shard_exchange="local" has each rank precondition its own rows of a model '
                "sharded with fully_shard (FSDP2 / HSDP), and this model's parameters are "
                'plain tensors (DDP or one process): leave shard_exchange="exact"'
            )
        return None
    plain = [n for n, p in named if not isinstance(p, DTensor)]
    if plain:
        if _under_fully_shard(model, plain[0]):
            advice = (
                "it is among fully_shard's ignored_params, whose gradients no rank averages; "
                "leave it out of ignored_params, or freeze it (requires_grad=False)"
            )
        else:
            advice = "apply fully_shard to the root module too (or to none, under DDP)"
        raise ValueError(
            f"parameter {plain[0]!r} is a plain tensor while {sharded[0][0]!r} is a DTensor: "
            f"K-FAC needs every trainable parameter in one layout; {advice}"
        )
    mesh = sharded[0][1].device_mesh
    for name, param in sharded:
        problem = _placement_problem(name, param)
        if problem is not None:
            raise ValueError(problem)
        if param.device_mesh != mesh:
            raise ValueError(
                f"parameter {name!r} lives on another device mesh than {sharded[0][0]!r}; "
                "K-FAC needs one FSDP/HSDP mesh for the whole model"
            )
    if strategy not in _STRATEGIES:
        raise ValueError(
            f'strategy="{strategy}" cannot apply to a model sharded with fully_shard: it '
            "reduces unreduced gradients itself, and FSDP2 has already reduce-scattered them; "
            f"use one of {', '.join(repr(s) for s in _STRATEGIES)}"
        )
    return ShardedLayout(model, layer_params, ledger=ledger, bucket_bytes=bucket_bytes)
