"""One sharded parameter of the sharded layout, and its rows of the gradient.

Under FSDP2 / HSDP each parameter and its averaged gradient are DTensors cut on dim 0
(``torch.chunk``'s cut) over the shard dimension of the mesh; :class:`ShardedParameter` says
where a parameter sits in the model and how it is cut, and the functions here read and
write this rank's rows of its gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "ShardedParameter",
    "grad_local",
    "keep_local",
    "keep_rows",
    "own_rows",
    "row_numel",
    "set_local_grad",
]


@dataclass
class ShardedParameter:
    """One sharded parameter: where it sits in the model and how it is cut.

    Attributes:
        name: Its (first) qualified name.
        param: The DTensor parameter.
        slots: Every ``(module, attribute)`` that holds it (tied weights: several).
        mesh_dim: The mesh dimension it is cut along (``None``: replicated DTensor).
    """

    name: str
    param: DTensor
    slots: list[tuple[nn.Module, str]]
    mesh_dim: int | None

    @property
    def parts(self) -> int:
        """Shards along dim 0 (1 for a replicated DTensor)."""
        return 1 if self.mesh_dim is None else self.param.device_mesh.size(self.mesh_dim)

    def chunk_rows(self) -> int:
        """Rows of the largest shard (``torch.chunk``'s cut, as DTensor's ``Shard(0)``)."""
        return math.ceil(self.param.shape[0] / self.parts)

    def rows_of(self, index: int) -> tuple[int, int]:
        """``[start, end)`` rows of shard ``index`` (empty past the end)."""
        chunk = self.chunk_rows()
        start = min(index * chunk, self.param.shape[0])
        return start, min(start + chunk, self.param.shape[0])

    def index(self) -> int:
        """This rank's shard along the mesh dimension."""
        return 0 if self.mesh_dim is None else self.param.device_mesh.get_local_rank(self.mesh_dim)


def set_local_grad(s: ShardedParameter, local: Tensor) -> None:
    """Gives the parameter a sharded gradient with this rank's rows ``local`` (a 0-d
    tensor: zeros of the shard's shape)."""
    if local.dim() == 0:
        local = local.expand(s.param.to_local().shape).clone()
    s.param.grad = DTensor.from_local(
        local, s.param.device_mesh, s.param.placements, shape=s.param.shape, stride=s.param.stride()
    )


def grad_local(s: ShardedParameter) -> Tensor:
    """This rank's rows of the parameter's gradient (the shard's own storage)."""
    grad = s.param.grad
    assert isinstance(grad, DTensor)
    return grad.to_local()


def row_numel(param: Tensor) -> int:
    """Entries in one dim-0 row of ``param``."""
    return int(math.prod(param.shape[1:]))


def own_rows(s: ShardedParameter) -> tuple[int, int]:
    """``[start, end)``: this rank's rows of the parameter (all of an uncut one)."""
    return s.rows_of(s.index()) if s.parts > 1 else (0, s.param.shape[0])


def keep_local(s: ShardedParameter, grad: Tensor | None) -> None:
    """Writes this rank's rows ``grad`` (its own gradient, or one the step created) into
    the shard's gradient."""
    if grad is None:
        return
    if s.param.grad is None:
        set_local_grad(s, grad.clone())
    elif grad_local(s).data_ptr() != grad.data_ptr():
        grad_local(s).copy_(grad)


def keep_rows(s: ShardedParameter, grad: Tensor | None) -> None:
    """Writes this rank's rows of the full ``grad`` into the shard's gradient."""
    if grad is None:
        return
    start, end = own_rows(s)
    rows = grad[start:end]
    if s.param.grad is None:  # created by the step (a missing bias gradient, as zeros)
        set_local_grad(s, rows.clone())
        return
    sharded_grad = s.param.grad
    assert isinstance(sharded_grad, DTensor)
    target = sharded_grad.to_local()
    if target.data_ptr() != rows.data_ptr():
        target.copy_(rows)
