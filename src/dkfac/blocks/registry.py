"""Which block handles which module type; users can register their own."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dkfac.blocks.base import Block
from dkfac.blocks.batchnorm import BatchNormBlock
from dkfac.blocks.conv2d import Conv2dBlock
from dkfac.blocks.embedding import EmbeddingBlock
from dkfac.blocks.linear import LinearBlock

logger = logging.getLogger(__name__)

BlockFactory = Callable[..., Block]

_REGISTRY: dict[type[nn.Module], BlockFactory] = {
    nn.Linear: LinearBlock,
    nn.Conv2d: Conv2dBlock,
    nn.Embedding: EmbeddingBlock,
    _BatchNorm: BatchNormBlock,
}


def register_block(module_type: type[nn.Module], factory: BlockFactory) -> None:
    """Registers (or replaces) the block used for ``module_type``.

    Args:
        module_type: An ``nn.Module`` subclass; subclasses of it match too unless they have
            their own entry.
        factory: Called as ``factory(name, module)``, plus those keyword options of
            :func:`make_block` that its signature names (e.g. ``reduction``); returns a
            :class:`Block`.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    _REGISTRY[module_type] = factory


def _accepted(factory: BlockFactory, options: dict[str, Any]) -> dict[str, Any]:
    """The options whose names are keyword parameters of ``factory`` (all, for ``**kw``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature: positional call only
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {key: value for key, value in options.items() if key in params}


def make_block(name: str, module: nn.Module, **options: Any) -> Block | None:
    """The block for ``module``, or ``None`` when its type is not supported.

    Grouped convolutions are skipped with a warning (their weight is block-diagonal over
    groups, which one Kronecker pair would describe wrongly), and so are sparse embeddings.

    Args:
        name: The module's qualified name.
        module: The module.
        **options: Keyword options for the factories that accept them (by parameter name),
            e.g. ``reduction``, ``positions`` and ``seed`` of
            :class:`~dkfac.blocks.conv2d.Conv2dBlock`; others ignore them.
    """
    for klass in type(module).__mro__:
        factory = _REGISTRY.get(klass)
        if factory is None:
            continue
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            logger.warning(
                "skipping %s: grouped convolution (groups=%d) is not supported; it keeps its "
                "plain gradient",
                name,
                module.groups,
            )
            return None
        if isinstance(module, _BatchNorm) and not module.affine:
            return None  # no parameters: nothing to precondition
        if isinstance(module, nn.Embedding) and module.sparse:
            logger.warning(
                "skipping %s: sparse embedding gradients are not supported; it keeps its "
                "plain gradient",
                name,
            )
            return None
        return factory(name, module, **_accepted(factory, options))
    return None
