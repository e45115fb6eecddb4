"""Per-parameter state cut on dim 0 like a sharded parameter: this rank's rows, the whole.

For state kept on each rank's shard of an FSDP2 / HSDP parameter (the leftover Adam moments,
as matrices whose dim 0 is the parameter's); plain tensors pass through.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

__all__ = ["gather_rows", "own_rows"]


def gather_rows(param: Tensor, local: Tensor) -> Tensor:
    """The whole of a tensor cut on dim 0 like ``param``, from this rank's rows ``local``.

    For per-parameter state kept on each rank's shard (the leftover Adam moments, as
    matrices whose dim 0 is the parameter's): a collective over the shard group when
    ``param`` is a sharded DTensor (checkpoints only: not on the step's ledger); ``local``
    itself otherwise.
    """
    if not isinstance(param, DTensor):
        return local
    shape = torch.Size((param.shape[0], *local.shape[1:]))
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    whole = DTensor.from_local(
        local.contiguous(), param.device_mesh, param.placements, shape=shape, stride=stride
    )
    return whole.full_tensor()


def own_rows(param: Tensor, whole: Tensor) -> Tensor:
    """This rank's dim-0 rows of ``whole``, cut as ``param`` is (all of it for a plain one)."""
    if not isinstance(param, DTensor):
        return whole
    dims = [i for i, p in enumerate(param.placements) if p == Shard(0)]
    if not dims:
        return whole
    mesh = param.device_mesh
    parts, index = mesh.size(dims[0]), mesh.get_local_rank(dims[0])
    chunk = math.ceil(whole.shape[0] / parts)
    start = min(index * chunk, whole.shape[0])
    return whole[start : min(start + chunk, whole.shape[0])]
