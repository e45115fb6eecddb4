"""The hooks a preconditioner leaves on the user's model, and what a copy of the model gets.

``torch.save(model)`` pickles every module's forward hooks and every parameter's
post-accumulate-grad hooks, and ``copy.deepcopy(model)`` copies them (an EMA of the weights,
a model kept for evaluation). A closure cannot be pickled, and a deep copy of one that holds
the preconditioner's capture would copy the capture's whole state into the model's copy and
keep capturing there. So every such hook is a :class:`ModelHook`: the model's copy gets an
inert hook, which does nothing, and the copy is a plain model again.

A hooked module also runs outside the training forward: ``torch.func.functional_call``
with other tensors as its parameters (a teacher's or an inner loop's weights), and under
``torch.func`` transforms (``vmap(grad(...))``: per-sample gradients). Those forwards are
not the model's (:func:`runs_as_the_model`): their statistics would be another network's,
and a transform's tensors cannot outlive it.

Under ``torch.compile`` every such hook runs eagerly (:func:`compiler_disabled`): the
statistics are Python state, which a hook traced into a graph would drop.

A backward or a step may run inside the user's ``torch.autocast`` region (Lightning's manual
optimization runs ``training_step``, its ``manual_backward`` and ``opt.step()`` included,
inside it; a loop may call ``loss.backward()`` under its ``with``): the gradient hooks and
the step then run with autocast on, which would compute the factors' products and the
preconditioned update in bfloat16 or float16. They run :func:`outside_autocast`, in the
dtypes they choose, as in a backward and a step outside the region.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

_EAGER_REASON = (
    "dkfac's hooks on the model run eagerly: they keep statistics in Python state, which a "
    "compiled graph drops (compile without fullgraph=True)"
)


def outside_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """A context with ``torch.autocast`` off where the caller is inside an autocast region
    (module notes).

    Args:
        device: The device whose type's autocast is checked, beside the CPU's.

    Returns:
        A context that turns off each of those autocasts that is on; a null context where
        none is.
    """
    kinds = {device.type, "cpu"}
    on = [k for k in kinds if torch.amp.is_autocast_available(k) and torch.is_autocast_enabled(k)]
    if not on:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for kind in on:
        stack.enter_context(torch.autocast(kind, enabled=False))
    return stack


def compiler_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``torch.compiler.disable`` (with :data:`_EAGER_REASON` where torch takes
    a reason): dynamo never traces it, it runs eagerly."""
    try:
        return torch.compiler.disable(fn, reason=_EAGER_REASON)
    except TypeError:  # a torch without ``reason=``
        return torch.compiler.disable(fn)


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

    # Run eagerly under torch.compile: dynamo traces the hooks of a module it inlines, and
    # a gradient hook registered on an intermediate tensor in a traced region becomes a
    # graph of tensor operations whose Python side effects (the capture's statistics) are
    # dropped: a compiled model would capture nothing. A disabled call is a graph break
    # (``fullgraph=True`` refuses it, with this reason).
    __call__ = compiler_disabled(__call__)

    def __reduce__(self) -> tuple[type[ModelHook], tuple[None]]:
        return ModelHook, (None,)


class PositionalInput:
    """A forward pre-hook (``with_kwargs=True``) that passes a layer's input positionally
    where the call gave it by keyword (``layer(input=x)``), the same binding of the same
    forward: the hooks that read a layer's input (a forward hook sees the positional
    arguments only) then see it. Registered first on every hooked layer; a copy of the
    model gets an inert one (the module notes), which leaves every call as it is.

    Args:
        active: ``False`` for the inert copy.
    """

    __slots__ = ("active",)

    def __init__(self, active: bool = True) -> None:
        self.active = active

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self.active or args or not kwargs:
            return None
        name = _first_parameter(module)
        if name is None or name not in kwargs:
            return None
        rest = dict(kwargs)
        return (rest.pop(name),), rest

    __call__ = compiler_disabled(__call__)

    def __reduce__(self) -> tuple[type[PositionalInput], tuple[bool]]:
        return PositionalInput, (False,)


def _first_parameter(module: torch.nn.Module) -> str | None:
    """The name of the first parameter of ``module``'s forward where it may be given
    positionally (``input`` for ``nn.Linear``); ``None`` where there is none. A forward
    that passes ``*args, **kwargs`` on (a wrapper subclass) takes the name of the first
    forward along the class's bases that names it."""
    forwards = [module.forward] + [
        vars(cls)["forward"] for cls in type(module).__mro__[1:] if "forward" in vars(cls)
    ]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for index, forward in enumerate(forwards):
        try:
            parameters = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):
            return None
        if index > 0:  # an unbound base forward: its first parameter is self
            parameters = parameters[1:]
        if not parameters:
            return None
        if parameters[0].kind in positional:
            return parameters[0].name
        if parameters[0].kind != inspect.Parameter.VAR_POSITIONAL:
            return None  # keyword-only: it cannot be passed positionally
    return None


def runs_as_the_model(registered: Sequence[Tensor], current: Sequence[Tensor]) -> bool:
    """Whether a registered module's forward runs as the model's own: with the parameters
    it had when the preconditioner was built (:func:`same_parameters`), and outside every
    ``torch.func`` transform."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return same_parameters(registered, current)


def same_parameters(registered: Sequence[Tensor], current: Sequence[Tensor]) -> bool:
    """Whether a module holds the parameters it had when the preconditioner was built
    (``registered``; ``current``: what it holds now), the same tensors. A registered
    parameter that is a sharded ``DTensor`` (FSDP2) takes any tensor: FSDP2 swaps the
    unsharded ones in."""
    return len(current) == len(registered) and all(
        now is then or isinstance(then, DTensor)
        for now, then in zip(current, registered, strict=True)
    )
