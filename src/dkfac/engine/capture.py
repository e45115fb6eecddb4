"""The capture hooks that feed each layer's accumulators, and the Monte-Carlo Fisher backward."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from dkfac.blocks.base import Rows
from dkfac.blocks.linear import LinearBlock
from dkfac.config import KFACConfig
from dkfac.distributed.comm import Communicator
from dkfac.engine import launches
from dkfac.engine.capture_groups import CaptureGroups
from dkfac.engine.fisher import REENTRANT_CHECKPOINT, mc_sample_loss, through_reentrant_checkpoint
from dkfac.engine.input_rms import add_input_square
from dkfac.engine.layer_state import LayerState, take_means_all
from dkfac.engine.micro_batches import BackwardCounter, computes_gradient, gradient_accumulator
from dkfac.engine.model_hooks import (
    ModelHook,
    PositionalInput,
    outside_autocast,
    runs_as_the_model,
)
from dkfac.engine.phases import phase

logger = logging.getLogger(__name__)


@dataclass
class _ForwardPass:
    """The captured forwards of one micro-batch's forward pass (those run since a backward
    last reached a captured layer, with the recomputations inside that backward).

    Attributes:
        largest: The largest batch among them.
        backpropagated: The largest batch among those a backward went through (a forward
            never backpropagated, a metric's with gradients on, counts for nothing).
        empty: Whether a captured layer's forward in it had an empty batch (0 samples): its
            one-sample forwards are then broadcast ones, as on the ranks whose batches
            have rows (their G comes at the step's end on every rank alike).
    """

    largest: int = 0
    backpropagated: int = 0
    empty: bool = False


@dataclass
class _Forward:
    """One captured forward of a layer, until its output's gradient arrives.

    Attributes:
        inputs: The layer's (possibly truncated) input, not detached (the grad hook reads
            it under ``torch.no_grad``); ``None`` once its input statistics were added.
        batch: Samples of the forward.
        scale: The squared number of terms the micro-batch's loss averages over.
        keep: Rows kept for the statistics (``factor_batch_size``), ``None``: all.
        forward_pass: The forward pass it belongs to.
        context: What the block's input capture returned, for its gradient capture.
        recomputed: Whether it ran inside a backward (a checkpointed segment's
            recomputation).
        accumulator: The gradient accumulator of the weight the forward ran with; a
            backward that computes no gradient of that weight is not captured
            (:func:`~dkfac.engine.micro_batches.computes_gradient`).
        captured: Whether a training backward already went through it (a second one,
            ``retain_graph=True``, is counted as another micro-batch's: logged once).
    """

    inputs: Tensor | None
    batch: int
    scale: float
    keep: int | None
    forward_pass: _ForwardPass
    context: Any = None
    recomputed: bool = False
    accumulator: Node | None = None
    captured: bool = False


@dataclass
class _Broadcast:
    """A broadcast layer's output gradient summed over this step's micro-batches."""

    context: Any
    total: Tensor
    scale: float


def rank_mean(comm: Communicator, rows: Tensor) -> Tensor:
    """``rows`` averaged over the ranks of ``comm`` (a blocking all-reduce, ledger kind
    ``"factors"``); ``rows`` itself is left as it is."""
    out = rows.contiguous().clone()
    comm.all_reduce([out], "factors").wait()
    return out


class _RankMeanSink:
    """A sink that averages rows marked :attr:`~dkfac.blocks.base.Rows.batch_mean` over the
    ranks before handing them to ``sink`` (every other contribution passes through)."""

    def __init__(self, sink: Any, mean: Callable[[Tensor], Tensor]) -> None:
        self._sink = sink
        self._mean = mean

    def __getattr__(self, name: str) -> Any:  # takes_sums, dtype, compute_dtype, add_sum
        return getattr(self._sink, name)

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        if getattr(rows, "batch_mean", False):
            rows = dataclasses.replace(rows, rows=self._mean(rows.rows))
        self._sink.add(rows, scale)


class FactorCapture:
    """The hooks that feed each layer's accumulators, and the Monte-Carlo Fisher backward.

    Scale convention: the backward hook sees ``grad_output = g / (B · k)`` for a loss that
    is the mean over the ``B`` samples of a micro-batch divided by ``k``, the micro-batches
    of the step; it multiplies by ``B`` and the step multiplies the gradient statistics by
    ``k²`` (:meth:`backward_passes`: ``k`` is counted, never stated), so the factors are on
    the per-sample Fisher scale. With ``loss_average="positions"`` the loss is a mean over
    ``B · T`` terms (``T``: the layer's output positions, a sequence's length) and the hook
    multiplies by ``B · T``: the factors are then on the scale of one term (a token).

    Statistics come only from forwards whose output is backpropagated before the step: the
    forward hook keeps the layer's input and the input statistics are added when the
    output's gradient arrives (a metric forward with gradients enabled, or the first pass
    of a checkpointed segment whose recomputation is what the backward runs through,
    leaves nothing). A frozen layer (weight without ``requires_grad``) captures nothing,
    nor does a forward that is not the model's
    (:func:`~dkfac.engine.model_hooks.runs_as_the_model`: ``functional_call`` with other
    tensors, a ``torch.func`` transform).

    A layer whose input has one sample while other backpropagated layers of the same forward
    pass have more (a position embedding looked up with ``position_ids`` of shape ``(1, T)``:
    its output is broadcast over the batch and its output gradient is the batch's sum) has
    no per-sample gradient (a micro-batch of one sample is no such layer: its forward pass
    has one);
    its G is built once a step from the sum of its output gradients over the micro-batches,
    i.e. from the step's gradient, as it is without accumulation.

    Args:
        config: The preconditioner's configuration.

    Attributes:
        active: Whether this step captures (a factor-update step); hooks do nothing if not.
        generator: The Monte-Carlo sampling generator (created on first use).
        bias_sums: With :attr:`checking`, layer name -> the sum of its raw output-gradient
            rows this step (a bias's gradient: :mod:`~dkfac.engine.scaler_check`).
        checking: Whether the hooks record :attr:`bias_sums`.
        rank_mean: Averages a tensor over the ranks whose statistics are later averaged
            (``None``: one process, or statistics kept per rank). Gradient rows marked
            :attr:`~dkfac.blocks.base.Rows.batch_mean` go through it before their products,
            so their statistic is the serial one of the global batch.
        grouping: Where launches bound the step (:mod:`~dkfac.engine.launches`), hold the
            captures of layers that their blocks can compute together
            (:meth:`~dkfac.blocks.base.Block.group_key`) until :meth:`flush_groups`: one
            group's work is then a few launches instead of a dozen a layer. Off while an
            overlapped reduction takes each layer's statistics as its backward ends.
    """

    def __init__(self, config: KFACConfig) -> None:
        self.config = config
        self.active = False
        self.generator: torch.Generator | None = None
        self._mc_active = False
        self._mc_captured = False
        # A reentrant checkpoint's recomputation got its gradient from the training backward:
        # no sampled backward reaches such a layer (check_mc refuses the step).
        self._mc_reentrant = False
        # Outputs of the layers captured in this forward: the sampled backward stops at them.
        self._mc_roots: list[GradientEdge] = []
        self._warned_missing: set[str] = set()
        self._warned_input: set[str] = set()
        self._warned_second_backward = False
        self.ran: set[int] = set()  # ids of the layers whose forward has ever run
        # a layer's forward ran through the hooks since the last step (not cleared when a
        # backward is discarded: a forward may have run before that zero_grad)
        self.ran_since_step = False
        self._handles: list[Any] = []
        # layer id -> the weight its running forward runs with (FSDP2's unsharded one), from
        # the forward pre-hook to the forward hook
        self._weights: dict[int, Tensor] = {}
        self.counter = BackwardCounter()
        self._pass = _ForwardPass()  # the forward pass being captured
        self._pass_ended = False  # a backward reached it since: the next forward starts one
        self._backward_batch = 0  # of those a backward went through
        self._broadcast: dict[str, _Broadcast] = {}
        # one-sample forwards' output gradients, until the step's end says whether their
        # pass had a larger batch that a backward went through (:meth:`_broadcasts`)
        self._undecided: dict[str, list[tuple[_Forward, Tensor]]] = {}
        # layers with a due forward of no rows this step -> its input's and output's dtypes
        self._empty: dict[str, tuple[torch.dtype, torch.dtype]] = {}
        # the layers whose statistics this step are those zeros (:meth:`_zeros_for`)
        self.zero_filled: set[str] = set()
        self.checking = False
        self.bias_sums: dict[str, Tensor] = {}
        self.rank_mean: Callable[[Tensor], Tensor] | None = None
        self.grouping = True
        self._groups = CaptureGroups()

    def attach(self, module: nn.Module, layer: LayerState) -> None:
        """Registers the forward hook (which registers the backward hook) on ``module``.

        First the block prepares the model (:meth:`~dkfac.blocks.base.Block.install`, e.g.
        an attention's forward that calls its projections as modules); :meth:`remove`
        undoes that with the hooks.
        """
        installed = layer.block.install()
        if installed is not None:
            self._handles.append(installed)

        # the parameters the forward runs with: under FSDP2 its pre-forward hook (always
        # first) has swapped in the unsharded ones, its post-forward hook (before ours) the
        # sharded ones back (dkfac.engine.micro_batches); a forward with other tensors
        # (functional_call) or under a torch.func transform is not the model's
        registered = tuple(layer.block.parameters())

        def ran_with_hook(*_: Any) -> None:
            self.ran.add(id(layer))
            self.ran_since_step = True
            current = layer.block.parameters()
            if runs_as_the_model(registered, current):
                self.counter.note_forward(current)
                self._weights[id(layer)] = current[0]  # read by the forward hook

        ran_with = ModelHook(ran_with_hook)
        # first of all: the input given by keyword passed positionally, for every hook
        self._handles.append(
            module.register_forward_pre_hook(PositionalInput(), prepend=True, with_kwargs=True)
        )
        self._handles.append(module.register_forward_pre_hook(ran_with))
        hook = ModelHook(functools.partial(self._forward_hook, layer, registered))
        self._handles.append(module.register_forward_hook(hook))
        self.counter.watch(layer.block.parameters())

    def remove(self) -> None:
        """Detaches every hook and undoes the blocks' installs."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._weights.clear()
        self.counter.remove()

    @property
    def captured_batch(self) -> int:
        """The largest batch of the forwards captured this step that a backward went
        through (0: none did); a forward without one (a loss over the whole set, logged
        with gradients on) captures nothing."""
        return self._backward_batch

    def backward_passes(self) -> int:
        """The micro-batches of this step: backward passes through the registered layers."""
        return self.counter.passes

    def end_step(self, params: Iterable[Sequence[Tensor]]) -> None:
        """Forgets this step's counts and sums; counts the layers unfrozen since
        (``params``: each layer's parameters; looked at only while some were frozen)."""
        self.counter.reset()
        if self.counter.waiting:
            self.counter.watch((p for ps in params for p in ps), every=True)
        self._pass, self._pass_ended = _ForwardPass(), False
        self._backward_batch = 0
        self._broadcast.clear()
        self._weights.clear()  # a forward that stopped early (raised) left its weight
        self._undecided.clear()
        self._empty.clear()
        self.zero_filled = set()
        self._groups.clear()
        self.bias_sums = {}

    def _forward_hook(
        self,
        layer: LayerState,
        registered: tuple[Tensor, ...],
        module: nn.Module,
        inputs: tuple[Any, ...],
        output: Any,
    ) -> None:
        weight = self._weights.pop(id(layer), None)  # the tensor this forward ran with
        rms = layer.input_rms and module.training and torch.is_grad_enabled()
        due = self.active and layer.captures and layer.due
        if not (rms or due) or not runs_as_the_model(registered, layer.block.parameters()):
            return  # nothing to take; or functional_call with other tensors, a transform
        if rms:
            x = layer.block.hooked_input(inputs)
            if x is not None:
                add_input_square(layer, x)  # every step (dkfac.engine.input_rms)
        if not due:
            return
        if not (module.training and torch.is_grad_enabled()):
            return
        if not layer.block.parameters()[0].requires_grad:
            return  # frozen now: nothing to precondition (counted again once unfrozen)
        x = layer.block.hooked_input(inputs)
        output = layer.block.hooked_output(output)
        if x is None and layer.name not in self._warned_input:
            self._warned_input.add(layer.name)
            logger.warning(
                "layer %r: its forward's first argument is not a tensor given positionally "
                "(a keyword-only argument, a tuple, or none), which the capture reads: it "
                "gets no factors and no K-FAC update",
                layer.name,
            )
        if x is None or output is None or not output.requires_grad:
            return
        batch = layer.block.batch_size(x)
        if batch == 0:  # no rows (a convolution's would not even reshape); see _zeros_for
            self._empty[layer.name] = (x.dtype, output.dtype)
            self._forward_pass().empty = True
            return
        forward_pass = self._forward_pass()
        forward_pass.largest = max(forward_pass.largest, batch)
        # The G scale is that of the micro-batch's mean loss, whatever rows are kept: the
        # number of terms the loss averages over (samples, or every sample's positions).
        terms = batch
        if self.config.loss_average == "positions":
            terms *= layer.block.output_positions(output)
        keep = self.config.factor_batch_size
        if keep is None or batch <= keep or x.shape[0] != batch:
            keep = None
        else:
            with torch.no_grad():  # a slice outside the graph
                x = x[:keep]
        recomputed = torch._C._current_graph_task_id() >= 0
        accumulator = None if weight is None else gradient_accumulator(weight)
        pending = _Forward(
            x, batch, float(terms) ** 2, keep, forward_pass, recomputed=recomputed,
            accumulator=accumulator,
        )  # fmt: skip
        output.register_hook(functools.partial(self._grad_hook, layer, pending))
        if self.config.fisher == "mc":
            # The edge, not the tensor: an in-place op after the layer (ReLU(inplace=True))
            # would move the tensor's history past the node this hook belongs to.
            self._mc_roots.append(get_gradient_edge(output))

    def _forward_pass(self) -> _ForwardPass:
        """The forward pass a capture now belongs to: a new one where a backward reached
        the last one, unless this forward runs inside a backward (a checkpointed segment's
        recomputation belongs to the pass whose backward runs it)."""
        if self._pass_ended and torch._C._current_graph_task_id() < 0:
            self._pass, self._pass_ended = _ForwardPass(), False
        return self._pass

    def _grad_sinks(self, layer: LayerState) -> dict[str, Any]:
        """The layer's due sinks for gradient rows: rows marked
        :attr:`~dkfac.blocks.base.Rows.batch_mean` averaged over the ranks first
        (:attr:`rank_mean`)."""
        sinks = layer.due_sinks()
        if self.rank_mean is None:
            return sinks
        mean = self.rank_mean
        return {key: _RankMeanSink(sink, mean) for key, sink in sinks.items()}

    def _grad_hook(self, layer: LayerState, pending: _Forward, grad: Tensor) -> None:
        # Outside autograd (a backward with create_graph=True records otherwise): the input
        # and gradient are used as they are, without a detached view of each a step.
        # Outside a backward's enclosing autocast region (model_hooks.outside_autocast).
        with torch.no_grad(), outside_autocast(grad.device):
            self._capture(layer, pending, grad)

    def _capture(self, layer: LayerState, pending: _Forward, grad: Tensor) -> None:
        """The grad hook's work: the input statistics on the forward's first backward, then
        the gradient statistics; nothing for a backward that computes no gradient of the
        weight (but the Monte-Carlo Fisher's own)."""
        if not (self._mc_active or computes_gradient(pending.accumulator)):
            return
        if not self._mc_active:
            if pending.captured:
                self._warn_second_backward(layer)
            pending.captured = True
        self._backward_batch = max(self._backward_batch, pending.batch)
        forward_pass = pending.forward_pass
        forward_pass.backpropagated = max(forward_pass.backpropagated, pending.batch)
        self._pass_ended = True
        if pending.inputs is not None and self._hold(layer, pending, grad):
            return
        if pending.inputs is not None:  # the first backward through this forward: its A
            with phase("dkfac.capture_a"):
                pending.context = layer.block.capture_input(pending.inputs, layer.due_sinks())
            pending.inputs = None
        if self.config.fisher == "mc" and not self._mc_active:
            # G comes from the sampled backward only (check_mc: that it came). A
            # recomputation's gradient arriving here is a reentrant checkpoint's (that of a
            # non-reentrant one's recomputed output never comes): none can come.
            self._mc_reentrant = self._mc_reentrant or pending.recomputed
            return
        if self.checking and self.config.fisher == "empirical":
            self._add_bias_sum(layer, grad)
        grad = grad if pending.keep is None else grad[: pending.keep]
        if self._broadcasts(pending):  # decided at the step's end (:meth:`_flush_broadcast`)
            self._undecided.setdefault(layer.name, []).append((pending, grad.clone()))
        else:
            self._capture_g(layer, pending, grad)
        self._mc_captured = True

    def _warn_second_backward(self, layer: LayerState) -> None:
        """Says once that a training backward went through a forward a backward already went
        through (``loss_1.backward(retain_graph=True); loss_2.backward()``)."""
        if self._warned_second_backward:
            return
        self._warned_second_backward = True
        logger.warning(
            "%s: a second backward went through a forward already backpropagated "
            "(retain_graph=True); K-FAC counts its output gradient as another micro-batch's, "
            "so the factors are not those of the summed loss: sum the losses and call "
            "backward() once",
            layer.name,
        )

    def _capture_g(self, layer: LayerState, pending: _Forward, grad: Tensor) -> None:
        """The gradient statistics of one forward's output gradient (its kept rows)."""
        with phase("dkfac.capture_g"):
            layer.block.capture_grad(pending.context, grad, self._grad_sinks(layer), pending.scale)

    def _hold(self, layer: LayerState, pending: _Forward, grad: Tensor) -> bool:
        """Holds the forward's whole capture for its group (see :attr:`grouping`), with the
        empirical Fisher, where the device is launch-bound and the block names a group."""
        if not (self.grouping and self.config.fisher == "empirical" and pending.batch > 1):
            return False
        if not launches.launch_bound(grad.device):
            return False
        assert pending.inputs is not None
        kept = grad if pending.keep is None else grad[: pending.keep]
        if not self._groups.hold(layer, pending.inputs, kept, pending.scale):
            return False
        if self.checking:
            self._add_bias_sum(layer, grad)
        pending.inputs = None
        self._mc_captured = True
        return True

    def held_bytes(self) -> int:
        """Bytes of the captures held for their groups until the step (:attr:`grouping`)."""
        return self._groups.held_bytes()

    def flush_groups(self) -> None:
        """Captures the forwards held for their groups (:attr:`grouping`)."""
        with torch.no_grad(), phase("dkfac.capture_group"):
            self._groups.flush()

    def _broadcasts(self, pending: _Forward) -> bool:
        """A one-sample input in a forward pass whose other inputs have more (see the class
        notes): a candidate when its gradient arrives; a broadcast layer at the step's end if
        a larger input of its pass was backpropagated too (:meth:`_flush_broadcast`)."""
        forward_pass = pending.forward_pass
        return (
            self.config.fisher == "empirical"
            and pending.batch == 1
            and (forward_pass.largest > 1 or forward_pass.empty)
        )

    def _add_broadcast(self, layer: LayerState, pending: _Forward, grad: Tensor) -> None:
        """Adds a broadcast layer's output gradient to the step's sum (G at the step's end)."""
        held = self._broadcast.get(layer.name)
        if held is not None and held.total.shape != grad.shape:  # another shape: G as it is
            layer.block.capture_grad(held.context, held.total, self._grad_sinks(layer), held.scale)
            held = None
        if held is None:
            self._broadcast[layer.name] = _Broadcast(pending.context, grad.clone(), pending.scale)
        else:
            held.total.add_(grad)
            held.context = pending.context

    def _add_bias_sum(self, layer: LayerState, grad: Tensor) -> None:
        """Adds the raw output gradient's column sums of a layer with a folded bias."""
        block = layer.block
        if not (isinstance(block, LinearBlock) and block.has_bias):
            return
        column = grad.reshape(-1, block.g_dim).sum(0)
        held = self.bias_sums.get(layer.name)
        self.bias_sums[layer.name] = column if held is None else held + column

    def _flush_broadcast(self, layer: LayerState) -> None:
        """A broadcast layer's G from the step's summed output gradient.

        A one-sample forward is a broadcast one only where a larger forward of its pass was
        backpropagated: a larger forward no backward went through (a metric's, with
        gradients on, between micro-batches) leaves a one-sample micro-batch a batch of its
        own. Its scale leaves out the ``k²`` the step applies to every gradient statistic:
        the sum already carries each micro-batch's ``1 / k``.
        """
        with torch.no_grad():  # a context may hold an input that is not detached
            for pending, grad in self._undecided.pop(layer.name, []):
                if pending.forward_pass.backpropagated > 1 or pending.forward_pass.empty:
                    self._add_broadcast(layer, pending, grad)
                else:
                    self._capture_g(layer, pending, grad)
        held = self._broadcast.pop(layer.name, None)
        if held is None:
            return
        scale = held.scale / float(self.backward_passes()) ** 2
        with torch.no_grad():  # its context may hold an input that is not detached
            layer.block.capture_grad(held.context, held.total, self._grad_sinks(layer), scale)

    def sample_fisher(self, outputs: Tensor, loss: str, params: list[Tensor], seed: int) -> None:
        """One backward of targets sampled from ``outputs``; only the G hooks see it.

        The backward asks for the gradients of the captured layers' outputs, not of their
        parameters: it then runs only as far back as the first captured layer and computes
        no weight gradient (it would be thrown away). ``params`` serve when this forward
        captured no output (the hooks did not run).

        Raises:
            RuntimeError: Where the backward met a reentrant checkpoint's segment (one it
                does not reach, before the first captured layer, is no obstacle).
        """
        roots, self._mc_roots = self._mc_roots, []
        if not self.active:
            return
        if self.generator is None or self.generator.device != outputs.device:
            self.generator = torch.Generator(device=outputs.device)
            self.generator.manual_seed(seed)
        sampled = mc_sample_loss(
            outputs, loss, self.generator, per_position=self.config.loss_average == "positions"
        )
        self._mc_active = True
        try:
            torch.autograd.grad(sampled, roots or params, retain_graph=True, allow_unused=True)
        except RuntimeError as error:
            if not through_reentrant_checkpoint(sampled):
                raise
            raise RuntimeError(REENTRANT_CHECKPOINT) from error
        finally:
            self._mc_active = False

    def take_layer(self, layer: LayerState) -> tuple[dict[str, Tensor] | None, bool]:
        """One layer's averaged statistics of this step (G not yet scaled); resets its sums.

        Returns:
            ``(means or None, missing_g)``: ``missing_g`` says the layer has some statistic
            but not every due gradient statistic (checked by :meth:`check_mc`).
        """
        self.flush_groups()
        missing_g = self._finish_layer(layer)  # before the sums are taken
        return layer.take_means() or self._zeros_for(layer), missing_g

    def _zeros_for(self, layer: LayerState) -> dict[str, Tensor] | None:
        """Zero statistics for a layer whose due forwards this step had no rows, where the
        ranks average their statistics (:attr:`rank_mean`), noted in :attr:`zero_filled`;
        ``None`` elsewhere.

        DDP's convention: a rank with an empty batch takes part in the average with its zero
        gradient, so it takes part in the statistics' average with zeros, and every rank
        then sends the same collectives. In one process (or under ``dp``, statistics kept
        per rank) an empty batch adds nothing: the step leaves the factors as they are. A
        low-rank side's ``U`` has a column a row, so it has no zero of a fixed shape, and a
        deferred solver's sides are decided by the rows (rows that differ across ranks are
        not supported there).
        """
        dtypes = self._empty.get(layer.name)
        if self.rank_mean is None or dtypes is None or layer.gathered():
            return None
        if any(key not in layer.kinds for key in layer.due):
            return None  # a deferred solver's sides, decided by rows: none came
        device = layer.block.parameters()[0].device
        shapes = layer.stored_shapes()
        zeros = {}
        for key, acc in layer.due_sinks().items():  # kept as the rows come, unless it says
            rows_dtype = dtypes[1] if key in layer.block.grad_statistics else dtypes[0]
            zeros[key] = torch.zeros(shapes[key], dtype=acc.dtype or rows_dtype, device=device)
        if not zeros:
            return None
        self.zero_filled.add(layer.name)
        return zeros

    def _finish_layer(self, layer: LayerState) -> bool:
        """Adds a broadcast layer's G; whether the layer lacks a due gradient statistic
        (warned once, see :meth:`take_layer`)."""
        self._flush_broadcast(layer)
        grad_keys = [key for key in layer.block.grad_statistics if key in layer.due]
        missing_g = any(acc.has_data for acc in layer.accumulators.values()) and any(
            not layer.accumulators[key].has_data for key in grad_keys
        )
        # Other layers got their gradient statistics, this one did not: say so once (a
        # step where none did is check_mc's error with fisher="mc").
        if (
            missing_g
            and self._mc_captured
            and not self._mc_reentrant  # check_mc's error says why
            and layer.name not in self._warned_missing
        ):
            self._warned_missing.add(layer.name)
            logger.warning(
                "%s: its input was captured but no output gradient reached it on this step "
                "(its output does not reach the loss); its factors are not updated until it does",
                layer.name,
            )
        return missing_g

    def check_mc(self, missing_g: bool) -> None:
        """Ends a capture step: with ``fisher="mc"``, G must have come from a sampled backward.

        Raises:
            RuntimeError: With ``fisher="mc"`` when no sampled backward fed the G factors,
                or a captured layer ran in a reentrant checkpoint's segment (which no
                sampled backward reaches: see :meth:`sample_fisher`).
        """
        captured, self._mc_captured = self._mc_captured, False
        reentrant, self._mc_reentrant = self._mc_reentrant, False
        self._mc_roots = []  # a forward whose sampled backward never came
        if reentrant:
            raise RuntimeError(REENTRANT_CHECKPOINT)
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

        ``g_scale`` is ``1 / grad_scaler_scale²`` under mixed precision; each statistic's
        kind applies it (a low-rank side holds ``U`` and is scaled by ``√g_scale``). Applied
        after the reduction (the mean is linear; a GradScaler's power-of-two scale makes it
        exact), so the hooks never read the scale (a host synchronisation).
        """
        if g_scale == 1.0:
            return
        for name, means in new.items():
            layer = layers[name]
            for key in layer.block.grad_statistics:
                if key in means:
                    means[key] = layer.kinds[key].rescale(means[key], g_scale)

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
        self.flush_groups()
        missing_g = False
        for layer in layers.values():
            missing_g = self._finish_layer(layer) or missing_g
        new = take_means_all(layers)
        if missing := self._empty.keys() - new.keys():
            for name in missing:
                if (zeros := self._zeros_for(layers[name])) is not None:
                    new[name] = zeros
            new = {name: new[name] for name in layers if name in new}  # the ranks' order
        self.scale_grad_statistics(layers, new, g_scale)
        self.check_mc(missing_g)
        return new
