"""Which block handles which module type; users can register their own.

A factory returns one block, or several for a module that holds several layers
(``nn.MultiheadAttention``: its q, k, v and out projections). Types of optional packages are
registered by qualified class name (``transformers.pytorch_utils.Conv1D``), so the package
is never imported here: a class matches when its module and qualified name are those.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from dkfac.blocks.attention import attention_blocks, functional_children
from dkfac.blocks.base import Block
from dkfac.blocks.batchnorm import BatchNormBlock
from dkfac.blocks.conv1d import Conv1dBlock
from dkfac.blocks.conv2d import Conv2dBlock
from dkfac.blocks.conv3d import Conv3dBlock, GroupedConv3dBlock
from dkfac.blocks.conv_transpose import ConvTranspose1dBlock, ConvTranspose2dBlock
from dkfac.blocks.embedding import EmbeddingBlock
from dkfac.blocks.grouped_conv import GroupedConvBlock
from dkfac.blocks.hf_conv1d import QUALIFIED_NAME as HF_CONV1D
from dkfac.blocks.hf_conv1d import HFConv1DBlock
from dkfac.blocks.linear import LinearBlock

logger = logging.getLogger(__name__)

BlockFactory = Callable[..., Block | Sequence[Block]]

_REGISTRY: dict[type[nn.Module], BlockFactory] = {
    nn.Linear: LinearBlock,
    nn.Conv1d: Conv1dBlock,
    nn.Conv2d: Conv2dBlock,
    nn.Conv3d: Conv3dBlock,
    nn.ConvTranspose1d: ConvTranspose1dBlock,
    nn.ConvTranspose2d: ConvTranspose2dBlock,
    nn.Embedding: EmbeddingBlock,
    _BatchNorm: BatchNormBlock,
    nn.MultiheadAttention: attention_blocks,
}

_BY_NAME: dict[str, BlockFactory] = {HF_CONV1D: HFConv1DBlock}
"""Factories of classes known by qualified name (``module.QualName``) only."""


def register_block(module_type: type[nn.Module] | str, factory: BlockFactory) -> None:
    """Registers (or replaces) the block used for ``module_type``.

    Args:
        module_type: An ``nn.Module`` subclass, or the qualified name of one
            (``"package.module.ClassName"``) for a class of a package that need not be
            installed; subclasses match too unless they have their own entry.
        factory: Called as ``factory(name, module)``, plus those keyword options of
            :func:`make_block` that its signature names (e.g. ``reduction``); returns a
            :class:`Block` or a sequence of blocks.
    """
    if isinstance(module_type, str):
        if "." not in module_type.strip("."):
            raise ValueError(
                f"a class name must be qualified (package.module.ClassName), got {module_type!r}"
            )
        _BY_NAME[module_type] = factory
        return
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


def find_factory(module: nn.Module) -> BlockFactory | None:
    """The factory registered for ``module``'s type or its nearest base, or ``None``."""
    for klass in type(module).__mro__:
        factory = _REGISTRY.get(klass) or _BY_NAME.get(f"{klass.__module__}.{klass.__qualname__}")
        if factory is not None:
            return factory
    return None


_GROUPED: dict[BlockFactory, BlockFactory] = {
    Conv1dBlock: GroupedConvBlock,
    Conv2dBlock: GroupedConvBlock,
    Conv3dBlock: GroupedConv3dBlock,
}
"""The unit-wise block of each built-in dense convolution block's grouped modules."""


def grouped_variant(factory: BlockFactory | None, module: nn.Module) -> BlockFactory | None:
    """The unit-wise block for a grouped ``nn.Conv1d``, ``nn.Conv2d``
    (:class:`~dkfac.blocks.grouped_conv.GroupedConvBlock`) or ``nn.Conv3d``
    (:class:`~dkfac.blocks.conv3d.GroupedConv3dBlock`) whose factory is the built-in dense
    block (a factory the user registered is kept); ``factory`` otherwise."""
    if factory is not None and getattr(module, "groups", 1) != 1:
        return _GROUPED.get(factory, factory)
    return factory


def owned_children(module: nn.Module) -> list[nn.Module]:
    """Submodules that ``module`` calls functionally: their blocks come from ``module``'s
    factory (``nn.MultiheadAttention``'s ``out_proj``), never from their own; and the
    parametrizations of a reparametrised weight (:func:`computed_weight`), whose parameters
    share their layer's fate."""
    owned = functional_children(module)
    if parametrize.is_parametrized(module):
        reparametrised = module.parametrizations
        assert isinstance(reparametrised, nn.Module)
        owned += list(reparametrised.modules())
    return owned


EMPTY_REASON = "a parameter with no entries (a layer of width 0)"
"""Why a module with an empty weight or bias gets no block: it has nothing to precondition
(its factors would be 0 wide)."""


def blocks_or_reason(name: str, module: nn.Module, **options: Any) -> list[Block] | str | None:
    """The blocks for ``module``, the reason it is declined, or ``None`` for an unknown type.

    Like :func:`block_or_reason`, with every factory's result as a list.
    """
    found = block_or_reason(name, module, **options)
    if found is None or isinstance(found, str):
        return found
    return [found] if isinstance(found, Block) else found


def block_or_reason(
    name: str, module: nn.Module, **options: Any
) -> Block | list[Block] | str | None:
    """The block for ``module``, the reason it is declined, or ``None`` for an unknown type.

    A factory that gives several blocks (``nn.MultiheadAttention``) gives them as a list.

    A factory that is a :class:`Block` subclass is first asked
    :meth:`~dkfac.blocks.base.Block.declines` (grouped convolutions with too wide units,
    grouped transposed convolutions, sparse embeddings, BatchNorm without affine
    parameters or with ``unitwise=False``...). A module with an empty parameter (a layer of
    width 0) is declined (:data:`EMPTY_REASON`). A grouped ``nn.Conv1d``/``nn.Conv2d``/
    ``nn.Conv3d`` gets its unit-wise block (:func:`grouped_variant`).

    Args:
        name: The module's qualified name.
        module: The module.
        **options: Keyword options for the factories that accept them (by parameter name),
            e.g. ``reduction``, ``positions`` and ``seed`` of
            :class:`~dkfac.blocks.conv2d.Conv2dBlock`, ``unitwise`` of BatchNorm.
    """
    factory = grouped_variant(find_factory(module), module)
    if factory is None:
        return None
    computed = computed_weight(module)
    if computed is not None:
        return computed
    if any(p.numel() == 0 for p in module.parameters(recurse=False)):
        return EMPTY_REASON
    if isinstance(factory, type) and issubclass(factory, Block):
        reason = factory.declines(module, **options)
        if reason is not None:
            return reason
    made = factory(name, module, **_accepted(factory, options))
    return made if isinstance(made, Block) else list(made)


def computed_weight(module: nn.Module) -> str | None:
    """Why ``module``'s weight (or bias) is not its own parameter, or ``None``.

    A reparametrisation (``weight_norm``, ``spectral_norm``, ``orthogonal``, a symmetric
    or low-rank parametrization; old or new API) computes the tensor from other parameters
    at each forward: a K-FAC update built for the tensor is not an update of those
    parameters, so the layer is left to the inner optimizer. The reason names the
    computed tensors and what computes them.
    """
    if parametrize.is_parametrized(module):
        found = module.parametrizations
        assert isinstance(found, nn.ModuleDict)
        computed = [
            f"its {tensor} is computed by {' then '.join(type(step).__name__ for step in steps)}"
            for tensor, steps in found.items()
            if isinstance(steps, nn.ModuleList)
        ]
        return (
            f"{' and '.join(computed)} from other parameters (a parametrization): K-FAC's "
            "update of a computed tensor is not an update of them"
        )
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and not isinstance(weight, nn.Parameter):
        return (
            "its weight is computed, not a parameter (by a forward pre-hook: "
            "torch.nn.utils.prune, the old torch.nn.utils.weight_norm): not supported"
        )
    return None


def make_block(name: str, module: nn.Module, **options: Any) -> Block | list[Block] | None:
    """The block(s) for ``module``, or ``None`` when its type is not supported or declined.

    A declined module (:func:`block_or_reason`) is logged with its reason, at WARNING
    unless the user chose it (``unitwise_bn=False``) or it has nothing to train.
    """
    found = block_or_reason(name, module, **options)
    if isinstance(found, str):
        quiet = found in ("no affine parameters", "unitwise_bn=False")
        logger.log(
            logging.INFO if quiet else logging.WARNING,
            "skipping %s: %s; it keeps its plain gradient",
            name,
            found,
        )
        return None
    return found
