"""The configuration by concern: groups, flat keywords, one source of names, domains."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dkfac.config import (
    GROUPS,
    METHODS,
    STRATEGY_CHOICES,
    DistributionConfig,
    EstimationConfig,
    KFACConfig,
    RefreshConfig,
    SolverConfig,
)
from dkfac.distributed.strategies import STRATEGIES
from dkfac.solvers import METHODS as SOLVER_METHODS


def _names(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}


def test_every_field_belongs_to_exactly_one_group() -> None:
    groups = [_names(g) for g in GROUPS]
    assert sum(len(g) for g in groups) == len(_names(KFACConfig))
    assert set().union(*groups) == _names(KFACConfig)


def test_flat_keywords_and_groups_build_the_same_config() -> None:
    flat = KFACConfig(method="cholesky", damping=0.01, strategy="kaisa", fisher="mc", seed=3)
    grouped = KFACConfig.from_groups(
        SolverConfig(method="cholesky", damping=0.01),
        DistributionConfig(strategy="kaisa"),
        fisher="mc",
        seed=3,
    )
    assert flat == grouped
    assert flat.solver_config == SolverConfig(method="cholesky", damping=0.01)
    assert flat.distribution_config.strategy == "kaisa"
    assert flat.estimation_config.fisher == "mc"
    assert flat.refresh_config == RefreshConfig()


@pytest.mark.parametrize(
    ("groups", "fields", "message"),
    [
        ((SolverConfig(), SolverConfig()), {}, "one instance of each"),
        (("damping",), {}, "one instance of each"),
        ((SolverConfig(damping=0.1),), {"damping": 0.2}, "given both in a group and by name"),
    ],
)
def test_from_groups_refuses_what_is_ambiguous(
    groups: tuple[object, ...], fields: dict[str, object], message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        KFACConfig.from_groups(*groups, **fields)


def test_names_come_from_the_tables_of_their_axes() -> None:
    assert METHODS == SOLVER_METHODS
    assert (*STRATEGIES, "auto") == STRATEGY_CHOICES


@pytest.mark.parametrize(
    ("group", "field", "value", "error"),
    [
        (SolverConfig, "method", "newton", ValueError),
        (SolverConfig, "damping", math.inf, ValueError),
        (SolverConfig, "eigen_dtype", torch.float16, ValueError),
        (EstimationConfig, "seed", -1, ValueError),
        (EstimationConfig, "seed", 1.5, TypeError),
        (EstimationConfig, "seed", 2**63, ValueError),
        (EstimationConfig, "factor_batch_size", 0, ValueError),
        (EstimationConfig, "skip_layers", ["("], ValueError),
        (EstimationConfig, "unitwise_bn", 1, TypeError),
        (DistributionConfig, "grad_worker_fraction", math.nan, ValueError),
        (DistributionConfig, "pack_triangles", "yes", TypeError),
        (RefreshConfig, "refresh_threshold", math.inf, ValueError),
        (RefreshConfig, "refresh_max_interval", True, ValueError),
        (RefreshConfig, "factor_update_interval", 2.5, ValueError),
    ],
)
def test_a_group_checks_its_fields_alone_and_in_the_whole(
    group: type, field: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=field):
        group(**{field: value})
    with pytest.raises(error, match=field):
        KFACConfig(**{field: value})


@pytest.mark.parametrize("group", [*GROUPS, KFACConfig])
def test_numpy_numbers_are_read_as_the_python_numbers_they_hold(group: type) -> None:
    # np.float32(0.9), np.int64(4), np.bool_: "moment_beta1 must be a number, got float32",
    # "basis_max_dim must be None or an integer >= 1, got np.int64(4)".
    numpy = pytest.importorskip("numpy")
    python = {
        "damping": 0.25,
        "moment_beta1": 0.5,
        "basis_max_dim": 4,
        "flattened_inputs": {"fc": (2, 4)},
        "factor_decay": 0.75,
        "seed": 3,
        "unitwise_bn": False,
        "grad_worker_fraction": 0.5,
        "bucket_bytes": 1024,
        "factor_update_interval": 2,
        "refresh_threshold": 0.125,
        "refresh_max_interval": 8,
    }
    python = {k: v for k, v in python.items() if k in _names(group)}
    as_numpy = {
        k: {"fc": (numpy.int64(2), numpy.int32(4))}
        if k == "flattened_inputs"
        else numpy.bool_(v)
        if isinstance(v, bool)
        else numpy.int64(v)
        if isinstance(v, int)
        else numpy.float32(v)  # every value above holds in float32 exactly
        for k, v in python.items()
    }
    method = {"method": "eigen_adam"} if "moment_beta1" in python else {}
    got, want = group(**as_numpy, **method), group(**python, **method)
    assert got == want
    for name in python:
        assert type(getattr(got, name)) is type(getattr(want, name)), name
