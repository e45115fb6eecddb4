"""Blocks for ``nn.MultiheadAttention``: q, k, v and the out projection, each a Linear.

An attention module yields four blocks, named ``<name>.q_proj``, ``<name>.k_proj``,
``<name>.v_proj`` and ``<name>.out_proj``: each projection has its own A (its input: the
query, key or value) and its own G (the gradient of its output), exactly the factors of
the same attention written with four separate ``nn.Linear`` layers. The q/k/v blocks own
rows ``[0:E]``, ``[E:2E]``, ``[2E:3E]`` of ``in_proj_weight`` and ``in_proj_bias`` (or all
of ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when ``kdim``/``vdim`` differ
from ``embed_dim``) and write their preconditioned gradient back into those rows.

The module calls these weights functionally, so no hook would see the projections. While
a block is installed (:meth:`~dkfac.blocks.base.Block.install`), the module's ``forward``
is replaced, in training with gradients enabled, by
:func:`~dkfac.blocks.attention_core.explicit_forward`, which calls three
:class:`Projection` modules and ``out_proj`` as modules; outside training or under
``no_grad`` the module's own forward runs unchanged. The projections are computed on
batch-first views, so each block sees ``(N, L, features)`` inputs whatever ``batch_first``
is. The replacement is shared by every preconditioner on the module and removed with the
last one's hooks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.blocks.attention_core import explicit_forward
from dkfac.blocks.base import Block, ParameterPart, gradient_write
from dkfac.blocks.linear import LinearBlock

__all__ = [
    "AttentionForward",
    "AttentionOutputBlock",
    "AttentionProjectionBlock",
    "Projection",
    "attention_blocks",
]

ROLES = ("q", "k", "v")
_SHARED = "_dkfac_attention_forward"
"""Attribute of an attention module holding its installed :class:`AttentionForward`."""


class Projection(nn.Module):
    """The q, k or v projection of an attention module, as a module hooks can see.

    It is not a submodule of the model and holds no parameter of its own: it reads rows of
    the attention's parameters on every call, so autograd reaches them.

    Args:
        attention: The attention module.
        role: ``"q"``, ``"k"`` or ``"v"``.
    """

    attention: nn.MultiheadAttention

    def __init__(self, attention: nn.MultiheadAttention, role: str) -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        object.__setattr__(self, "attention", attention)  # not a submodule
        self.role = role

    @property
    def training(self) -> bool:
        """The attention's mode: the projection is no submodule that ``.eval()`` reaches."""
        return bool(self.attention.training)

    @training.setter
    def training(self, value: bool) -> None:
        """Ignored (``nn.Module.__init__`` sets it): the mode is always the attention's."""

    @property
    def rows(self) -> slice:
        """The rows of ``in_proj_weight`` / ``in_proj_bias`` this projection owns."""
        embed = int(self.attention.embed_dim)
        index = ROLES.index(self.role)
        return slice(index * embed, (index + 1) * embed)

    def weight_part(self) -> ParameterPart:
        """The weight parameter and the rows of it that are this projection's."""
        attention = self.attention
        if attention._qkv_same_embed_dim:
            return attention.in_proj_weight, self.rows
        weight = getattr(attention, f"{self.role}_proj_weight")
        assert isinstance(weight, Tensor)
        return weight, None

    def bias_part(self) -> ParameterPart | None:
        """The bias parameter and this projection's rows of it, or ``None`` without bias."""
        bias = self.attention.in_proj_bias
        return None if bias is None else (bias, self.rows)

    @property
    def in_features(self) -> int:
        """``embed_dim``, ``kdim`` or ``vdim``."""
        return int(
            {"q": self.attention.embed_dim, "k": self.attention.kdim}.get(
                self.role, self.attention.vdim
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x W_roleᵀ + b_role``."""
        weight, rows = self.weight_part()
        bias = self.bias_part()
        return F.linear(
            x,
            weight if rows is None else weight[rows],
            None if bias is None else bias[0][bias[1]],
        )


class _Release:
    """Handle of one :meth:`AttentionForward.acquire`; ``remove()`` releases it once."""

    def __init__(self, owner: AttentionForward) -> None:
        self._owner: AttentionForward | None = owner

    def remove(self) -> None:
        """Releases the forward replacement (the last release restores the module)."""
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()


class AttentionForward:
    """The forward replacement of one attention module and its projection modules.

    Use :func:`shared_forward` to get it: every preconditioner on the module then shares
    the same projection modules (whose hooks each of them attaches).

    Args:
        module: The attention module.
    """

    def __init__(self, module: nn.MultiheadAttention) -> None:
        self.module = module
        self.projections = {role: Projection(module, role) for role in ROLES}
        self._users = 0
        self._previous: Any = None

    def acquire(self) -> _Release:
        """Installs the replacement on the first call; returns a handle that releases it."""
        if self._users == 0:
            self._previous = self.module.__dict__.get("forward")
            self.module.forward = self.forward  # type: ignore[method-assign]
            self.module.__dict__[_SHARED] = self
        self._users += 1
        return _Release(self)

    def release(self) -> None:
        """Undoes one :meth:`acquire`; the last restores the module's own forward."""
        self._users -= 1
        if self._users > 0:
            return
        self.module.__dict__.pop(_SHARED, None)
        if self._previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self._previous  # type: ignore[method-assign]
        self._previous = None

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """The module's forward: explicit in training with gradients, its own otherwise."""
        module = self.module
        if module.training and torch.is_grad_enabled():
            return explicit_forward(module, self.projections, *args, **kwargs)
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)


def shared_forward(module: nn.MultiheadAttention) -> AttentionForward:
    """The forward replacement installed on ``module``, or a new (not yet installed) one."""
    found = module.__dict__.get(_SHARED)
    return found if isinstance(found, AttentionForward) else AttentionForward(module)


class AttentionProjectionBlock(LinearBlock):
    """The q, k or v projection of an attention module, preconditioned as a Linear.

    Args:
        name: ``<attention name>.q_proj`` (``k_proj``, ``v_proj``).
        module: Its :class:`Projection` (hooks attach to it).
        forward: The attention's forward replacement, installed with the hooks.
    """

    module: Projection  # type: ignore[assignment]
    rows_are_outputs = False  # rows of the shared in_proj_weight, not a whole parameter

    def __init__(self, name: str, module: Projection, forward: AttentionForward) -> None:
        super().__init__(name, module)
        self.replacement = forward

    @property
    def in_features(self) -> int:
        """``embed_dim``, ``kdim`` or ``vdim``."""
        return self.module.in_features

    @property
    def out_features(self) -> int:
        """``embed_dim``."""
        return int(self.module.attention.embed_dim)

    @property
    def has_bias(self) -> bool:
        """Whether the attention has ``in_proj_bias``."""
        return self.module.bias_part() is not None

    def install(self) -> _Release:
        """Replaces the attention's forward while the hooks are attached."""
        return self.replacement.acquire()

    def parameter_parts(self) -> list[ParameterPart]:
        """The weight rows and bias rows of this projection."""
        bias = self.module.bias_part()
        return [self.module.weight_part(), *([bias] if bias is not None else [])]

    def parameters(self) -> list[Tensor]:
        """The weight (``in_proj_weight`` or the own one) and ``in_proj_bias``."""
        return [param for param, _ in self.parameter_parts()]

    def weight_grad(self) -> Tensor | None:
        """This projection's rows of the gradients as a ``g_dim × a_dim`` matrix."""
        parts = self.parameter_parts()
        weight, rows = parts[0]
        if weight.grad is None:
            return None
        grads = [weight.grad if rows is None else weight.grad[rows]]
        if len(parts) > 1:
            bias, bias_rows = parts[1]
            bias_grad = bias.grad if bias.grad is not None else torch.zeros_like(bias)
            grads.append(bias_grad[bias_rows].reshape(-1, 1))
        return torch.cat(grads, dim=1) if len(grads) > 1 else grads[0]

    def grad_writes(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        """A ``g_dim × a_dim`` matrix back into this projection's rows of the gradients
        (the bias's: :func:`~dkfac.blocks.base.gradient_write`)."""
        parts = self.parameter_parts()
        weight, rows = parts[0]
        assert weight.grad is not None
        writes = []
        if len(parts) > 1:
            bias, bias_rows = parts[1]
            writes += gradient_write(bias, matrix[:, -1], bias_rows)
            matrix = matrix[:, :-1]
        writes.append((weight.grad if rows is None else weight.grad[rows], matrix))
        return writes


class AttentionOutputBlock(LinearBlock):
    """``out_proj`` of an attention module: a Linear whose forward the attention calls.

    Args:
        name: ``<attention name>.out_proj``.
        module: The attention's ``out_proj``.
        forward: The attention's forward replacement (which calls ``out_proj`` as a module).
    """

    def __init__(self, name: str, module: nn.Linear, forward: AttentionForward) -> None:
        super().__init__(name, module)
        self.replacement = forward

    def install(self) -> _Release:
        """Replaces the attention's forward while the hooks are attached."""
        return self.replacement.acquire()

    def left_out(self) -> list[tuple[Tensor, str]]:
        """The attention's own parameters no block of it holds, with why: ``bias_k`` and
        ``bias_v`` (``add_bias_kv``), and the projections' weights and ``in_proj_bias``
        when one projection weight is frozen (:func:`attention_blocks`)."""
        attention = self.replacement.module
        frozen = [
            name
            for name, param in attention.named_parameters(recurse=False)
            if name.endswith("proj_weight") and not param.requires_grad
        ]
        left: list[tuple[Tensor, str]] = []
        for name, param in attention.named_parameters(recurse=False):
            if name in ("bias_k", "bias_v"):
                kind = "key" if name == "bias_k" else "value"
                reason = (
                    f"an attention's {name} (add_bias_kv) is one more {kind} appended to "
                    "every sequence, not a projection's weight"
                )
            elif frozen:
                reason = (
                    f"the attention's q, k and v projections are preconditioned together "
                    f"(they share in_proj_bias), and {' and '.join(frozen)} does not require "
                    "a gradient"
                )
            else:
                continue
            left.append((param, reason))
        return left


def attention_blocks(name: str, module: nn.Module) -> list[Block]:
    """The q, k, v and out blocks of an ``nn.MultiheadAttention`` (in that order).

    The q/k/v blocks come as a group: only when every projection weight requires a
    gradient (they share ``in_proj_bias``, which cannot be split between K-FAC and the
    inner optimizer). Registration drops the out block when ``out_proj.weight`` does not
    require a gradient.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"{name}: expected nn.MultiheadAttention, got {type(module).__name__}")
    forward = shared_forward(module)
    prefix = f"{name}." if name else ""  # the model itself may be the attention
    projections = [
        AttentionProjectionBlock(f"{prefix}{role}_proj", forward.projections[role], forward)
        for role in ROLES
    ]
    blocks: list[Block] = []
    if all(block.parameters()[0].requires_grad for block in projections):
        blocks.extend(projections)
    blocks.append(AttentionOutputBlock(f"{prefix}out_proj", module.out_proj, forward))
    return blocks


def functional_children(module: nn.Module) -> list[nn.Module]:
    """Submodules that ``module`` calls functionally (their hooks never fire on their own)."""
    return [module.out_proj] if isinstance(module, nn.MultiheadAttention) else []
