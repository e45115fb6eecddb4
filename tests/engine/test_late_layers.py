"""The late-layer bookkeeping's saved form: what loads and what is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dkfac import KFACPreconditioner


def _pre() -> KFACPreconditioner:
    torch.manual_seed(0)
    return KFACPreconditioner(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))


def test_a_fresh_preconditioner_saves_every_layer_as_waiting() -> None:
    assert _pre().state_dict()["late_layers"] == ["0", "2"]


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        (["0", "5"], r"layers this model does not have: \['5'\]"),
        ("0", "must be a list of layer names"),
        ([0], "must be a list of layer names"),
    ],
)
def test_a_bad_entry_is_refused_before_anything_changes(saved: object, message: str) -> None:
    pre = _pre()
    state = pre.state_dict()
    state["late_layers"] = saved
    with pytest.raises(ValueError, match=message):
        pre.check_state_dict(state)
    with pytest.raises(ValueError, match=message):
        pre.load_state_dict(state)
    assert pre.late.waiting == {"0", "2"}


def test_a_checkpoint_without_the_entry_loads_with_no_layer_waiting() -> None:
    pre = _pre()
    state = pre.state_dict()
    del state["late_layers"]
    pre.load_state_dict(state)
    assert pre.late.waiting == set()


@pytest.mark.parametrize(
    ("missed", "message"),
    [
        (["5"], r"'late_layers_missed' names layers that are not waiting: \['5'\]"),
        ("0", "'late_layers_missed' must be a list of layer names"),
    ],
)
def test_a_bad_missed_entry_is_refused(missed: object, message: str) -> None:
    pre = _pre()
    state = pre.state_dict()
    assert state["late_layers_missed"] == []
    state["late_layers_missed"] = missed
    with pytest.raises(ValueError, match=message):
        pre.load_state_dict(state)
    assert pre.late.missed == set()
