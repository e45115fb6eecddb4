"""Parameter layouts: where the weights and their averaged gradients live.

With DDP (or one process) every rank holds every weight and its whole averaged gradient: the
*replicated* layout, which needs nothing from this module. Under FSDP2
(``torch.distributed.fsdp.fully_shard``) and HSDP (``fully_shard`` on a 2-D mesh, replicate
× shard) each weight and its averaged gradient are DTensors cut on dim 0 (output rows /
output channels) over the shard dimension of the mesh: the *sharded* layout,
:class:`ShardedLayout`.

The hooks see full activations and full output gradients either way (a layer runs on
unsharded weights), so factors are built and reduced as with DDP. What the sharded layout
adds is the gradient exchange around the step (:meth:`ShardedLayout.full_gradients`): every
rank's rows of the preconditioned layers' gradients are gathered (one all-gather per bucket
of about ``bucket_bytes``, over the shard group, recorded as ``"gradients"`` on the ledger),
the step runs on the full averaged gradients exactly as under DDP (so every strategy whose
math is the serial math stays exact), and each rank keeps its own rows of the result.

:func:`find_layout` checks a model at construction and refuses, naming the parameter and what
is allowed: a model where some trainable parameters are DTensors and others not, a placement
other than ``Shard(0)`` / ``Replicate()`` (tensor parallelism's ``Shard(1)``), DTensors on
different meshes, FSDP1's ``FullyShardedDataParallel`` wrapper, and ``strategy="spngd"``
(which reduces unreduced gradients itself; FSDP2 has already reduced them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from dkfac.distributed.comm import CommLedger, Communicator

__all__ = ["ShardedLayout", "find_layout"]

_STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp", "auto")
"""Strategies offered with the sharded layout (``auto`` never picks ``spngd`` here)."""


def _is_fsdp1(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a build without FSDP1
        return False
    return isinstance(module, FullyShardedDataParallel)


@dataclass
class _Sharded:
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


def find_layout(
    model: nn.Module,
    layer_params: Mapping[str, Sequence[Tensor]],
    *,
    strategy: str,
    ledger: CommLedger,
    bucket_bytes: int,
) -> ShardedLayout | None:
    """The sharded layout of ``model``, ``None`` when its parameters are plain tensors.

    Args:
        model: The model handed to the preconditioner (wrappers included).
        layer_params: The parameters each preconditioned layer takes, by layer name.
        strategy: The configured strategy.
        ledger: Where the gradient exchange records its bytes (the preconditioner's).
        bucket_bytes: Size of one all-gather bucket.

    Raises:
        ValueError: For FSDP1, a mix of DTensor and plain parameters, a placement other
            than ``Shard(0)``/``Replicate()``, DTensors on different meshes, or a strategy
            that cannot apply to sharded parameters.
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
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sharded = [(n, p) for n, p in named if isinstance(p, DTensor)]
    if not sharded:
        return None
    plain = [n for n, p in named if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"parameter {plain[0]!r} is a plain tensor while {sharded[0][0]!r} is a DTensor: "
            "K-FAC needs every trainable parameter in one layout; apply fully_shard to the "
            "root module too (or to none, under DDP)"
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


class ShardedLayout:
    """Full gradients for the step from the dim-0 shards of FSDP2/HSDP, rows back after.

    Args:
        model: The sharded model.
        layer_params: The parameters each preconditioned layer takes, by layer name.
        ledger: Where the gradient exchange records its bytes.
        bucket_bytes: Size of one all-gather bucket (after padding the shards).
    """

    def __init__(
        self,
        model: nn.Module,
        layer_params: Mapping[str, Sequence[Tensor]],
        *,
        ledger: CommLedger,
        bucket_bytes: int,
    ) -> None:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    slots.setdefault(id(param), []).append((module, attr))
        self.params: list[_Sharded] = []
        seen: set[int] = set()
        for params in layer_params.values():
            for tensor in params:
                if id(tensor) in seen or not isinstance(tensor, DTensor):
                    continue
                seen.add(id(tensor))
                dims = [i for i, p in enumerate(tensor.placements) if p == Shard(0)]
                self.params.append(
                    _Sharded(
                        names[id(tensor)], tensor, slots[id(tensor)], dims[0] if dims else None
                    )
                )
        mesh = self.params[0].param.device_mesh if self.params else None
        cut = {s.mesh_dim for s in self.params if s.mesh_dim is not None}
        self.mesh_dim = cut.pop() if cut else None
        group = None if mesh is None or self.mesh_dim is None else mesh.get_group(self.mesh_dim)
        self.comm = Communicator(group, ledger=ledger, bucket_bytes=bucket_bytes)

    @property
    def shards(self) -> int:
        """Ranks a weight is cut over (the shard group's size)."""
        return self.comm.world_size

    def _gather(self, present: list[_Sharded]) -> dict[int, Tensor]:
        """Full gradients of ``present`` (their ``.grad`` set), in buckets of padded shards."""
        full: dict[int, Tensor] = {}
        cut = [s for s in present if s.parts > 1 and self.comm.active]
        for s in present:
            if s not in cut:  # replicated, or one shard: the local tensor is the whole
                full[id(s.param)] = s.param.grad.to_local()  # type: ignore[union-attr]
        buckets: list[list[_Sharded]] = []
        size = 0
        for s in cut:
            nbytes = s.chunk_rows() * _row_numel(s.param) * s.param.element_size()
            if not buckets or size + nbytes > self.comm.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(s)
            size += nbytes
        for bucket in buckets:
            full.update(self._gather_bucket(bucket))
        return full

    def _gather_bucket(self, bucket: list[_Sharded]) -> dict[int, Tensor]:
        """One all-gather of the bucket's padded shards; the full gradients it yields."""
        grads = [s.param.grad.to_local() for s in bucket]  # type: ignore[union-attr]
        sizes = [s.chunk_rows() * _row_numel(s.param) for s in bucket]
        flat = grads[0].new_zeros(1, sum(sizes))
        offset = 0
        for grad, size in zip(grads, sizes, strict=True):
            flat[0, offset : offset + grad.numel()] = grad.reshape(-1)
            offset += size
        gathered, handle = self.comm.all_gather_rows(flat, "gradients")
        handle.wait()
        out: dict[int, Tensor] = {}
        offset = 0
        for s, size in zip(bucket, sizes, strict=True):
            pieces = []
            for index in range(s.parts):
                start, end = s.rows_of(index)
                count = (end - start) * _row_numel(s.param)
                pieces.append(gathered[index, offset : offset + count])
            shape = (s.param.shape[0], *s.param.shape[1:])
            out[id(s.param)] = torch.cat(pieces).reshape(shape)
            offset += size
        return out

    @contextlib.contextmanager
    def full_gradients(self) -> Iterator[None]:
        """Within it, the preconditioned layers' parameters are plain stand-ins whose
        ``.grad`` is the full averaged gradient; on leaving, each rank's rows of the
        (preconditioned) gradients are written into its shards and the parameters put back.

        The stand-ins hold no weights (a zero-stride view of the parameter's shape: the
        step reads only gradients), so the exchange moves gradients only.
        """
        present = [s for s in self.params if s.param.grad is not None]
        full = self._gather(present)
        stand_ins: dict[int, Tensor] = {}
        for s in self.params:
            local = s.param.to_local()
            stand_in = local.new_zeros(()).expand(s.param.shape)
            if id(s.param) in full:
                stand_in.grad = full[id(s.param)]
            stand_ins[id(s.param)] = stand_in
            for module, attr in s.slots:
                module._parameters[attr] = stand_in  # type: ignore[assignment]
        try:
            yield
        finally:
            for s in self.params:
                for module, attr in s.slots:
                    module._parameters[attr] = s.param  # type: ignore[assignment]
                _keep_rows(s, stand_ins[id(s.param)].grad)


def _row_numel(param: Tensor) -> int:
    """Entries in one dim-0 row of ``param``."""
    return int(math.prod(param.shape[1:]))


def _keep_rows(s: _Sharded, grad: Tensor | None) -> None:
    """Writes this rank's rows of the full ``grad`` into the shard's gradient."""
    if grad is None:
        return
    start, end = s.rows_of(s.index()) if s.parts > 1 else (0, s.param.shape[0])
    rows = grad[start:end]
    if s.param.grad is None:  # created by the step (a missing bias gradient, as zeros)
        local = rows.clone()
        s.param.grad = DTensor.from_local(
            local,
            s.param.device_mesh,
            s.param.placements,
            shape=s.param.shape,
            stride=s.param.stride(),
        )
        return
    sharded_grad = s.param.grad
    assert isinstance(sharded_grad, DTensor)
    target = sharded_grad.to_local()
    if target.data_ptr() != rows.data_ptr():
        target.copy_(rows)


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
