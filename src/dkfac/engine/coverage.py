"""Which parameters K-FAC preconditions, which it leaves to the inner optimizer, and why.

:func:`~dkfac.engine.registration.register` records, while it walks the model, why each
module's own parameters get no block (``skip_layers``, a type without a block, a block
that declines, a frozen weight). :class:`Coverage` turns that into ``describe()``'s rows:
each layer lists the parameters (and rows of them) it preconditions, and every other
trainable parameter gets a row ``block="inner optimizer"`` with its reason.

**Tied weights.** A tensor used by several registered modules (GPT-2's token embedding
and output head share one) is preconditioned once: the *last* of those modules in model
order keeps its block; the earlier ones are not registered, and a warning names the
parameter and the decision. The gradient of a tied tensor is the sum over its uses; the
last user of a tied embedding is the output head, whose factors see the dense gradient of
every logit (an embedding's A only counts the tokens present, and would scale the head's
update of rare tokens' rows by ``1/frequency``).

**The warning.** Parameters with two or more dimensions that are left out by no choice of
the user (a type without a block, a declined layer, a parameter no block holds) are named
in one warning at registration, with their share of the model's trainable parameters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from dkfac.blocks.base import Block
from dkfac.blocks.ties import overlap, resolve_ties

__all__ = ["USER_CHOICES", "Coverage", "LeftOut", "Registration"]

logger = logging.getLogger(__name__)

USER_CHOICES = frozenset({"unitwise_bn=False", "no affine parameters"})
"""Reasons blocks decline with that follow from the user's own settings."""

MAX_NAMED = 20
"""Parameters named in the coverage warning (the rest are counted)."""


@dataclass(frozen=True)
class LeftOut:
    """A trainable parameter the inner optimizer updates, given its plain gradient (or
    Adam's direction on it: ``leftover_update``, :mod:`~dkfac.engine.leftover`).

    Attributes:
        name: The parameter's qualified name.
        reason: Why no block preconditions it.
        numel: Its number of elements.
        ndim: Its number of dimensions.
        chosen: Whether the user chose it (``skip_layers``, a frozen weight...).
    """

    name: str
    reason: str
    numel: int
    ndim: int
    chosen: bool

    def row(self) -> dict[str, Any]:
        """Its ``describe()`` row."""
        return {
            "name": self.name,
            "block": "inner optimizer",
            "reason": self.reason,
            "parameters": [self.name],
            "numel": self.numel,
        }


class Coverage:
    """What every trainable parameter of a model gets: a block, or the inner optimizer.

    Args:
        model: The bare model.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self._aliases.setdefault(id(param), []).append(name)
        self._reasons: dict[int, tuple[str, bool]] = {}
        self.layers: dict[str, list[str]] = {}
        self.numel: dict[str, int] = {}
        self.left_out: list[LeftOut] = []

    def leave(self, module: nn.Module, reason: str, chosen: bool) -> None:
        """Records why ``module``'s own parameters (not its children's) get no block."""
        for param in module.parameters(recurse=False):
            self._reasons.setdefault(id(param), (reason, chosen))

    def reasons(self) -> list[str]:
        """``"name (reason)"`` of each trainable parameter of two or more dimensions left
        out so far, in model order (what an error that no layer is left can name)."""
        return [
            f"{name} ({self._reasons[id(param)][0]})"
            for name, param in self.model.named_parameters()
            if param.requires_grad and param.dim() >= 2 and id(param) in self._reasons
        ]

    def resolve_ties(self, blocks: dict[str, Block]) -> dict[str, Block]:
        """The blocks with ties resolved (:func:`resolve_ties`); warns of each tie."""
        kept, dropped = resolve_ties(blocks)
        for name, keeper in dropped.items():
            block = blocks[name]
            shared = [
                " = ".join(self._labels(param, rows))
                for param, rows in block.parameter_parts()
                if any(overlap((param, rows), part) for part in kept[keeper].parameter_parts())
            ]
            logger.warning(
                "parameter %s is shared by %s and %s: K-FAC preconditions it once, with the "
                "factors of %s (the last user in model order); %s is not registered",
                ", ".join(shared),
                name,
                keeper,
                keeper,
                name,
            )
            self.leave(block.module, f"its weight is tied to {keeper}'s", chosen=False)
        return kept

    def _labels(self, param: Tensor, rows: slice | None) -> list[str]:
        """Every name of ``param`` (tied tensors have several), with the rows if a part."""
        suffix = "" if rows is None else f"[{rows.start}:{rows.stop}]"
        names = self._aliases.get(id(param), ["<not a parameter of the model>"])
        return [f"{name}{suffix}" for name in names]

    def finish(self, blocks: dict[str, Block]) -> None:
        """Lists each layer's parameters and every other one's reason; warns once of those
        left out by no choice of the user."""
        covered: set[int] = set()
        for name, block in blocks.items():
            parts = block.parameter_parts()
            self.layers[name] = [label for part in parts for label in self._labels(*part)]
            self.numel[name] = sum(
                (param if rows is None else param[rows]).numel() for param, rows in parts
            )
            covered.update(id(param) for param, _ in parts)
            for param, reason in block.left_out():  # the block's own word on the rest
                self._reasons.setdefault(id(param), (reason, False))
        for name, param in self.model.named_parameters():
            if not param.requires_grad or id(param) in covered:
                continue
            reason, chosen = self._reasons.get(
                id(param), ("held by a registered layer but not by its block", False)
            )
            self.left_out.append(LeftOut(name, reason, param.numel(), param.dim(), chosen))
        self._warn()

    def _warn(self) -> None:
        """One warning naming the left-out parameters of two or more dimensions not chosen."""
        unchosen = [p for p in self.left_out if p.ndim >= 2 and not p.chosen]
        if not unchosen:
            return
        total = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        share = sum(p.numel for p in unchosen) / max(total, 1)
        named = [f"{p.name} ({p.reason})" for p in unchosen[:MAX_NAMED]]
        more = len(unchosen) - len(named)
        logger.warning(
            "K-FAC leaves %d parameter(s) of two or more dimensions to the inner optimizer, "
            "%.1f%% of the model's trainable parameters: %s%s; see describe() or "
            "register_block()",
            len(unchosen),
            100.0 * share,
            "; ".join(named),
            f"; and {more} more" if more else "",
        )

    def table(self, layers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """``describe()``'s rows: the layers' rows, then those of the parameters left out.

        Args:
            layers: Layer name -> its row (summary and placement), in registration order.

        Returns:
            Every row with the same keys: a layer's gains ``parameters``, ``reason=None`` and
            ``numel`` (the elements it preconditions); a left-out parameter's row has
            ``None`` for the layer keys.
        """
        rows = [
            {**row, "parameters": self.layers[name], "reason": None, "numel": self.numel[name]}
            for name, row in layers.items()
        ]
        blank = dict.fromkeys(rows[0]) if rows else {}
        return rows + [{**blank, **p.row()} for p in self.left_out]


@dataclass
class Registration:
    """What :func:`~dkfac.engine.registration.register` found.

    Attributes:
        blocks: Layer name -> block, in module order.
        coverage: Each layer's parameters and every other parameter's reason.
    """

    blocks: dict[str, Block]
    coverage: Coverage
