"""One harness for the tests that compare a run on several ranks with its serial twin.

A run trains ``model_fn()`` with a :class:`~dkfac.KFACPreconditioner` and SGD for some steps
on global batches ``batch_fn(step)`` (inputs and targets). The global batch is cut into
``world`` equal shards, shard ``r`` for rank ``r``, and each shard into ``micro`` equal
micro-batches. :func:`train_sharded` with ``rank=r`` trains on shard ``r``; with ``rank=None``
it is the serial twin: one process holding every shard, whose micro-batch ``k`` is every
rank's micro-batch ``k`` in rank order, so it sees exactly the rows the ranks see together.

What the loop guarantees, so that no test writes it again:

- ``batch_fn`` is called once per step, in order (a stateful generator inside it is fine);
- each micro-batch's loss is divided by ``micro`` and the preconditioner is built with
  ``accumulation_steps=micro``; a DDP model synchronises on the last micro-batch only (a
  sharded one too with ``sync_last_only=True``: ``set_requires_gradient_sync``);
- inside a process group of several ranks, an unwrapped model's gradients are averaged over
  the ranks before ``pre.step()`` (what DDP would do), unless the strategy averages them
  itself (``pre.strategy.reduces_gradients``, SP-NGD); a parameter the rank's batch did not
  reach counts as a zero gradient, so every rank launches the same collectives;
- with ``fisher="mc"`` it calls ``pre.sample_fisher(output)`` before each backward;
- with ``grad_scale`` a ``GradScaler`` scales the loss, is handed to the preconditioner and
  unscales the gradients before ``pre.step()``;
- ``pre.step(lr=lr)`` then the SGD step (learning rate ``lr``, ``momentum``), every step.

The ``assert_*`` helpers name the case and the rank in every failure message.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dkfac import KFACPreconditioner

__all__ = [
    "COMPACT_SIDES",
    "Batch",
    "Hooks",
    "Run",
    "assert_factors_close",
    "assert_ranks_match",
    "assert_tensors_close",
    "average_gradients",
    "matches_serial",
    "micro_batch_rows",
    "once_per_key",
    "params_of_cases",
    "shard_children",
    "train_case",
    "train_sharded",
]

Batch = tuple[Tensor, Tensor]

COMPACT_SIDES: dict[str, Any] = {
    "method": "eigen_adam",
    "basis_refresh": "power",
    "moment_carry": "rotate",
    "moment_eps": 1e-6,
    "basis_max_dim": 30,
    "basis_block_size": 8,
}
"""Options of a case whose statistics are not kept whole: a side wider than 30 is
one-sided (its factor kept as the ``(d,)`` diagonal), one wider than 8 block-diagonal (its
diagonal blocks of 8). For the layouts that move factors (all-reduced, owner-only, reduced
to the owners, sharded parameters): a run on several ranks must give the serial weights."""
K = TypeVar("K")
V = TypeVar("V")
Factors = Mapping[str, tuple[Tensor, Tensor]]


@dataclass
class Run:
    """A trained (or training) run: what the hooks see and what the tests read.

    Attributes:
        model: The bare model (its parameters are the ones trained).
        wrapped: What the batches go through: the DDP wrapper, or ``model``.
        pre: The preconditioner.
        optimizer: The SGD optimizer.
        scaler: The ``GradScaler``, if the run scales its loss.
        step: The step being trained (for the hooks).
        losses: Each step's loss (the mean over the rank's rows), detached.
    """

    model: nn.Module
    wrapped: nn.Module
    pre: KFACPreconditioner
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None = None
    step: int = 0
    losses: list[Tensor] = field(default_factory=list)

    def params(self) -> list[Tensor]:
        """Copies of the model's parameters, in ``parameters()`` order (a sharded one
        gathered whole: a collective under FSDP2)."""
        return [
            p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for p in self.model.parameters()
        ]

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Copies of the statistics this rank keeps, by layer name."""
        return {n: (a.clone(), g.clone()) for n, (a, g) in self.pre.factors().items()}

    def checkpoint(self) -> dict[str, Any]:
        """Deep copies of the model, optimizer and preconditioner states."""
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "opt": self.optimizer.state_dict(),
                "pre": self.pre.state_dict(),
            }
        )

    def restore(self, state: Mapping[str, Any]) -> None:
        """Loads a :meth:`checkpoint` (copied first: SGD keeps the momentum tensors it gets)."""
        state = copy.deepcopy(dict(state))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["opt"])
        self.pre.load_state_dict(state["pre"])


RunHook = Callable[[Run], None]


@dataclass(frozen=True)
class Hooks:
    """Optional callbacks into the loop; each gets the :class:`Run` (``run.step`` is set).

    Attributes:
        setup: Once, after the model, preconditioner and optimizer are built.
        before_forward: At the start of every step, before its first forward pass.
        after_backward: After the step's last backward, before unscaling and ``pre.step()``.
        after_step: After the optimizer step.
    """

    setup: RunHook | None = None
    before_forward: RunHook | None = None
    after_backward: RunHook | None = None
    after_step: RunHook | None = None


def micro_batch_rows(n: int, world: int, rank: int | None, micro: int) -> list[Tensor]:
    """Row indices of each micro-batch of one rank (``rank=None``: of the serial twin).

    Args:
        n: Rows of the global batch; ``world * micro`` must divide it.
        world: Shards the global batch is cut into (one per rank).
        rank: The rank whose shard is cut, or ``None`` for every shard: micro-batch ``k``
            is then the concatenation of every rank's micro-batch ``k``.
        micro: Micro-batches per shard.

    Returns:
        ``micro`` index tensors.
    """
    if world < 1 or micro < 1 or n % (world * micro):
        raise ValueError(f"{n} rows do not cut into {world} shards of {micro} micro-batches")
    size = n // world
    part = size // micro
    ranks = range(world) if rank is None else [rank]
    return [
        torch.cat([torch.arange(r * size + k * part, r * size + (k + 1) * part) for r in ranks])
        for k in range(micro)
    ]


def average_gradients(model: nn.Module, world_size: int) -> None:
    """What DDP would do: every trained parameter's gradient averaged over the ranks.

    A parameter without a gradient on this rank (its batch did not reach it) takes part
    with zeros, so every rank launches the same all-reduces.
    """
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world_size


def _group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _build(
    model_fn: Callable[[], nn.Module],
    *,
    ddp: bool | Mapping[str, Any],
    shard: Callable[[nn.Module], Any] | None,
    lr: float,
    momentum: float,
    grad_scale: float | None,
    options: dict[str, Any],
) -> Run:
    model = model_fn()
    if shard is not None:
        shard(model)
    ddp_options = ddp if isinstance(ddp, Mapping) else {}
    wrapped: nn.Module = (
        nn.parallel.DistributedDataParallel(model, **ddp_options) if ddp is not False else model
    )
    scaler = None
    if grad_scale is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=grad_scale)
        options = {**options, "grad_scaler": scaler}
    pre = KFACPreconditioner(wrapped, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return Run(model=model, wrapped=wrapped, pre=pre, optimizer=optimizer, scaler=scaler)


def _backward(
    run: Run, x: Tensor, y: Tensor, *, micro: int, sync: bool, mc: bool, sync_last_only: bool
) -> Tensor:
    """Forward and backward of one micro-batch; returns its (divided, unscaled) loss."""
    if sync_last_only:  # FSDP2: reduce-scatter on the last micro-batch only
        run.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
    out = run.wrapped(x)
    if mc:
        run.pre.sample_fisher(out)
    loss = F.cross_entropy(out, y)
    if micro > 1:
        loss = loss / micro
    scaled = run.scaler.scale(loss) if run.scaler is not None else loss
    no_sync = getattr(run.wrapped, "no_sync", None)
    with contextlib.nullcontext() if sync or no_sync is None else no_sync():
        scaled.backward()
    return loss.detach()


def train_sharded(
    rank: int | None,
    world: int,
    *,
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Batch],
    steps: int | range,
    micro: int = 1,
    ddp: bool | Mapping[str, Any] = False,
    shard: Callable[[nn.Module], Any] | None = None,
    lr: float = 0.1,
    momentum: float = 0.9,
    grad_scale: float | None = None,
    hooks: Hooks | None = None,
    sync_last_only: bool = False,
    **options: Any,
) -> Run:
    """Trains one rank's shard (``rank=None``: the serial twin) of ``batch_fn``'s batches.

    Args:
        rank: This rank, or ``None`` for every shard in one process (the serial twin; inside
            a process group every rank then trains on the whole batch).
        world: Shards each global batch is cut into.
        model_fn: Builds the model (seeding it itself, so every rank builds the same one).
        batch_fn: The global batch (inputs, class targets) of a step.
        steps: How many steps from step 0, or which steps (a ``range``: e.g. the rest of a
            run restored by a ``setup`` hook).
        micro: Micro-batches per shard and step (``accumulation_steps``).
        ddp: Wrap the model in ``DistributedDataParallel`` (needs a process group); a
            mapping wraps it too and holds the wrapper's keyword arguments.
        shard: Shards the built model in place (``fully_shard`` on its blocks and root:
            FSDP2 or HSDP, needs a process group); it averages the gradients itself.
        lr: The learning rate of SGD and of ``pre.step(lr=...)`` (so the preconditioner's own
            ``lr`` option is never read).
        momentum: SGD's momentum.
        grad_scale: If given, the initial scale of a ``GradScaler`` used for the loss.
        hooks: Callbacks into the loop, if any.
        sync_last_only: A sharded model (``shard``) reduces its gradients on the last
            micro-batch only (``set_requires_gradient_sync(False)`` on the others, FSDP2's
            ``no_sync()``); otherwise on every micro-batch.
        **options: Keyword arguments of :class:`~dkfac.KFACPreconditioner`.

    Returns:
        The run after its last step.
    """
    if "accumulation_steps" in options:
        raise TypeError("pass micro=..., not accumulation_steps (the loop needs to know it)")
    run = _build(
        model_fn,
        ddp=ddp,
        shard=shard,
        lr=lr,
        momentum=momentum,
        grad_scale=grad_scale,
        options={**options, "accumulation_steps": micro},
    )
    hooks = hooks or Hooks()
    group = _group_size()
    averaged = ddp is not False or shard is not None or run.pre.strategy.reduces_gradients
    average_over = group if group > 1 and not averaged else 1
    mc = options.get("fisher") == "mc"
    if hooks.setup is not None:
        hooks.setup(run)
    for step in range(steps) if isinstance(steps, int) else steps:
        run.step = step
        if hooks.before_forward is not None:
            hooks.before_forward(run)
        x, y = batch_fn(step)
        rows = micro_batch_rows(x.shape[0], world, rank, micro)
        parts = [(x[r], y[r]) for r in rows]
        _train_step(run, parts, average_over, mc, lr, hooks, sync_last_only and shard is not None)
    return run


def _train_step(
    run: Run,
    parts: list[Batch],
    average_over: int,
    mc: bool,
    lr: float,
    hooks: Hooks,
    sync_last_only: bool = False,
) -> None:
    """One step on the micro-batches ``parts``: backward each, average, precondition, step."""
    run.optimizer.zero_grad()
    losses = [
        _backward(
            run,
            x,
            y,
            micro=len(parts),
            sync=k == len(parts) - 1,
            mc=mc,
            sync_last_only=sync_last_only,
        )
        for k, (x, y) in enumerate(parts)
    ]
    run.losses.append(torch.stack(losses).sum())
    if average_over > 1:
        average_gradients(run.model, average_over)
    if hooks.after_backward is not None:
        hooks.after_backward(run)
    if run.scaler is not None:
        run.scaler.unscale_(run.optimizer)
    run.pre.step(lr=lr)
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    if hooks.after_step is not None:
        hooks.after_step(run)


def shard_children(model: nn.Module) -> None:
    """``fully_shard`` (FSDP2) on every child of ``model`` with parameters, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)


def train_case(
    rank: int | None,
    world: int,
    case: Mapping[str, Any],
    *,
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Batch],
    steps: int,
    options: Mapping[str, Any],
) -> Run:
    """:func:`train_sharded` with ``options`` updated by one case of a table; the case's
    ``"fsdp": True`` shards the model with :func:`shard_children` on a rank (the serial
    twin, ``rank=None``, is never sharded)."""
    merged = {**options, **case}
    fsdp = merged.pop("fsdp", False)
    shard = shard_children if fsdp and rank is not None else None
    return train_sharded(
        rank, world, model_fn=model_fn, batch_fn=batch_fn, steps=steps, shard=shard, **merged
    )


def params_of_cases(
    rank: int, world: int, train: Callable[..., Run], cases: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[Tensor]]:
    """Each case's parameters after ``train(rank, world, case)`` (a spawned rank's work:
    one spawn runs the whole table)."""
    return {key: train(rank, world, case).params() for key, case in cases.items()}


def matches_serial(
    results: Sequence[Mapping[str, list[Tensor]]],
    key: str,
    train: Callable[..., Run],
    cases: Mapping[str, Mapping[str, Any]],
    model_fn: Callable[[], nn.Module],
    **tolerance: float,
) -> Run:
    """Checks that the ranks' parameters of case ``key`` (:func:`params_of_cases` on each
    rank) equal its serial twin's (the case without ``ddp`` and ``fsdp``), which moved every
    parameter away from ``model_fn()``'s; returns the twin's run."""
    serial_case = {k: v for k, v in cases[key].items() if k not in ("ddp", "fsdp")}
    serial = train(None, len(results), serial_case)
    start = list(model_fn().parameters())
    assert all(not torch.equal(p, q) for p, q in zip(serial.params(), start, strict=True))
    assert_ranks_match([r[key] for r in results], serial.params(), label=key, **tolerance)
    return serial


def once_per_key(compute: Callable[[K], V]) -> Callable[[K], V]:
    """``compute`` memoised by its argument, failures included.

    For a module fixture that spawns one process group per world size for many
    parametrised cases: a spawn that failed fails every case that needs it without being
    run again.
    """
    done: dict[K, tuple[bool, Any]] = {}

    def get(key: K) -> V:
        if key not in done:
            try:
                done[key] = (True, compute(key))
            except Exception as exc:
                done[key] = (False, exc)
        ok, value = done[key]
        if not ok:
            raise value
        return cast(V, value)

    return get


def _prefixed(prefix: str) -> Callable[[str], str]:
    """A ``msg`` for ``assert_close`` that puts ``prefix`` before torch's message."""
    return lambda message: f"{prefix}: {message}"


def assert_tensors_close(
    got: Sequence[Tensor],
    want: Sequence[Tensor],
    *,
    label: str,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Pairwise ``torch.testing.assert_close`` of two equally long tensor lists.

    Args:
        got: The tensors checked.
        want: The expected tensors (same count, same order).
        label: Names the case in the failure message.
        rtol: Relative tolerance (``None``: torch's default for the dtype; give both or none).
        atol: Absolute tolerance.
    """
    assert len(got) == len(want), f"{label}: {len(got)} tensors, expected {len(want)}"
    for index, (p, q) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            p, q, rtol=rtol, atol=atol, msg=_prefixed(f"{label}, tensor {index}")
        )


def assert_ranks_match(
    per_rank: Sequence[Sequence[Tensor]],
    want: Sequence[Tensor],
    *,
    label: str,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Every rank's tensors (``per_rank[r]``, e.g. its parameters) equal ``want`` (e.g. the
    serial twin's); the arguments are :func:`assert_tensors_close`'s, the rank joins ``label``.
    """
    for rank, got in enumerate(per_rank):
        assert_tensors_close(got, want, label=f"{label}, rank {rank}", rtol=rtol, atol=atol)


def assert_factors_close(
    got: Factors,
    want: Factors,
    *,
    label: str,
    kept_only: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """The statistics in ``got`` equal those of the same layers in ``want``.

    Args:
        got: ``{layer: (A, G)}`` checked.
        want: ``{layer: (A, G)}`` expected.
        label: Names the case.
        kept_only: ``got`` may hold fewer layers than ``want`` (a rank keeps only its own);
            otherwise both must hold the same layers.
        rtol: Relative tolerance (``None``: torch's default for the dtype).
        atol: Absolute tolerance.
    """
    if kept_only:
        missing = sorted(set(got) - set(want))
        assert not missing, f"{label}: layers {missing} have no expected statistics"
    else:
        assert sorted(got) == sorted(want), f"{label}: layers {sorted(got)} != {sorted(want)}"
    for name, (a, g) in got.items():
        for side, value, expected in (("A", a, want[name][0]), ("G", g, want[name][1])):
            torch.testing.assert_close(
                value,
                expected,
                rtol=rtol,
                atol=atol,
                msg=_prefixed(f"{label}, layer {name} {side}"),
            )
