"""Rules that need no layer names: each layer's role, and flattened convolution maps.

A recipe used to name layers by regular expression (``orthogonal_layers=["^blocks\\."]``,
``skip_layers=["^tokens$", "^head$"]``) and shapes by hand (``flattened_inputs=
["classifier.0=64x16"]``). The rules here read them off the model instead:

* :func:`layer_roles`: every ``nn.Linear``, ``nn.Conv1d/2d/3d``,
  ``nn.ConvTranspose1d/2d/3d``, ``nn.MultiheadAttention``, ``transformers``' ``Conv1D``
  (GPT-2's projections, a linear layer with its weight stored transposed) and
  ``nn.Embedding`` gets a role, Muon's split: ``"embedding"``; ``"input"``, a matrix
  layer that reads the forward's arguments and no other matrix layer or embedding (the raw
  data: a vision or audio transformer's patch layer, each tower's first layer; a language
  model's first layer reads its token embedding); ``"head"``, a matrix layer no other one
  reads from (it writes an output: a main and an auxiliary head are both heads);
  ``"hidden"``, every other one. Where fx cannot trace the model, the first matrix layer
  in module order is the input layer (when no embedding comes before it) and the last the
  head. A pattern ``"role:NAME"``
  in ``skip_layers`` or ``orthogonal_layers`` stands for the layers of that role
  (:func:`resolve_role_patterns`); module names never hold a colon, so no regular
  expression is taken for a role by mistake.
* :func:`flattened_conv_inputs`: a linear layer whose input is ``flatten(x, 1)`` of a
  convolution's ``C``-channel map (through pooling, upsampling, padding, activations,
  normalisation over channels, dropout and residual additions, which keep the channels;
  the spellings of that flatten: :mod:`~dkfac.engine.flatten_nodes`)
  reads ``C × P`` features, channel-major, with ``P = in_features / C`` positions: found
  by tracing the model's graph (``torch.fx``), with no input. A model fx cannot trace
  (data-dependent control flow) gets none.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.batchnorm import _NormBase

from dkfac.blocks.hf_conv1d import QUALIFIED_NAME as HF_CONV1D
from dkfac.config import KFACConfig
from dkfac.config.checks import BLOCK_WIDTHS
from dkfac.engine.flatten_nodes import flattened_source
from dkfac.engine.tracing import (
    call_order,
    compiled_original,
    layer_links,
    traced_graph,
    unsharded,
    untouched_layers,
)

__all__ = [
    "ROLES",
    "ROLE_PREFIX",
    "VOCABULARY_FLOOR",
    "apply_model_rules",
    "basis_block_from_widths",
    "block_roles",
    "flattened_conv_inputs",
    "layer_roles",
    "resolve_role_patterns",
    "role_blocks",
    "vocabulary_layers",
]

logger = logging.getLogger(__name__)

ROLES = ("input", "hidden", "head", "embedding")
"""Every role :func:`layer_roles` gives."""

ROLE_PREFIX = "role:"
"""A pattern ``"role:NAME"`` picks the layers of role ``NAME``."""

_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, *_TRANSPOSED)
_MATRIX = (nn.Linear, *_CONV, nn.MultiheadAttention)
_CHANNEL_COUNTS = (_NormBase, nn.GroupNorm)
"""Normalisations over channels (BatchNorm, SyncBatchNorm, InstanceNorm, GroupNorm and their
subclasses): each knows its channel count."""
_KEEPS_CHANNELS_MODULES = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh,
    nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.Softplus,
    nn.PReLU, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.AlphaDropout, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d,
    nn.AvgPool3d, nn.LPPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Upsample,
    nn.ZeroPad2d, nn.ConstantPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d,
    nn.LocalResponseNorm,
)  # fmt: skip
_KEEPS_CHANNELS_FUNCTIONS = {
    F.relu, F.relu6, torch.relu, F.gelu, F.silu, F.mish, F.hardswish, F.hardsigmoid,
    F.leaky_relu, F.elu, F.selu, F.softplus, torch.tanh, torch.sigmoid, F.max_pool1d,
    F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d, F.interpolate,
    F.pad, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, operator.add, torch.add,
    operator.mul, torch.mul,
}  # fmt: skip
_KEEPS_CHANNELS_METHODS = {"relu", "relu_", "tanh", "sigmoid", "contiguous", "add", "mul"}


def apply_model_rules(model: nn.Module, config: KFACConfig) -> KFACConfig:
    """``config`` with its rules read off ``model``: ``"role:NAME"`` patterns of
    ``skip_layers`` resolved to the layers' names and ``basis_block_size="widths"`` to
    :func:`basis_block_from_widths` (``flattened_inputs="graph"`` is resolved once the
    layers are registered: :func:`~dkfac.engine.registration.graph_input_maps`). The
    roles of ``orthogonal_layers`` are checked here and resolved at registration
    (:func:`role_blocks`), among the layers K-FAC preconditions: a role none of them has
    (every hidden layer a depthwise convolution, say) picks nothing instead of failing as
    an explicit pattern that matches nothing does.

    Raises:
        ValueError: For an unknown role.
    """
    changes: dict[str, Any] = {}
    resolved = resolve_role_patterns("skip_layers", config.skip_layers, model)
    if resolved != config.skip_layers:
        changes["skip_layers"] = resolved
    for pattern in config.orthogonal_layers:
        if pattern.startswith(ROLE_PREFIX):
            _role("orthogonal_layers", pattern)
    if config.basis_block_size == BLOCK_WIDTHS:
        block = basis_block_from_widths(model)
        logger.info("basis_block_size from the widths: %s", block or "none (whole bases)")
        changes["basis_block_size"] = block
    return dataclasses.replace(config, **changes) if changes else config


def _is_matrix(module: nn.Module) -> bool:
    """Whether ``module`` is a weight-matrix layer: one of :data:`_MATRIX`, or a class
    derived from ``transformers``' ``Conv1D`` (known by its qualified name, so
    ``transformers`` is not imported)."""
    if isinstance(module, _MATRIX):
        return True
    return any(f"{k.__module__}.{k.__qualname__}" == HF_CONV1D for k in type(module).__mro__)


def layer_roles(model: nn.Module) -> dict[str, str]:
    """Qualified module name -> its role (see the module docstring), in module order.

    Read from the forward's data flow (:func:`~dkfac.engine.tracing.layer_links`): a head is
    a matrix layer no other matrix layer reads from, directly or not (a model with an
    auxiliary output has two heads: the main one and the auxiliary one); an input layer is
    one that reads the forward's arguments and no other matrix layer or embedding (a
    two-tower model has two). A head defined in ``__init__`` before the layers it reads is
    still the head. A matrix layer the forward never touches (a projection head kept for
    another task, or a head the training loop applies to the forward's output: the graph
    cannot tell them apart) is a head and changes no other layer's role: the real head is
    never orthogonalised for it, at worst the layer before it is taken for a head too. Where
    the data flow is not known (a model fx cannot trace, or a layer not called as a module
    in its graph), the first and the last matrix layer the forward calls
    (:func:`~dkfac.engine.tracing.call_order`), or in module order, are the input layer
    (when no embedding comes before it in module order) and the head. Either way, a matrix
    layer whose weight is an embedding's (a language model's tied output layer: BERT's
    masked-token decoder beside its next-sentence head) is a head.
    """
    modules = list(model.named_modules())
    matrices = [name for name, m in modules if _is_matrix(m)]
    embeddings = [name for name, m in modules if isinstance(m, nn.Embedding)]
    links = layer_links(model, matrices + embeddings) if len(matrices) > 1 else None
    if links is not None:  # a layer the forward never touches is in no other's decision
        used = [n for n in matrices if n in links]
        heads = {n for n in used if not links[n].after.intersection(matrices)}
        inputs = {n for n in used if links[n].reads_data and not links[n].before}
        if heads:  # none: the matrix layers read each other in a cycle (shared weights)
            unused = set(matrices) - set(used)  # heads themselves (docstring)
            return _roles(modules, heads | unused | _tied_heads(modules), inputs - heads)
    if not matrices:
        return _roles(modules, set(), set())
    ordered = (call_order(model, matrices) if len(matrices) > 1 else None) or matrices
    untouched = untouched_layers(model, matrices) if len(matrices) > 1 else frozenset()
    ordered = [name for name in ordered if name not in untouched] or ordered
    first: set[str] = set()
    for name, module in modules:
        if isinstance(module, nn.Embedding):
            break
        if name == ordered[0]:
            first = {name}
            break
    heads = {ordered[-1], *untouched, *_tied_heads(modules)}
    return _roles(modules, heads, first - heads)


def _tied_heads(modules: list[tuple[str, nn.Module]]) -> set[str]:
    """The matrix layers whose ``weight`` is an embedding's (tied output layers). The
    stored parameters are compared: reading a parametrized ``weight`` would run its
    parametrization, and spectral_norm's advances its power iteration in place."""
    tables = {id(m._parameters.get("weight")) for _, m in modules if isinstance(m, nn.Embedding)}
    tables.discard(id(None))
    return {n for n, m in modules if _is_matrix(m) and id(m._parameters.get("weight")) in tables}


def _roles(
    modules: list[tuple[str, nn.Module]], heads: set[str], inputs: set[str]
) -> dict[str, str]:
    """Every embedding and matrix layer of ``modules`` -> its role, given the heads and
    the input layers (every other matrix layer is hidden)."""
    roles: dict[str, str] = {}
    for name, module in modules:
        if isinstance(module, nn.Embedding):
            roles[name] = "embedding"
        elif _is_matrix(module):
            roles[name] = "head" if name in heads else "input" if name in inputs else "hidden"
    return roles


MIN_BLOCK = 128
"""The narrowest block :func:`basis_block_from_widths` gives (a narrower one loses most of
the coupling a basis keeps)."""


def basis_block_from_widths(model: nn.Module) -> int | None:
    """A ``basis_block_size`` from the widths: the narrowest output width of a hidden layer
    that is at least :data:`MIN_BLOCK`, when some side of a layer is more than twice that
    (else ``None``: every basis whole). A wide layer's basis is then cut into blocks as wide
    as the model's narrow layers, whose whole bases cost as much (the recipes' 250 on the
    64-1000-500-250-30 autoencoder, 128 on the width-128 language model, whose MLP is 512
    wide)."""
    roles = layer_roles(model)
    modules = dict(model.named_modules())
    widths, sides = [], []
    for name, role in roles.items():
        module = modules[name]
        if not _is_matrix(module) or isinstance(module, nn.MultiheadAttention):
            continue
        out, inp = _sides(module)
        # a bias is a column of the input side, except a transposed convolution's (its
        # bias goes to the inner optimizer)
        bias = getattr(module, "bias", None) is not None and not isinstance(module, _TRANSPOSED)
        sides += [out, inp + bias]
        if role == "hidden":
            widths.append(out)
    wide = [w for w in widths if w >= MIN_BLOCK]
    if not wide or max(sides) <= 2 * min(wide):
        return None
    return min(wide)


VOCABULARY_FLOOR = 4096
"""A table side :func:`vocabulary_layers` may leave out only above this (a dense factor of
4096² float32 entries is 64 MiB, and its eigendecomposition seconds on a CPU core)."""


def vocabulary_layers(model: nn.Module, floor: int = VOCABULARY_FLOOR) -> list[str]:
    """The embeddings and heads whose vocabulary side (an embedding's rows, a head's
    outputs) is wider than ``floor`` and than every side of the hidden layers, in module
    order: a language model's token table and output layer with a real tokenizer's
    vocabulary (32,000 rows and more), whose dense ``V × V`` factor would cost more than all
    the hidden layers' together (Muon leaves both to Adam). Empty when the model has no
    hidden layer to compare with."""
    roles = layer_roles(model)
    modules = dict(model.named_modules())
    widest = max(
        (
            side
            for name, role in roles.items()
            if role == "hidden"
            for side in _sides(modules[name])
        ),
        default=None,
    )
    if widest is None:
        return []
    vocabulary = {}
    for name, role in roles.items():
        module = modules[name]
        if role == "embedding" and isinstance(module, nn.Embedding):
            vocabulary[name] = int(module.num_embeddings)
        elif role == "head" and not isinstance(module, (*_CONV, nn.MultiheadAttention)):
            vocabulary[name] = _sides(module)[0]
    return [name for name, side in vocabulary.items() if side > max(floor, widest)]


def _sides(module: nn.Module) -> tuple[int, int]:
    """``(outputs, inputs)`` of a matrix layer's weight (a convolution's inputs per output
    position; ``(0, 0)`` for an attention module, whose projections are hidden matrices
    of their own width)."""
    if isinstance(module, nn.Linear):
        return int(module.out_features), int(module.in_features)
    if isinstance(module, _TRANSPOSED):  # its block's sides: C_out·k (outputs), C_in
        return int(module.out_channels * math.prod(module.kernel_size)), int(module.in_channels)
    if isinstance(module, _CONV):
        return int(module.out_channels), int(module.in_channels * math.prod(module.kernel_size))
    if isinstance(module, nn.MultiheadAttention):
        return int(module.embed_dim), int(module.embed_dim)
    weight = module.weight  # transformers' Conv1D: stored inputs x outputs
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[1]), int(weight.shape[0])


def resolve_role_patterns(
    option: str, patterns: Sequence[str], model: nn.Module
) -> tuple[str, ...]:
    """``patterns`` with every ``"role:NAME"`` replaced by exact-name patterns of the layers
    of that role (none when no layer has it); other patterns are kept as they are.

    Raises:
        ValueError: For a role outside :data:`ROLES`.
    """
    if not any(p.startswith(ROLE_PREFIX) for p in patterns):
        return tuple(patterns)
    roles = layer_roles(model)
    resolved: list[str] = []
    for pattern in patterns:
        if not pattern.startswith(ROLE_PREFIX):
            resolved.append(pattern)
            continue
        names = _role_patterns(_role(option, pattern), roles)
        logger.info("%s %r: %s", option, pattern, names or "no layer")
        resolved += names
    return tuple(dict.fromkeys(resolved))


def role_blocks(pattern: str, roles: Mapping[str, str], blocks: Iterable[str]) -> list[str]:
    """The names of ``blocks`` that ``pattern`` (``"role:NAME"``) picks: the layers of that
    role in ``roles`` (:func:`layer_roles`) and the blocks under their names.

    Raises:
        ValueError: For a role outside :data:`ROLES`.
    """
    names = _role_patterns(_role("orthogonal_layers", pattern), roles)
    return [b for b in blocks if any(re.search(n, b) for n in names)]


def block_roles(roles: Mapping[str, str], blocks: Iterable[str]) -> dict[str, str]:
    """Each of ``blocks``' role (``describe()``'s ``role``): its layer's in ``roles``
    (:func:`layer_roles`), or that of the layer it is under (an attention's projections);
    a block of no such layer (a BatchNorm's) is left out."""
    found: dict[str, str] = {}
    for block in blocks:
        owners = [n for n in roles if re.search(f"^{re.escape(n)}(?:$|[.:])", block)]
        if owners:
            found[block] = roles[max(owners, key=len)]
    return found


def _role(option: str, pattern: str) -> str:
    role = pattern[len(ROLE_PREFIX) :]
    if role not in ROLES:
        raise ValueError(
            f"{option}: unknown role {role!r} in {pattern!r}; roles: {', '.join(ROLES)}"
        )
    return role


def _role_patterns(role: str, roles: Mapping[str, str]) -> list[str]:
    """Exact-name patterns of the layers of ``role``: the layer itself, or the blocks under
    its name (an attention layer's projections)."""
    return [f"^{re.escape(n)}(?:$|[.:])" for n, r in roles.items() if r == role]


def flattened_conv_inputs(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Linear layer name -> ``(channels, positions)`` of the convolution map it reads
    flattened (see the module docstring); empty when the model cannot be traced, and for a
    model wrapped in FSDP1's ``FullyShardedDataParallel`` (its flat parameters hide the
    layers). A model sharded with FSDP2's ``fully_shard`` is traced as its unsharded twin,
    and one compiled with ``torch.compile`` (the whole model or its parts) as the module it
    compiles (:func:`~dkfac.engine.tracing.traced_graph`), so both get the eager model's
    maps."""
    original = compiled_original(model)
    if original is not None:  # torch.compile(model): its layers are "_orig_mod.<name>"
        return {f"_orig_mod.{k}": v for k, v in flattened_conv_inputs(original).items()}
    graph = traced_graph(model, "flattened inputs")
    if graph is None:
        return {}
    modules = dict(model.named_modules())
    found: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.Linear):
            continue
        linear = modules[node.target]
        assert isinstance(linear, nn.Linear)
        source = flattened_source(node.args[0], modules) if node.args else None
        channels = None if source is None else _channels(source, modules)
        if channels and linear.in_features % channels == 0:
            positions = linear.in_features // channels
            if positions > 1:
                found[str(node.target)] = (channels, positions)
    return found


def _channels(node: fx.Node, modules: dict[str, nn.Module]) -> int | None:
    """The channel count of ``node``'s output, read back through channel-keeping nodes to a
    convolution or a normalisation over channels. A padding on the way keeps the channels
    only if it pads no more trailing dimensions than the convolution has spatial ones
    (``F.pad(x, (1, 1, 1, 1))`` of a 1-D map pads its channels too): the walk then goes
    on past the normalisations to the convolution to know."""
    seen = padded = 0
    current: object = node
    while isinstance(current, fx.Node) and seen < 64:
        seen += 1
        module = modules.get(str(current.target)) if current.op == "call_module" else None
        if isinstance(module, _CONV):
            return int(module.out_channels) if padded <= len(module.kernel_size) else None
        norm = issubclass(unsharded(type(module)), _CHANNEL_COUNTS)
        if norm and not padded:
            return int(getattr(module, "num_features", getattr(module, "num_channels", 0)))
        padded = max(padded, _padded_dims(current, module))
        keeps = (
            norm
            or isinstance(module, _KEEPS_CHANNELS_MODULES)
            or (current.op == "call_function" and current.target in _KEEPS_CHANNELS_FUNCTIONS)
            or (current.op == "call_method" and current.target in _KEEPS_CHANNELS_METHODS)
        )
        if isinstance(module, nn.Sequential) or not keeps or not current.args:
            return None
        current = current.args[0]
    return None


_PADS = (nn.ZeroPad2d, nn.ConstantPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d)


def _padded_dims(node: fx.Node, module: nn.Module | None) -> int:
    """How many trailing dimensions ``node`` pads (0: not a padding; a padding whose width
    the graph does not hold counts as every dimension)."""
    if isinstance(module, _PADS):
        return len(module.padding) // 2
    if node.op != "call_function" or node.target is not F.pad:
        return 0
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    return len(pad) // 2 if isinstance(pad, (tuple, list)) else 64
