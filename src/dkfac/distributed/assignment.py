"""Pure, deterministic placement of K-FAC work onto ranks.

Nothing in this module touches a process group: every function takes plain numbers and
returns plain data, so every rank that calls it with the same arguments gets the same answer,
and the placement is unit-tested without ``torch.distributed``.

Placement has two parts:

1. **Inverse owners.** Each layer (its A and G factors together, one indivisible unit) is
   given to one rank that computes its damped inverse / eigendecomposition. Owners are chosen
   by longest-processing-time (LPT) greedy scheduling on a per-layer cost
   (a block's ``placement_cost``, :func:`assign_lpt`).
2. **Gradient workers (KAISA).** With ``P`` ranks and gradient-worker fraction ``f``, every
   layer is preconditioned by ``n = round(f·P)`` ranks, its *gradient workers*. The ranks are
   partitioned into ``P/n`` *grad-worker groups* of ``n`` ranks each, by stride::

       group k = [k, k + P/n, k + 2·P/n, ..., k + (n-1)·P/n]      for k in range(P/n)

   A layer whose inverse owner is ``r`` is preconditioned by the group containing ``r``
   (``r mod P/n`` is its index). ``f = 1`` gives one group holding every rank (COMM-OPT:
   everybody preconditions everything, "replicated"); ``f = 1/P`` gives singleton groups
   (MEM-OPT: only the owner preconditions).

   The complementary *grad-receiver groups* are the ``n`` contiguous blocks
   ``[j·P/n, ..., (j+1)·P/n - 1]`` for ``j in range(n)``. Each receiver group holds exactly one
   member of every grad-worker group, so for any layer the grad worker in receiver group
   ``j`` sends the layer's preconditioned gradient to the other ranks of block ``j``
   (:func:`grad_source_for`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "LayerPlacement",
    "assign_lpt",
    "grad_receiver_groups",
    "grad_source_for",
    "grad_worker_count",
    "grad_worker_groups",
    "grad_workers_for",
    "plan_placement",
    "serving_worker",
    "shard_offsets",
    "shard_sizes",
]


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def assign_lpt(costs: Mapping[str, float], world_size: int) -> dict[str, int]:
    """Assign layers to ranks with longest-processing-time greedy scheduling.

    Layers are visited by cost, largest first (equal costs in ascending name order), and each
    goes to the rank with the smallest accumulated cost so far; equal loads go to the rank
    holding fewer layers, then to the lowest rank (so zero-cost layers still spread out).
    The result depends only on the arguments, so every rank computes the same placement.
    With more ranks than layers some ranks own nothing.

    Args:
        costs: Layer name -> non-negative finite cost (for example a block's ``placement_cost``).
        world_size: Number of ranks, at least 1.

    Returns:
        Layer name -> owning rank, in the iteration order of ``costs``.

    Raises:
        ValueError: If ``world_size < 1`` or a cost is negative, NaN or infinite.
    """
    _check_world_size(world_size)
    for name, cost in costs.items():
        value = float(cost)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"costs[{name!r}] must be finite and >= 0, got {cost!r}")
    # a heap of (load, layers held, rank): its top is the rank the rule picks, so a plan
    # for many ranks costs O(layers · log ranks), not O(layers · ranks)
    ranks = [(0.0, 0, r) for r in range(world_size)]
    owners: dict[str, int] = {}
    for name in sorted(costs, key=lambda n: (-float(costs[n]), n)):
        load, count, rank = ranks[0]
        owners[name] = rank
        heapq.heapreplace(ranks, (load + float(costs[name]), count + 1, rank))
    return {name: owners[name] for name in costs}


def grad_worker_count(world_size: int, grad_worker_fraction: float) -> int:
    """Number ``n = round(f·P)`` of gradient workers per layer.

    Args:
        world_size: Number of ranks ``P``.
        grad_worker_fraction: KAISA fraction ``f`` in ``(0, 1]``.

    Returns:
        ``n``, which is at least 1 and divides ``world_size``; 1 on one rank whatever ``f``
        (one process is the serial engine, so a script runs unchanged on one rank and on
        many).

    Raises:
        ValueError: If ``f`` is outside ``(0, 1]``, or with several ranks ``n`` is 0 or does
            not divide ``P``.
    """
    _check_world_size(world_size)
    fraction = float(grad_worker_fraction)
    if not math.isfinite(fraction) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"grad_worker_fraction must be in (0, 1], got {grad_worker_fraction!r}")
    if world_size == 1:
        return 1
    n = round(fraction * world_size)
    if n < 1 or world_size % n != 0:
        raise ValueError(
            "world size must be divisible by grad_worker_fraction × world_size: "
            f"grad_worker_fraction={grad_worker_fraction!r}, world_size={world_size}, "
            f"round(grad_worker_fraction × world_size)={n}"
        )
    return n


def grad_worker_groups(world_size: int, grad_worker_fraction: float) -> list[list[int]]:
    """Partition the ranks into KAISA grad-worker groups (stride partition).

    Args:
        world_size: Number of ranks ``P``.
        grad_worker_fraction: KAISA fraction ``f``; ``n = round(f·P)`` must divide ``P``.

    Returns:
        ``P/n`` groups of ``n`` ranks: ``[[k + j·(P/n) for j in range(n)] for k in range(P/n)]``.
        For ``P = 4``: ``f = 1`` -> ``[[0, 1, 2, 3]]``; ``f = 0.5`` -> ``[[0, 2], [1, 3]]``;
        ``f = 0.25`` -> ``[[0], [1], [2], [3]]``.

    Raises:
        ValueError: As :func:`grad_worker_count`.
    """
    n = grad_worker_count(world_size, grad_worker_fraction)
    stride = world_size // n
    return [[k + j * stride for j in range(n)] for k in range(stride)]


def grad_receiver_groups(world_size: int, grad_worker_fraction: float) -> list[list[int]]:
    """Partition the ranks into KAISA grad-receiver groups (contiguous blocks).

    Block ``j`` holds exactly one member of every grad-worker group; that member sends the
    preconditioned gradient of the layers its group handles to the rest of block ``j``.

    Args:
        world_size: Number of ranks ``P``.
        grad_worker_fraction: KAISA fraction ``f``; ``n = round(f·P)`` must divide ``P``.

    Returns:
        ``n`` groups of ``P/n`` ranks: ``[list(range(j·P/n, (j+1)·P/n)) for j in range(n)]``.

    Raises:
        ValueError: As :func:`grad_worker_count`.
    """
    n = grad_worker_count(world_size, grad_worker_fraction)
    size = world_size // n
    return [list(range(j * size, (j + 1) * size)) for j in range(n)]


def serving_worker(grad_workers: Sequence[int], world_size: int, index: int) -> int:
    """The grad worker that delivers a layer's preconditioned gradient to rank ``index``.

    It is the one member of ``grad_workers`` inside ``index``'s grad-receiver block
    (:func:`grad_receiver_groups`, blocks of ``P / n`` ranks): ``index`` itself when it is
    one of them.

    Args:
        grad_workers: The layer's grad workers, ascending (one per receiver block).
        world_size: Number of ranks ``P``.
        index: The receiving rank.
    """
    return grad_workers[index // (world_size // len(grad_workers))]


def _check_rank(name: str, rank: int, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{name} must be an integer in [0, {world_size}), got {rank!r}")


def grad_workers_for(owner: int, world_size: int, grad_worker_fraction: float) -> list[int]:
    """Ranks that precondition a layer whose inverse owner is ``owner``.

    Args:
        owner: Inverse owner of the layer.
        world_size: Number of ranks ``P``.
        grad_worker_fraction: KAISA fraction ``f``.

    Returns:
        The grad-worker group containing ``owner`` (ascending, includes ``owner``).

    Raises:
        ValueError: If ``owner`` is not a rank, or as :func:`grad_worker_count`.
    """
    groups = grad_worker_groups(world_size, grad_worker_fraction)
    _check_rank("owner", owner, world_size)
    return list(groups[owner % len(groups)])


def grad_source_for(rank: int, owner: int, world_size: int, grad_worker_fraction: float) -> int:
    """Grad worker from which ``rank`` obtains the preconditioned gradient of a layer.

    Args:
        rank: The rank that needs the preconditioned gradient.
        owner: Inverse owner of the layer.
        world_size: Number of ranks ``P``.
        grad_worker_fraction: KAISA fraction ``f``.

    Returns:
        The unique grad worker of the layer in ``rank``'s receiver group; ``rank`` itself when
        ``rank`` is one of the layer's grad workers.

    Raises:
        ValueError: If a rank is out of range, or as :func:`grad_worker_count`.
    """
    workers = grad_workers_for(owner, world_size, grad_worker_fraction)
    _check_rank("rank", rank, world_size)
    block = world_size // len(workers)
    return workers[rank // block]


@dataclass(frozen=True, kw_only=True)
class LayerPlacement:
    """Where one layer's second-order work runs.

    Attributes:
        name: Layer name.
        inverse_owner: Rank that computes the layer's inverse (or eigendecomposition).
        grad_workers: Ranks that precondition the layer's gradient, ascending; always
            contains ``inverse_owner``.
    """

    name: str
    inverse_owner: int
    grad_workers: tuple[int, ...]

    def is_grad_worker(self, rank: int) -> bool:
        """Whether ``rank`` preconditions this layer."""
        return rank in self.grad_workers

    def grad_source(self, rank: int, world_size: int) -> int:
        """Grad worker that sends this layer's preconditioned gradient to ``rank``.

        Args:
            rank: Receiving rank.
            world_size: Number of ranks ``P``.

        Returns:
            The grad worker in ``rank``'s receiver group (``rank`` itself if it is one).
        """
        _check_rank("rank", rank, world_size)
        block = world_size // len(self.grad_workers)
        return self.grad_workers[rank // block]


def plan_placement(
    costs: Mapping[str, float], world_size: int, grad_worker_fraction: float = 1.0
) -> dict[str, LayerPlacement]:
    """LPT inverse owners plus KAISA grad workers for every layer.

    Args:
        costs: Layer name -> non-negative finite cost.
        world_size: Number of ranks ``P``.
        grad_worker_fraction: KAISA fraction ``f`` (1 = COMM-OPT, 1/P = MEM-OPT).

    Returns:
        Layer name -> :class:`LayerPlacement`, in the iteration order of ``costs``.

    Raises:
        ValueError: As :func:`assign_lpt` and :func:`grad_worker_count`.
    """
    groups = grad_worker_groups(world_size, grad_worker_fraction)
    owners = assign_lpt(costs, world_size)
    return {
        name: LayerPlacement(
            name=name, inverse_owner=owner, grad_workers=tuple(groups[owner % len(groups)])
        )
        for name, owner in owners.items()
    }


def shard_sizes(total: int, world_size: int) -> list[int]:
    """Split ``total`` items into ``world_size`` near-equal contiguous shards.

    Args:
        total: Number of items, at least 0.
        world_size: Number of shards, at least 1.

    Returns:
        Shard sizes; the first ``total % world_size`` shards hold one extra item.

    Raises:
        ValueError: If ``total < 0`` or ``world_size < 1``.
    """
    _check_world_size(world_size)
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be an integer >= 0, got {total!r}")
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def shard_offsets(total: int, world_size: int) -> list[int]:
    """Start offsets of the shards from :func:`shard_sizes` (``world_size + 1`` entries).

    Args:
        total: Number of items, at least 0.
        world_size: Number of shards, at least 1.

    Returns:
        ``[0, s0, s0 + s1, ..., total]``.
    """
    offsets = [0]
    for size in shard_sizes(total, world_size):
        offsets.append(offsets[-1] + size)
    return offsets
