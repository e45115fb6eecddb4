"""Cost model: byte and memory formulas against hand-derived counts, placement, planner CLI.

The tiny model used throughout has two layers (fp32, 4 bytes per element):

* ``fc1 = Linear(3, 5)`` with bias: a = 4, g = 5; LPT cost 4³ + 5³ = 189
* ``fc2 = Linear(5, 2)`` with bias: a = 6, g = 2; LPT cost 6³ + 2³ = 224

so LPT puts fc2 on rank 0 and fc1 on rank 1 (at 2 and at 4 ranks).

==================  =======================  =======================  =========
elements            fc1                      fc2                      total
==================  =======================  =======================  =========
factors (full)      16 + 25 = 41             36 + 4 = 40              81
factors (packed)    10 + 15 = 25             21 + 3 = 24              49
eigen state         16 + 4 + 25 + 5 = 50     36 + 6 + 4 + 2 = 48      98
cholesky state      41                       40                       81
gradient            20                       12                       32
==================  =======================  =======================  =========
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from dkfac.app.models import build_model
from dkfac.app.plan import main as plan_main
from dkfac.blocks.base import kronecker_cost
from dkfac.costmodel import (
    DeviceRates,
    KFACLayer,
    ModelSpec,
    candidate_strategies,
    element_counts,
    extract_layers,
    placement_for,
    predict,
    predict_ledger_bytes,
    predict_memory,
    recommend,
)
from dkfac.distributed.assignment import plan_placement


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


@pytest.fixture
def spec() -> ModelSpec:
    return extract_layers(tiny_model())


def kinds(gradients: int = 0, factors: int = 0, inverses: int = 0, pre: int = 0) -> dict:
    return {"gradients": gradients, "factors": factors, "inverses": inverses, "preconditioned": pre}


def test_extract_tiny_model(spec: ModelSpec) -> None:
    assert [(x.name, x.a_dim, x.g_dim, x.grad_numel) for x in spec.layers] == [
        ("0", 4, 5, 20),
        ("2", 6, 2, 12),
    ]
    assert spec.other_param_numel == 0
    assert spec.param_numel == sum(p.numel() for p in tiny_model().parameters())


def test_extract_conv_bn_and_grouped_conv() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=True),  # a = 27 + 1, T = 8·8 on a 10×10 input
        nn.BatchNorm2d(8),
        nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False),  # unit-wise: d = 4·9, g = 8
        nn.Conv2d(8, 4, 1, stride=2, bias=False),  # a = 8, T = 4·4
        nn.Flatten(),
        nn.Linear(64, 3, bias=False),
    )
    spec = extract_layers(model, (3, 10, 10))
    assert [(x.name, x.a_dim, x.g_dim, x.positions, x.kind) for x in spec.layers] == [
        ("0", 28, 8, 64, "conv2d"),
        ("1", 2, 8, 1, "batchnorm"),  # unit-wise: a = 2 (γ_c, β_c), g = C
        ("2", 36, 8, 64, "grouped_conv"),
        ("3", 8, 4, 16, "conv2d"),
        ("5", 64, 3, 1, "linear"),
    ]
    assert [x.unitwise for x in spec.layers] == [False, True, True, False, False]
    assert [(b.name, b.channels) for b in spec.bn_layers] == [("1", 8)]
    assert spec.other_param_numel == 0
    assert spec.forward_flops_per_sample == 2 * (64 * 28 * 8 + 64 * 36 * 8 + 16 * 8 * 4 + 64 * 3)
    grouped = spec.layers[2]
    assert grouped.placement_cost("compute") == 8 * 36**3
    assert grouped.placement_cost("memory") == 8 * 36**2
    counts = element_counts(grouped, "eigen", packed=True)
    assert counts == {
        "factors_sent": 8 * 36 * 36,
        "factors_stored": 8 * 36 * 36,
        "inverse": 8 * 36 * 36,
        "moments": 0,
        "grad": 8 * 36,
    }
    plain = extract_layers(model, unitwise_bn=False)  # BN then counts as other parameters
    assert [x.kind for x in plain.layers] == ["conv2d", "grouped_conv", "conv2d", "linear"]
    assert plain.other_param_numel == 2 * 8
    assert plain.param_numel == spec.param_numel


def test_a_grouped_conv_with_too_wide_units_counts_as_other_parameters() -> None:
    model = nn.Sequential(nn.Conv2d(64, 64, 3, groups=2), nn.Flatten(), nn.Linear(64, 3))
    spec = extract_layers(model, (64, 3, 3))  # d = 32·9 + 1 = 289 > MAX_UNIT_DIM
    assert [x.kind for x in spec.layers] == ["linear"]
    assert spec.other_param_numel == 64 * 32 * 9 + 64


def test_a_transposed_convolution_is_priced_by_its_input_positions() -> None:
    """Each of its 6·6 input vectors meets the unfolded ``C_out·k²`` weight once: the
    forward is ``2 · 36 · 8 · 64`` flops, not the 144 output positions' (stride² more)."""
    model = nn.Sequential(nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1), nn.Flatten())
    spec = extract_layers(model, (8, 6, 6))
    assert [(x.a_dim, x.g_dim, x.positions) for x in spec.layers] == [(8, 64, 36)]
    assert spec.forward_flops_per_sample == 2 * 36 * 8 * 64


def test_extract_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="model"):
        extract_layers("resnet")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        extract_layers(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError, match="input_shape"):
        extract_layers(tiny_model(), (0, 3))
    with pytest.raises(ValueError, match="a_dim"):
        KFACLayer(name="x", a_dim=0, g_dim=3)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("replicated", kinds(factors=81 * 4, inverses=98 * 4)),
        ("mem-opt", kinds(factors=81 * 4, pre=32 * 4)),
        ("dp", kinds(pre=32 * 4)),
        ("spngd", kinds(gradients=32 * 4, factors=49 * 4, pre=32 * 4)),
    ],
)
def test_ledger_bytes_two_ranks_by_hand(spec: ModelSpec, strategy: str, expected: dict) -> None:
    ledger = predict_ledger_bytes(spec, 2, strategy)
    assert ledger == {0: expected, 1: expected}


def test_ledger_bytes_kaisa_four_ranks_by_hand(spec: ModelSpec) -> None:
    # f = 1/2 at P = 4: grad-worker groups [0, 2] and [1, 3]; fc2 (owner 0) is broadcast in
    # group [0, 2] (48 elements), fc1 (owner 1) in [1, 3] (50 elements); receiver blocks of
    # 2 ranks get every preconditioned gradient (32 elements).
    ledger = predict_ledger_bytes(spec, 4, "kaisa", grad_worker_fraction=0.5)
    even = kinds(factors=324, inverses=48 * 4, pre=128)
    odd = kinds(factors=324, inverses=50 * 4, pre=128)
    assert ledger == {0: even, 1: odd, 2: even, 3: odd}
    cholesky = predict_ledger_bytes(spec, 4, "kaisa", grad_worker_fraction=0.5, method="cholesky")
    assert [cholesky[r]["inverses"] for r in range(4)] == [160, 164, 160, 164]


def test_ledger_bytes_step_kinds_and_single_rank(spec: ModelSpec) -> None:
    plain = predict_ledger_bytes(spec, 2, "replicated", factor_step=False, inverse_step=False)
    assert plain == {0: kinds(), 1: kinds()}
    no_inv = predict_ledger_bytes(spec, 2, "spngd", inverse_step=False)
    assert no_inv[0] == kinds(gradients=128, factors=196, pre=128)
    for strategy in ("replicated", "kaisa", "mem-opt", "dp", "spngd"):
        assert predict_ledger_bytes(spec, 1, strategy) == {0: kinds()}


def test_ledger_bytes_other_params_and_dtypes() -> None:
    from dkfac.costmodel import DtypeBytes

    model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    spec = extract_layers(model)
    assert spec.other_param_numel == 10
    ledger = predict_ledger_bytes(spec, 2, "spngd", dtypes=DtypeBytes(factor=2, grad=2))
    assert ledger[0] == kinds(gradients=(32 + 10) * 2, factors=49 * 2, pre=32 * 2)
    # A BatchNorm1d(5) is a unit-wise layer: statistic 5·2·2 (not packed), gradient 5·2.
    bn = extract_layers(nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2)))
    assert bn.other_param_numel == 0
    ledger = predict_ledger_bytes(bn, 2, "spngd", dtypes=DtypeBytes(factor=2, grad=2))
    assert ledger[0] == kinds(gradients=(32 + 10) * 2, factors=(49 + 20) * 2, pre=(32 + 10) * 2)


def test_placement_matches_assignment_module(spec: ModelSpec) -> None:
    for world in (1, 2, 3, 4, 7):
        place = placement_for(spec, world, "mem-opt")
        costs = {x.name: kronecker_cost(x.a_dim, x.g_dim) for x in spec.layers}
        expected = plan_placement(costs, world, 1.0 / world)
        assert place.owners == tuple(expected[x.name].inverse_owner for x in spec.layers)
    assert placement_for(spec, 2, "mem-opt").owners == (1, 0)


def test_memory_by_hand_and_sums(spec: ModelSpec) -> None:
    rep = predict_memory(spec, 2, "replicated")
    assert rep[0] == rep[1] == {"factors": 324, "inverses": 392, "moments": 0, "accumulators": 324}
    mem = predict_memory(spec, 2, "mem-opt")
    # rank 0 owns fc2, rank 1 owns fc1
    assert mem[0] == {"factors": 160, "inverses": 192, "moments": 0, "accumulators": 324}
    assert mem[1] == {"factors": 164, "inverses": 200, "moments": 0, "accumulators": 324}
    dp = predict_memory(spec, 2, "dp")
    assert [dp[r]["accumulators"] for r in range(2)] == [160, 164]
    # Owner-only strategies partition the state: per-rank sums equal the replicated totals.
    for strategy in ("mem-opt", "dp", "spngd"):
        for world in (2, 3, 5):
            m = predict_memory(spec, world, strategy)
            assert sum(m[r]["factors"] for r in m) == 324
            assert sum(m[r]["inverses"] for r in m) == 392
    kaisa = predict_memory(spec, 4, "kaisa", grad_worker_fraction=0.5)
    assert [kaisa[r]["inverses"] for r in range(4)] == [192, 200, 192, 200]


def test_time_phases_by_hand(spec: ModelSpec) -> None:
    rates = DeviceRates(
        matmul_flops=1e3, eigh_rate=10.0, cholesky_rate=20.0, bandwidth=1e3, latency=0.01
    )
    pred = predict(spec, 2, "replicated", batch_per_rank=3, rates=rates)
    ph = pred.phases
    # ring all-reduce of 324 bytes over 2 ranks: 2·(1/2)·324/1e3 + 1 bucket · 2·1 · 0.01
    assert ph["factor_comm"] == pytest.approx(0.324 + 0.02)
    # factor build on every rank: 2·B·T·(a²+g²) summed = 2·3·81 flops
    assert ph["factor_build"] == pytest.approx(2 * 3 * 81 / 1e3)
    # inverse: max over ranks of Σ (a³+g³)/rate: rank 0 owns fc2 (224), rank 1 fc1 (189)
    assert ph["inverse"] == pytest.approx(224 / 10.0)
    # precondition (eigen): 4·a·g·(a+g) for every layer on every rank: 720 + 384
    assert ph["precondition"] == pytest.approx((720 + 384) / 1e3)
    # eigen state broadcast in a group of 2: M/bw + ⌈log₂ 2⌉·α per layer, one group
    assert ph["inverse_comm"] == pytest.approx(392 / 1e3 + 2 * 0.01)
    assert ph["preconditioned_comm"] == 0.0
    assert ph["grad_comm"] == pytest.approx(128 / 1e3 + 0.02)
    assert pred.total_seconds == pytest.approx(sum(ph.values()))
    amortised = predict(
        spec, 2, "replicated", batch_per_rank=3, rates=rates, factor_interval=2, inverse_interval=4
    )
    assert amortised.phases["factor_comm"] == pytest.approx(ph["factor_comm"] / 2)
    assert amortised.phases["inverse"] == pytest.approx(ph["inverse"] / 4)
    assert amortised.ledger_bytes["inverses"] == pytest.approx(392 / 4)


def test_planner_scales_to_1024_ranks() -> None:
    spec = extract_layers(build_model("resnet20", in_channels=3, image_size=32, num_classes=10))
    choice, preds = recommend(spec, 1024, batch_per_rank=32)
    assert [p.label for p in preds] == [
        "replicated",
        "kaisa(f=0.5)",
        "kaisa(f=0.25)",
        "mem-opt",
        "dp",
        "spngd",
    ]
    assert choice.total_seconds == min(p.total_seconds for p in preds)
    grad_bytes = 4 * spec.kfac_param_numel
    dp = next(p for p in preds if p.strategy == "dp")
    assert dp.ledger_bytes == {
        "gradients": 0,
        "factors": 0,
        "inverses": 0,
        "preconditioned": grad_bytes,
    }
    assert len(predict_ledger_bytes(spec, 1024, "kaisa", grad_worker_fraction=0.25)) == 1024


def test_recommend_respects_memory_budget(spec: ModelSpec) -> None:
    _, preds = recommend(spec, 2, batch_per_rank=4)
    needs = {p.label: p.memory_max + p.model_state_bytes for p in preds}
    budget = needs["dp"]  # dp holds only its owned layers' factors: the smallest need
    assert budget == min(needs.values())
    choice, _ = recommend(spec, 2, batch_per_rank=4, memory_budget_bytes=budget)
    assert needs[choice.label] <= budget
    with pytest.raises(ValueError, match="no strategy fits"):
        recommend(spec, 2, batch_per_rank=4, memory_budget_bytes=budget - 1)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        recommend(spec, 2, batch_per_rank=4, memory_budget_bytes=0)


def test_candidates_skip_invalid_fractions() -> None:
    assert candidate_strategies(6, (0.5, 0.25)) == [
        ("replicated", 1.0),
        ("kaisa", 0.5),
        ("mem-opt", 1 / 6),
        ("dp", 1 / 6),
        ("spngd", 1 / 6),
    ]
    assert [s for s, _ in candidate_strategies(1)] == ["replicated", "mem-opt", "dp", "spngd"]


def test_predict_validates(spec: ModelSpec) -> None:
    with pytest.raises(ValueError, match="strategy"):
        predict_ledger_bytes(spec, 2, "nope")
    with pytest.raises(ValueError, match="method"):
        predict_ledger_bytes(spec, 2, "dp", method="qr")
    with pytest.raises(ValueError, match="world_size"):
        predict_ledger_bytes(spec, 0, "dp")
    with pytest.raises(ValueError, match="divisible"):
        predict_ledger_bytes(spec, 4, "kaisa", grad_worker_fraction=0.75)
    with pytest.raises(ValueError, match="batch_per_rank"):
        predict(spec, 2, "dp", batch_per_rank=0)
    with pytest.raises(ValueError, match="bandwidth"):
        DeviceRates(bandwidth=0.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "nope", "--world-size", "4"],
        ["--model", "cnn", "--world-size", "0"],
        ["--model", "cnn", "--world-size", "4", "--bandwidth-gbps", "-1"],
        ["--model", "cnn", "--world-size", "4", "--latency-us", "nan"],
        ["--model", "cnn"],
        ["--model", "cnn", "--world-size", "1", "--strategies", "kaisa"],
    ],
)
def test_plan_cli_bad_input_exits_2(argv: list[str]) -> None:
    assert plan_main(argv) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # A fraction past the world size's float precision: UnboundLocalError ('preds').
        (["--world-size", "99999999999999999"], "--world-size must be in (0, 1e+06]"),
        # A fraction of more than every rank was taken and silently planned for nothing.
        (["--world-size", "4", "--grad-worker-fraction", "3"], "must be in (0, 1], got 3"),
        # torch.device's own RuntimeError, a traceback.
        (["--world-size", "4", "--calibrate", "--device", "gpu0"], "--device must be auto"),
        # A 100000² image: a forward of 40 GB, the allocator's RuntimeError.
        (["--world-size", "4", "--image-size", "100000"], "--image-size must be in [1, 4096]"),
        (["--world-size", "4", "--num-classes", "1"], "--num-classes must be in [2, 100000]"),
        (["--world-size", "4", "--bandwidth-gbps", "inf"], "must be finite and > 0, got inf"),
        # One replica: dkfac train refuses it, plan planned it.
        (
            ["--world-size", "4", "--parallel", "hsdp", "--shard-size", "4"],
            "--shard-size 4 must divide them into 2 or more replicas of 2 or more ranks",
        ),
    ],
)
def test_plan_cli_answers_hostile_input_in_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plan_main(["--model", "cnn", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("dkfac plan: error:"), err


def test_the_shapes_come_from_a_forward_without_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The positions per sample are read from a forward on fake tensors (a 4096² VGG-16's
    real one took 13 GB); a forward that reads values takes a real one, with the same
    positions (oracle: the real forward of the same model)."""
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
    fake = extract_layers(model, (1, 8, 8))

    def reads_values(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() >= 0):  # data-dependent: a fake tensor has no value to branch on
            return original(self, x)
        raise AssertionError("unreachable")

    original = type(model).forward
    monkeypatch.setattr(type(model), "forward", reads_values)
    real = extract_layers(model, (1, 8, 8))
    assert [layer.positions for layer in fake.layers] == [layer.positions for layer in real.layers]
    assert [layer.positions for layer in real.layers] == [64, 64, 16, 1, 1]


def test_plan_cli_json_and_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--model", "cnn", "--world-size", "4", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    labels = [p["label"] for p in payload["predictions"]]
    assert labels == ["replicated", "kaisa(f=0.5)", "mem-opt", "dp", "spngd"]
    assert payload["recommended"] in labels
    argv = ["--model", "cnn", "--world-size", "4", "--json", "--strategies", "replicated", "spngd"]
    assert plan_main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [p["label"] for p in payload["predictions"]] == ["replicated", "spngd"]
    assert plan_main(["--model", "cnn", "--world-size", "4", "--memory-budget-gb", "1e-9"]) == 1
    out = capsys.readouterr()
    assert "no strategy fits" in out.err
    assert "replicated" in out.out


def test_calibrate_returns_positive_rates() -> None:
    from dkfac.costmodel import calibrate

    rates = calibrate("cpu", seconds=0.05, size=32)
    assert rates.matmul_flops > 0 and rates.eigh_rate > 0 and rates.cholesky_rate > 0
    assert torch.get_num_threads() >= 1


def test_a_depthwise_model_is_planned_with_its_unit_wise_layers_priced() -> None:
    """A MobileNet-like stack: every strategy predicted (finite), the depthwise layers'
    d × d factorisations in the inverse phase, their C·d² statistics in the factors sent."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.Conv2d(16, 16, 7, padding=3, groups=16),  # d = 49 + 1
        nn.Conv2d(16, 32, 1, bias=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    spec = extract_layers(model, (3, 16, 16))
    grouped = next(x for x in spec.layers if x.kind == "grouped_conv")
    assert (grouped.a_dim, grouped.g_dim, grouped.positions) == (50, 16, 256)
    choice, preds = recommend(spec, 4, batch_per_rank=32)
    for pred in preds:
        assert all(math.isfinite(v) and v >= 0 for v in pred.phases.values()), pred.label
    without = extract_layers(nn.Sequential(*list(model)[:2], *list(model)[3:]), (3, 16, 16))
    rates = dataclasses.replace(DeviceRates(), cholesky_rate=1e9)
    kw = {"batch_per_rank": 32, "rates": rates, "inverse_interval": 1, "factor_interval": 1}
    extra = (
        predict(spec, 1, "replicated", **kw).phases["inverse"]
        - predict(without, 1, "replicated", **kw).phases["inverse"]
    )
    assert extra == pytest.approx(16 * 50**3 / 1e9)
    assert choice.total_seconds == min(p.total_seconds for p in preds)
