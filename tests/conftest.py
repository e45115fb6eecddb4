"""Shared fixtures: deterministic, single-threaded torch for reproducible oracles."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
