"""Which ``torch.fx`` nodes flatten a map from dimension 1 on (a linear layer's input).

:func:`~dkfac.engine.roles.flattened_conv_inputs` reads a convolution map's channels back
from the node a linear layer's input is flattened from; the spellings of that flatten a
model may use are recognised here: ``nn.Flatten()``, ``torch.flatten(x, 1)``,
``x.flatten(start_dim=1)``, and the reshapes to ``(rows, -1)`` written
``x.view(x.size(0), -1)``, ``x.reshape(x.shape[0], -1)`` or ``torch.reshape(x, (n, -1))``.
A reshape counts only when its rows are read off the same tensor: a batch size read from
another (a video's ``B`` of ``(B·T, C, H, W)`` frames) would group other features.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn

__all__ = ["flattened_source"]


def flattened_source(node: object, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The node whose output ``node`` flattens from dimension 1 on, if it is such a flatten:
    ``nn.Flatten()``, ``torch.flatten(x, 1)`` or ``x.flatten(1)`` (dimensions given by
    position or keyword), or ``x.view(n, -1)`` / ``x.reshape(n, -1)`` /
    ``torch.reshape(x, (n, -1))`` with ``n`` read off ``x`` itself (``x.size(0)``,
    ``x.shape[0]``: a batch size read elsewhere may not be ``x``'s rows)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module" and isinstance(modules.get(str(node.target)), nn.Flatten):
        flatten = modules[str(node.target)]
        assert isinstance(flatten, nn.Flatten)
        ok = flatten.start_dim == 1 and flatten.end_dim == -1
        return node.args[0] if ok and isinstance(node.args[0], fx.Node) else None
    source = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(source, fx.Node):
        return None
    return source if _flattens(node) or _reshapes_rows(node, source) else None


def _flattens(node: fx.Node) -> bool:
    """``node`` is ``torch.flatten`` or ``Tensor.flatten`` from dimension 1 to the last."""
    function = node.op == "call_function" and node.target is torch.flatten
    if not (function or (node.op == "call_method" and node.target == "flatten")):
        return False
    start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
    end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
    return bool(start == 1 and end == -1)


def _reshapes_rows(node: fx.Node, source: fx.Node) -> bool:
    """``node`` reshapes ``source`` to ``(source's rows, -1)``."""
    if node.op == "call_method" and node.target in ("view", "reshape"):
        shape: Any = node.args[1:] if len(node.args) > 2 else node.args[1:2]
        if len(shape) == 1:
            shape = shape[0]
    elif node.op == "call_function" and node.target is torch.reshape:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("shape")
    else:
        return False
    if not isinstance(shape, (tuple, list)) or len(shape) != 2 or shape[1] != -1:
        return False
    rows = shape[0]
    if not isinstance(rows, fx.Node):
        return False
    if rows.op == "call_method" and rows.target == "size":  # x.size(0), x.size(dim=0)
        return rows.args[0] is source and (rows.args[1:] == (0,) or rows.kwargs == {"dim": 0})
    if rows.op != "call_function" or rows.target is not operator.getitem or rows.args[1] != 0:
        return False
    held = rows.args[0]  # x.shape[0], x.size()[0]
    if not isinstance(held, fx.Node) or held.args[:1] != (source,):
        return False
    shape_of = held.op == "call_function" and held.target is getattr and held.args[1] == "shape"
    return shape_of or (held.op == "call_method" and held.target == "size" and len(held.args) == 1)
