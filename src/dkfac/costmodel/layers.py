"""What the cost model needs to know about a model: its K-FAC layers and other parameters.

:func:`extract_layers` reads an ``nn.Module`` directly (it does not build a preconditioner):

- ``nn.Linear(in, out)``: ``a_dim = in + 1`` with a bias (``in`` without), ``g_dim = out``.
- ``nn.Conv2d(C_in, C_out, (kh, kw), groups=1)``: ``a_dim = C_in·kh·kw + 1`` with a bias,
  ``g_dim = C_out`` (``nn.Conv1d`` and ``nn.Conv3d`` alike, over their kernel's entries).
- A grouped ``nn.Conv1d``/``nn.Conv2d``/``nn.Conv3d`` (``groups = G > 1``, units of at most
  :data:`~dkfac.blocks.grouped_conv.MAX_UNIT_DIM` parameters): a unit-wise layer of kind
  ``"grouped_conv"`` with ``a_dim = d = (C_in/G)·kh·kw + 1`` with a bias and
  ``g_dim = C_out``: statistic and solver state ``C_out·d²``, gradient ``C_out·d``,
  placement cost ``C_out·d³`` (compute) or ``C_out·d²`` (memory); a wider one's parameters
  count as other parameters.
- ``nn.Embedding(V, D)``: ``a_dim = V``, ``g_dim = D``.
- ``nn.BatchNorm*`` (with affine parameters): a :class:`BNLayer` of ``channels`` channels and,
  as the engine preconditions it by default (``unitwise_bn=True``), also a unit-wise layer of
  kind ``"batchnorm"`` with ``a_dim = 2`` (the unit ``(γ_c, β_c)``) and ``g_dim = C``:
  statistic ``F`` of ``C·2·2`` elements, unit-wise solver state of ``C·2·2``, gradient
  ``C·2``, placement cost ``8C`` (compute) or ``4C`` (memory) — exactly what
  :class:`~dkfac.blocks.batchnorm.BatchNormBlock` reports.

Every Kronecker layer has ``a_dim · g_dim`` gradient elements (the bias is the extra column).
:func:`spec_from_blocks` builds the same description from a preconditioner's blocks.
With an ``input_shape`` one forward pass of a single sample records the number of output
positions ``T`` of each layer (``1`` for Linear; for a Linear applied to a sequence, the
sequence length), which the time model uses for factor-build and forward/backward flops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dkfac.blocks.base import Block, BlockCost, kronecker_cost
from dkfac.blocks.registry import blocks_or_reason, owned_children
from dkfac.blocks.ties import resolve_ties

__all__ = ["BNLayer", "KFACLayer", "ModelSpec", "extract_layers", "spec_from_blocks"]


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class KFACLayer:
    """One Kronecker-factored layer.

    Attributes:
        name: Module name.
        a_dim: Side of the activation factor A (inputs per output position, plus 1 for a bias).
        g_dim: Side of the gradient factor G (outputs).
        positions: Output positions per sample ``T`` (1 for Linear, ``H_out·W_out`` for conv).
        kind: The block's name of its layer kind (:attr:`dkfac.blocks.base.Block.cost_kind`:
            ``"linear"``, ``"conv2d"``, ``"embedding"``... informative only), or
            ``"batchnorm"``, which implies ``unitwise`` (and ``a_dim`` 2).
        unitwise: Unit-wise ``a_dim × a_dim`` blocks, one per unit (``g_dim`` units:
            BatchNorm's channels, a grouped convolution's output channels), instead of a
            Kronecker pair (sizes as in the module notes).
    """

    name: str
    a_dim: int
    g_dim: int
    positions: int = 1
    kind: str = "linear"
    unitwise: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        _check_positive_int("a_dim", self.a_dim)
        _check_positive_int("g_dim", self.g_dim)
        _check_positive_int("positions", self.positions)
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"kind must be a non-empty string, got {self.kind!r}")
        if self.kind == "batchnorm":
            object.__setattr__(self, "unitwise", True)
        if self.kind == "batchnorm" and self.a_dim != 2:
            raise ValueError(f"a BatchNorm layer has a_dim 2, got {self.a_dim}")

    @property
    def grad_numel(self) -> int:
        """Gradient elements of weight and bias together: ``a_dim · g_dim``."""
        return self.a_dim * self.g_dim

    def placement_cost(self, cost_kind: str = "compute") -> float:
        """The engine's placement cost (the block's ``placement_cost``)."""
        if self.unitwise:
            if cost_kind not in ("compute", "memory"):
                raise ValueError(f"kind must be 'compute' or 'memory', got {cost_kind!r}")
            power = 3 if cost_kind == "compute" else 2
            return float(self.g_dim * self.a_dim**power)
        return kronecker_cost(self.a_dim, self.g_dim, cost_kind)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class BNLayer:
    """A BatchNorm layer with affine parameters (γ and β per channel).

    Attributes:
        name: Module name.
        channels: Number of channels.
    """

    name: str
    channels: int

    def __post_init__(self) -> None:
        _check_positive_int("channels", self.channels)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The cost model's view of a model.

    Attributes:
        layers: K-FAC layers in module order.
        bn_layers: BatchNorm layers (informative; with ``unitwise_bn`` they are also in
            ``layers``, otherwise their γ, β are part of ``other_param_numel``).
        other_param_numel: Trainable parameter elements outside the K-FAC layers (BN, grouped
            convs, embeddings, ...); DDP all-reduces their gradients too.
        other_param_tensors: How many trainable tensors hold them (under ``eigen_adam``
            each keeps Adam's moments and a count: ``leftover_update``).
        forward_flops_per_sample: Multiply-add flops (2 per MAC) of one sample's forward pass
            through the K-FAC layers, 0 if unknown.
    """

    layers: tuple[KFACLayer, ...]
    bn_layers: tuple[BNLayer, ...] = field(default_factory=tuple)
    other_param_numel: int = 0
    other_param_tensors: int = 0
    forward_flops_per_sample: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "bn_layers", tuple(self.bn_layers))
        if not self.layers:
            raise ValueError("layers must hold at least one KFACLayer")
        if not all(isinstance(layer, KFACLayer) for layer in self.layers):
            raise TypeError("layers must be KFACLayer instances")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        for name in ("other_param_numel", "other_param_tensors"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def kfac_param_numel(self) -> int:
        """Gradient elements of all K-FAC layers."""
        return sum(layer.grad_numel for layer in self.layers)

    @property
    def param_numel(self) -> int:
        """All trainable parameter elements (what DDP all-reduces)."""
        return self.kfac_param_numel + self.other_param_numel


def extract_layers(
    model: nn.Module, input_shape: Sequence[int] | None = None, *, unitwise_bn: bool = True
) -> ModelSpec:
    """Reads the K-FAC layers, BatchNorm layers and other parameters of ``model``.

    Args:
        model: Any module (a DDP wrapper is looked through via ``.module``).
        input_shape: Shape of ONE sample (without the batch dimension), e.g. ``(3, 224, 224)``;
            when given, a single forward pass (no gradients, on the model's device) records
            output positions and forward flops. Without it every ``positions`` is 1.
        unitwise_bn: BatchNorm layers are preconditioned (as ``KFACConfig.unitwise_bn``).

    Returns:
        The :class:`ModelSpec`.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``.
        ValueError: If the model has no layer to precondition with a trainable weight, or
            ``input_shape`` is not a sequence of positive integers.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    assert isinstance(inner, nn.Module)
    if input_shape is not None:
        shape = tuple(input_shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"input_shape must be positive integers, got {input_shape!r}")
    blocks = _blocks(inner)
    positions = _count_positions(inner, blocks, input_shape) if input_shape is not None else {}
    layers: list[KFACLayer] = []
    bn_layers: list[BNLayer] = []
    kfac_params: set[int] = set()
    flops = 0.0
    for name, block in blocks.items():
        cost = block.cost_description()
        if cost.kind == "batchnorm":
            bn_layers.append(BNLayer(name=name, channels=cost.g_dim))
            if not unitwise_bn:
                continue
        t = positions.get(name, 1)
        layers.append(_layer(name, cost, t))
        if cost.forward_flops:
            flops += 2.0 * t * cost.a_dim * cost.g_dim
        kfac_params.update(id(p) for p in block.parameters())
    if not layers:
        raise ValueError(
            "model has no nn.Linear, nn.Conv1d/2d/3d or other layer K-FAC preconditions"
        )
    others = [p for p in inner.parameters() if p.requires_grad and id(p) not in kfac_params]
    return ModelSpec(
        layers=tuple(layers),
        bn_layers=tuple(bn_layers),
        other_param_numel=sum(p.numel() for p in others),
        other_param_tensors=len(others),
        forward_flops_per_sample=flops if positions else 0.0,
    )


def spec_from_blocks(blocks: Mapping[str, Block], other_param_numel: int = 0) -> ModelSpec:
    """The cost model's view of a preconditioner's registered blocks (module order kept).

    Args:
        blocks: Layer name -> block, as ``KFACPreconditioner`` registered them.
        other_param_numel: Trainable parameter elements outside the blocks.

    Returns:
        The :class:`ModelSpec` (``positions`` all 1: blocks do not know the input size).

    Raises:
        ValueError: If a block is neither a dense Kronecker pair (statistics ``A`` of
            ``a × a`` and ``G`` of ``g × g``) nor a unit-wise block, e.g. a block
            type registered by the user, or ``blocks`` is empty.
    """
    if not blocks:
        raise ValueError("blocks must not be empty")
    layers = [_layer(name, block.cost_description(), 1) for name, block in blocks.items()]
    return ModelSpec(layers=tuple(layers), other_param_numel=other_param_numel)


def _blocks(model: nn.Module) -> dict[str, Block]:
    """The blocks K-FAC would register (BatchNorm always, for BNLayer), by the engine's rules:
    a module's several blocks (attention), the children its factory owns skipped, frozen
    weights left out, and a tied tensor counted once (:func:`~dkfac.blocks.ties.resolve_ties`).
    """
    blocks: dict[str, Block] = {}
    claimed: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in claimed:
            continue
        claimed.update(id(child) for child in owned_children(module))
        found = blocks_or_reason(name, module, unitwise=True)
        if not isinstance(found, list):
            continue
        for block in found:
            if block.parameters()[0].requires_grad:
                blocks[block.name] = block
    return resolve_ties(blocks)[0]


def _layer(name: str, cost: BlockCost, positions: int) -> KFACLayer:
    """The cost model's layer of a block's cost description."""
    if cost.kind is None:
        raise ValueError(f"block {name!r} has no cost description (its cost_kind is None)")
    return KFACLayer(
        name=name,
        a_dim=cost.a_dim,
        g_dim=cost.g_dim,
        positions=positions,
        kind=cost.kind,
        unitwise=cost.unitwise,
    )


def _count_positions(
    model: nn.Module, blocks: Mapping[str, Block], input_shape: Sequence[int]
) -> dict[str, int]:
    """Positions per sample of every block that prices forward flops (its rows,
    :meth:`~dkfac.blocks.base.Block.forward_rows`, in a forward of one sample: a
    transposed convolution's input positions), from one forward pass on fake tensors
    (shapes without storage; a real one where the forward reads values)."""
    found: dict[str, int] = {}
    handles = []

    def hook(name: str, inputs: tuple[object, ...], output: object) -> None:
        if isinstance(output, Tensor):
            first = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
            found[name] = blocks[name].forward_rows(first, output)

    for name, block in blocks.items():
        if block.cost_description().forward_flops:
            handles.append(
                block.module.register_forward_hook(lambda m, i, o, name=name: hook(name, i, o))
            )
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            try:  # shapes only: no memory for the activations (a 4096² VGG took 13 GB)
                with FakeTensorMode(allow_non_fake_inputs=True):
                    model(torch.zeros((1, *input_shape), device=device))
            except Exception:  # a forward that reads values (data-dependent control flow)
                found.clear()
                model(torch.zeros((1, *input_shape), device=device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return found
