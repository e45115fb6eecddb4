"""The hooks a preconditioner leaves on the user's model, and what a copy of the model gets.

``torch.save(model)`` pickles every module's forward hooks and every parameter's
post-accumulate-grad hooks, and ``copy.deepcopy(model)`` copies them (an EMA of the weights,
a model kept for evaluation). A closure cannot be pickled, and a deep copy of one that holds
the preconditioner's capture would copy the capture's whole state into the model's copy and
keep capturing there. So every such hook is a :class:`ModelHook`: the model's copy gets an
inert hook, which does nothing, and the copy is a plain model again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ModelHook:
    """A hook on the user's module or parameter that calls ``fn`` while it is attached.

    Pickling or deep-copying it gives an inert hook (``fn`` ``None``), which returns
    ``None``: a forward hook that leaves the output as it is, a gradient hook that does
    nothing.

    Args:
        fn: What the hook calls with its arguments; ``None`` for an inert hook.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any] | None) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        if self.fn is not None:
            self.fn(*args)

    def __reduce__(self) -> tuple[type[ModelHook], tuple[None]]:
        return ModelHook, (None,)
