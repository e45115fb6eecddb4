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
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch

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
    compiled at its first call; ``function`` itself for a ``None`` backend and after a
    failure (module notes). ``function`` must be pure (it may change in place only
    tensors it made), so that a failed compiled call can be run again eagerly."""

    def __init__(self, function: Callable[..., Any], backend: str | None) -> None:
        check_backend(backend)
        self.function = function
        self.backend = backend
        self._compiled: Callable[..., Any] | None = None

    @property
    def active(self) -> bool:
        """Whether calls go through the compiler (a backend, and no failure yet)."""
        return self.backend is not None

    def __call__(self, *args: Any) -> Any:
        """``function(*args)``, compiled where :attr:`active`."""
        if self.backend is None:
            return self.function(*args)
        if self._compiled is None:
            own = own_code(self.function)
            self._compiled = torch.compile(own, backend=self.backend, fullgraph=True, dynamic=False)
        try:
            return self._compiled(*args)
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
