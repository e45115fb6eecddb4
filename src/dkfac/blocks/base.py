"""The block interface: what a layer type contributes to the Kronecker factors.

A block turns the input a layer saw in the forward pass into the rows of the *input factor*
A and the gradient of its output into the rows of the *output-gradient factor* G. A factor is
``R.T @ R / n`` for the row matrix ``R`` and normaliser ``n`` a block returns, so

* the dense solvers form the d×d factor from ``R``;
* the low-rank (SMW) solver keeps ``R / sqrt(n)`` itself as ``U`` with ``A = U U^T``.

Conventions: the weight gradient is seen as a matrix
``d_out × d_in`` with the bias folded in as an extra input column of ones; gradients reaching
the blocks are already multiplied by the batch size, so the factors are on the per-sample
Fisher scale.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Rows:
    """Rows of one factor contribution: the factor is ``rows.T @ rows / normaliser``.

    Attributes:
        rows: A ``(r, d)`` matrix.
        normaliser: The count the outer products are averaged over (rows, or samples).
        batch_mean: The rows are the gradient of the whole batch's mean loss, not rows of
            single samples (a lookup whose output the caller broadcast over the batch: its
            output gradient arrives summed over the samples). The statistic is quadratic in
            them, so with the batch split over ranks the rows must be averaged over the
            ranks *before* their products; the capture does that (one small all-reduce).
    """

    rows: Tensor
    normaliser: float
    batch_mean: bool = False

    def scaled(self) -> Tensor:
        """``rows / sqrt(normaliser)``: the ``(r, d)`` matrix ``Uᵀ`` with factor ``U Uᵀ``."""
        return self.rows / self.normaliser**0.5


CostKind = Literal["compute", "memory"]

GROUP_MAX_ELEMENTS = 2**22
"""The largest input or output gradient (entries) whose capture a block groups with others
(:meth:`Block.group_key`): a group stacks them, a copy of each, which the small models whose
steps launches bound afford."""


def kronecker_cost(a_dim: int, g_dim: int, kind: CostKind = "compute") -> float:
    """Relative cost of a Kronecker layer's second-order work, used to balance owners.

    Args:
        a_dim: Side length of the activation factor A (d_in, plus 1 with a bias).
        g_dim: Side length of the gradient factor G (d_out).
        kind: ``"compute"``: ``a_dim³ + g_dim³``, the scaling of two eigendecompositions;
            ``"memory"``: ``a_dim² + g_dim²``, the number of stored factor entries.

    Returns:
        The cost as a float (only ratios between layers matter).

    Raises:
        ValueError: If a dimension is not a positive integer or ``kind`` is unknown.
    """
    for name, dim in (("a_dim", a_dim), ("g_dim", g_dim)):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"{name} must be a positive integer, got {dim!r}")
    if kind == "compute":
        return float(a_dim**3 + g_dim**3)
    if kind == "memory":
        return float(a_dim**2 + g_dim**2)
    raise ValueError(f"kind must be 'compute' or 'memory', got {kind!r}")


@dataclass(frozen=True)
class BlockCost:
    """What the cost model needs to know of a block (:meth:`Block.cost_description`).

    Attributes:
        kind: The cost model's name of the layer kind (``"linear"``, ``"conv2d"``,
            ``"embedding"``, ``"batchnorm"``; ``None`` for a block it cannot describe).
        a_dim: Side of the input factor A (2 for a unit-wise block: the unit ``(γ, β)``).
        g_dim: Side of the output-gradient factor G (channels of a unit-wise block).
        unitwise: A unit-wise 2×2 block per channel (statistic ``g_dim·2·2``) instead of a
            Kronecker pair.
        forward_flops: Whether the forward pass costs ``2·T·a_dim·g_dim`` flops (a matrix
            product per output position; an embedding lookup does not).
    """

    kind: str | None
    a_dim: int
    g_dim: int
    unitwise: bool = False
    forward_flops: bool = True


class StatisticSink(Protocol):
    """Where a block adds one statistic's contribution (an accumulator of the solver's).

    A sink whose :attr:`takes_sums` is true keeps only ``Σ scale·RᵀR`` and accepts
    :meth:`add_sum`; a block may then build that sum its own faster way, with the products'
    inputs in :attr:`compute_dtype` and the sum in :attr:`dtype`. Other sinks (low-rank
    sides keep the rows themselves) need :meth:`add`.
    """

    @property
    def takes_sums(self) -> bool:
        """Whether :meth:`add_sum` is accepted (a dense accumulator)."""

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """Precision of the products' inputs (``None``: as they come)."""

    @property
    def dtype(self) -> torch.dtype | None:
        """Precision the sum is kept in (``None``: as the products come)."""

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds ``scale · rows.T @ rows`` and the rows' normaliser."""

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        """Adds a precomputed sum of outer products and its normaliser."""


@dataclass(frozen=True)
class HeldForward:
    """One forward whose capture waits for its group (:meth:`Block.capture_group`).

    Attributes:
        block: The layer's block.
        inputs: The input it saw.
        grad: Its output's gradient.
        sinks: Its due statistics.
        scale: The scale of its gradient statistics (as :meth:`Block.capture_grad`'s).
    """

    block: Block
    inputs: Tensor
    grad: Tensor
    sinks: Mapping[str, StatisticSink]
    scale: float


class Removable(Protocol):
    """What :meth:`Block.install` returns: a handle whose ``remove()`` undoes the install."""

    def remove(self) -> None:
        """Undoes the install (a second call does nothing)."""


ParameterPart = tuple[Tensor, slice | None]
"""A parameter a block preconditions, and the rows of it (``None``: all of it)."""


class Block(ABC):
    """Curvature estimation for one module: Kronecker factors by default.

    The hooks of the preconditioner only call :meth:`capture_input` (forward) and
    :meth:`capture_grad` (backward), which feed named statistics (:meth:`statistic_shapes`);
    a Kronecker block feeds ``"A"`` from :meth:`a_rows` and ``"G"`` from :meth:`g_rows`.
    Blocks that are not a Kronecker pair (unit-wise BatchNorm) override these methods and
    name their solver in :attr:`solver_name`.

    Args:
        name: The module's qualified name in the model.
        module: The module itself.

    Attributes:
        solver_name: The solver this block always uses, or ``None`` for the configured one.
        grad_statistics: Statistics that are quadratic in the output gradient (rescaled by
            ``1/scale²`` under a ``GradScaler``; missing ones mean no backward fed them).
    """

    solver_name: ClassVar[str | None] = None
    adam_solver_name: ClassVar[str | None] = None
    """The solver this block takes instead of :attr:`solver_name` where the configured
    method has Adam's scale (:attr:`~dkfac.solvers.base.Solver.adam_scaled`, as the
    default's ``"eigen_adam"``): a unit-wise block of a weight layer then gets Adam's
    moments in its units' eigenbases (``"unitwise_adam"``); ``None``: :attr:`solver_name`."""
    grad_statistics: ClassVar[tuple[str, ...]] = ("G",)
    damping_key: ClassVar[str] = "damping"
    """Which damping of the step applies: ``"damping"`` or ``"bn_damping"``."""
    rows_are_outputs: ClassVar[bool] = False
    """Dim 0 of each of its parameters indexes the rows of its ``g_dim × a_dim`` gradient
    matrix (the ``G`` side), whole (Linear, Conv2d): a rank holding some rows of each can
    precondition them with the full ``A`` and its rows' diagonal block of ``G``
    (``shard_exchange="local"``)."""
    cost_kind: ClassVar[str | None] = None
    """The cost model's name of the layer kind (:class:`BlockCost`); ``None``: the cost
    model cannot describe the block (``strategy="auto"`` then falls back to its rule)."""
    left_out_reason: ClassVar[str | None] = None
    """Why the module's own parameters that :meth:`parameters` leaves out go to the inner
    optimizer (``describe()``'s reason); ``None``: the block holds all of them."""

    @classmethod
    def declines(cls, module: nn.Module, **options: Any) -> str | None:
        """Why this block cannot precondition ``module`` with these options, or ``None``.

        The registry asks before building a block; the reason is logged and reported as
        the reason the module's parameters are left to the inner optimizer.
        """
        del module, options
        return None

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module

    @property
    def has_bias(self) -> bool:
        """Whether the module has a bias (folded into A as a column of ones)."""
        return getattr(self.module, "bias", None) is not None

    @property
    def input_row_bias(self) -> bool | None:
        """How ``A`` is made of the hooked input: the second moment of rows of its entries,
        ending with the bias's constant 1 (``True``) or not (``False``); ``None`` where
        ``A`` is not that (an embedding's, of token counts). Read by
        :mod:`~dkfac.engine.input_rms`."""
        return self.has_bias

    def batch_size(self, inputs: Tensor) -> int:
        """Samples in a forward input: its first dimension, or 1 for an unbatched input."""
        return int(inputs.shape[0]) if inputs.dim() > 1 else 1

    @property
    @abstractmethod
    def a_dim(self) -> int:
        """Dimension of the input factor A (bias column included)."""

    @property
    @abstractmethod
    def g_dim(self) -> int:
        """Dimension of the output-gradient factor G."""

    @abstractmethod
    def a_rows(self, inputs: Tensor) -> Rows:
        """Rows of A from the layer's forward input."""

    @abstractmethod
    def g_rows(self, grad_output: Tensor) -> Rows:
        """Rows of G from the (batch-size scaled) gradient of the layer's output."""

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every statistic, known without data (receive buffers, checkpoints)."""
        return {"A": (self.a_dim, self.a_dim), "G": (self.g_dim, self.g_dim)}

    def capture_input(self, inputs: Tensor, sinks: Mapping[str, StatisticSink]) -> Any:
        """Forward hook: adds the input statistics; returns what the backward hook needs.

        ``sinks`` holds only the statistics due this step (a refresh policy may skip some).
        """
        if "A" in sinks:
            sinks["A"].add(self.a_rows(inputs))
        return None

    def capture_grad(
        self, context: Any, grad_output: Tensor, sinks: Mapping[str, StatisticSink], scale: float
    ) -> None:
        """Backward hook: adds the output-gradient statistics (``scale`` = batch size²)."""
        del context
        if "G" in sinks:
            sinks["G"].add(self.g_rows(grad_output), scale)

    def group_key(
        self, inputs: Tensor, grad_output: Tensor, sinks: Mapping[str, StatisticSink]
    ) -> Hashable | None:
        """What the layers share whose captures :meth:`capture_group` may compute together
        (where launches bound the step); ``None`` (the default): captured alone, in the
        hooks."""
        del inputs, grad_output, sinks
        return None

    @classmethod
    def capture_group(cls, members: Sequence[HeldForward]) -> None:
        """The captures of forwards of one :meth:`group_key`; the default: each alone, as
        the hooks would. A group's sums are its own tensors: a sink may keep them."""
        for held in members:
            context = held.block.capture_input(held.inputs, held.sinks)
            held.block.capture_grad(context, held.grad, held.sinks, held.scale)

    def placement_cost(self, kind: CostKind = "compute") -> float:
        """Relative cost of the layer's second-order work (:func:`kronecker_cost`)."""
        return kronecker_cost(self.a_dim, self.g_dim, kind)

    def cost_description(self) -> BlockCost:
        """The layer as the cost model sees it."""
        return BlockCost(self.cost_kind, self.a_dim, self.g_dim)

    def output_positions(self, output: Tensor) -> int:
        """Output positions ``T`` per sample in a forward output (1 by default)."""
        del output
        return 1

    def forward_rows(self, inputs: Tensor | None, output: Tensor) -> int:
        """The rows of a forward (samples × positions) whose products make the layer's
        training step, ``2 · rows · a · g`` multiply-adds each way, and over which its
        factors are summed: the output's rows of ``g`` entries by default (the overhead
        budget's count, :mod:`dkfac.engine.overhead`)."""
        del inputs
        return max(1, output.numel() // max(1, self.g_dim))

    def install(self) -> Removable | None:
        """Prepares the model so that the capture hooks on :attr:`module` fire; ``None``: nothing.

        Called once when the preconditioner attaches this block's hooks; the handle is removed
        with them. A block whose layer is called functionally by its parent (the projections
        of ``nn.MultiheadAttention``) swaps the parent's forward for one that calls hookable
        pieces.
        """
        return None

    def hooked_input(self, inputs: tuple[Any, ...]) -> Tensor | None:
        """The forward input the capture hook reads (the first positional one)."""
        return inputs[0] if inputs and isinstance(inputs[0], Tensor) else None

    def hooked_output(self, output: Any) -> Tensor | None:
        """The forward output whose gradient the backward hook reads."""
        return output if isinstance(output, Tensor) else None

    def set_step(self, step: int) -> None:
        """Tells the block the preconditioner's step counter before a step's passes.

        Blocks whose rows depend on the step (seeded spatial subsampling) use it so that the
        forward (A) and backward (G) hooks of one step pick the same positions on every rank;
        the default ignores it.
        """
        del step

    def weight_grad(self) -> Tensor | None:
        """The gradient as a ``g_dim × a_dim`` matrix, or ``None`` when there is none."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        if weight.grad is None:
            return None
        # the columns named: a rank's shard of a layer may hold no rows (0 × -1 is ambiguous)
        grad = weight.grad.reshape(weight.shape[0], math.prod(weight.shape[1:]))
        if self.has_bias:
            bias = self.module.bias
            assert isinstance(bias, Tensor)
            bias_grad = bias.grad if bias.grad is not None else torch.zeros_like(bias)
            grad = torch.cat([grad, bias_grad.reshape(-1, 1)], dim=1)
        return grad

    def grad_sources(self) -> list[Tensor] | None:
        """The ``.grad`` tensors :meth:`weight_grad`'s matrix is made of, in the order of
        :meth:`grad_layout`'s views; ``None`` where one is missing or the block builds its
        matrix otherwise (an override of :meth:`weight_grad`): then take :meth:`weight_grad`.

        A GPU step is launches: the engine copies every layer's sources into views of one
        buffer made once (:meth:`grad_layout`), one multi-tensor copy for all layers."""
        if type(self).weight_grad is not Block.weight_grad:
            return None
        grads = [param.grad for param in self.parameters()]
        return None if any(grad is None for grad in grads) else grads  # type: ignore[return-value]

    def grad_shape(self) -> tuple[int, int]:
        """The shape of :meth:`weight_grad`'s matrix (for :meth:`grad_layout`)."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return (weight.shape[0], math.prod(weight.shape[1:]) + int(self.has_bias))

    def grad_layout(self, matrix: Tensor) -> list[Tensor]:
        """Views of a :meth:`grad_shape` matrix, one per tensor of :meth:`grad_sources`:
        each gradient copied into its view makes :meth:`weight_grad`'s matrix."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        if not self.has_bias:
            return [matrix.view(weight.shape)]
        width = matrix.shape[1] - 1
        return [matrix[:, :width].view(weight.shape), matrix[:, width]]

    def grad_writes(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        """``(destination, value)`` pairs that write a ``g_dim × a_dim`` matrix back into
        the parameters' ``.grad`` (a missing bias gradient is created as zeros first; a
        frozen bias gets none: :func:`gradient_write`).

        The destinations are views of the ``.grad`` tensors and each value has its
        destination's shape; the engine copies every layer's pairs in one multi-tensor
        copy (a GPU step is launches), :meth:`set_weight_grad` one layer's.
        """
        weight = self.module.weight
        assert isinstance(weight, Tensor) and weight.grad is not None
        writes = []
        if self.has_bias:
            bias = self.module.bias
            assert isinstance(bias, Tensor)
            writes += gradient_write(bias, matrix[:, -1])
            matrix = matrix[:, :-1]
        writes.append((weight.grad, matrix.reshape(weight.shape)))
        return writes

    def set_weight_grad(self, matrix: Tensor) -> None:
        """Writes a ``g_dim × a_dim`` matrix back into the parameters' ``.grad``
        (:meth:`grad_writes`, copied)."""
        for destination, value in self.grad_writes(matrix):
            destination.copy_(value)

    def parameters(self) -> list[Tensor]:
        """The module's parameters this block preconditions."""
        params = [self.module.weight]
        if self.has_bias:
            params.append(self.module.bias)
        return [p for p in params if isinstance(p, Tensor)]

    def parameter_parts(self) -> list[ParameterPart]:
        """Each parameter this block preconditions with the rows it owns (``None``: all).

        Registration uses it to find tied weights (two blocks on overlapping parts of one
        tensor) and to report which parameters each layer covers.
        """
        return [(param, None) for param in self.parameters()]

    def left_out(self) -> list[tuple[Tensor, str]]:
        """The parameters of the layer this block leaves to the inner optimizer, each with
        why (``describe()``'s reason; those :meth:`parameters` holds are never listed).

        By default the module's own parameters, with :attr:`left_out_reason`, where it is
        set."""
        if self.left_out_reason is None:
            return []
        return [(param, self.left_out_reason) for param in self.module.parameters(recurse=False)]


def gradient_write(
    param: Tensor, value: Tensor, rows: slice | None = None
) -> list[tuple[Tensor, Tensor]]:
    """The write of ``value`` into ``param.grad`` (its ``rows``; ``None``: all) as
    :meth:`Block.grad_writes` pairs, for a parameter whose gradient may be missing (a
    bias, BatchNorm's ``γ`` and ``β``): a trainable one's is created as zeros first; a
    frozen ``nn.Parameter`` (``requires_grad`` off) gets no write, and no gradient where it
    has none (a stale one, kept by ``zero_grad(set_to_none=False)``, stays as it is), so that
    an optimizer holding it (``for_model``'s holds every parameter) leaves it as torch does.
    A plain tensor is a sharded layout's stand-in for a parameter
    (:meth:`~dkfac.distributed.layout.ShardedLayout.full_gradients`): written as a
    trainable one.
    """
    if isinstance(param, nn.Parameter) and not param.requires_grad:
        return []
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    destination = param.grad if rows is None else param.grad[rows]
    return [(destination, value.reshape(destination.shape))]


def append_ones(rows: Tensor) -> Tensor:
    """Appends a column of ones (the folded-in bias input) to a row matrix."""
    return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
