"""A solver's per-step elementwise work run through ``torch.compile``, eager as the fallback.

On a GPU the moment update and scaling of the eigenbasis-moment solvers are a dozen or two
elementwise passes a group of layers (one flat pass for all groups on a launch-bound device:
:mod:`dkfac.solvers.flat_moments`), each a kernel launch; a compiler fuses them into one or
two kernels. :class:`Compiled` runs a function through ``torch.compile`` with a backend
(``"inductor"``: generated kernels, Triton on a CUDA device and C++ on a CPU, which needs a
C compiler; ``"aot_eager"``: the same capture run by eager kernels, a check of the capture
with no speed-up) and, on the first failure of the compiler (or of its generated code),
logs a warning and runs the eager function from then on. The compiled code may round in
another order than eager kernels (a fused multiply-add, say): its results equal eager ones
to the rounding, not bit for bit.

Dynamo keeps its graphs, and counts the recompilations it allows (eight by default), per
code object; past the limit it runs the function eagerly. One solver preconditions every
group of its options, each group of its own shapes, and the graphs are static
(``dynamic=False``: symbolic shapes broke dynamo's guards on block-diagonal bases). So a
:class:`Compiled` compiles a copy of the function's code object (:func:`own_code`) for each
key of its tensor arguments' shapes, dtypes and devices: a model of many shapes never
reaches the limit, and what a graph reads as constants (the options, Python numbers)
recompiles only its own key. Values that change every step (a cycled β₁, a damping
schedule) are not for a compiler: :meth:`Compiled.stop` runs the function eagerly from then
on.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

__all__ = ["COMPILE_BACKENDS", "Compiled", "check_backend", "own_code"]

logger = logging.getLogger(__name__)

COMPILE_BACKENDS = ("inductor", "aot_eager")
"""The ``torch.compile`` backends a solver's elementwise work may run through."""


def check_backend(backend: object, name: str = "compile_backend") -> None:
    """Raises ValueError unless ``backend`` (the option ``name``) is ``None`` or one of
    :data:`COMPILE_BACKENDS`."""
    if backend is not None and backend not in COMPILE_BACKENDS:
        raise ValueError(f"{name} must be None or one of {COMPILE_BACKENDS}, got {backend!r}")


class Compiled:
    """``function`` through ``torch.compile(backend=backend, fullgraph=True, dynamic=False)``,
    compiled at the first call of each key of its tensor arguments (module notes);
    ``function`` itself for a ``None`` backend and after a failure. ``function`` must be
    pure (it may change in place only tensors it made), so that a failed compiled call can
    be run again eagerly."""

    def __init__(self, function: Callable[..., Any], backend: str | None) -> None:
        check_backend(backend)
        self.function = function
        self.backend = backend
        self._compiled: dict[Hashable, Callable[..., Any]] = {}

    @property
    def active(self) -> bool:
        """Whether calls go through the compiler (a backend, and no failure yet)."""
        return self.backend is not None

    def stop(self) -> bool:
        """Where ``function`` has compiled, runs it eagerly from now on and returns ``True``:
        its graphs hold the values it reads (options, Python numbers) as constants, so values
        that keep changing would compile a graph each. Not compiled yet: ``False``, nothing
        changes (the first call compiles with the values of that moment)."""
        if self.backend is None or not self._compiled:
            return False
        self.backend = None
        return True

    def __call__(self, *args: Any) -> Any:
        """``function(*args)``, compiled where :attr:`active`."""
        if self.backend is None:
            return self.function(*args)
        key = tuple((a.shape, a.dtype, a.device) for a in args if isinstance(a, Tensor))
        compiled = self._compiled.get(key)
        if compiled is None:
            own = own_code(self.function)
            compiled = torch.compile(own, backend=self.backend, fullgraph=True, dynamic=False)
            self._compiled[key] = compiled
        try:
            return compiled(*args)
        except Exception as err:
            logger.warning(
                "torch.compile (%s) failed for %s (%s: %s); running it eagerly from now on",
                self.backend,
                getattr(self.function, "__qualname__", self.function),
                type(err).__name__,
                str(err).splitlines()[0] if str(err) else "",
            )
            self.backend = None
            return self.function(*args)


def own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a plain function or a bound method) with a copy of its code object of
    its own: the same behaviour, its own ``torch.compile`` cache (module notes)."""
    bound = getattr(function, "__self__", None)
    plain = getattr(function, "__func__", function)
    if not isinstance(plain, types.FunctionType):
        return function  # a callable object: compiled as it is
    copy = types.FunctionType(
        plain.__code__.replace(),
        plain.__globals__,
        plain.__name__,
        plain.__defaults__,
        plain.__closure__,
    )
    copy.__kwdefaults__ = plain.__kwdefaults__
    copy.__qualname__ = plain.__qualname__
    return copy if bound is None else types.MethodType(copy, bound)
