"""How a collective's tensors travel: symmetric matrices packed to their upper triangle, and
tensors grouped per owner into size-capped flat buckets of one dtype and device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.distributed.ledger import Kind

__all__ = ["Bucket", "bucket_tensors", "pack_triangle", "split_by_owner", "unpack_triangle"]


def pack_triangle(sym: Tensor) -> Tensor:
    """Upper triangle (diagonal included) of a square matrix, row-major, as a 1-D tensor.

    Args:
        sym: ``n×n`` matrix.

    Returns:
        A new 1-D tensor of ``n(n+1)/2`` entries.

    Raises:
        ValueError: If ``sym`` is not a square 2-D tensor.
    """
    if sym.dim() != 2 or sym.shape[0] != sym.shape[1]:
        raise ValueError(f"sym must be a square matrix, got shape {tuple(sym.shape)}")
    n = sym.shape[0]
    rows, cols = torch.triu_indices(n, n, device=sym.device)
    return sym[rows, cols]


def unpack_triangle(flat: Tensor, n: int) -> Tensor:
    """Symmetric ``n×n`` matrix from the output of :func:`pack_triangle`.

    Args:
        flat: 1-D tensor of ``n(n+1)/2`` entries.
        n: Matrix side.

    Returns:
        A new symmetric matrix whose upper and lower triangles both equal ``flat``'s entries.

    Raises:
        ValueError: If ``flat`` has the wrong shape.
    """
    if flat.dim() != 1 or flat.numel() != n * (n + 1) // 2:
        raise ValueError(
            f"flat must be 1-D with n(n+1)/2 = {n * (n + 1) // 2} entries, "
            f"got shape {tuple(flat.shape)}"
        )
    out = flat.new_zeros(n, n)
    rows, cols = torch.triu_indices(n, n, device=flat.device)
    out[rows, cols] = flat
    out[cols, rows] = flat
    return out


class Bucket:
    """Tensors flattened into one contiguous buffer (packed triangles where ``packed``)."""

    def __init__(self, tensors: list[Tensor], packed: list[bool], kinds: list[Kind]) -> None:
        self.tensors = tensors
        self.packed = packed
        self.kinds = kinds
        parts = [
            pack_triangle(t) if p else t.reshape(-1) for t, p in zip(tensors, packed, strict=True)
        ]
        self.numels = [p.numel() for p in parts]
        self.flat = torch.cat(parts)  # always a fresh buffer: callers' tensors stay intact

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def bytes_by_kind(self) -> dict[Kind, int]:
        """Bytes of the buffer that belong to each kind (they sum to :attr:`nbytes`)."""
        out: dict[Kind, int] = {}
        for kind, numel in zip(self.kinds, self.numels, strict=True):
            out[kind] = out.get(kind, 0) + numel * self.flat.element_size()
        return out

    def unflatten(self, scale: float | None = None) -> None:
        flat = self.flat if scale is None else self.flat.mul_(scale)
        parts = zip(self.tensors, self.packed, flat.split(self.numels), strict=True)
        for t, packed, part in parts:
            if packed:
                t.copy_(unpack_triangle(part, t.shape[0]))
            else:
                t.copy_(part.view(t.shape))


def split_by_owner(
    count: int, owners: Sequence[int] | None, ranks: Sequence[int]
) -> dict[int, list[int]]:
    """Tensor indices grouped by owner, owners ascending (identical on all ranks)."""
    if owners is None:
        return {-1: list(range(count))}
    if len(owners) != count:
        raise ValueError(f"owners must have one entry per tensor: {len(owners)} != {count}")
    by_owner: dict[int, list[int]] = {}
    for i, owner in enumerate(owners):
        if owner not in ranks:
            raise ValueError(
                f"owner/src rank {owner!r} of tensors[{i}] is not in the group {ranks}"
            )
        by_owner.setdefault(owner, []).append(i)
    return {o: by_owner[o] for o in sorted(by_owner)}


def bucket_tensors(
    tensors: Sequence[Tensor], packed: Sequence[bool], kinds: Sequence[Kind], bucket_bytes: int
) -> list[Bucket]:
    """Group tensors (order kept within each dtype/device) into size-capped buckets.

    ``packed`` and ``kinds`` (ledger kinds) hold one entry per tensor.
    """
    Entry = tuple[Tensor, bool, Kind]
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[Entry], int]] = {}
    groups: list[list[Entry]] = []
    for entry in zip(tensors, packed, kinds, strict=True):
        t, pack, _ = entry
        n = t.shape[0] if pack else 0
        size = (n * (n + 1) // 2 if pack else t.numel()) * t.element_size()
        key = (t.dtype, t.device)
        members, used = open_.get(key, ([], 0))
        if members and used + size > bucket_bytes:
            groups.append(members)
            members, used = [], 0
        members.append(entry)
        open_[key] = (members, used + size)
    groups.extend(m for m, _ in open_.values() if m)
    return [
        Bucket([t for t, _, _ in g], [p for _, p, _ in g], [k for _, _, k in g]) for g in groups
    ]
