"""Which layers of a model K-FAC preconditions, and the state each one gets.

:func:`register` walks the (unwrapped) model once: every module that the block registry
(:func:`~dkfac.blocks.registry.blocks_or_reason`) knows, that ``skip_layers`` does not
exclude gets its block(s) (a frozen one too, for when it is unfrozen); what every other parameter
gets, and why, is recorded in a :class:`~dkfac.engine.coverage.Coverage` (``describe()``).
Once the strategy is known, :func:`create_layers` gives each a
:class:`~dkfac.engine.layer_state.LayerState` with its solver and accumulators. Every other
parameter keeps its plain gradient (:func:`other_parameters`), or, with ``leftover_update``,
gets Adam's direction on it (:mod:`~dkfac.engine.leftover`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from dkfac.blocks.base import Block
from dkfac.blocks.linear import LinearBlock
from dkfac.blocks.registry import blocks_or_reason, owned_children
from dkfac.config import KFACConfig, leftover_adam, resolve
from dkfac.config.checks import GRAPH_MAPS
from dkfac.config.estimation import statistic_dtype
from dkfac.engine import launches
from dkfac.engine.coverage import USER_CHOICES, Coverage, Registration
from dkfac.engine.guards import name_list
from dkfac.engine.layer_state import LayerState
from dkfac.engine.roles import ROLE_PREFIX, flattened_conv_inputs, role_blocks
from dkfac.engine.tracing import compiled_original, uncalled_layers
from dkfac.solvers import EigenMomentsSolver, RowsRule, adam_scaled, make_solver, precision

__all__ = [
    "check_given_maps",
    "create_layers",
    "find_blocks",
    "graph_input_maps",
    "input_maps",
    "is_skipped",
    "matching_pattern",
    "orthogonal_layers",
    "other_parameters",
    "register",
    "rows_rule",
    "unwrap",
]

logger = logging.getLogger(__name__)

UNCALLED = (
    "its forward never runs: the model applies its weight itself (F.linear(x, layer.weight)), "
    "so no hook sees the layer's input"
)
"""Why a layer :func:`~dkfac.engine.tracing.uncalled_layers` finds has no block."""

LOWERED_OPTIONS = ("rotation_dtype", "gradient_rotation_dtype", "capture_dtype")
"""The config's optional low precisions, which take ``"auto"``."""


def _wrappers(model: nn.Module) -> Iterator[nn.Module]:
    """``model``, then each module it wraps in turn: a DDP / DataParallel wrapper's
    ``module``, ``torch.compile``'s ``OptimizedModule``'s ``_orig_mod`` and Lightning
    Fabric's ``_FabricModule``'s ``_forward_module`` (what ``fabric.setup`` returns: the
    strategy's module, itself a DDP where Fabric runs one), in any nesting, down to the bare
    model."""
    while True:
        yield model
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = getattr(model, "module", None)
        elif _is_fabric_module(model):
            inner = getattr(model, "_forward_module", None)
        else:
            inner = compiled_original(model)
        if not isinstance(inner, nn.Module):
            return
        model = inner


def _is_fabric_module(model: nn.Module) -> bool:
    """Whether ``model`` is Lightning Fabric's module wrapper (known by its class, so that
    Lightning need not be installed)."""
    kind = type(model)
    return kind.__name__ == "_FabricModule" and kind.__module__.split(".")[0] in (
        "lightning",
        "lightning_fabric",
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside its DDP / DataParallel wrapper, ``torch.compile``'s
    ``OptimizedModule`` (its ``_orig_mod``) and Fabric's module, in any nesting, so that
    layer names (those of checkpoints, ``skip_layers``, ``orthogonal_layers``,
    ``describe()``) are the eager bare model's."""
    *_, bare = _wrappers(model)
    return bare


def ddp_wrapper(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` that averages ``model``'s gradients: ``model`` itself,
    or the one inside ``torch.compile``'s ``OptimizedModule`` (``torch.compile(DDP(m))``, in
    any nesting); ``None`` where there is none."""
    wrappers = (m for m in _wrappers(model) if isinstance(m, nn.parallel.DistributedDataParallel))
    return next(wrappers, None)


def is_skipped(name: str, module: nn.Module, patterns: Sequence[str]) -> bool:
    """Whether a regular expression of ``patterns`` is found (``re.search``) in the module's
    qualified name or its type name."""
    return matching_pattern(name, module, patterns) is not None


def matching_pattern(name: str, module: nn.Module, patterns: Sequence[str]) -> str | None:
    """The first pattern of ``patterns`` found (``re.search``) in the module's qualified name
    or its type name, or ``None`` (``skip_layers`` and ``orthogonal_layers`` match so)."""
    for pattern in patterns:
        if re.search(pattern, name) or re.search(pattern, type(module).__name__):
            return pattern
    return None


def find_blocks(model: nn.Module, config: KFACConfig) -> dict[str, Block]:
    """The block of every layer K-FAC preconditions, in module order (see :func:`register`).

    Raises:
        ValueError: If no layer of the model can be preconditioned.
    """
    return register(model, config).blocks


def register(model: nn.Module, config: KFACConfig) -> Registration:
    """The blocks of the layers K-FAC preconditions, and what every other parameter gets.

    Walks the modules in order: a module matched by ``skip_layers``, of a type without a
    block, declined by its block, or whose forward the model never calls while it applies
    the module's weight itself (:func:`~dkfac.engine.tracing.uncalled_layers`) leaves its
    own parameters to the inner optimizer; a
    module's blocks (several for ``nn.MultiheadAttention``) are kept when their weight
    requires a gradient. A tensor used by several modules is preconditioned once, by the
    last of them (:func:`~dkfac.engine.coverage.resolve_ties`). Parameters with two or more
    dimensions left out by no choice of the user are named in one warning.

    Args:
        model: The bare model (see :func:`unwrap`).
        config: The preconditioner's configuration (``skip_layers``, block options...).

    Raises:
        ValueError: If no layer of the model can be preconditioned, or a parameter is not
            yet initialised (a lazy module before its first forward).
    """
    _check_initialised(model)
    coverage = Coverage(model)
    blocks: dict[str, Block] = {}
    conv = {"reduction": config.conv_reduction, "positions": config.subsample_positions}
    claimed: set[int] = set()  # modules whose blocks came from their parent's factory
    for name, module in model.named_modules():
        if id(module) in claimed:
            continue
        pattern = matching_pattern(name, module, config.skip_layers)
        children = owned_children(module)
        claimed.update(id(child) for child in children)
        if pattern is not None:
            for part in (module, *children):
                coverage.leave(part, f"skip_layers pattern {pattern!r}", chosen=True)
            continue
        found = blocks_or_reason(
            name, module, seed=config.seed, unitwise=config.unitwise_bn, **conv
        )
        if found is None:
            coverage.leave(module, _no_block_reason(module), chosen=False)
            continue
        if isinstance(found, str):
            chosen = found in USER_CHOICES
            logger.info("skipping %s: %s; it takes %s", name, found, _leftover_words(config))
            for part in (module, *children):
                coverage.leave(part, f"declined by its block: {found}", chosen=chosen)
            continue
        for block in found:
            blocks.update(_admitted(block, config, coverage))
    for name in uncalled_layers(model, {name: block.module for name, block in blocks.items()}):
        logger.info("skipping %s: %s; it takes %s", name, UNCALLED, _leftover_words(config))
        coverage.leave(blocks.pop(name).module, UNCALLED, chosen=False)
    blocks = coverage.resolve_ties(blocks)
    if not blocks:
        raise ValueError(
            "model has no layer K-FAC can precondition (supported: nn.Linear, nn.Conv1d, "
            "nn.Conv2d and nn.Conv3d (grouped too), nn.ConvTranspose1d and nn.ConvTranspose2d "
            "with groups=1, "
            "nn.Embedding, nn.MultiheadAttention, affine BatchNorm (unit-wise), transformers' "
            f"Conv1D, or types added with register_block); skip_layers={list(config.skip_layers)}"
            + (f"; left out: {name_list(left)}" if (left := coverage.reasons()) else "")
        )
    logger.info("K-FAC registered %d layers: %s", len(blocks), list(blocks))
    _warn_unmatched(model, config.skip_layers)
    coverage.finish(blocks)
    return Registration(blocks, coverage)


def _warn_unmatched(model: nn.Module, patterns: Sequence[str]) -> None:
    """Names, in one warning, the ``skip_layers`` patterns that match no module's name or
    type name (a misspelled one skips nothing, and the layer it meant stays preconditioned)."""
    modules = [(name, type(module).__name__) for name, module in model.named_modules()]
    unmatched = [
        p for p in patterns if not any(re.search(p, n) or re.search(p, t) for n, t in modules)
    ]
    if unmatched:
        logger.warning(
            "skip_layers patterns %s match no module of the model (its names: %s): they "
            "skip nothing",
            unmatched,
            name_list([name for name, _ in modules if name]),
        )


def _check_initialised(model: nn.Module) -> None:
    """Refuses a model with lazy parameters (``nn.LazyLinear``, ``nn.LazyConv2d``...): their
    shapes, which the blocks' factors are sized by, exist only after a first forward.

    Raises:
        ValueError: Naming them, and what to do.
    """
    lazy = [name for name, param in model.named_parameters() if nn.parameter.is_lazy(param)]
    if lazy:
        raise ValueError(
            f"the model's parameters {name_list(lazy)} are not initialised yet (a lazy "
            "module takes its shapes at its first forward): run the model once on a batch "
            "before building the preconditioner"
        )


def _admitted(block: Block, config: KFACConfig, coverage: Coverage) -> dict[str, Block]:
    """``{block.name: block}`` unless its own name is skipped or only its weight is frozen.

    A wholly frozen layer (no parameter requires a gradient) is registered: it captures
    nothing and has no gradient while frozen, and is preconditioned once unfrozen (gradual
    unfreezing), as ``torch.optim.AdamW(model.parameters())`` would step it. A layer whose
    weight is frozen but not its bias (BitFit) leaves the bias to the inner optimizer.
    """
    pattern = matching_pattern(block.name, block.module, config.skip_layers)
    if pattern is not None:
        coverage.leave(block.module, f"skip_layers pattern {pattern!r}", chosen=True)
        return {}
    params = block.parameters()
    if not params[0].requires_grad and any(p.requires_grad for p in params):
        logger.info("skipping %s: its weight does not require a gradient", block.name)
        coverage.leave(block.module, "its layer's weight does not require a gradient", True)
        return {}
    return {block.name: block}


def rows_rule(config: KFACConfig, gathered_ranks: int) -> RowsRule:
    """The rule by which a deferred solver (``"smw"``/``"auto"``) turns rows into a rank.

    Args:
        config: The configuration (decay and intervals are resolved at step 0).
        gathered_ranks: The ranks whose rows one reduced statistic holds.
    """
    values = {
        name: resolve(name, getattr(config, name), 0)
        for name in ("factor_decay", "factor_update_interval", "inverse_update_interval")
    }
    return RowsRule(
        accumulation_steps=config.accumulation_steps,
        gathered_ranks=gathered_ranks,
        decay=float(values["factor_decay"] or 0.0),
        factor_update_interval=int(values["factor_update_interval"] or 1),
        inverse_update_interval=int(values["inverse_update_interval"] or 1),
    )


def create_layers(
    blocks: Mapping[str, Block],
    config: KFACConfig,
    rule: RowsRule,
    roles: Mapping[str, str] | None = None,
) -> dict[str, LayerState]:
    """The state of every block's layer: its solver, statistic kinds and accumulators.

    A block names its own solver (``solver_name``, or ``adam_solver_name`` under a method
    with Adam's scale) or takes ``config.method``; a plain
    Kronecker pair (statistics ``"A"`` and ``"G"``) under ``"smw"``/``"auto"`` gets a
    deferred solver, decided by ``rule`` at the first capture; another block under
    ``"auto"`` gets the SMW solver with dense sides. A layer of ``flattened_inputs`` gets
    its input map (:func:`input_maps`), a layer of ``orthogonal_layers`` an orthogonalised
    update (:func:`orthogonal_layers`, its roles from ``roles``). An ``"auto"`` precision is
    resolved here, from the device and dtype of the layer's parameters
    (:func:`dkfac.solvers.precision.resolve`).

    Raises:
        ValueError: For a ``flattened_inputs`` entry that does not fit (:func:`input_maps`),
            or an ``orthogonal_layers`` pattern that matches no layer.
    """
    maps = input_maps(blocks, config)
    orthogonal = orthogonal_layers(blocks, config, roles)
    layers: dict[str, LayerState] = {}
    decided: dict[tuple[str, str, torch.dtype | None], None] = {}  # "auto", in order
    for name, block in blocks.items():
        param = block.parameters()[0]
        dtype = config.factor_dtype or statistic_dtype(param.dtype)
        lowered: dict[str, torch.dtype | None] = {}
        for option in LOWERED_OPTIONS:  # "auto": bf16 where this layer's device has it natively
            value = getattr(config, option)
            lowered[option] = precision.resolve(value, param.device, param.dtype)
            if value == precision.AUTO:
                decided[(option, str(param.device), lowered[option])] = None
        kronecker = block.solver_name is None and set(block.statistic_shapes()) == {"A", "G"}
        method = block.solver_name or config.method
        if block.adam_solver_name is not None and adam_scaled(config.method):
            method = block.adam_solver_name
        if method == "auto" and not kronecker:
            method = "smw"
        compute = config.eigen_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        solver = make_solver(
            method,
            compute,
            rule if kronecker else None,
            dataclasses.replace(
                config.adam_options(),
                basis_refresh=config.basis_refresh,
                carry=config.moment_carry,
                max_dim=config.basis_max_dim,
                rotation_dtype=lowered["rotation_dtype"],
                orthogonal_rms=config.orthogonal_rms if name in orthogonal else None,
                orthogonal_rms_power=config.orthogonal_rms_power if name in orthogonal else 0.0,
                orthogonal_steps=config.orthogonal_steps,
                orthogonal_split=config.orthogonal_split if name in orthogonal else 0.0,
                gradient_rotation_dtype=lowered["gradient_rotation_dtype"],
                power_rank=config.power_rank,
                block_size=_block_size(config),
                compile_backend=launches.compile_backend(config.compile_moments, param.device),
                step_compile_backend=launches.compile_backend(config.compile_step, param.device),
            ),
            maps.get(name),
        )
        if name in orthogonal and not isinstance(solver, EigenMomentsSolver):
            raise ValueError(
                f"orthogonal_layers picks {name!r}, whose method {method!r} has no eigenbasis "
                "of moments to orthogonalise the update of"
            )
        layers[name] = LayerState.create(block, solver, dtype, lowered["capture_dtype"])
        if config.orthogonal_input_rms and name in orthogonal:
            if block.input_row_bias is None:
                raise ValueError(
                    f"orthogonal_input_rms divides an update by the RMS entry of its layer's "
                    f"input, and {name!r} ({type(block).__name__}) reads no input entries "
                    "(token ids): leave it out of orthogonal_layers, or drop the option"
                )
            layers[name].input_rms = True
    for option, device, chosen in decided:
        logger.info(
            '%s="auto" on %s: %s',
            option,
            device,
            chosen or "the default precision (bf16 not native there, or a float64 layer)",
        )
    return layers


def _block_size(config: KFACConfig) -> int | None:
    """``config.basis_block_size`` once read off the model (``"widths"`` is resolved by
    :func:`dkfac.engine.roles.apply_model_rules` before any layer is registered)."""
    block = config.basis_block_size
    if isinstance(block, str):
        raise ValueError(
            f"basis_block_size={block!r} is read off the model when the preconditioner is "
            "built; register layers with a config from KFACPreconditioner"
        )
    return block


def graph_input_maps(
    model: nn.Module, config: KFACConfig, blocks: Mapping[str, Block]
) -> KFACConfig:
    """``config`` with ``flattened_inputs="graph"`` resolved to the maps of
    :func:`~dkfac.engine.roles.flattened_conv_inputs` of the linear layers in ``blocks``
    (those K-FAC preconditions; ``model`` is the bare model they were registered from).

    A layer the graph shows reading a flattened map that has no block (``skip_layers``,
    a vocabulary-sized head, a weight computed by a parametrisation or frozen alone) needs
    no map: it is left out and logged, where a map named by hand for it is refused
    (:func:`input_maps`). Maps given by hand are returned as they are, each checked
    against the graph's where the graph shows one (:func:`check_given_maps`).
    """
    if dict(config.flattened_inputs) != GRAPH_MAPS:
        if config.flattened_inputs:
            check_given_maps(config.flattened_inputs, flattened_conv_inputs(model))
        return config
    found = flattened_conv_inputs(model)
    maps = {name: m for name, m in found.items() if isinstance(blocks.get(name), LinearBlock)}
    logger.info("flattened_inputs from the graph: %s", maps or "none")
    if unregistered := sorted(found.keys() - maps.keys()):
        logger.info(
            "flattened_inputs: %s read a flattened convolution map but are not "
            "preconditioned: no map",
            unregistered,
        )
    return dataclasses.replace(config, flattened_inputs=maps)


def check_given_maps(
    given: Mapping[str, tuple[int, int]], found: Mapping[str, tuple[int, int]]
) -> None:
    """Checks maps named by hand against those the graph shows (``found``, from
    :func:`~dkfac.engine.roles.flattened_conv_inputs`): a map that is the graph's with its
    two sides swapped is refused, as the structured basis would then pair each feature
    with the wrong channel and position; any other difference is logged as a warning (the
    user may know the model's reshapes better than the trace).

    Raises:
        ValueError: For a map that is the graph's, swapped.
    """
    for name, (channels, positions) in given.items():
        seen = found.get(name)
        if seen is None or seen == (channels, positions):
            continue
        if seen == (positions, channels):
            if min(seen) == 1:  # (1, P) and (P, 1): the same basis of the whole side
                continue
            raise ValueError(
                f"flattened_inputs[{name!r}] = ({channels}, {positions}) has its sides "
                f"swapped: the graph shows {name!r} reading a map of {seen[0]} channels at "
                f"{seen[1]} positions, flattened, which is ({seen[0]}, {seen[1]}) (channels "
                f"first); give that, or flattened_inputs='graph'"
            )
        logger.warning(
            "flattened_inputs[%r] = (%d, %d), but the graph shows %r reading a map of %d "
            "channels at %d positions: the structured basis follows the map given",
            name, channels, positions, name, *seen,
        )  # fmt: skip


def input_maps(blocks: Mapping[str, Block], config: KFACConfig) -> dict[str, tuple[int, int]]:
    """``config.flattened_inputs``, each checked against the layer it names.

    Raises:
        ValueError: If a name is not a registered linear layer (the message lists them), or
            the layer's input features are not ``channels · positions``.
    """
    maps = dict(config.flattened_inputs)
    linear = [name for name, block in blocks.items() if isinstance(block, LinearBlock)]
    for name, (channels, positions) in maps.items():
        block = blocks.get(name)
        if not isinstance(block, LinearBlock):
            what = "not a preconditioned layer" if block is None else type(block).__name__
            raise ValueError(
                f"flattened_inputs names {name!r}, which is {what}; the preconditioned "
                f"linear layers are {linear}"
            )
        if block.in_features != channels * positions:
            raise ValueError(
                f"flattened_inputs[{name!r}] = ({channels}, {positions}) has "
                f"{channels * positions} features, but the layer reads {block.in_features}"
            )
    return maps


def orthogonal_layers(
    blocks: Mapping[str, Block], config: KFACConfig, roles: Mapping[str, str] | None = None
) -> set[str]:
    """The layers ``config.orthogonal_layers`` picks: by name or class name (``re.search``),
    or by role (``"role:NAME"``, :func:`~dkfac.engine.roles.role_blocks` with ``roles``, the
    model's :func:`~dkfac.engine.roles.layer_roles`; a block that names its own solver, a
    grouped convolution's unit-wise one, is never picked by a role).

    Raises:
        ValueError: If a pattern that is not a role matches no layer (the message lists
            them); a role that no preconditioned layer has picks none (logged): it is a
            rule, which a model may not need.
    """
    picked: set[str] = set()
    for pattern in config.orthogonal_layers:
        if pattern.startswith(ROLE_PREFIX):
            # a role is a rule: a block with its own solver (unit-wise) has no basis
            kron = [n for n, b in blocks.items() if b.solver_name is None]
            matched = set(role_blocks(pattern, roles or {}, kron))
            if not matched:
                logger.info("orthogonal_layers %r: no preconditioned layer has it", pattern)
        else:
            matched = {n for n, b in blocks.items() if matching_pattern(n, b.module, (pattern,))}
            if not matched:
                raise ValueError(
                    f"orthogonal_layers pattern {pattern!r} matches none of the preconditioned "
                    f"layers {list(blocks)}"
                )
        picked |= matched
    if picked:
        logger.info("K-FAC orthogonalises the updates of %s", sorted(picked))
    return picked


def other_parameters(model: nn.Module, layers: dict[str, LayerState]) -> list[Tensor]:
    """The parameters of the bare ``model`` that no registered block holds (frozen ones
    too: they have no gradient until they are unfrozen)."""
    block_params = {id(p) for layer in layers.values() for p in layer.block.parameters()}
    return [p for p in model.parameters() if id(p) not in block_params]


def _leftover_words(config: KFACConfig) -> str:
    """What a parameter no block takes gets (``leftover_update``), for the log."""
    return "Adam's direction" if leftover_adam(config) else "its plain gradient"


def _no_block_reason(module: nn.Module) -> str:
    """Why ``module``'s own parameters get no block: a layer type without one (a module
    with no children: ``"LayerNorm has no K-FAC block"``), or raw parameters a module with
    layers of its own uses in its forward (a position table or class token), which no layer
    holds."""
    name = type(module).__name__
    if next(module.children(), None) is None:
        return f"{name} has no K-FAC block"
    return f"a raw parameter of {name}, used by its own forward, not through a layer"
