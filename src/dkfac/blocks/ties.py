"""Tied and shared weights: a tensor used by several blocks is preconditioned once.

The rule (``docs/transformers.md``): of blocks whose parameters share elements, the last one
in model order keeps them (for a tied embedding and language-model head, the head). The
engine warns of each tie it resolves; the cost model applies the same rule.
"""

from __future__ import annotations

from dkfac.blocks.base import Block, ParameterPart

__all__ = ["overlap", "resolve_ties"]


def overlap(first: ParameterPart, second: ParameterPart) -> bool:
    """Whether two parameter parts share an element (same tensor, intersecting rows)."""
    (a, rows_a), (b, rows_b) = first, second
    if a is not b:
        return False
    if rows_a is None or rows_b is None:
        return True
    return max(rows_a.start, rows_b.start) < min(rows_a.stop, rows_b.stop)


def resolve_ties(blocks: dict[str, Block]) -> tuple[dict[str, Block], dict[str, str]]:
    """Keeps, of blocks sharing part of a parameter, the last one in model order.

    Returns:
        The kept blocks (in order) and ``dropped name -> keeper name``.
    """
    kept: list[Block] = []
    dropped: dict[str, str] = {}
    for block in reversed(list(blocks.values())):
        keeper = next(
            (
                other
                for other in kept
                if any(
                    overlap(mine, theirs)
                    for mine in block.parameter_parts()
                    for theirs in other.parameter_parts()
                )
            ),
            None,
        )
        if keeper is None:
            kept.append(block)
        else:
            dropped[block.name] = keeper.name
    return {block.name: block for block in reversed(kept)}, dropped
