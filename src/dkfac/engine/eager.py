"""Phase-1 traffic launched from the backward hooks, so it overlaps the rest of the backward.

Without overlap, ``pre.step()`` collects every layer's statistics after the backward, the
ranks agree which exist (:mod:`dkfac.engine.presence`) and only then is anything sent.
With :class:`EagerReducer` a layer's statistics (and, for ``spngd``, its gradient, in the
same buffers) are handed to the strategy as soon as they are final:

* **When a layer is final.** A post-accumulate-grad hook on each of the layer's parameters
  sees every backward pass through it. Under ``DistributedDataParallel`` the last
  micro-batch is the one DDP synchronises (``require_backward_grad_sync``, off inside
  ``no_sync()``), so no count is needed; a model without DDP counts ``accumulation_steps``
  backward passes. When every parameter of the layer has accumulated its last gradient,
  the last micro-batch's backward has passed the layer: its A and its G (the
  output-gradient hooks of every use of the layer, which add both, fire before its weight
  gradient accumulates) are complete, and so is its gradient. Parameter hooks fire once
  per backward even when a module is called several times, and not for
  ``torch.autograd.grad`` (the Monte-Carlo Fisher backward of ``sample_fisher``).
* **Fixed buckets.** Before each step every rank forms the same buckets: the layers with
  traffic this step (due statistics on a factor-update step; every layer when the strategy
  averages gradients), in reverse registration order (about the backward order), filled up
  to ``bucket_bytes``. Buckets are launched strictly in that order, each as soon as all of
  its layers are final and every earlier bucket has been launched (as DDP does), so the
  sequence of collectives is the same on every rank whatever the order hooks fire in.
* **``step()``** launches the buckets that are still pending (e.g. fewer backward passes
  than ``accumulation_steps``) in the same order and waits once. No host synchronisation
  happens in the hooks; the GradScaler's ``1/scale²`` is applied after the reduction.

* **Layers in eval mode.** The hooks capture nothing from a layer whose module is in eval
  mode (:mod:`dkfac.engine.eval_mode`). A mode is set by the training loop, the same on
  every rank, and is final once the forward has run, so the plan is settled at the step's
  first hook (or in ``step()``): a due layer held in eval mode then sends no statistics on
  any rank, and ``step()`` names it as skipped, as the presence agreement would.

This is correct only when every rank runs every layer on every step: there is no presence
agreement on this path (a rank that skipped a layer would launch fewer collectives). A rank
that finds a planned layer without statistics or gradient raises ``RuntimeError`` in
``step()`` before launching anything more; the ranks that did have it are then left
waiting on their collectives until the process group's timeout (best effort: the error is
raised on the rank that lacks the layer). :func:`resolve_overlap` turns it on by default
only where DDP already guarantees it (``find_unused_parameters=False``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dkfac.config import OVERLAP_MODES, KFACConfig
from dkfac.distributed.comm import CommHandle
from dkfac.distributed.strategy_base import Strategy, join_handles
from dkfac.engine.capture import FactorCapture
from dkfac.engine.layer_state import LayerState, layers_device
from dkfac.engine.model_hooks import ModelHook, outside_autocast
from dkfac.engine.presence import agree_presence
from dkfac.engine.registration import ddp_wrapper

__all__ = ["EagerReducer", "build_eager", "resolve_overlap"]

logger = logging.getLogger(__name__)

_OFF_HINT = 'set overlap_comm="off" for models whose ranks may skip layers'


def resolve_overlap(mode: str, *, world_size: int, ddp_find_unused: bool | None) -> bool:
    """Whether phase-1 traffic is launched from the hooks (a pure function of the setup).

    Args:
        mode: ``KFACConfig.overlap_comm``: ``"on"``, ``"off"`` or ``"auto"``.
        world_size: Ranks that train together.
        ddp_find_unused: The DDP wrapper's ``find_unused_parameters``, ``None`` when the
            model is not wrapped in ``DistributedDataParallel``.

    Returns:
        ``"on"``: ``True``; ``"off"``: ``False``; ``"auto"``: ``True`` exactly when there is
        something to overlap (``world_size > 1``) and DDP guarantees that every rank used
        every parameter on every step (a DDP model with ``find_unused_parameters=False``:
        DDP itself fails when a rank skips one). An unwrapped model (``spngd``, or gradients
        averaged by hand) may skip layers data-dependently, so ``"auto"`` keeps it off.

    Raises:
        ValueError: For an unknown mode or a world size below 1.
    """
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap_comm must be one of {OVERLAP_MODES}, got {mode!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if mode != "auto":
        return mode == "on"
    return world_size > 1 and ddp_find_unused is False


def build_eager(
    config: KFACConfig,
    layers: dict[str, LayerState],
    capture: FactorCapture,
    strategy: Strategy,
    *,
    model: nn.Module,
    grad_scaled: bool,
) -> EagerReducer | None:
    """The overlapped path of a preconditioner, or ``None`` where ``overlap_comm`` is off.

    Args:
        config: The preconditioner's configuration (``overlap_comm``, buckets...).
        layers: The registered layers.
        capture: Their capture hooks.
        strategy: The strategy (built).
        model: The model as given to the preconditioner (a DDP wrapper tells ``"auto"``
            it is safe).
        grad_scaled: Whether an enabled GradScaler scales the gradients (then they are
            reduced in ``step()``, after unscaling).
    """
    ddp = ddp_wrapper(model)
    on = resolve_overlap(
        config.overlap_comm,
        world_size=strategy.world_size,
        ddp_find_unused=None if ddp is None else bool(ddp.find_unused_parameters),
    )
    if not on:
        return None
    return EagerReducer(
        layers,
        capture,
        strategy,
        synced=None if ddp is None else (lambda: bool(ddp.require_backward_grad_sync)),
        accumulation_steps=config.accumulation_steps,
        bucket_bytes=config.bucket_bytes,
        with_gradients=strategy.reduces_gradients and not grad_scaled,
    )


class EagerReducer:
    """Launches each bucket's reduction from the parameters' post-accumulate-grad hooks.

    Args:
        layers: The registered layers (registration order).
        capture: The preconditioner's hooks (per-layer statistics and the MC check).
        strategy: Where the statistics and gradients go (:meth:`Strategy.reduce_step`).
        accumulation_steps: Backward passes per ``step()`` when ``synced`` is ``None``.
        synced: Whether the current backward is the one DDP synchronises (the step's
            last micro-batch); ``None`` without DDP.
        bucket_bytes: Cap of one bucket's estimated payload.
        with_gradients: Also launch the layers' gradients (a strategy that averages them
            itself, without a GradScaler that ``unscale_`` would change after the backward).

    Attributes:
        launched: Buckets launched so far this step (a prefix of :attr:`buckets`).
        buckets: This step's buckets of layer names, in launch order.
        held: The layers due this step whose module is in eval mode (they capture nothing,
            so they send no statistics and are skipped on every rank).
    """

    def __init__(
        self,
        layers: dict[str, LayerState],
        capture: FactorCapture,
        strategy: Strategy,
        *,
        accumulation_steps: int,
        bucket_bytes: int,
        with_gradients: bool,
        synced: Callable[[], bool] | None = None,
    ) -> None:
        self.layers = layers
        self.synced = synced
        self.capture = capture
        self.strategy = strategy
        self.accumulation_steps = accumulation_steps
        self.bucket_bytes = bucket_bytes
        self.with_gradients = with_gradients
        self.buckets: list[list[str]] = []
        self.launched = 0
        self.held: set[str] = set()
        self._settled = False
        self._capturing = False
        self._counts: dict[int, int] = {}
        self._ready: set[str] = set()
        self._stats: dict[str, dict[str, Tensor]] = {}
        self._grads: dict[str, Tensor] = {}
        self._handles: list[CommHandle] = []
        self._missing_g = False
        self._problem: str | None = None
        self._users: dict[int, list[str]] = {}
        self._hooks: list[Any] = []
        # Each layer's weight as built: inside a sharded layout's step the module holds a
        # stand-in without requires_grad, which would read as frozen (no traffic).
        self._weights = {name: layer.block.parameters()[0] for name, layer in layers.items()}
        params: dict[int, Tensor] = {}
        for name, layer in layers.items():
            for param in layer.block.parameters():
                if param.requires_grad:
                    params[id(param)] = param
                    self._users.setdefault(id(param), []).append(name)
        for key, param in params.items():
            self._hooks.append(
                param.register_post_accumulate_grad_hook(
                    ModelHook(lambda _p, key=key: self._on_grad(key))
                )
            )

    def remove(self) -> None:
        """Detaches the parameter hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ planning
    def _trainable(self, name: str) -> bool:
        """Whether the layer's weight requires a gradient now (a frozen layer has no
        traffic); its own weight's flag, also within the step (module notes on stand-ins)."""
        return bool(self._weights[name].requires_grad)

    def _due(self, name: str, layer: LayerState) -> bool:
        """Whether the layer has statistics due this step (on every rank alike: under
        ``dp`` only its owner captures them)."""
        return self._capturing and bool(layer.due) and self._trainable(name)

    def _factor_traffic(self, name: str, layer: LayerState) -> bool:
        return (
            self.strategy.factor_reduction != "none"
            and layer.captures
            and self._due(name, layer)
            and name not in self.held
        )

    def plan(self, capturing: bool) -> None:
        """Forms this step's buckets (the same on every rank) and forgets the last step's."""
        self._capturing = capturing
        self.held = set()
        self._settled = False
        self._form_buckets()
        self.launched = 0
        self._counts.clear()
        self._ready.clear()
        self._stats = {}
        self._grads = {}
        self._handles = []
        self._missing_g = False
        self._problem = None

    def _settle(self) -> None:
        """Once a step, after the forward: drops the statistics of due layers held in eval
        mode from the plan (module notes; the same on every rank)."""
        if self._settled:
            return
        self._settled = True
        self.held = {
            name
            for name, layer in self.layers.items()
            if self._due(name, layer) and not layer.block.module.training
        }
        if self.held:
            self._form_buckets()

    def _form_buckets(self) -> None:
        self.buckets = []
        size = 0
        for name in reversed(list(self.layers)):
            layer = self.layers[name]
            nbytes = 0
            element = layer.block.parameters()[0].element_size()
            if self._factor_traffic(name, layer):
                shapes = layer.stored_shapes()
                nbytes += sum(math.prod(shapes[key]) for key in layer.due) * element
            if self.with_gradients and self._trainable(name):
                nbytes += layer.block.a_dim * layer.block.g_dim * element  # its g×a gradient
            if nbytes == 0:
                continue
            if not self.buckets or size + nbytes > self.bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(name)
            size += nbytes

    def discard(self) -> None:
        """Drops this step's traffic (its gradients are being discarded, the step will not
        run): waits for the buckets already launched, then forms the plan again."""
        join_handles(self._handles).wait()
        self.plan(self._capturing)

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, key: int) -> None:
        if self.synced is None:
            count = self._counts.get(key, 0) + 1
            last = self.accumulation_steps
        else:  # DDP says which backward is the last: the one it synchronises
            if not self.synced():
                return
            count = self._counts.get(key, 0) + 1
            last = 1
        self._counts[key] = count
        if count > last:
            self._problem = (
                "more synchronised backward passes than one before step() (under DDP "
                "accumulate with model.no_sync() on all micro-batches but the last, or set "
                'overlap_comm="off")'
                if self.synced is not None
                else f"more backward passes than accumulation_steps={self.accumulation_steps} "
                "before step()"
            ) + ": with overlap_comm the statistics were already sent after the last expected one"
            return
        if count < last:
            return
        self._settle()
        for name in self._users[key]:
            params = [p for p in self.layers[name].block.parameters() if p.requires_grad]
            if all(self._counts.get(id(p), 0) >= last for p in params):
                self._ready.add(name)
        self._launch_in_order(pending_too=False)

    def _launch_in_order(self, pending_too: bool) -> None:
        """Launches the next buckets in plan order, stopping at the first problem.

        Only buckets whose layers are all final, unless ``pending_too`` (every bucket left).
        Outside a backward's enclosing autocast region, as the capture's own hooks
        (:func:`~dkfac.engine.model_hooks.outside_autocast`): a bucket's statistics may be
        computed here (a broadcast layer's G).
        """
        device = layers_device(self.layers)
        with torch.no_grad(), outside_autocast(device):
            while self._problem is None and self.launched < len(self.buckets):
                names = self.buckets[self.launched]
                if not pending_too and not all(name in self._ready for name in names):
                    return
                self._launch(names)
                self.launched += 1

    def _launch(self, names: list[str]) -> None:
        """Takes the bucket's statistics and gradients and launches their reduction."""
        stats: dict[str, dict[str, Tensor]] = {}
        grads: dict[str, Tensor] = {}
        for name in names:
            layer = self.layers[name]
            if self._factor_traffic(name, layer):
                means, missing_g = self.capture.take_layer(layer)
                self._missing_g = self._missing_g or missing_g
                if means is None or set(means) != set(layer.due):
                    self._problem = (
                        f"layer {name} has statistics {sorted(means or {})} on this rank, "
                        f"expected {sorted(layer.due)}; {_OFF_HINT}"
                    )
                    return
                stats[name] = means
            if self.with_gradients and self._trainable(name):
                grad = layer.block.weight_grad()
                if grad is None:
                    self._problem = f"layer {name} has no gradient on this rank; {_OFF_HINT}"
                    return
                grads[name] = grad
        gathered = {n: self.layers[n].gathered() for n in stats if self.layers[n].gathered()}
        self._handles.append(self.strategy.reduce_step(stats, gathered, grads, []))
        self._stats.update(stats)
        self._grads.update(grads)

    # ------------------------------------------------------------------ the step
    def finish(
        self, grads: dict[str, Tensor | None], other_params: Sequence[Tensor]
    ) -> tuple[dict[str, dict[str, Tensor]], CommHandle]:
        """Launches what is left of this step's traffic; the statistics and one handle.

        Pending buckets are launched in order; the statistics of layers without traffic
        (``dp``) are collected; under a strategy that averages gradients, the ranks agree
        which gradients exist (one small all-reduce) and the gradients not yet launched
        (the other parameters', every layer's with a GradScaler) are launched.

        Args:
            grads: Layer name -> gradient matrix; replaced in place by the tensors the
                reduction writes into, for the layers whose gradient was launched.
            other_params: Parameters not handled by a block.

        Returns:
            ``(statistics by layer, handle)``; the statistics are final after ``wait()``.
            The due layers held in eval mode, skipped on every rank, are :attr:`held`.

        Raises:
            RuntimeError: When this rank lacks a planned layer's statistics or gradient,
                ran more backward passes than ``accumulation_steps``, or (``fisher="mc"``)
                captured no sampled G.
        """
        self._settle()
        self._launch_in_order(pending_too=True)
        if self._problem is None:
            self._problem = self._late_statistics()
        if self._problem is not None:
            problem, self._problem = self._problem, None
            raise RuntimeError(f"overlap_comm: {problem}")
        stats = self._stats
        if self._capturing:
            for name, layer in self.layers.items():
                if name not in stats:
                    means, missing_g = self.capture.take_layer(layer)
                    self._missing_g = self._missing_g or missing_g
                    if means is not None:
                        stats[name] = means
            self.capture.check_mc(self._missing_g)
        grads.update(self._grads)
        handles = list(self._handles)
        if self.strategy.reduces_gradients:
            comm = self.strategy.comm
            agree_presence(comm, self.layers, {}, grads, other_params, statistics=False)
            rest = {n: g for n, g in grads.items() if g is not None and n not in self._grads}
            others = [p.grad for p in other_params if p.grad is not None]
            handles.append(self.strategy.reduce_gradients(rest, others))
        return stats, join_handles(handles)

    def _late_statistics(self) -> str | None:
        """A problem when a launched layer received statistics after it was sent."""
        for name in self._stats:
            if any(acc.has_data for acc in self.layers[name].accumulators.values()):
                return (
                    f"layer {name} captured statistics after they were sent (more forward "
                    "passes than accumulation_steps, or a forward after the backward)"
                )
        return None

    def pending_bytes(self) -> int:
        """Bytes of this step's statistics already handed to the reduction."""
        return sum(t.numel() * t.element_size() for s in self._stats.values() for t in s.values())
