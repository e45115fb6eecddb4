"""A step inside PyTorch's ``Join`` context, which shadows DDP's collectives but not K-FAC's.

``torch.distributed.algorithms.join.Join([ddp_model])`` lets ranks with fewer batches
finish early: a rank that has run out of inputs loops in ``Join.__exit__``, answering each
collective a :class:`~torch.distributed.algorithms.join.Joinable` (DDP) runs on the ranks
still training. K-FAC's step (and, under the overlapped reduction, the backward) runs
collectives of its own that nobody shadows, so they meet the joined rank's DDP shadows:
gloo aborts the process on the size mismatch or waits until the process group's timeout,
and a collective of the same size would mix unrelated tensors. With
``throw_on_early_termination=True`` the ranks still training raise ``RuntimeError`` at
their next forward, before any K-FAC collective of that step, so that mode is safe.

:func:`refuse_join` makes the unsafe mode an error at the first step inside it, on every
rank alike (each rank runs that step: nobody has run out yet, unless a rank had no batch at
all), instead of a crash, a hang or mixed tensors when the first rank runs out.
"""

from __future__ import annotations

from torch import nn

from dkfac.engine.registration import ddp_wrapper

__all__ = ["refuse_join"]


def refuse_join(model: nn.Module) -> None:
    """Raises when the DDP wrapper of ``model`` is inside ``Join`` without
    ``throw_on_early_termination`` (module notes).

    Args:
        model: The model as given to the preconditioner (DDP, or a wrapper around one).

    Raises:
        RuntimeError: Saying what to use instead.
    """
    ddp = ddp_wrapper(model)
    config = getattr(ddp, "_join_config", None)  # set by Join on each of its joinables
    if config is None or not config.enable or config.throw_on_early_termination:
        return
    raise RuntimeError(
        "step() inside torch.distributed.algorithms.join.Join(...) without "
        "throw_on_early_termination=True: a rank that runs out of inputs shadows DDP's "
        "collectives but not K-FAC's, so the ranks would crash, hang or mix tensors. Use "
        "Join([model], throw_on_early_termination=True) (every rank stops when the first "
        "runs out), or give every rank the same number of batches "
        "(DistributedSampler(..., drop_last=True))"
    )
