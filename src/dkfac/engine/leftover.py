"""Adam's moments for the parameters no block preconditions, under ``"eigen_adam"``.

Under ``method="eigen_adam"`` a registered layer's update is Adam's in its Kronecker
eigenbasis, ``m̂ ⊘ (√v̂ + ε)``: entries of about one, stepped by the inner SGD at ``lr``.
A parameter no block takes (a LayerNorm's weight and bias, a raw ``nn.Parameter``) would
reach that SGD with its plain gradient instead, a step ``lr`` times a gradient that is
often 10⁻²–10⁻⁴: it hardly moves. With ``leftover_update="adam"`` (the default under
``"eigen_adam"``: ``"auto"``) :class:`LeftoverAdam` replaces such a gradient by Adam's
direction on the raw gradient — eigen_adam with the identity as both bases: the same
solver's moment step and formulas (β₁, β₂, ε, bias correction and Nesterov from the config;
no rotation, blocks or orthogonalisation; the parameters of one shape as one stack) — so
the inner SGD's step is Adam's at ``lr``, and its weight decay AdamW's decoupled decay, for
every parameter alike. The moments are kept in float32 at least (a float16 gradient's square
would underflow).

It runs after the strategy's reductions, on the gradients every rank holds averaged (by
DDP, or by ``"spngd"``'s own reduction), so every rank keeps the same moments, and they
are saved once, by parameter name. A gradient with a NaN or Inf is left as it is (the
:class:`~dkfac.optimizer.KFACOptimizer` skips that step). The moments advance only on a
step whose gradients are finite everywhere: in every parameter here and in every
registered layer (:meth:`step` runs before the layers' moments advance, takes the layers'
answer and returns its own), so the step the optimizer skips leaves every moment as it
was; the choice is a ``torch.where``, no host sync.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dkfac.config import SolverConfig
from dkfac.distributed.shard_rows import gather_rows, own_rows
from dkfac.solvers import EigenAdamSolver, SolverState
from dkfac.solvers.stacking import same_tensors

__all__ = ["LeftoverAdam"]


def _local(grad: Tensor) -> Tensor:
    """This rank's part of a gradient: the local shard of a DTensor (FSDP2), Adam being
    elementwise; the gradient itself otherwise."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _matrix_shape(tensor: Tensor) -> tuple[int, int]:
    """The ``rows × columns`` shape the solver sees ``tensor`` as (a scalar is ``1 × 1``)."""
    return (tensor.shape[0], math.prod(tensor.shape[1:])) if tensor.dim() else (1, 1)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The moments' precision for a gradient of ``dtype``: float32 at least (a float16
    gradient's square underflows below 6e-8, and ``m̂ ⊘ (√v̂ + ε)`` over a flushed ``v``
    would be ``m̂ / ε``); float64 stays."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _stack(members: list[tuple[str, Tensor]]) -> tuple[list[tuple[str, Tensor]], Tensor, Tensor]:
    """``(members, matrices, finite)``: the gradients of one group stacked as the solver's
    matrices (float32 at least), and whether each is finite: the test of
    :func:`~dkfac.engine.finite.finite_each`, the squares' sum of each in one call (a
    gradient whose squares overflow would make ``v`` Inf for good)."""
    stacked = torch.stack([grad for _, grad in members])
    matrices = stacked.view(len(members), *_matrix_shape(stacked[0])).to(_wide(stacked.dtype))
    return members, matrices, torch.isfinite(matrices.square().sum(dim=(1, 2)))


class LeftoverAdam:
    """Adam's direction in place of the gradients of ``params`` (see the module notes).

    Args:
        params: The parameters, by qualified name.
        config: The preconditioner's configuration (its ``moment_beta1``,
            ``moment_beta2``, ``moment_eps``, ``moment_bias_correction`` and
            ``moment_nesterov`` are read).
    """

    def __init__(self, params: Mapping[str, Tensor], config: SolverConfig) -> None:
        self.params = dict(params)
        # Nothing is rotated here: no rounding floor (Adam's own update, to the bit).
        options = dataclasses.replace(config.adam_options(), rounding_floor=0.0)
        self.solver = EigenAdamSolver(torch.float32, options)
        self.moments: dict[str, SolverState] = {}
        # Per group (its names): the stacked moments of the last step and the per-name
        # slices handed out, read again while ``moments`` holds those very slices.
        self._stacks: dict[tuple[str, ...], tuple[SolverState, list[SolverState]]] = {}

    @torch.no_grad()
    def step(
        self, advance: Tensor | bool = True, agree: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor | None:
        """Replaces each present, finite gradient by Adam's direction; the moments advance
        where every gradient here is finite and ``advance`` holds (a 0-d bool tensor or a
        bool: the registered layers' gradients are finite, see the module notes).

        The parameters of one matrix shape, dtype and device go through the solver as one
        stack (the solver's formulas are the same on a stack: a few calls for a model's
        LayerNorms instead of a dozen each).

        Args:
            advance: Whether the layers' gradients are finite.
            agree: Ands a 1-element bool tensor across the ranks; applied to the answer
                where the gradients are shards (FSDP2's ``DTensor``), which the ranks hold
                differently.

        Returns:
            A 0-d bool tensor, whether every gradient here is finite (agreed where they are
            shards); ``None`` where no parameter here has a gradient.
        """
        groups: dict[tuple[Any, ...], list[tuple[str, Tensor]]] = {}
        sharded = False
        for name, param in self.params.items():
            if param.grad is not None:
                sharded = sharded or isinstance(param.grad, DTensor)
                grad = _local(param.grad)  # Adam is elementwise: a shard's own
                groups.setdefault((tuple(grad.shape), grad.dtype, grad.device), []).append(
                    (name, grad)
                )
        if not groups:
            return None
        stacks = [_stack(members) for members in groups.values()]
        ok = stacks[0][2].all()
        for _, _, finite in stacks[1:]:
            ok = ok & finite.all().to(ok.device)
        if sharded and agree is not None:
            ok = agree(ok.reshape(1)).reshape(())
        moves = ok & advance
        for members, matrices, finite in stacks:
            self._step_group(members, matrices, finite, moves)
        return ok

    def _step_group(
        self,
        members: list[tuple[str, Tensor]],
        matrices: Tensor,
        finite: Tensor,
        moves: Tensor,
    ) -> None:
        """The gradients of one shape, dtype and device as one stack of matrices (:func:`_stack`):
        a few calls for the group, none a parameter but the copy back; the moments advance
        where ``moves`` holds."""
        grads = [grad for _, grad in members]
        names = tuple(name for name, _ in members)
        given = [self.moments.get(name) for name in names]
        last = self._stacks.get(names)
        if last is not None and same_tensors(given, last[1]):
            old = last[0]  # this group's moments as the last step left them: no stacking
        else:
            old = self.solver.stack_moments(given, [matrices[0]] * len(members))
        # The update in the identity basis: the moment step alone (no rotation to take).
        new, update = self.solver.moment_step(old, matrices, 0.0)
        if moves.device != matrices.device:  # a model across devices
            moves = moves.to(matrices.device)
        kept = {key: torch.where(moves, new[key], old[key]) for key in new}
        update = torch.where(finite.view(-1, 1, 1), update, matrices)
        parts = {key: value.unbind(0) for key, value in kept.items()}  # one call a key
        slices = [{key: part[i] for key, part in parts.items()} for i in range(len(names))]
        self.moments.update(zip(names, slices, strict=True))
        self._stacks[names] = (kept, slices)
        torch._foreach_copy_(grads, list(update.view(len(grads), *grads[0].shape).unbind(0)))

    def nbytes(self) -> int:
        """Bytes of the moments held."""
        return sum(t.numel() * t.element_size() for m in self.moments.values() for t in m.values())

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """The moments by parameter name (copies; a sharded parameter's gathered whole, a
        collective under FSDP2)."""
        return {
            name: {
                k: (t if k == "t" else gather_rows(self.params[name], t)).clone()
                for k, t in m.items()
            }
            for name, m in self.moments.items()
        }

    def check_state_dict(self, state: Any) -> None:
        """Raises ValueError unless ``state`` is a :meth:`state_dict` of these parameters.

        Every name must be one of the parameters, with finite tensors ``m`` and ``v`` of
        its gradient's matrix shape and a 1-element count ``t``.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"saved leftover moments must be a dict, got {type(state).__name__}")
        unknown = sorted(set(state) - set(self.params))
        if unknown:
            raise ValueError(
                f"saved leftover moments name parameters the preconditioner leaves no moments "
                f"to: {unknown}; it keeps them for {sorted(self.params)}"
            )
        for name, moments in state.items():
            shape = _matrix_shape(self.params[name])
            expected = {"m": shape, "v": shape, "t": (1,)}
            if not isinstance(moments, Mapping) or set(moments) != set(expected):
                raise ValueError(f"{name}: saved leftover moments must be a dict of m, v and t")
            for key, value in moments.items():
                if not isinstance(value, Tensor) or tuple(value.shape) != expected[key]:
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise ValueError(
                        f"{name}: saved leftover moment {key!r} must be a tensor of shape "
                        f"{expected[key]}, got {got}"
                    )
                if not bool(torch.isfinite(value).all()):
                    raise ValueError(f"{name}: saved leftover moment {key!r} is not finite")
                if key in ("v", "t") and bool((value < 0).any()):
                    raise ValueError(f"{name}: saved leftover moment {key!r} is negative")

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Restores :meth:`state_dict`'s moments (checked first); absent ones start afresh."""
        self.check_state_dict(state)
        self.moments = {
            name: {
                k: (t if k == "t" else own_rows(self.params[name], t))
                .to(self.params[name].device)
                .clone()
                for k, t in moments.items()
            }
            for name, moments in state.items()
        }
