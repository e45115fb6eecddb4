"""KFACPreconditioner: registers blocks and hooks, and runs one K-FAC step.

A step has four phases, each under a ``torch.profiler.record_function`` label:

1. ``dkfac.factors``: the factors captured by the hooks since the last step become the new
   running averages (only on factor-update steps; the hooks do no work on other steps).
2. ``dkfac.inverse``: on inverse-update steps every layer's solver state is recomputed.
3. ``dkfac.precondition``: every layer's gradient is replaced by the damped natural gradient.
4. ``dkfac.kl_clip``: all preconditioned gradients are scaled by the KL-clip factor ν.

Scale convention: the backward hook sees ``grad_output = g / (B · k)`` for a loss that is the
mean over the ``B`` samples of a micro-batch divided by ``k = accumulation_steps``; it
multiplies by ``B · k`` so the factors are on the per-sample Fisher scale. With a
``GradScaler`` the factors are divided by the square of its scale, and ``step()`` must see
unscaled gradients (call ``scaler.unscale_(optimizer)`` first, as for gradient clipping).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from dkfac.blocks.registry import make_block
from dkfac.config import KFACConfig, resolve
from dkfac.fisher import mc_sample_loss
from dkfac.layer_state import FactorAccumulator, LayerState
from dkfac.solvers import SolverError, make_solver

logger = logging.getLogger(__name__)


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP / DataParallel wrapper (names then match the bare model)."""
    inner = getattr(model, "module", None)
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        assert isinstance(inner, nn.Module)
        return inner
    return model


class KFACPreconditioner:
    """Replaces the gradients of supported layers with K-FAC preconditioned gradients.

    Args:
        model: The model (optionally wrapped in DDP). Its ``nn.Linear`` and ``nn.Conv2d``
            layers (and any type registered with :func:`dkfac.blocks.register_block`) are
            preconditioned; every other parameter keeps its plain gradient.
        config: A :class:`KFACConfig`; keyword ``options`` override its fields.
        grad_scaler: The ``torch.amp.GradScaler`` used for mixed precision, if any.
        **options: Fields of :class:`KFACConfig` (``method``, ``damping``, ...).

    Raises:
        ValueError: For a bad option value or a model with no supported layer.
        TypeError: For an unknown option or a value of the wrong type.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: KFACConfig | None = None,
        grad_scaler: Any | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if config is None:
            config = KFACConfig(**options)
        elif options:
            config = dataclasses.replace(config, **options)
        if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
            raise TypeError("grad_scaler must be a torch.amp.GradScaler (it has no get_scale())")
        self.config = config
        self.model = model
        self.grad_scaler = grad_scaler
        self.layers: dict[str, LayerState] = {}
        self._steps = 0
        self._mc_active = False
        self._mc_captured = False
        self._generator: torch.Generator | None = None
        self._handles: list[Any] = []
        self._register(_unwrap(model))
        self._capture = self._is_factor_step(0)
        self.last_kl_scale: float | None = None

    # ----------------------------------------------------------------- registration
    def _skipped(self, name: str, module: nn.Module) -> bool:
        return any(
            re.search(pattern, name) or re.search(pattern, type(module).__name__)
            for pattern in self.config.skip_layers
        )

    def _register(self, model: nn.Module) -> None:
        cfg = self.config
        for name, module in model.named_modules():
            if self._skipped(name, module):
                continue
            block = make_block(name, module)
            if block is None:
                continue
            weight = getattr(module, "weight", None)
            if not isinstance(weight, Tensor) or not weight.requires_grad:
                logger.info("skipping %s: its weight does not require a gradient", name)
                continue
            dtype = cfg.factor_dtype or weight.dtype
            state = LayerState(
                block=block,
                solver=make_solver(cfg.method, cfg.eigen_dtype),
                a_acc=FactorAccumulator(dtype=dtype),
                g_acc=FactorAccumulator(dtype=dtype),
            )
            self.layers[name] = state
            self._handles.append(
                module.register_forward_hook(functools.partial(self._forward_hook, state))
            )
        if not self.layers:
            raise ValueError(
                "model has no layer K-FAC can precondition (supported: nn.Linear, nn.Conv2d "
                f"with groups=1, or types added with register_block); skip_layers="
                f"{list(cfg.skip_layers)}"
            )
        logger.info("K-FAC registered %d layers: %s", len(self.layers), list(self.layers))

    def remove_hooks(self) -> None:
        """Detaches every hook from the model (the preconditioner is unusable afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ----------------------------------------------------------------- hooks
    def _is_factor_step(self, step: int) -> bool:
        interval = resolve("factor_update_interval", self.config.factor_update_interval, step)
        assert interval is not None
        return step % int(interval) == 0

    def _forward_hook(
        self, layer: LayerState, module: nn.Module, inputs: tuple[Any, ...], output: Any
    ) -> None:
        if not (self._capture and module.training and torch.is_grad_enabled()):
            return
        if not inputs or not isinstance(inputs[0], Tensor):
            return
        x = inputs[0].detach()
        with record_function("dkfac.capture_a"):
            layer.a_acc.add(layer.block.a_rows(x))
        if isinstance(output, Tensor) and output.requires_grad:
            scale = float(layer.block.batch_size(x) * self.config.accumulation_steps) ** 2
            output.register_hook(functools.partial(self._grad_hook, layer, scale))

    def _grad_hook(self, layer: LayerState, scale: float, grad: Tensor) -> None:
        if self.config.fisher == "mc" and not self._mc_active:
            return
        with record_function("dkfac.capture_g"):
            layer.g_acc.add(layer.block.g_rows(grad.detach()), scale)
        self._mc_captured = True

    # ----------------------------------------------------------------- Monte-Carlo Fisher
    def sample_fisher(self, outputs: Tensor, loss: str = "cross_entropy") -> None:
        """Feeds the G factors from one backward of targets sampled from ``outputs``.

        Call it between the forward pass and ``loss.backward()`` when ``fisher="mc"``. It
        runs ``torch.autograd.grad`` with ``retain_graph=True``, so ``.grad`` and the graph
        the training backward needs are left untouched.

        Args:
            outputs: The model's outputs of this forward pass (logits for cross-entropy).
            loss: ``"cross_entropy"`` (categorical) or ``"mse"`` (unit Gaussian).
        """
        if self.config.fisher != "mc":
            raise RuntimeError('sample_fisher() needs fisher="mc" in the preconditioner config')
        if not isinstance(outputs, Tensor) or not outputs.requires_grad:
            raise ValueError("outputs must be the model's output tensor, with a graph")
        if not self._capture:
            return
        if self._generator is None or self._generator.device != outputs.device:
            self._generator = torch.Generator(device=outputs.device)
            self._generator.manual_seed(self.config.seed)
        sampled = mc_sample_loss(outputs, loss, self._generator)
        params = [p for layer in self.layers.values() for p in layer.block.parameters()]
        self._mc_active = True
        try:
            torch.autograd.grad(sampled, params, retain_graph=True, allow_unused=True)
        finally:
            self._mc_active = False

    # ----------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """Preconditions the gradients of every registered layer in place.

        Args:
            lr: The learning rate for the KL-clip; defaults to the configured ``lr``.
        """
        step = self._steps
        cfg = self.config
        damping = resolve("damping", cfg.damping, step)
        inverse_interval = resolve("inverse_update_interval", cfg.inverse_update_interval, step)
        assert damping is not None and inverse_interval is not None
        grads = {name: layer.block.weight_grad() for name, layer in self.layers.items()}
        with record_function("dkfac.factors"):
            new_factors = self._collect_factors() if self._capture else {}
            finite = self._finite_flags(new_factors, grads)
            self._update_factors(new_factors, finite, step)
        if step % int(inverse_interval) == 0:
            with record_function("dkfac.inverse"):
                self._update_inverses(damping)
        with record_function("dkfac.precondition"):
            updates = self._precondition(grads, finite, damping)
        with record_function("dkfac.kl_clip"):
            self._apply(updates, lr if lr is not None else resolve("lr", cfg.lr, step))
        self._steps += 1
        self._capture = self._is_factor_step(self._steps)

    def _collect_factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        scale = 1.0
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale = float(self.grad_scaler.get_scale()) ** -2
        new: dict[str, tuple[Tensor, Tensor]] = {}
        missing_g = []
        for name, layer in self.layers.items():
            a, g = layer.a_acc.mean(), layer.g_acc.mean()
            layer.reset_accumulators()
            if a is not None and g is None:
                missing_g.append(name)
            if a is None or g is None:
                continue
            new[name] = (a, g * scale if scale != 1.0 else g)
        if self.config.fisher == "mc" and missing_g and not self._mc_captured:
            raise RuntimeError(
                'fisher="mc": call pre.sample_fisher(outputs) after the forward pass and '
                "before loss.backward() on factor-update steps"
            )
        self._mc_captured = False
        return new

    def _finite_flags(
        self, new: dict[str, tuple[Tensor, Tensor]], grads: dict[str, Tensor | None]
    ) -> dict[str, tuple[bool, bool]]:
        """(factors finite, gradient finite) per layer, with a single host synchronisation."""
        names = list(self.layers)
        checks: list[Tensor] = []
        for name in names:
            pair = new.get(name)
            grad = grads[name]
            checks.append(
                torch.isfinite(pair[0]).all() & torch.isfinite(pair[1]).all()
                if pair is not None
                else torch.tensor(True)
            )
            checks.append(torch.isfinite(grad).all() if grad is not None else torch.tensor(True))
        device = checks[0].device
        values = torch.stack([c.to(device) for c in checks]).tolist()
        return {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(names)}

    def _update_factors(
        self,
        new: dict[str, tuple[Tensor, Tensor]],
        finite: dict[str, tuple[bool, bool]],
        step: int,
    ) -> None:
        decay = resolve("factor_decay", self.config.factor_decay, step)
        assert decay is not None
        for name, (a, g) in new.items():
            if not finite[name][0]:
                logger.warning("step %d: non-finite factors in %s; update skipped", step, name)
                continue
            self.layers[name].update_running(a, g, decay)

    def _update_inverses(self, damping: float, names: list[str] | None = None) -> None:
        for name in self.layers if names is None else names:
            layer = self.layers[name]
            if layer.a is None or layer.g is None:
                continue
            try:
                layer.solver_state = layer.solver.compute(layer.a, layer.g, damping)
            except SolverError as err:
                logger.warning("%s: %s; keeping the last good inverse", name, err)

    def _precondition(
        self,
        grads: dict[str, Tensor | None],
        finite: dict[str, tuple[bool, bool]],
        damping: float,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """``name -> (preconditioned, raw)`` for every layer that can be preconditioned."""
        updates: dict[str, tuple[Tensor, Tensor]] = {}
        for name, layer in self.layers.items():
            grad = grads[name]
            if grad is None:
                continue
            if not finite[name][1]:
                logger.warning("step %d: non-finite gradient in %s; zeroed", self._steps, name)
                layer.block.set_weight_grad(torch.zeros_like(grad))
                continue
            if layer.solver_state is None:
                continue
            updates[name] = (layer.solver.apply(layer.solver_state, grad, damping), grad)
        return updates

    def _apply(self, updates: dict[str, tuple[Tensor, Tensor]], lr: float | None) -> None:
        kl_clip = resolve("kl_clip", self.config.kl_clip, self._steps)
        scale: Tensor | None = None
        if kl_clip is not None and updates and lr is not None and lr > 0:
            vg = sum((v * g).sum() for v, g in updates.values())
            assert isinstance(vg, Tensor)
            vg_abs = (vg * lr**2).abs()
            scale = torch.clamp(torch.sqrt(kl_clip / vg_abs.clamp(min=1e-30)), max=1.0)
        for name, (v, _) in updates.items():
            self.layers[name].block.set_weight_grad(v * scale if scale is not None else v)
        self.last_kl_scale = None if scale is None else float(scale)

    # ----------------------------------------------------------------- inspection and state
    @property
    def steps(self) -> int:
        """Number of completed ``step()`` calls."""
        return self._steps

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``name -> (A, G)`` running factors, on the per-sample Fisher scale."""
        return {
            name: (layer.a, layer.g)
            for name, layer in self.layers.items()
            if layer.a is not None and layer.g is not None
        }

    def memory_usage(self) -> dict[str, int]:
        """Bytes held, by kind: ``factors``, ``inverses`` and ``accumulators``."""

        def nbytes(tensors: list[Tensor | None]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        usage = {"factors": 0, "inverses": 0, "accumulators": 0}
        for layer in self.layers.values():
            usage["factors"] += nbytes([layer.a, layer.g])
            usage["inverses"] += nbytes(list((layer.solver_state or {}).values()))
            usage["accumulators"] += nbytes([layer.a_acc.total, layer.g_acc.total])
        return usage

    def describe(self) -> list[dict[str, Any]]:
        """One row per registered layer: name, block type, factor dimensions and method."""
        return [
            {
                "name": name,
                "block": type(layer.block).__name__,
                "a_dim": layer.block.a_dim,
                "g_dim": layer.block.g_dim,
                "method": layer.solver.name,
            }
            for name, layer in self.layers.items()
        ]

    def state_dict(self, include_inverses: bool = False) -> dict[str, Any]:
        """Step counter and running factors keyed by module name.

        Args:
            include_inverses: Also save the solver states. Without them ``load_state_dict``
                recomputes the inverses from the saved factors, which reproduces the next
                step exactly only when the state was saved right after an inverse update.
        """
        layers: dict[str, dict[str, Any]] = {}
        for name, layer in self.layers.items():
            entry: dict[str, Any] = {"A": layer.a, "G": layer.g}
            if include_inverses and layer.solver_state is not None:
                entry["inverse"] = dict(layer.solver_state)
            layers[name] = entry
        generator = None if self._generator is None else self._generator.get_state()
        return {"step": self._steps, "layers": layers, "mc_generator": generator}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`; inverses are recomputed unless they were saved.

        Raises:
            ValueError: If the layer names or factor shapes do not match this model.
        """
        if not isinstance(state, dict) or "layers" not in state or "step" not in state:
            raise ValueError("not a KFACPreconditioner state dict (needs 'step' and 'layers')")
        saved, mine = set(state["layers"]), set(self.layers)
        if saved != mine:
            raise ValueError(
                f"state dict layers do not match the model: missing {sorted(mine - saved)}, "
                f"unexpected {sorted(saved - mine)}"
            )
        for name, entry in state["layers"].items():
            layer = self.layers[name]
            dims = {"A": layer.block.a_dim, "G": layer.block.g_dim}
            for key, dim in dims.items():
                value = entry.get(key)
                if value is not None and tuple(value.shape) != (dim, dim):
                    raise ValueError(
                        f"{name}: saved {key} has shape {tuple(value.shape)}, expected {(dim, dim)}"
                    )
            device = layer.block.parameters()[0].device
            layer.a = None if entry.get("A") is None else entry["A"].to(device).clone()
            layer.g = None if entry.get("G") is None else entry["G"].to(device).clone()
            inverse = entry.get("inverse")
            layer.solver_state = (
                None if inverse is None else {k: v.to(device) for k, v in inverse.items()}
            )
            layer.reset_accumulators()
        self._steps = int(state["step"])
        if state.get("mc_generator") is not None:
            device = next(iter(self.layers.values())).block.parameters()[0].device
            self._generator = torch.Generator(device=device)
            self._generator.set_state(state["mc_generator"])
        stale = [name for name, e in state["layers"].items() if e.get("inverse") is None]
        if stale:
            damping = resolve("damping", self.config.damping, max(self._steps - 1, 0))
            assert damping is not None
            self._update_inverses(damping, stale)
        self._capture = self._is_factor_step(self._steps)
