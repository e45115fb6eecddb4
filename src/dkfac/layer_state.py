"""Per-layer runtime state (accumulators, running factors, solver state) and the capture hooks."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.profiler import record_function

from dkfac.blocks.base import Block, Rows
from dkfac.config import KFACConfig
from dkfac.fisher import mc_sample_loss
from dkfac.lowrank import LowRank, decay_concat
from dkfac.solvers.base import Solver, SolverState

logger = logging.getLogger(__name__)


@dataclass
class FactorAccumulator:
    """Sums ``scale · RᵀR`` and normalisers over the micro-batches of one step.

    Attributes:
        dtype: Precision the sums are kept in (``None``: as the rows come).
        product_dtype: Precision the rows are cast to for their products (``None``:
            ``dtype``); a product is converted to ``dtype`` before it is added.
        total: The running sum of outer products, ``None`` before the first contribution.
        normaliser: The running sum of normalisers.
    """

    dtype: torch.dtype | None = None
    product_dtype: torch.dtype | None = None
    total: Tensor | None = None
    normaliser: float = 0.0

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The precision of the products' inputs (``None``: as the rows come)."""
        return self.product_dtype or self.dtype

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds ``scale · rows.T @ rows`` and the rows' normaliser."""
        dtype = self.compute_dtype
        matrix = rows.rows if dtype is None else rows.rows.to(dtype)
        contribution = matrix.T @ matrix
        if self.dtype is not None:
            contribution = contribution.to(self.dtype)
        if scale != 1.0:
            contribution.mul_(scale)
        if self.total is None:
            self.total = contribution
        else:
            self.total.add_(contribution)
        self.normaliser += rows.normaliser

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        """Adds a precomputed sum of outer products (any shape) and its normaliser."""
        contribution = total if self.dtype is None else total.to(self.dtype)
        if scale != 1.0:
            contribution = contribution * scale
        if self.total is None:
            self.total = contribution.clone()
        else:
            self.total.add_(contribution)
        self.normaliser += normaliser

    @property
    def has_data(self) -> bool:
        """Whether anything was added since the last reset."""
        return self.total is not None

    def mean(self) -> Tensor | None:
        """The averaged factor, or ``None`` when nothing was added."""
        if self.total is None or self.normaliser == 0:
            return None
        return self.total / self.normaliser

    def tensors(self) -> list[Tensor]:
        """The tensors held (for memory accounting)."""
        return [] if self.total is None else [self.total]

    def reset(self) -> None:
        """Forgets every contribution."""
        self.total = None
        self.normaliser = 0.0


class Accumulator(Protocol):
    """One statistic's accumulator: dense (:class:`FactorAccumulator`), low-rank
    (:class:`~dkfac.lowrank.LowRankRowsAccumulator`) or a placeholder that decides which at
    the first capture (:class:`~dkfac.lowrank_state.PendingSink`)."""

    @property
    def has_data(self) -> bool:
        """Whether anything was added since the last reset."""

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds ``scale · rows.T @ rows`` and the rows' normaliser."""

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        """Adds a precomputed sum of outer products and its normaliser."""

    def mean(self) -> Tensor | None:
        """This step's statistic (``U`` for a low-rank side), ``None`` when empty."""

    def reset(self) -> None:
        """Forgets every contribution."""

    def tensors(self) -> list[Tensor]:
        """The tensors held."""


def _pair() -> dict[str, Accumulator]:
    return {"A": FactorAccumulator(), "G": FactorAccumulator()}


@dataclass
class LayerState:
    """Everything the preconditioner keeps for one registered layer on this rank.

    Statistics are *named* (``"A"`` and ``"G"`` for a Kronecker block) so that strategies
    can reduce, keep and checkpoint them without knowing what they are.

    Attributes:
        block: What the layer's factors are.
        solver: How the layer's damped inverse is applied.
        accumulators: Statistic name -> accumulator of the current step's contribution.
        running: Statistic name -> running average; empty on ranks that do not keep it.
        solver_state: The last good solver state, ``None`` before the first inverse update
            and on ranks that do not precondition this layer.
        captures: Whether this rank's hooks build the layer's statistics (a strategy may
            leave all of the capture work to the layer's owner).
        due: The statistics captured this step (set by the refresh policy before a step).
        lowrank: Statistic name -> bounded rank, for the sides held as ``U`` (``d × m``,
            factor ``U Uᵀ``) instead of a ``d × d`` matrix (SMW; see
            :mod:`dkfac.lowrank_state`). Their step statistic and running value are ``U``.
        method_label: The method as ``describe()`` shows it (e.g. ``smw(A=lowrank,G=dense)``).
    """

    block: Block
    solver: Solver
    accumulators: dict[str, Accumulator] = field(default_factory=_pair)
    running: dict[str, Tensor] = field(default_factory=dict)
    solver_state: SolverState | None = None
    captures: bool = True
    lowrank: dict[str, int] = field(default_factory=dict)
    method_label: str = ""
    due: frozenset[str] = frozenset()

    def due_sinks(self) -> dict[str, Any]:
        """The accumulators of the statistics due this step."""
        return {key: acc for key, acc in self.accumulators.items() if key in self.due}

    @property
    def name(self) -> str:
        """The module's qualified name."""
        return self.block.name

    @property
    def a_acc(self) -> Accumulator:
        """Accumulator of the input factor A."""
        return self.accumulators["A"]

    @property
    def g_acc(self) -> Accumulator:
        """Accumulator of the output-gradient factor G."""
        return self.accumulators["G"]

    @property
    def a(self) -> Tensor | None:
        """Running input factor A (``None`` when not kept here)."""
        return self.running.get("A")

    @property
    def g(self) -> Tensor | None:
        """Running output-gradient factor G (``None`` when not kept here)."""
        return self.running.get("G")

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every statistic, known without data (used to allocate receive buffers)."""
        return self.block.statistic_shapes()

    def take_means(self) -> dict[str, Tensor] | None:
        """This step's averaged statistics (those that were fed, or ``None``); resets the sums."""
        means = {key: acc.mean() for key, acc in self.accumulators.items()}
        self.reset_accumulators()
        present = {key: value for key, value in means.items() if value is not None}
        return present or None

    def update_running(self, new: dict[str, Tensor], decay: float) -> None:
        """``F ← decay·F + (1−decay)·F_new`` per statistic; a first value is taken as it is.

        Low-rank sides keep ``U ← [√decay·U, √(1−decay)·U_new]`` (bounded rank, oldest
        columns dropped first; :func:`~dkfac.lowrank.decay_concat`), never a sum of ``U``'s.
        """
        for key, value in new.items():
            if key in self.lowrank:
                old = self.running.get(key)
                self.running[key] = decay_concat(old, value, decay, self.lowrank[key])
            elif key not in self.running or decay == 0.0:
                self.running[key] = value
            else:
                self.running[key].mul_(decay).add_(value, alpha=1.0 - decay)

    @property
    def complete(self) -> bool:
        """Whether every statistic has a running value (the solver can be computed)."""
        return set(self.running) == set(self.block.statistic_shapes())

    def solver_inputs(self) -> dict[str, Any]:
        """The running statistics as the solver takes them (low-rank sides as ``LowRank``)."""
        return {
            key: LowRank(value) if key in self.lowrank else value
            for key, value in self.running.items()
        }

    def factor_kinds(self) -> dict[str, str]:
        """``a_factor`` / ``g_factor``: ``"lowrank"``, ``"dense"`` or ``"pending"``."""
        pending = self.method_label.endswith("(pending)")
        return {
            f"{key.lower()}_factor": "pending"
            if pending
            else ("lowrank" if key in self.lowrank else "dense")
            for key in ("A", "G")
        }

    def summary(self) -> dict[str, Any]:
        """Name, block type, factor dimensions, method and factor kinds (``describe()``)."""
        return {
            "name": self.name,
            "block": type(self.block).__name__,
            "a_dim": self.block.a_dim,
            "g_dim": self.block.g_dim,
            "method": self.method_label or self.solver.name,
            **self.factor_kinds(),
        }

    def memory(self) -> dict[str, int]:
        """Bytes of running ``factors``, solver state (``inverses``) and ``accumulators``."""
        groups = {
            "factors": list(self.running.values()),
            "inverses": list((self.solver_state or {}).values()),
            "accumulators": [t for acc in self.accumulators.values() for t in acc.tensors()],
        }
        return {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in groups.items()}

    def reset_accumulators(self) -> None:
        """Drops the current step's partial statistics."""
        for acc in self.accumulators.values():
            acc.reset()


class FactorCapture:
    """The hooks that feed each layer's accumulators, and the Monte-Carlo Fisher backward.

    Scale convention: the backward hook sees ``grad_output = g / (B · k)`` for a loss that
    is the mean over the ``B`` samples of a micro-batch divided by ``k =
    accumulation_steps``; it multiplies by ``B · k`` so the factors are on the per-sample
    Fisher scale.

    Args:
        config: The preconditioner's configuration.

    Attributes:
        active: Whether this step captures (a factor-update step); hooks do nothing if not.
        generator: The Monte-Carlo sampling generator (created on first use).
    """

    def __init__(self, config: KFACConfig) -> None:
        self.config = config
        self.active = False
        self.generator: torch.Generator | None = None
        self._mc_active = False
        self._mc_captured = False
        # Outputs of the layers captured in this forward: the sampled backward stops at them.
        self._mc_roots: list[GradientEdge] = []
        self._warned_missing: set[str] = set()
        self._handles: list[Any] = []

    def attach(self, module: nn.Module, layer: LayerState) -> None:
        """Registers the forward hook (which registers the backward hook) on ``module``."""
        hook = functools.partial(self._forward_hook, layer)
        self._handles.append(module.register_forward_hook(hook))

    def remove(self) -> None:
        """Detaches every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(
        self, layer: LayerState, module: nn.Module, inputs: tuple[Any, ...], output: Any
    ) -> None:
        if not (self.active and layer.captures and layer.due):
            return
        if not (module.training and torch.is_grad_enabled()):
            return
        if not inputs or not isinstance(inputs[0], Tensor):
            return
        x = inputs[0].detach()
        batch = layer.block.batch_size(x)
        # The G scale is that of the whole micro-batch's mean loss, whatever rows are kept.
        scale = float(batch * self.config.accumulation_steps) ** 2
        keep = self.config.factor_batch_size
        if keep is None or batch <= keep or x.shape[0] != batch:
            keep = None
        else:
            x = x[:keep]
        with record_function("dkfac.capture_a"):
            context = layer.block.capture_input(x, layer.due_sinks())
        if isinstance(output, Tensor) and output.requires_grad:
            hook = functools.partial(self._grad_hook, layer, scale, context, keep)
            output.register_hook(hook)
            if self.config.fisher == "mc":
                # The edge, not the tensor: an in-place op after the layer (ReLU(inplace=True))
                # would move the tensor's history past the node this hook belongs to.
                self._mc_roots.append(get_gradient_edge(output))

    def _grad_hook(
        self, layer: LayerState, scale: float, context: Any, keep: int | None, grad: Tensor
    ) -> None:
        if self.config.fisher == "mc" and not self._mc_active:
            return
        grad = grad.detach() if keep is None else grad.detach()[:keep]
        with record_function("dkfac.capture_g"):
            layer.block.capture_grad(context, grad, layer.due_sinks(), scale)
        self._mc_captured = True

    def sample_fisher(self, outputs: Tensor, loss: str, params: list[Tensor], seed: int) -> None:
        """One backward of targets sampled from ``outputs``; only the G hooks see it.

        The backward asks for the gradients of the captured layers' outputs, not of their
        parameters: it then runs only as far back as the first captured layer and computes
        no weight gradient (it would be thrown away). ``params`` serve when this forward
        captured no output (the hooks did not run).
        """
        roots, self._mc_roots = self._mc_roots, []
        if not self.active:
            return
        if self.generator is None or self.generator.device != outputs.device:
            self.generator = torch.Generator(device=outputs.device)
            self.generator.manual_seed(seed)
        sampled = mc_sample_loss(outputs, loss, self.generator)
        self._mc_active = True
        try:
            torch.autograd.grad(sampled, roots or params, retain_graph=True, allow_unused=True)
        finally:
            self._mc_active = False

    def take_layer(self, layer: LayerState) -> tuple[dict[str, Tensor] | None, bool]:
        """One layer's averaged statistics of this step (G not yet scaled); resets its sums.

        Returns:
            ``(means or None, missing_g)``: ``missing_g`` says the layer has some statistic
            but not every due gradient statistic (checked by :meth:`check_mc`).
        """
        grad_keys = [key for key in layer.block.grad_statistics if key in layer.due]
        missing_g = any(acc.has_data for acc in layer.accumulators.values()) and any(
            not layer.accumulators[key].has_data for key in grad_keys
        )
        # Other layers got their gradient statistics, this one did not: say so once (a
        # step where none did is check_mc's error with fisher="mc").
        if missing_g and self._mc_captured and layer.name not in self._warned_missing:
            self._warned_missing.add(layer.name)
            logger.warning(
                "%s: its input was captured but no output gradient reached it on this step "
                "(its output does not reach the loss); its factors are not updated until it does",
                layer.name,
            )
        return layer.take_means(), missing_g

    def check_mc(self, missing_g: bool) -> None:
        """Ends a capture step: with ``fisher="mc"``, G must have come from a sampled backward.

        Raises:
            RuntimeError: With ``fisher="mc"`` when no sampled backward fed the G factors.
        """
        captured, self._mc_captured = self._mc_captured, False
        self._mc_roots = []  # a forward whose sampled backward never came
        if self.config.fisher == "mc" and missing_g and not captured:
            raise RuntimeError(
                'fisher="mc": call pre.sample_fisher(outputs) after the forward pass and '
                "before loss.backward() on factor-update steps"
            )

    @staticmethod
    def scale_grad_statistics(
        layers: dict[str, LayerState], new: dict[str, dict[str, Tensor]], g_scale: float
    ) -> None:
        """Multiplies the gradient statistics in ``new`` by ``g_scale`` in place.

        ``g_scale`` is ``1 / grad_scaler_scale²`` under mixed precision; a low-rank side
        holds ``U`` and is scaled by ``√g_scale``. Applied after the reduction (the mean is
        linear; a GradScaler's power-of-two scale makes it exact), so the hooks never read
        the scale (a host synchronisation).
        """
        if g_scale == 1.0:
            return
        for name, means in new.items():
            layer = layers[name]
            for key in layer.block.grad_statistics:
                if key in means:
                    factor = g_scale**0.5 if key in layer.lowrank else g_scale
                    means[key] = means[key] * factor

    def collect(
        self, layers: dict[str, LayerState], g_scale: float
    ) -> dict[str, dict[str, Tensor]]:
        """This step's averaged statistics of the layers captured here; resets the sums.

        Args:
            layers: The registered layers.
            g_scale: Factor applied to G (``1 / grad_scaler_scale²`` under mixed precision).

        Raises:
            RuntimeError: With ``fisher="mc"`` when no sampled backward fed the G factors.
        """
        new: dict[str, dict[str, Tensor]] = {}
        missing_g = False
        for name, layer in layers.items():
            means, missing = self.take_layer(layer)
            missing_g = missing_g or missing
            if means is not None:
                new[name] = means
        self.scale_grad_statistics(layers, new, g_scale)
        self.check_mc(missing_g)
        return new
