"""Guards against library misuse that would silently corrupt training (issue 20, class 6).

- :class:`GradientMarks`: ``step()`` twice after one backward would precondition the
  already preconditioned gradients again. After each step the marks record which gradient
  tensor every registered parameter holds and its version counter (bumped by every in-place
  write: a backward accumulating into it, ``zero_grad(set_to_none=False)``, unscaling,
  clipping, DDP's averaging); a new backward either bumps the counter or, after
  ``zero_grad()``, creates a new tensor. A layer whose gradients are all unchanged is stale.
  Reading the counters is host-side metadata: no device synchronisation.
- :func:`claim_modules` / :func:`release_modules`: a module is hooked by at most one live
  preconditioner. A new one on modules another holds takes them over: the other's hooks
  are all detached and its ``step()`` raises (a framework builds a new optimizer for the
  same model at each run: Lightning's ``configure_optimizers`` at every ``fit``, its tuner,
  a second ``Trainer``; the earlier optimizer is still referenced then). The registry holds
  the modules and their holders weakly, so a preconditioner that is garbage-collected (or
  whose hooks were removed) frees its modules.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dkfac.engine.model_hooks import same_parameters

logger = logging.getLogger(__name__)

__all__ = [
    "MARK_ATTRIBUTE",
    "GradientMarks",
    "HookOwnership",
    "Placement",
    "check_parameters_kept",
    "claim_modules",
    "name_list",
    "placements",
    "refuse_unhooked_forward",
    "release_modules",
    "warn_if_moved",
]

# module -> the hooks on it (a preconditioner's HookOwnership; both held weakly)
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[HookOwnership]] = (
    weakref.WeakKeyDictionary()
)


def name_list(names: Sequence[str], limit: int = 8) -> str:
    """The first ``limit`` of ``names`` joined by commas, and how many more (an error's
    list of modules or parameters)."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def claim_modules(holder: HookOwnership, modules: Mapping[str, nn.Module]) -> None:
    """Registers ``holder`` as the one whose hooks are on ``modules``; another live holder
    of any of them is retired first (:meth:`HookOwnership.retire`): the preconditioner
    built last on a model is the one that captures and steps.

    Args:
        holder: The hooks of the new preconditioner (held weakly).
        modules: Qualified name -> module it registers.
    """
    for module in modules.values():
        ref = _OWNERS.get(module)
        other = None if ref is None else ref()
        if other is not None and other is not holder:
            other.retire()
    ref = weakref.ref(holder)
    for module in modules.values():
        _OWNERS[module] = ref


def release_modules(holder: HookOwnership, modules: Iterable[nn.Module]) -> None:
    """Frees the ``modules`` that ``holder`` holds (after its hooks were removed)."""
    for module in modules:
        ref = _OWNERS.get(module)
        if ref is not None and ref() is holder:
            del _OWNERS[module]


def _remove_all(hooked: list[Any]) -> None:
    """Detaches the hooks of every holder (a finalizer: it must not refer to the owner)."""
    for holder in hooked:
        holder.remove()


class HookOwnership:
    """The hooks a preconditioner put on its modules, and its claim on those modules.

    The hooks are detached by :meth:`remove`, by :meth:`retire` (another preconditioner
    took the modules) or when the owner is garbage-collected (they do not refer to it, so
    a forgotten preconditioner does not keep capturing). The modules are claimed by
    :meth:`claim`, at the end of the owner's construction.

    Args:
        owner: The preconditioner.
        modules: Qualified name -> module it registers (claimed here, see
            :func:`claim_modules`).
    """

    def __init__(self, owner: object, modules: Mapping[str, nn.Module]) -> None:
        self._modules = list(modules.values())
        self._hooked: list[Any] = []
        self._detach = weakref.finalize(owner, _remove_all, self._hooked)
        self._detach.atexit = False
        self._taken = False
        self._claimed = dict(modules)

    def claim(self) -> None:
        """Takes the modules (:func:`claim_modules`), once the preconditioner is built: one
        whose construction fails retires no other."""
        claim_modules(self, self._claimed)

    def add(self, holder: Any) -> None:
        """Adds an object whose ``remove()`` detaches hooks it attached."""
        self._hooked.append(holder)

    def remove(self) -> None:
        """Detaches every hook and frees the modules for another preconditioner."""
        self._detach()
        release_modules(self, self._modules)

    def retire(self) -> None:
        """Detaches every hook, all modules' (another preconditioner takes some of them)."""
        self._taken = True
        self.remove()

    def check(self, call: str) -> None:
        """Raises RuntimeError after :meth:`remove` (no statistics would be captured)."""
        if self._taken:
            raise RuntimeError(
                f"{call}() on a preconditioner whose layers a newer KFACPreconditioner took "
                "over (one built on the same model later, as a framework does for each "
                "run): step the newer one's optimizer"
            )
        if not self._detach.alive:
            raise RuntimeError(
                f"{call}() after remove_hooks(): this preconditioner no longer captures "
                "statistics; build a new KFACPreconditioner to precondition again"
            )


MARK_ATTRIBUTE = "_dkfac_step_mark"
"""The attribute a step leaves on each gradient it preconditioned: a token of that step.
A token rather than a weak reference to the gradient: a tensor with a weak reference
cannot be swapped, and ``model.to()`` swaps a parameter's gradient (under
``torch.__future__.set_swap_module_params_on_conversion(True)``, and always for a tensor
subclass such as FSDP2's ``DTensor``). A conversion makes new gradients of the old ones
(the token is not copied): a step after it takes them as new."""

# one entry per parameter: the token left on its gradient, and the gradient's version counter
_Mark = tuple[object, int]


class GradientMarks:
    """The gradients each layer's parameters held when the last ``step()`` ended."""

    def __init__(self) -> None:
        self._marks: dict[str, list[_Mark | None]] = {}

    def record(self, params: Mapping[str, Sequence[Tensor]]) -> None:
        """Notes every parameter's current gradient (call it at the end of a step): leaves a
        token of this step on it (:data:`MARK_ATTRIBUTE`) and keeps the token and the
        gradient's version counter.

        Args:
            params: Layer name -> the parameters its block preconditions.
        """
        token = object()
        marks: dict[str, list[_Mark | None]] = {}
        for name, ps in params.items():
            marks[name] = []
            for p in ps:
                if p.grad is None:
                    marks[name].append(None)
                    continue
                setattr(p.grad, MARK_ATTRIBUTE, token)
                marks[name].append((token, p.grad._version))
        self._marks = marks

    def stale(self, params: Mapping[str, Sequence[Tensor]]) -> list[str]:
        """The layers whose every gradient is the one recorded, unchanged since then.

        A layer without gradients is not stale (an unused branch); neither is one with a
        gradient that is new (it carries no token of the last step: a backward made it, or
        a conversion of the model replaced it) or was written to since the last step.
        """
        stale = []
        for name, ps in params.items():
            marks = self._marks.get(name)
            if marks is None or len(marks) != len(ps):
                continue
            grads = [(p.grad, mark) for p, mark in zip(ps, marks, strict=True)]
            present = [(g, mark) for g, mark in grads if g is not None]
            if present and all(
                mark is not None
                and getattr(g, MARK_ATTRIBUTE, None) is mark[0]
                and mark[1] == g._version
                for g, mark in present
            ):
                stale.append(name)
        return stale

    def check(self, params: Mapping[str, Sequence[Tensor]]) -> None:
        """Raises RuntimeError if some layer's gradients are those the last step wrote.

        Args:
            params: Layer name -> the parameters its block preconditions.
        """
        stale = self.stale(params)
        if stale:
            raise RuntimeError(
                f"step() without a new backward: the gradients of {stale} are the ones the "
                "last step() already preconditioned (again would corrupt them); run "
                "zero_grad() and loss.backward() before each step() (with gradient "
                "accumulation: step() once after the last backward)"
            )


def check_parameters_kept(
    registered: Mapping[str, Sequence[Tensor]], current: Mapping[str, Sequence[Tensor]]
) -> None:
    """Raises RuntimeError if some layer's module holds other parameters than it did when
    the preconditioner was built (:func:`~dkfac.engine.model_hooks.same_parameters`): its
    hooks take no statistics from a forward with other tensors, and the optimizer steps
    the ones it was given.

    Args:
        registered: Layer name -> the parameters its block preconditioned at the build.
        current: Layer name -> the parameters its module holds now.
    """
    replaced = [
        name for name, params in current.items() if not same_parameters(registered[name], params)
    ]
    if replaced:
        raise RuntimeError(
            f"the layers {replaced} hold other parameters than when the optimizer was built: "
            "the model's parameters were replaced since (model.to_empty() from the meta "
            "device, load_state_dict(..., assign=True), a weight tied or set anew), and the "
            "optimizer would step the old ones; build it once the model's parameters are final"
        )


def refuse_unhooked_forward(ran: bool, backward: bool) -> None:
    """Raises RuntimeError where a backward reached the registered layers' parameters since
    the last step (``backward``) while no registered layer's forward ran through the
    preconditioner's hooks (``ran``): K-FAC would capture and precondition nothing.

    The model then runs without the hooks: a graph ``torch.compile`` captured before the
    hooks were put on (dynamo reuses it, for this model or for another instance of its
    class in the process, and does not look for module hooks added since), or a parent that
    applies the layers' weights without calling the layers. Not for gradients set by hand
    (no backward), nor at a preconditioner's first step, whose gradients may come from a
    forward run before it was built.
    """
    if ran or not backward:
        return
    raise RuntimeError(
        "no registered layer's forward ran through dkfac's hooks since the last step, yet "
        "a backward reached their parameters: K-FAC would capture and precondition nothing. "
        "A model compiled with torch.compile runs the graph dynamo captured at its first "
        "forward (or another instance of its class did, in this process), which has no hooks "
        "added since: build the optimizer before the compiled model's first forward, or call "
        "torch.compiler.reset() after building it. A model that applies the layers' weights "
        "without calling the layers: leave them to the inner optimizer (skip_layers)"
    )


Placement = tuple[torch.device, torch.dtype]
"""Where a layer's first parameter lives: its device and dtype."""


def placements(params: Mapping[str, Sequence[Tensor]]) -> dict[str, Placement]:
    """Each layer's :data:`Placement` (``params``: layer name -> its parameters)."""
    return {name: (ps[0].device, ps[0].dtype) for name, ps in params.items() if ps}


def warn_if_moved(built: Mapping[str, Placement], params: Mapping[str, Sequence[Tensor]]) -> None:
    """Logs a warning when a layer's parameters are on another device or of another dtype
    than when the preconditioner was built (``built``, :func:`placements`): a model moved
    after its optimizer was built keeps the choices made for where it was.

    Args:
        built: The layers' placements at the build.
        params: Layer name -> the parameters its module holds now.
    """
    moved = {
        name: f"{b[0]} {str(b[1]).removeprefix('torch.')} -> {now[0]} "
        f"{str(now[1]).removeprefix('torch.')}"
        for name, now in placements(params).items()
        if (b := built.get(name)) is not None and b != now
    }
    if moved:
        shown = dict(list(moved.items())[:3])
        more = f" and {len(moved) - 3} more" if len(moved) > 3 else ""
        logger.warning(
            "the model's layers moved after the optimizer was built (%s%s): what depends on "
            "the device and dtype was chosen for where they were (the factors' precision, "
            '"auto" precisions and compile backends); build the optimizer after moving the '
            "model (with accelerate: model.to(accelerator.device) before it)",
            shown,
            more,
        )
