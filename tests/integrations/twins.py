"""What the integration tests compare twin runs by."""

from __future__ import annotations

from torch import nn


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between the two models' parameters, in order."""
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
