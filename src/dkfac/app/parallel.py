"""How the training program spreads a model over the ranks: ``--parallel ddp|fsdp|hsdp``.

* ``ddp`` (the default): every rank holds the whole model, wrapped in
  ``DistributedDataParallel`` (not for ``--strategy spngd``, which reduces the gradients
  itself); checkpoints are single files.
* ``fsdp``: FSDP2, ``torch.distributed.fsdp.fully_shard`` on each block of the model
  (:func:`shard_units`), then on the root: every weight, gradient and optimizer state is
  cut on dim 0 over all ranks.
* ``hsdp``: the same on a 2-D device mesh, replicate × shard: weights cut over groups of
  ``--shard-size`` ranks, those groups replicated (``world / shard-size`` of them).

Under ``fsdp`` and ``hsdp`` checkpoints go through ``torch.distributed.checkpoint``
(:mod:`dkfac.app.sharded_checkpoint`), so they resume at any world size and layout.
:func:`flag_problem` says which flags cannot go with a sharded model (checked when the
arguments are parsed); :func:`mesh_shape` checks the world size once it is known.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from dkfac.app.runconfig import optional

__all__ = [
    "PARALLEL",
    "add_parallel_arguments",
    "flag_problem",
    "mesh_shape",
    "shard_units",
    "wrap_model",
]

PARALLEL = ("ddp", "fsdp", "hsdp")
SHARDED = ("fsdp", "hsdp")


def add_parallel_arguments(group: argparse._ArgumentGroup) -> None:
    """``--parallel`` and ``--shard-size``."""
    group.add_argument(
        "--parallel",
        choices=PARALLEL,
        default="ddp",
        help="several ranks: ddp = whole model on every rank; fsdp = FSDP2 fully_shard on "
        "each block and the root; hsdp = fsdp on a replicate x shard mesh (see --shard-size)",
    )
    group.add_argument(
        "--shard-size",
        type=optional(int),
        default=None,
        help="--parallel hsdp: ranks each weight is cut over, a divisor of the world size "
        "that leaves 2 or more replicas (default: the ranks of one node, LOCAL_WORLD_SIZE)",
    )


def _optimizers(args: argparse.Namespace) -> list[str]:
    if getattr(args, "command", None) == "compare":
        return [n for n in str(args.optimizers).split(",") if n]
    return [str(args.optimizer)]


def flag_problem(args: argparse.Namespace) -> str | None:
    """The first flag that cannot go with ``--parallel`` (``None``: they fit).

    Sharded models (``fsdp``, ``hsdp``) do not run ``--optimizer muon`` (it orthogonalises
    whole matrices), ``--amp fp16`` (its GradScaler does not unscale DTensor gradients; use
    bf16), ``--weight-rescale`` (it reads whole weights) or ``--strategy spngd`` (FSDP2 has
    already reduced the gradients it would reduce).
    """
    parallel, size = args.parallel, args.shard_size
    if size is not None and parallel != "hsdp":
        return f"--shard-size applies to --parallel hsdp, not --parallel {parallel}"
    if parallel not in SHARDED:
        return None
    other = "; or use --parallel ddp"
    if "muon" in _optimizers(args):
        return f"--optimizer muon does not run on a model sharded with --parallel {parallel}{other}"
    if args.amp == "fp16":
        return f"--amp fp16 does not run with --parallel {parallel}: use --amp bf16{other}"
    if getattr(args, "weight_rescale", False):
        return f"--weight-rescale does not run with --parallel {parallel}{other}"
    if getattr(args, "strategy", None) == "spngd":
        return (
            f"--strategy spngd reduces the gradients itself and --parallel {parallel} has "
            "already reduced them: use replicated, kaisa, mem-opt, dp or auto" + other
        )
    return None


def mesh_shape(parallel: str, world: int, shard_size: int | None) -> tuple[int, ...]:
    """The device mesh of a sharded run: ``(world,)`` for fsdp, ``(replicas, shard)`` for hsdp.

    Raises:
        ValueError: For one rank, or a shard size that does not divide the world into 2 or
            more replicas of 2 or more ranks.
    """
    if world < 2:
        raise ValueError(
            f"--parallel {parallel} needs several ranks (torchrun --nproc-per-node N, N >= 2)"
        )
    if parallel == "fsdp":
        return (world,)
    if world < 4:
        raise ValueError(
            f"--parallel hsdp needs 4 or more ranks (2 or more replicas of 2 or more); on "
            f"{world} ranks use --parallel fsdp"
        )
    size = shard_size
    if size is None:
        size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        where = f"the ranks of one node ({size}, LOCAL_WORLD_SIZE)"
    else:
        where = f"--shard-size {size}"
    if size < 2 or world % size or world // size < 2:
        raise ValueError(
            f"--parallel hsdp on {world} ranks: {where} must divide them into 2 or more "
            f"replicas of 2 or more ranks; pass --shard-size with a divisor of {world} "
            f"between 2 and {world // 2}, or use --parallel fsdp"
        )
    return (world // size, size)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the root: the model's blocks.

    The children of its ``blocks`` or ``layers`` container (a GPT's transformer blocks, a
    ResNet's residual blocks) when it has one, else its children that hold parameters.
    """
    for name in ("blocks", "layers"):
        container = getattr(model, name, None)
        if isinstance(container, (nn.Sequential, nn.ModuleList)):
            return [m for m in container.children() if any(True for _ in m.parameters())]
    return [m for m in model.children() if any(True for _ in m.parameters())]


def wrap_model(
    bare: nn.Module,
    parallel: str,
    *,
    world: int,
    device: torch.device,
    shard_size: int | None = None,
    strategy: str | None = None,
) -> nn.Module:
    """The model the program trains: ``bare`` under DDP, or sharded in place (fsdp, hsdp).

    Raises:
        ValueError: For a world size or shard size a sharded run cannot use.
    """
    if parallel not in SHARDED:
        if world > 1 and strategy != "spngd":
            ids = [device.index] if device.type == "cuda" else None
            return nn.parallel.DistributedDataParallel(bare, device_ids=ids)
        return bare
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = mesh_shape(parallel, world, shard_size)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    for unit in shard_units(bare):
        fully_shard(unit, mesh=mesh)
    fully_shard(bare, mesh=mesh)
    return bare
