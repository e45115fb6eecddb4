"""A user's model in the training program: ``--model package.module:factory``.

:func:`load_factory` imports the callable; :func:`build_from_factory` calls it with the
keywords of the dataset's shape that its signature names (every one when it takes
``**kwargs``): ``in_channels``, ``image_size``, ``num_classes`` and, with ``--data text``,
``seq_len`` (where ``num_classes`` is the vocabulary, 256, and ``image_size`` equals
``seq_len``); a factory whose signature needs more than those is refused before it is
called. It must return an ``nn.Module``. Every failure to get one is a
:class:`ModelError` with a one-line message; an exception raised inside the factory itself is
left alone (its traceback is the user's to read).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any, cast

from torch import nn


class ModelError(ValueError):
    """A model name or ``package.module:factory`` that gives no model."""


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def load_factory(spec: str) -> Callable[..., Any]:
    """Imports the callable named by ``"package.module:factory"``.

    The current folder is put on ``sys.path`` (last) when it is not there, so a module next
    to where ``dkfac`` runs is found as it is with ``python -m dkfac``.

    Raises:
        ModelError: For a malformed spec, a module that does not import, a missing attribute
            or one that is not callable (one line each).
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ModelError(f"a model factory is written package.module:function, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ModelError(f"model factory {spec}: no module named {err.name!r}") from None
    except Exception as err:  # the user's module failed while importing: say how, in one line
        raise ModelError(
            f"model factory {spec}: importing {module_name} failed: {_one_line(err)}"
        ) from err
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ModelError(f"model factory {spec}: module {module_name} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        kind = type(target).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"  # "an int"
        raise ModelError(f"model factory {spec}: {attribute} is {article} {kind}, not a callable")
    return cast(Callable[..., Any], target)


def _keywords_taken(factory: Callable[..., Any], offered: dict[str, int]) -> dict[str, int]:
    """The keywords of ``offered`` that ``factory``'s signature names (all for ``**kwargs``)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read: call it without arguments
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(offered)
    named = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in offered.items() if k in named}


def _check_callable_with(
    spec: str, factory: Callable[..., Any], keywords: dict[str, int], offered: dict[str, int]
) -> None:
    """Refuses a factory whose signature cannot take just ``keywords`` (a parameter without
    a default that is none of them), before calling it.

    Raises:
        ModelError: Naming the parameters it needs and the keywords it is offered.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read: the call itself will say
        return
    try:
        signature.bind(**keywords)
    except TypeError:
        needed = [
            p.name
            for p in signature.parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            and p.name not in keywords
        ]
        raise ModelError(
            f"model factory {spec} needs {', '.join(needed) or 'positional arguments'}, which "
            f"the training program does not give: it calls the factory with those of "
            f"{', '.join(offered)} that its signature names, as keywords"
        ) from None


def build_from_factory(spec: str, **offered: int) -> nn.Module:
    """Calls the factory of ``spec`` with the keywords of ``offered`` it names.

    Raises:
        ModelError: If the factory cannot be loaded, needs an argument it is not offered,
            or returns no ``nn.Module``.
    """
    factory = load_factory(spec)
    keywords = _keywords_taken(factory, offered)
    _check_callable_with(spec, factory, keywords, offered)
    model = factory(**keywords)
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model factory {spec} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model
