"""The layout of a :class:`~dkfac.KFACOptimizer` state dict: a standard optimizer state dict.

``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` (and
``set_state_dict``) read an optimizer's state dict as ``{"state": {param id: ...},
"param_groups": [...]}``, rename the ids to parameter names and drop every other key; and
``dcp.load`` loads *into* a state dict of the same structure built by a fresh optimizer. So
the wrapper's state dict is the inner optimizer's, with the K-FAC part (the preconditioner's
state and the count of skipped steps) in the first parameter group under :data:`KFAC_KEY`,
as one opaque ``bytes`` value (``torch.save`` of the part): ``dcp`` saves and loads it
whole, whatever its shapes (a fresh preconditioner holds no factors yet). The
preconditioner's state is gathered from the owners, so the value is the same on every rank
and loads at any world size. :func:`unpack` reads it back (and reads the older layout
``{"inner", "preconditioner", "skipped_steps"}``).
"""

from __future__ import annotations

import io
from typing import Any, Final

import torch

KFAC_KEY: Final = "kfac"
"""The key of the K-FAC part in the first parameter group."""


def encode(part: dict[str, Any]) -> bytes:
    """``part`` (tensors and plain containers) as the bytes of ``torch.save``."""
    buffer = io.BytesIO()
    torch.save(part, buffer)
    return buffer.getvalue()


def decode(blob: Any) -> dict[str, Any]:
    """The K-FAC part saved by :func:`encode` (``weights_only`` loading, tensors on CPU).

    Raises:
        ValueError: If ``blob`` is not such bytes.
    """
    if not isinstance(blob, (bytes, bytearray)):
        raise ValueError(f"the {KFAC_KEY!r} entry must be bytes, got {type(blob).__name__}")
    try:
        part = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"the {KFAC_KEY!r} entry does not load: {err}") from None
    if not isinstance(part, dict) or "preconditioner" not in part:
        raise ValueError(f"the {KFAC_KEY!r} entry holds no preconditioner state")
    return part


def pack(inner: dict[str, Any], preconditioner: dict[str, Any], skipped: int) -> dict[str, Any]:
    """The wrapper's state dict: ``inner``'s, with the K-FAC part in its first group."""
    groups = [dict(group) for group in inner["param_groups"]]
    groups[0][KFAC_KEY] = encode({"preconditioner": preconditioner, "skipped_steps": skipped})
    return {"state": inner["state"], "param_groups": groups}


def unpack(state_dict: Any) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """``(inner state dict, preconditioner state, skipped steps)`` of a wrapper's state dict.

    The inner state dict is a copy without the K-FAC entry (its tensors are shared).

    Raises:
        ValueError: If ``state_dict`` is not a state dict of a :class:`~dkfac.KFACOptimizer`.
    """
    if not isinstance(state_dict, dict):
        raise ValueError(f"a KFACOptimizer state dict is a dict, got {type(state_dict).__name__}")
    if {"inner", "preconditioner"} <= set(state_dict):  # the layout before the standard one
        return (
            state_dict["inner"],
            state_dict["preconditioner"],
            state_dict.get("skipped_steps", 0),
        )
    groups = state_dict.get("param_groups")
    if "state" not in state_dict or not isinstance(groups, list) or not groups:
        raise ValueError(
            "not a KFACOptimizer state dict (needs 'state' and 'param_groups', the first group "
            f"holding {KFAC_KEY!r})"
        )
    if not all(isinstance(group, dict) for group in groups) or KFAC_KEY not in groups[0]:
        raise ValueError(
            f"not a KFACOptimizer state dict: its first parameter group holds no {KFAC_KEY!r}"
        )
    part = decode(groups[0][KFAC_KEY])
    inner_groups = [{k: v for k, v in group.items() if k != KFAC_KEY} for group in groups]
    inner = {"state": state_dict["state"], "param_groups": inner_groups}
    return inner, part["preconditioner"], part.get("skipped_steps", 0)


def initialises_state(param_groups: list[dict[str, Any]]) -> bool:
    """Whether a ``step()`` cannot move any weight: every learning rate is 0 and every
    gradient is zero (or absent).

    ``torch.distributed.checkpoint``'s ``get_state_dict``/``set_state_dict`` run such a step
    to create a stateless optimizer's state; the wrapper then leaves K-FAC's state (step
    counter, running factors, moments) as it is. The gradients are read only when every
    learning rate is 0.
    """
    if any(float(group.get("lr", 0.0)) != 0.0 for group in param_groups):
        return False
    grads = [p.grad for group in param_groups for p in group["params"] if p.grad is not None]
    return all(not bool(g.any()) for g in grads)


def replace_preconditioner(state_dict: dict[str, Any], preconditioner: dict[str, Any]) -> None:
    """Puts ``preconditioner`` in place of the preconditioner state of ``state_dict`` (a
    wrapper's state dict of either layout), in place.

    Raises:
        ValueError: If ``state_dict`` is not a state dict of a :class:`~dkfac.KFACOptimizer`.
    """
    _, _, skipped = unpack(state_dict)
    if "preconditioner" in state_dict:
        state_dict["preconditioner"] = preconditioner
    else:
        first = state_dict["param_groups"][0]
        first[KFAC_KEY] = encode({"preconditioner": preconditioner, "skipped_steps": skipped})
