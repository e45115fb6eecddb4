"""``flattened_inputs``: a linear layer that reads a flattened map gets the structured basis.

The model of tests/strategy_cases.py has ``Conv2d(2→3)`` on 4×4 images, flattened into
``Linear(48→6)`` (module ``"3"``): a 3 × 16 map. Oracles: the layer's basis is
:func:`~dkfac.solvers.kron_basis.structured_basis` of its own running factor, and the update
is Adam on the gradient rotated into that basis; the rest of the model is unchanged. The
checkpoint round trip is a case of tests/engine/test_moments.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from dkfac import KFACConfig, KFACPreconditioner
from dkfac.app.cli import build_parser, parse_args
from dkfac.app.runconfig import config_file_tokens, kfac_config_from_args, resolved_config
from dkfac.engine.registration import check_given_maps
from dkfac.solvers.kron_basis import structured_basis
from tests.oracles import weight_grad_matrix
from tests.strategy_cases import global_batch, make_model

MAP = {"3": (3, 16)}
OPTIONS: dict[str, Any] = {
    "method": "eigen_adam",
    "kl_clip": None,
    "factor_decay": 0.9,
    "inverse_update_interval": 1,
    "eigen_dtype": torch.float64,
    "basis_refresh": "power",
    "flattened_inputs": MAP,
}


def test_the_layer_basis_is_the_structured_one_and_the_update_adam_in_it() -> None:
    model = make_model()
    pre = KFACPreconditioner(model, **OPTIONS)
    reference = KFACPreconditioner(make_model(), **{**OPTIONS, "flattened_inputs": {}})
    reference.remove_hooks()
    b1, b2, eps = 0.9, 0.95, 1e-8
    m = v = torch.zeros(())
    old: tuple[Tensor, Tensor] | None = None
    for t in range(1, 4):
        x, y = global_batch(t, 1)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = weight_grad_matrix(pre.layers["3"].block.module).clone()
        pre.step()
        layer = pre.layers["3"]
        state = layer.solver_state
        assert state is not None
        _, qa = structured_basis(layer.running["A"], MAP["3"], torch.float64)[:2]
        torch.testing.assert_close(state["qa"], qa, rtol=0, atol=0)
        if old is not None:  # moment_carry="keep_v": m carried exactly, v kept
            m = state["qg"].T @ (old[0] @ m @ old[1].T) @ qa
        old = (state["qg"], qa)
        r = state["qg"].T @ raw @ qa
        m = b1 * m + (1 - b1) * r
        v = b2 * v + (1 - b2) * r * r
        scaled = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        torch.testing.assert_close(
            weight_grad_matrix(layer.block.module), state["qg"] @ scaled @ qa.T
        )
    # The other layers keep the dense basis, a power step from the previous one.
    dense = pre.layers["0"].solver_state
    assert dense is not None and dense["qa"].shape == (19, 19)
    labels = {row["name"]: row["method"] for row in pre.describe()}
    assert labels["3"] == "eigen_adam (A basis 3x16)" and labels["6"] == "eigen_adam"
    assert reference.describe()[1]["method"] == "eigen_adam"


@pytest.mark.parametrize(
    ("maps", "message"),
    [
        ({"7": (3, 16)}, "names '7', which is not a preconditioned layer; .* \\['3', '6'\\]"),
        ({"0": (2, 9)}, "names '0', which is Conv2dBlock"),
        ({"3": (4, 16)}, "= \\(4, 16\\) has 64 features, but the layer reads 48"),
    ],
)
def test_an_entry_that_does_not_fit_the_model_is_refused(
    maps: dict[str, tuple[int, int]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        KFACPreconditioner(make_model(), **{**OPTIONS, "flattened_inputs": maps})


def test_a_map_with_its_sides_swapped_against_the_graphs_is_refused() -> None:
    """Layer "3" reads the 3-channel map at 16 positions: (16, 3) has its 48 features but
    would pair each feature with the wrong channel and position."""
    with pytest.raises(ValueError, match=r"\(16, 3\) has its sides swapped: .* \(3, 16\)"):
        KFACPreconditioner(make_model(), **{**OPTIONS, "flattened_inputs": {"3": (16, 3)}})


def test_a_map_other_than_the_graphs_is_kept_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A factorisation the graph does not show may be the user's better knowledge of a
    reshape: it is used, and named."""
    with caplog.at_level(logging.WARNING, logger="dkfac.engine.registration"):
        pre = KFACPreconditioner(make_model(), **{**OPTIONS, "flattened_inputs": {"3": (6, 8)}})
    assert pre.config.flattened_inputs == {"3": (6, 8)}
    assert "map of 3 channels at 16 positions" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dkfac.engine.registration"):
        KFACPreconditioner(make_model(), **OPTIONS)  # the graph's own map: nothing said
    assert not caplog.text


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ({"3": (3, 0)}, ValueError, "two integers >= 1, got \\(3, 0\\)"),
        ({"3": (3,)}, ValueError, "two integers >= 1"),
        ({"": (3, 16)}, ValueError, "non-empty string"),
        (["3=3x16", "3=3x16"], ValueError, "given twice"),
        (["3:3x16"], ValueError, "strings 'NAME=CxP', got the entry '3:3x16'"),
        (5, TypeError, "got int"),
    ],
)
def test_config_refuses_malformed_input_maps(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        KFACConfig(method="eigen_adam", flattened_inputs=value)  # type: ignore[arg-type]


def test_config_reads_every_spelling_and_needs_a_moment_method() -> None:
    for value in ({"3": (3, 16)}, {"3": [3, 16]}, "3=3x16", ["3 = 3X16"], ("3=3x16",)):
        config = KFACConfig(method="ekfac", flattened_inputs=value)  # type: ignore[arg-type]
        assert config.flattened_inputs == {"3": (3, 16)}
    assert KFACConfig().flattened_inputs == {}
    with pytest.raises(ValueError, match="needs method 'eigen_adam' or 'ekfac'"):
        KFACConfig(method="eigen", flattened_inputs={"3": (3, 16)})


def test_the_command_line_flag_and_the_resolved_config_round_trip() -> None:
    flags = ["train", "--method", "eigen_adam", "--flattened-inputs", "3=3x16", "a.b=2x5"]
    args = parse_args(flags)
    config = kfac_config_from_args(args)
    assert config.flattened_inputs == {"3": (3, 16), "a.b": (2, 5)}
    values = resolved_config(args)
    assert values["flattened_inputs"] == ["3=3x16", "a.b=2x5"]
    _, subs = build_parser()
    tokens = config_file_tokens(values, subs["train"], "config.toml")
    assert kfac_config_from_args(parse_args(["train", *tokens])) == config
    assert kfac_config_from_args(parse_args(["train"])).flattened_inputs == {}


def test_a_bad_flag_value_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        kfac_config_from_args(
            parse_args(["train", "--method", "eigen_adam", "--flattened-inputs", "x"])
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "flattened_inputs" in err[-1] and "got the entry 'x'" in err[-1]


def test_a_one_channel_map_may_be_given_either_way(caplog: pytest.LogCaptureFixture) -> None:
    """``(1, 16)`` and ``(16, 1)`` both give the whole side one basis: neither is refused
    nor warned of; ``(16, 3)`` against the graph's ``(3, 16)`` is."""
    with caplog.at_level(logging.WARNING, logger="dkfac.engine.registration"):
        check_given_maps({"fc": (16, 1)}, {"fc": (1, 16)})
        check_given_maps({"fc": (1, 16)}, {"fc": (16, 1)})
        check_given_maps({"fc": (3, 16)}, {})  # the graph shows none: nothing to check
    assert not caplog.text
    with pytest.raises(ValueError, match="swapped"):
        check_given_maps({"fc": (16, 3)}, {"fc": (3, 16)})
