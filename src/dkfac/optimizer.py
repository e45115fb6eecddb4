"""KFACOptimizer: a ``torch.optim.Optimizer`` that preconditions, then runs an inner optimizer.

It shares the inner optimizer's ``param_groups`` (and ``state``), so LR schedulers, gradient
clipping utilities and checkpointing code written for plain optimizers work unchanged. Each
``step()`` feeds the inner optimizer's current learning rate to the KL-clip.

:meth:`KFACOptimizer.for_model` builds the best general method measured (BENCHMARKS.md,
"The default on six model families") from nothing but the model: :data:`DEFAULT_OPTIONS`
under an SGD without momentum, its factor batch and intervals chosen within
:data:`DEFAULT_OVERHEAD`.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from torch import nn
from torch.optim import Optimizer

from dkfac.config import unread_moment_fields
from dkfac.config.checks import check_bool, check_int, check_range, python_number
from dkfac.engine import optimizer_state
from dkfac.engine.device_checks import LateWarnings
from dkfac.engine.finite import gradients_finite
from dkfac.engine.moment_betas import set_moment_betas
from dkfac.engine.overhead import BUDGETED_OPTIONS
from dkfac.engine.param_groups import (
    LARGEST,
    check_group,
    check_groups,
    check_weight_decay,
    lr_number,
)
from dkfac.engine.registration import unwrap
from dkfac.engine.roles import vocabulary_layers
from dkfac.engine.zero_state import Consolidated, consolidate, kfac_part
from dkfac.preconditioner import KFACPreconditioner

logger = logging.getLogger(__name__)

DEFAULT_LR: Final = 3e-3
"""The step size of :meth:`KFACOptimizer.for_model` (the autoencoder recipe's lr; the
language model's recipe takes 0.006, the digits CNN's 0.01)."""

DEFAULT_OVERHEAD: Final = 0.3
"""The overhead budget of :meth:`KFACOptimizer.for_model`: the preconditioner's work at most
30% over the training step, as its cost model counts it (:mod:`dkfac.costmodel.budget`)."""

DEFAULT_OPTIONS: Final[dict[str, Any]] = {
    "method": "eigen_adam",
    "moment_nesterov": True,
    "basis_refresh": "power",
    "moment_carry": "reset",
    "kl_clip": None,
    "factor_update_interval": 1,
    "inverse_update_interval": 5,
    "flattened_inputs": "graph",
    "orthogonal_layers": "role:hidden",
}
"""The preconditioner of :meth:`KFACOptimizer.for_model`: Adam's moments in the eigenbasis of
K-FAC's factors (SOAP's update with K-FAC's bases), Nesterov's first moment, the basis
followed by one power-iteration step at each refresh, the moments restarted after it
(reset beats keeping them), no KL-clip (Adam's normalisation bounds the step); a linear
layer that reads a flattened convolution map gets the Kronecker-structured input basis, the
map found in the model's graph (``flattened_inputs="graph"``, :mod:`dkfac.engine.roles`);
the hidden matrices (every linear or convolution layer but the input layer and the head,
Muon's split, found by role: ``"role:hidden"``) take the orthogonal polar factor of that
update (fewer steps on five of the six families of ``dkfac bench suite``, the same on the
digits CNN).
The factor batch and both intervals (and, where the per-step work alone is over it, 3
Newton–Schulz steps instead of 5; for a side wider than 3/4 of the rows a step sees, no
basis) are chosen within :data:`DEFAULT_OVERHEAD`; with
``overhead=None``, factors every step and a refresh every 5 steps. A refresh every 5 steps
against 10: 11 steps to 97.5% on the digits CNN against 13 (10 seeds), 35 to the
autoencoder's MSE 0.02 against 39 (3 seeds), less time on both. The comparison with AdamW,
Muon and SOAP: the results page (BENCHMARKS.md).
``rotation_dtype=torch.bfloat16`` is left out: it pays only where bf16 matrix products are
fast (GPUs, CPUs with AVX512-BF16 or AMX); ``rotation_dtype="auto"`` takes bf16 only there
(:mod:`dkfac.solvers.precision`), not yet measured with these options."""


_SKIP_MESSAGE: Final = ("step %d: non-finite gradient; optimizer step skipped",)


def _fused_sgd_fits(params: Sequence[torch.Tensor]) -> bool:
    """Whether ``for_model``'s SGD over ``params`` is fused: on a launch-bound (CUDA) device."""
    return all(p.is_cuda for p in params)


def _fuse_sgd(inner: Optimizer) -> None:
    """Makes ``for_model``'s SGD fused, as ``SGD(..., fused=True)`` builds it, where its
    parameters are on a launch-bound device by the first step: a model moved there after the
    optimizer was built (accelerate's ``prepare``, the Trainer)."""
    params = [p for group in inner.param_groups for p in group["params"]]
    if not isinstance(inner, torch.optim.SGD) or not _fused_sgd_fits(params):
        return
    for group in inner.param_groups:
        group["fused"], group["foreach"] = True, None
    inner.defaults["fused"], inner.defaults["foreach"] = True, None
    inner._step_supports_amp_scaling = True
    inner._need_device_dtype_check_for_fused = True


def _skips_on_device(inner: Optimizer) -> bool:
    """Whether ``inner`` takes ``found_inf`` from its attributes (fused optimizers)."""
    return bool(getattr(inner, "_step_supports_amp_scaling", False))


def _check_holds_layers(inner: Optimizer, preconditioner: KFACPreconditioner) -> None:
    """Every parameter of a registered layer that requires a gradient is one of ``inner``'s
    (by identity): the inner optimizer steps what the preconditioner preconditions. A frozen
    parameter may be left out (``filter(lambda p: p.requires_grad, ...)``).

    Raises:
        ValueError: Naming the registered layers with such a parameter ``inner`` does not
            hold (an optimizer built over another model, or over part of this one).
    """
    held = {id(p) for group in inner.param_groups for p in group["params"]}
    missing = [
        name
        for name, layer in preconditioner.layers.items()
        if any(p.requires_grad and id(p) not in held for p in layer.block.parameters())
    ]
    if missing:
        shown = ", ".join(repr(name) for name in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise ValueError(
            f"the inner optimizer does not hold the trainable parameters of the registered "
            f"layers {shown}{more}: they would be stepped without preconditioning or not at "
            "all; build it over the parameters of the model the preconditioner was built on "
            "(e.g. torch.optim.SGD(model.parameters(), ...)), or leave those layers out of "
            "the preconditioner (skip_layers)"
        )


def _check_steps_without_closure(inner: Optimizer) -> None:
    """``inner.step`` runs without a closure: K-FAC preconditions the one gradient of each
    step, and an optimizer whose ``step`` requires a closure (``torch.optim.LBFGS``)
    re-evaluates it several times per step, gradients no preconditioner has seen.

    Raises:
        ValueError: If ``inner.step`` has a ``closure`` parameter without a default.
    """
    try:
        closure = inspect.signature(inner.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read (a builtin): nothing required
        return
    if closure is None or closure.default is not inspect.Parameter.empty:
        return
    if closure.kind not in (closure.VAR_POSITIONAL, closure.VAR_KEYWORD):
        raise ValueError(
            f"the inner optimizer {type(inner).__name__} requires a closure in step(): it "
            "re-evaluates the model several times per step, and K-FAC preconditions the one "
            "gradient of each step; use an optimizer that steps on the gradient it is given "
            "(SGD, Adam, AdamW, ...)"
        )


def _check_steps_dense_gradients(inner: Optimizer) -> None:
    """``inner`` steps dense gradients: K-FAC writes its layers' preconditioned gradients
    dense, and ``torch.optim.SparseAdam`` refuses any dense gradient in its step.

    Raises:
        ValueError: If ``inner`` is a ``torch.optim.SparseAdam``.
    """
    if isinstance(inner, torch.optim.SparseAdam):
        raise ValueError(
            "the inner optimizer SparseAdam steps only sparse gradients, and K-FAC writes its "
            "layers' preconditioned gradients dense; use an optimizer that steps dense "
            "gradients (Adam, AdamW, SGD, ...)"
        )


def method_defaults(method: str) -> dict[str, Any]:
    """:data:`DEFAULT_OPTIONS` as another ``method`` keeps them: the ones it reads. The
    moment options it does not read are errors when passed, and a method without a basis
    of moments takes neither a structured input basis nor a polar factor
    (``flattened_inputs``, ``orthogonal_layers``); ``method`` itself is left to the caller.
    """
    unread = unread_moment_fields(method)
    if "moment_beta2" in unread:
        unread = (*unread, "flattened_inputs", "orthogonal_layers")
    return {k: v for k, v in DEFAULT_OPTIONS.items() if k not in unread}


class KFACOptimizer(Optimizer):
    """Wraps ``inner`` so that every step is preconditioned by ``preconditioner``.

    Args:
        inner: Any ``torch.optim.Optimizer`` over the model's parameters whose ``step``
            takes the gradients as they are (not one that requires a closure); it must hold
            every parameter of the preconditioner's layers that requires a gradient (frozen
            ones may be left out).
        preconditioner: The :class:`KFACPreconditioner` of the same model.
        skip_nonfinite: Skip the inner step (and log it) when any parameter gradient is not
            finite, before or after preconditioning, so NaN/Inf never reaches the weights
            (the preconditioner itself zeroes the non-finite gradients of its layers and
            skips their factor updates). A gradient whose squares overflow its dtype
            (:mod:`~dkfac.engine.finite`) counts as not finite. A skipped step leaves the
            weights and every moment as they were; it still counts toward the update
            intervals, and the layers whose statistics were finite keep them.

    Raises:
        TypeError: If ``inner`` is not an optimizer, ``preconditioner`` not a
            :class:`KFACPreconditioner`, or ``skip_nonfinite`` not a bool.
        ValueError: If ``inner`` does not hold a trainable parameter of a registered layer
            (the message names the layers), or its ``step`` requires a closure
            (``torch.optim.LBFGS``: it evaluates several gradients per step, K-FAC
            preconditions one), or it steps only sparse gradients
            (``torch.optim.SparseAdam``).
        TypeError, ValueError: For a group of ``inner`` whose hyperparameters a step would
            refuse (a NaN or negative ``lr``, ``differentiable=True``:
            :mod:`~dkfac.engine.param_groups`).
        RuntimeError: If ``preconditioner`` no longer captures: a newer one built on the
            same model took its layers over, or its hooks were removed.
    """

    def __init__(
        self,
        inner: Optimizer,
        preconditioner: KFACPreconditioner,
        *,
        skip_nonfinite: bool = True,
    ) -> None:
        if not isinstance(inner, Optimizer):
            raise TypeError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        if not isinstance(preconditioner, KFACPreconditioner):
            raise TypeError(
                f"preconditioner must be a KFACPreconditioner, got {type(preconditioner).__name__}"
            )
        check_bool("skip_nonfinite", skip_nonfinite)
        # A preconditioner a newer one took over, or after remove_hooks(): its step() raises.
        preconditioner._hooks.check("KFACOptimizer")
        _check_steps_without_closure(inner)
        _check_steps_dense_gradients(inner)
        _check_holds_layers(inner, preconditioner)
        self.inner = inner
        self.preconditioner = preconditioner
        self.skip_nonfinite = skip_nonfinite
        self._skipped = 0  # read on the host, and on the device (``skipped_steps``)
        self._skipped_late: torch.Tensor | None = None
        self._late = LateWarnings()
        self._shared = False
        self._betas_drive_moments = False  # for_model: the groups' "betas" are the moments'
        self._fuse_at_first_step = False  # for_model's SGD, for a model moved after the build
        self._consolidated: Consolidated | None = None  # consolidate_state_dict's, to a step
        super().__init__(inner.param_groups, inner.defaults)
        # Share, not copy: schedulers and users mutate these dicts.
        self.param_groups = inner.param_groups
        self.state = inner.state
        self._shared = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group to the inner optimizer (the list is shared), as for any optimizer.

        Parameters no registered layer holds get what the model's other parameters get
        (:meth:`~dkfac.KFACPreconditioner.adopt_parameters`: Adam's direction under
        ``leftover_update``); those of a registered layer are preconditioned with it.
        ``torch.optim.Optimizer``'s checks apply (a parameter already in a group raises
        ``ValueError``), and the group's hyperparameters, with the optimizer's defaults for
        those it does not hold, are checked as a step checks them
        (:mod:`~dkfac.engine.param_groups`).

        Raises:
            TypeError: For a group that is not a dict, or a value of the wrong kind.
            ValueError: For a group without ``"params"``, or a value outside its range (a
                NaN or negative ``lr`` or ``weight_decay``); nothing is added then.
        """
        if isinstance(param_group, dict):  # not one: torch's TypeError
            if "params" not in param_group:
                raise ValueError(
                    "a parameter group must hold 'params' (the parameters it steps), got the "
                    f"keys {sorted(map(str, param_group))}"
                )
            try:
                group = {**self.defaults, **param_group}
                check_group(group, self.defaults, self._betas_drive_moments)
            except (TypeError, ValueError) as err:
                raise type(err)(f"param_groups[{len(self.param_groups)}]: {err}") from None
        super().add_param_group(param_group)
        if self._shared:  # not Optimizer.__init__'s own calls
            index = len(self.param_groups) - 1
            params = list(self.param_groups[index]["params"])
            self.preconditioner.adopt_parameters(params, f"param_groups.{index}")

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        lr: float | torch.Tensor = DEFAULT_LR,
        *,
        weight_decay: float = 0.0,
        overhead: float | None = DEFAULT_OVERHEAD,
        **options: Any,
    ) -> KFACOptimizer:
        """dkfac's recommended default for ``model``, built from the model alone.

        :data:`DEFAULT_OPTIONS` (``method="eigen_adam"``, see there) with ``options`` over
        them, under ``torch.optim.SGD(lr=lr, momentum=0, weight_decay=weight_decay)``: the
        preconditioner's update is the whole step, and SGD's weight decay acts on the update
        plus the weights, i.e. AdamW's decoupled decay. Parameters the preconditioner does
        not take (LayerNorm, raw ``nn.Parameter``s; ``pre.describe()`` lists them) get
        Adam's direction on their raw gradient (``leftover_update``), so the same SGD steps
        them as AdamW at ``lr`` would.

        Its param groups hold ``"betas"``: the ``(moment_beta1, moment_beta2)`` of the
        moments (with a method that keeps Adam's first moment), read at each step (from
        the first group), so a scheduler that cycles an optimizer's momentum
        (``OneCycleLR``, ``CyclicLR``, which cycle Adam's ``β₁``) cycles the first moment's,
        as it does AdamW's (:mod:`~dkfac.engine.moment_betas`); the inner SGD's own
        ``momentum`` stays 0.

        A language model's token table and output layer with a tokenizer's vocabulary
        (wider than :data:`~dkfac.engine.roles.VOCABULARY_FLOOR` and than every hidden
        layer: :func:`~dkfac.engine.roles.vocabulary_layers`) are left to Adam's direction,
        as Muon leaves them: their dense ``V × V`` factors would cost more than all the
        hidden layers' (``describe()`` names them by their ``skip_layers`` pattern); a
        ``skip_layers`` given in ``options`` replaces this rule.

        Sweep only ``lr``, over about 1e-3 to 2e-2 (the grid ``dkfac bench suite`` gives
        it, AdamW and SOAP). A constant rate can reach a target and then stall or collapse in a
        run several times longer (the GPT's second text split at the rate a short sweep
        chose; a plain deep ReLU MLP at twice its best rate: BENCHMARKS.md, "The default
        past its target"): for such a run take the rate below a short sweep's winner, or
        decay it. The same advice holds for a transformer: use this as it is
        (``loss_average`` scales the factors, which changes none of its steps: its bases and
        Adam's moments do not depend on that scale). The tuned configurations measured
        against AdamW, Muon and SOAP are in ``benchmarks/recipes/`` (docs/transformers.md
        shows the language model's as options of this method).

        Example:
            >>> opt = KFACOptimizer.for_model(model)  # doctest: +SKIP

        Args:
            model: The model to train (all of its parameters go to the inner SGD: frozen
                ones are stepped once they are unfrozen and have gradients).
            lr: Step size > 0 (at most float32's largest number): a number (a numpy scalar
                is read as its Python number, an int as its float) or a one-element
                floating tensor, handed to the inner SGD as given.
            weight_decay: Decoupled weight decay >= 0 (at most the same), a number (handed
                to the inner SGD as a float).
            overhead: The overhead budget (see :class:`~dkfac.KFACPreconditioner`): after
                the first step, the factor batch and the factor and basis intervals are
                chosen so that the preconditioner's work stays within ``overhead`` times
                the training step (or within a tenth of the budget over the cheapest
                choice, where the per-step part nears it), and where even that part does
                not fit, the
                orthogonalised updates take 3 Newton–Schulz steps instead of 5; a side
                wider than 3/4 of the rows a step sees keeps the identity basis, its
                rotations costing more than half its layer's training step
                (``describe()``'s last row says what and why); an interval, factor batch,
                ``orthogonal_steps`` or ``basis_max_dim`` passed in ``options`` is kept.
                The choice is made once, from the first step's shapes, and kept (also in
                checkpoints); a later step that captures factors from a batch at least
                twice the first one's is named in one warning.
                ``None``: the fixed intervals of :data:`DEFAULT_OPTIONS` (factors every
                step, the basis every 5) and the whole batch.
            **options: Any :class:`~dkfac.KFACConfig` field, over the defaults; with another
                ``method``, the defaults that method does not read
                (:func:`~dkfac.config.unread_moment_fields`) are left out. Also
                :class:`~dkfac.KFACPreconditioner`'s ``grad_scaler`` and ``process_group``.

        Raises:
            TypeError: If ``model`` is not an ``nn.Module``, ``lr`` is not a number or a
                one-element floating tensor (which torch's optimizers take too), or
                ``weight_decay`` is not a number (or an option has the wrong type: the
                config's errors).
            ValueError: If ``lr`` is not > 0 or ``weight_decay`` not >= 0, or either is
                beyond float32's largest number (about 3.4e38; or an option's value is bad).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        lr, weight_decay = python_number(lr), python_number(weight_decay)  # np.float32(3e-3)
        # The inner SGD multiplies float32 weights by both: a larger number fails in torch.
        check_range("lr", lr_number(lr), low=0.0, high=LARGEST, high_inclusive=True)
        check_weight_decay(weight_decay)
        # As floats: torch's SGD step converts a Python int to a C integer (10**30 failed).
        lr = float(lr) if isinstance(lr, int) else lr
        weight_decay = float(weight_decay)
        defaults = method_defaults(options.get("method", DEFAULT_OPTIONS["method"]))
        if overhead is not None:  # the budget chooses these unless the caller did
            defaults = {k: v for k, v in defaults.items() if k not in BUDGETED_OPTIONS}
        if "skip_layers" not in options:
            wide = vocabulary_layers(unwrap(model))
            if wide:
                logger.info("for_model: the vocabulary layers %s keep Adam's direction", wide)
                defaults["skip_layers"] = tuple(f"^{re.escape(name)}$" for name in wide)
        preconditioner = KFACPreconditioner(model, overhead=overhead, **{**defaults, **options})
        # Every parameter, frozen ones too, as AdamW(model.parameters()) takes them: one
        # unfrozen later is stepped (a parameter without a gradient is left as it is).
        params = list(model.parameters())
        # Fused on a launch-bound device: it skips a non-finite step without a host read.
        fused = preconditioner.flags_on_device and _fused_sgd_fits(params)
        inner = torch.optim.SGD(
            params, lr=lr, momentum=0.0, weight_decay=weight_decay, fused=fused or None
        )
        config = preconditioner.config
        moments = "moment_beta1" not in unread_moment_fields(config.method)
        if moments:  # schedulers that cycle the momentum cycle the first moment's β₁
            betas = (config.moment_beta1, config.moment_beta2)
            inner.defaults["betas"] = betas
            for group in inner.param_groups:
                group["betas"] = betas
        optimizer = cls(inner, preconditioner)
        optimizer._betas_drive_moments = moments
        optimizer._fuse_at_first_step = not fused
        return optimizer

    def _finite_flag(self) -> tuple[torch.Tensor, bool] | None:
        """``(flag, sharded)``: a 0-d bool tensor, every parameter gradient on this rank is
        finite, and whether any is a shard (FSDP2's ``DTensor``, checked on this rank's
        shard: the ranks then agree with :meth:`_agreed`); ``None``: no gradients."""
        return gradients_finite([p.grad for group in self.param_groups for p in group["params"]])

    def _agreed(self, flag: torch.Tensor, sharded: bool) -> torch.Tensor:
        """``flag`` AND-ed over the ranks where gradients are sharded: one tiny all-reduce a
        step, where checking the ``DTensor`` itself would all-reduce once per parameter."""
        if not sharded:
            return flag
        return self.preconditioner.comm.all_true(flag.reshape(1)).reshape(())

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Preconditions the gradients, then takes one step of the inner optimizer.

        Args:
            closure: Re-evaluates the model and returns the loss (run with grad enabled
                before preconditioning), as for any optimizer.

        A step that cannot move any weight (every learning rate 0 and every gradient zero:
        what ``torch.distributed.checkpoint`` runs to create an optimizer's state) steps only
        the inner optimizer and leaves K-FAC's state as it is. So does a step with no
        gradient at all in one process (Lightning steps after a ``training_step`` that
        returned ``None`` to skip its batch), which also forgets what the batch's forward
        captured: as if the batch was never seen, as torch's optimizers take such a step.
        On several ranks such a step runs as any other (whether every rank has none would
        take a collective a step to agree on).

        Raises:
            TypeError, ValueError: For a parameter group whose hyperparameters were changed
                to a value outside their domain since the last step (a NaN, negative or
                non-number ``lr`` or ``weight_decay``, ``lr`` removed, a NaN momentum, bad
                ``"betas"``: :mod:`~dkfac.engine.param_groups`), before anything changes.
        """
        check_groups(self.param_groups, [], self.defaults, self._betas_drive_moments)
        self._consolidated = None  # a state consolidated before this step is not its state
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if optimizer_state.initialises_state(self.param_groups):
            self._inner_step()  # nothing can move: K-FAC's state is left as it is
            return loss
        if (
            not self.preconditioner.comm.active
            and not any(p.grad is not None for group in self.param_groups for p in group["params"])
            and not self.preconditioner.has_gradients()  # (parameters replaced: refused below)
        ):  # no gradient at all (a batch the framework skipped): as if it never ran
            self.preconditioner.forget_captures()
            self.preconditioner.capture.ran_since_step = False
            self._inner_step()
            return loss
        # The raw gradients the preconditioner may change into finite ones (a layer's
        # non-finite gradient is zeroed) are its layers': it checks them itself
        # (``gradients_finite``), and every other gradient is finite after its step when it
        # was before. One check of every gradient, after it (a sharded layout's rows are
        # checked before as well: its owners exchange them).
        sharded_layout = self.preconditioner.layout is not None
        raw_finite = self._finite_flag() if self.skip_nonfinite and sharded_layout else None
        if self._betas_drive_moments and "betas" in self.param_groups[0]:
            solvers = [layer.solver for layer in self.preconditioner.layers.values()]
            if self.preconditioner.leftover is not None:
                solvers.append(self.preconditioner.leftover.solver)
            set_moment_betas(solvers, *map(python_number, self.param_groups[0]["betas"]))
        self.preconditioner.step(lr=self._layer_rates())
        if self._fuse_at_first_step:
            self._fuse_at_first_step = False
            if self.preconditioner.flags_on_device:  # decided again at its first step
                _fuse_sgd(self.inner)
        finite = self._finite_flag() if self.skip_nonfinite else None
        if finite is None:
            self._inner_step()
            return loss
        both = finite[0] & self.preconditioner.gradients_finite
        if raw_finite is not None:
            both = both & raw_finite[0]
        ok = self._agreed(both, finite[1] or (raw_finite is not None and raw_finite[1]))
        if self.preconditioner.flags_on_device and _skips_on_device(self.inner):
            self._step_unless(ok)
            return loss
        if not bool(ok):
            self._skipped += 1
            logger.warning(_SKIP_MESSAGE[0], self.preconditioner.steps - 1)
            return loss
        self._inner_step()
        return loss

    def _layer_rates(self) -> float | dict[str, float]:
        """The learning rate of each registered layer, for the KL-clip: that of the group
        holding its weight (0 where no group holds it: it is not stepped); one number when
        there is one group."""
        groups = self.param_groups
        if len(groups) == 1:
            return float(groups[0]["lr"])
        rate = {id(p): float(group["lr"]) for group in groups for p in group["params"]}
        layers = self.preconditioner.layers
        return {
            name: rate.get(id(layer.block.parameters()[0]), 0.0) for name, layer in layers.items()
        }

    def _inner_step(self) -> None:
        """The inner optimizer's step, without torch's *global* step hooks
        (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``): they
        already fire around this optimizer's step, and a user's step is one step. The inner
        optimizer's own hooks (``inner.register_step_pre_hook``) still fire."""
        inner = self.inner
        step = type(inner).step
        if "step" in vars(inner) or not getattr(step, "hooked", False):
            inner.step()  # patched on the instance, or not torch's hooked step: call as is
            return
        for pre_hook in list(inner._optimizer_step_pre_hooks.values()):
            pre_hook(inner, (), {})
        step.__wrapped__(inner)  # type: ignore[attr-defined]
        for post_hook in list(inner._optimizer_step_post_hooks.values()):
            post_hook(inner, (), {})

    def _step_unless(self, ok: torch.Tensor) -> None:
        """The inner step, skipped on the device where ``ok`` fails (no host read): the
        inner optimizer's own ``found_inf`` (the protocol of ``torch.amp.GradScaler``, which
        fused optimizers honour); counted and logged a step late."""
        failed = (~ok).to(torch.float32)
        self.inner.found_inf = failed  # type: ignore[attr-defined]
        self.inner.grad_scale = None  # type: ignore[attr-defined]
        try:
            self._inner_step()
        finally:
            del self.inner.found_inf, self.inner.grad_scale  # type: ignore[attr-defined]
        late = self._skipped_late
        self._skipped_late = failed if late is None else late + failed
        self._late.poll()
        self._late.record(self.preconditioner.steps - 1, ok.reshape(1), _SKIP_MESSAGE)

    @property
    def skipped_steps(self) -> int:
        """Inner steps skipped for a non-finite gradient (reads the device's count)."""
        late = self._skipped_late
        return self._skipped + (0 if late is None else int(late.item()))

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        """Sets the count (a checkpoint's, or 0 to restart it).

        Raises:
            ValueError: For a value that is not an integer >= 0.
        """
        check_int("skipped_steps", value, low=0)
        self._skipped, self._skipped_late = python_number(value), None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients through the inner optimizer, and the statistics the
        backward passes since the last step captured
        (:meth:`~dkfac.KFACPreconditioner.discard_backward`: a step that a GradScaler
        skipped, or a closure evaluated again, leaves none behind)."""
        self.inner.zero_grad(set_to_none=set_to_none)
        self.preconditioner.discard_backward()

    def __getstate__(self) -> dict[str, Any]:
        """Refuses ``copy.copy``, ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the
        optimizer object (torch's ``Optimizer.__getstate__`` keeps only its groups and
        state, so the copy would have no preconditioner and fail at its first call).

        Raises:
            TypeError: Always: the preconditioner holds hooks on the model and process-group
                handles, which cannot be copied; save :meth:`state_dict` and rebuild.
        """
        raise TypeError(
            "a KFACOptimizer cannot be copied or pickled: its preconditioner holds hooks on the "
            "model and process-group handles. Save opt.state_dict() (with the model's "
            "state_dict()), then build a new optimizer on the restored model and call its "
            "load_state_dict()"
        )

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, with the K-FAC part in its first group.

        A standard optimizer state dict (``"state"``, ``"param_groups"``), so
        ``torch.distributed.checkpoint``'s ``get_state_dict``/``set_state_dict`` and
        ``dcp.save``/``dcp.load`` handle it; the preconditioner's state (with its solver
        states) and :attr:`skipped_steps` are one ``bytes`` entry of the first group
        (:mod:`dkfac.engine.optimizer_state`). A collective with several ranks (the
        preconditioner's state is gathered from the layers' owners): call it on every rank.
        After :meth:`consolidate_state_dict` on every rank, call it on that rank only (no
        collective then): ZeRO's rule, which a ``ZeroRedundancyOptimizer`` inside requires.

        Raises:
            RuntimeError: With a ``ZeroRedundancyOptimizer`` inside, on a rank that holds
                no state consolidated since the last step (before any collective).

        The hooks registered with ``register_state_dict_pre_hook`` and
        ``register_state_dict_post_hook`` run as ``torch.optim.Optimizer`` runs them: each
        pre hook with this optimizer first, then each post hook with this optimizer and the
        state dict (one that returns a dict replaces it).
        """
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        # The collective first: an inner optimizer refusing on some ranks leaves none waiting.
        kfac = kfac_part(self.inner, self.preconditioner, self._consolidated)
        inner = self.inner.state_dict()
        state_dict = optimizer_state.pack(inner, kfac, self.skipped_steps)
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the whole state on rank ``to`` (collectives: call it on every rank), so
        that :meth:`state_dict` on rank ``to`` alone returns it and runs no collective, as
        ``torch.distributed.optim.ZeroRedundancyOptimizer``'s does; Lightning and Fabric save
        an optimizer that has this method that way (:mod:`~dkfac.engine.zero_state`). With a
        ``ZeroRedundancyOptimizer`` inside it consolidates that one's shards too, and its
        :meth:`state_dict` needs it. It holds until the next step; :meth:`load_state_dict`
        of that state runs on every rank.

        Raises:
            TypeError: For a ``to`` that is not an int.
        """
        self._consolidated = None
        self._consolidated = consolidate(self.inner, self.preconditioner, to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (or a dict of ``"inner"`` and ``"preconditioner"``,
        with ``"skipped_steps"`` where it was kept: 0 without it), all or nothing.

        The preconditioner part is checked first (without changing anything); the inner
        optimizer is then loaded and, if anything after that fails, put back as it was
        (its own ``state`` and ``param_groups`` objects, nothing copied). Either way the
        wrapper's ``param_groups`` and ``state`` stay the inner optimizer's.

        The hooks registered with ``register_load_state_dict_pre_hook`` and
        ``register_load_state_dict_post_hook`` run as ``torch.optim.Optimizer`` runs them:
        each pre hook with this optimizer and a shallow copy of ``state_dict`` before
        anything is checked (one that returns a dict replaces it), each post hook with this
        optimizer once the state has loaded (not after a refused load).

        Raises:
            ValueError: If the state dict is not one of this optimizer, or a group has no
                ``lr``, or its ``lr`` or ``weight_decay`` is not a finite number in ``[0,
                float32's largest]``, or, where the groups' ``"betas"`` are the moments'
                (:meth:`for_model`), they are not two numbers in ``[0, 1)``, or another of
                its values is not of the kind of the current group's (a NaN or a string
                momentum: :mod:`~dkfac.engine.param_groups`); nothing is changed.
        """
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch's: a hook may change its keys
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        inner, preconditioner, skipped = optimizer_state.unpack(state_dict)
        if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
            raise ValueError(
                "'inner' is not an optimizer state dict (needs 'state', 'param_groups')"
            )
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"'skipped_steps' must be an integer >= 0, got {skipped!r}")
        current = self.inner.param_groups
        saved_groups = inner["param_groups"]
        if isinstance(saved_groups, list | tuple) and len(saved_groups) != len(current):
            raise ValueError(  # before the preconditioner's moments name the groups' params
                f"the state dict has {len(saved_groups)} parameter groups, this optimizer "
                f"{len(current)}: add the groups it had (add_param_group) before loading"
            )
        try:  # each saved group against the group it replaces
            check_groups(
                inner["param_groups"], current, self.inner.defaults, self._betas_drive_moments
            )
        except TypeError as err:
            raise ValueError(str(err)) from None
        if not isinstance(inner["state"], dict):
            raise ValueError(f"'state' must be a dict, got {type(inner['state']).__name__}")
        self.preconditioner.check_state_dict(preconditioner)
        before = {"state": self.inner.state, "param_groups": self.inner.param_groups}
        try:
            self.inner.load_state_dict(inner)
            self.preconditioner.load_state_dict(preconditioner)
        except BaseException:
            self.inner.__setstate__(before)
            raise
        finally:
            self.param_groups = self.inner.param_groups
            self.state = self.inner.state
        self.skipped_steps = skipped
        self._consolidated = None
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)
