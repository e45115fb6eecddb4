"""Shared fixtures: deterministic, single-threaded torch for reproducible oracles."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dkfac.solvers import precision


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Sets whether the CPU counts as multiplying bf16 natively (``"auto"`` precisions and
    the polar factor's follow it), so a test takes either branch on any machine."""

    def set_native(native: bool) -> None:
        monkeypatch.setitem(precision._FAST, "cpu", native)

    return set_native
