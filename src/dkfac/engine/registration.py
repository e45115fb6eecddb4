"""Which layers of a model K-FAC preconditions, and the state each one gets.

:func:`register_layers` walks the (unwrapped) model once: every module that the block
registry (:func:`~dkfac.blocks.registry.make_block`) knows, that ``skip_layers`` does not
exclude and whose weight requires a gradient becomes a :class:`~dkfac.engine.layer_state.LayerState`
with its solver and accumulators, and gets the capture hooks. Every other parameter keeps
its plain gradient (:func:`other_parameters`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from torch import Tensor, nn

from dkfac.blocks.batchnorm import BatchNormBlock
from dkfac.blocks.registry import make_block
from dkfac.config import KFACConfig
from dkfac.engine.capture import FactorCapture
from dkfac.engine.layer_state import LayerState
from dkfac.engine.lowrank_plan import LowRankPlan
from dkfac.solvers import make_solver
from dkfac.solvers.statistics import Accumulator, FactorAccumulator

__all__ = ["is_skipped", "other_parameters", "register_layers", "unwrap"]

logger = logging.getLogger(__name__)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP / DataParallel wrapper (names then match the bare model)."""
    inner = getattr(model, "module", None)
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        assert isinstance(inner, nn.Module)
        return inner
    return model


def is_skipped(name: str, module: nn.Module, patterns: Sequence[str]) -> bool:
    """Whether a regular expression of ``patterns`` matches the module's name or type name."""
    return any(
        re.search(pattern, name) or re.search(pattern, type(module).__name__)
        for pattern in patterns
    )


def register_layers(
    model: nn.Module,
    config: KFACConfig,
    capture: FactorCapture,
    lowrank: LowRankPlan | None,
) -> dict[str, LayerState]:
    """The state of every layer K-FAC preconditions, in module order, hooks attached.

    Args:
        model: The bare model (see :func:`unwrap`).
        config: The preconditioner's configuration (``skip_layers``, ``method``, dtypes...).
        capture: The hooks that feed each layer's accumulators; attached to every layer.
        lowrank: The SMW plan (``method="smw"``/``"auto"``) that prepares each layer's
            low-rank sides, or ``None``.

    Returns:
        Module name -> its layer state.

    Raises:
        ValueError: If no layer of the model can be preconditioned.
    """
    layers: dict[str, LayerState] = {}
    conv = {"reduction": config.conv_reduction, "positions": config.subsample_positions}
    for name, module in model.named_modules():
        if is_skipped(name, module, config.skip_layers):
            continue
        block = make_block(name, module, seed=config.seed, **conv)
        if block is None or (isinstance(block, BatchNormBlock) and not config.unitwise_bn):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor) or not weight.requires_grad:
            logger.info("skipping %s: its weight does not require a gradient", name)
            continue
        dtype = config.factor_dtype or weight.dtype
        method = block.solver_name or ("smw" if config.method == "auto" else config.method)
        accumulators: dict[str, Accumulator] = {
            key: FactorAccumulator(dtype, config.capture_dtype) for key in block.statistic_shapes()
        }
        state = LayerState(block, make_solver(method, config.eigen_dtype), accumulators)
        if lowrank is not None:
            lowrank.prepare(state)
        layers[name] = state
        capture.attach(module, state)
    if not layers:
        raise ValueError(
            "model has no layer K-FAC can precondition (supported: nn.Linear, nn.Conv2d "
            f"with groups=1, or types added with register_block); skip_layers="
            f"{list(config.skip_layers)}"
        )
    logger.info("K-FAC registered %d layers: %s", len(layers), list(layers))
    return layers


def other_parameters(model: nn.Module, layers: dict[str, LayerState]) -> list[Tensor]:
    """The trainable parameters of the bare ``model`` that no registered block holds."""
    block_params = {id(p) for layer in layers.values() for p in layer.block.parameters()}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in block_params]
