"""Benchmark plumbing: time-to-target on scripted traces, the tta loop's clock, dispatch."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from dkfac.app.models import build_model
from dkfac.bench import autoencoder
from dkfac.bench import main as bench_main
from dkfac.bench.common import first_reaching, parse_options
from dkfac.bench.tta import OptimizerSpec, summarise, train_to_target


def test_first_reaching_accuracy_trace() -> None:
    trace = [(1, 0.5, 0.80), (2, 1.25, 0.96), (3, 2.0, 0.974), (4, 2.5, 0.975), (5, 3.0, 0.99)]
    assert first_reaching(trace, 0.975) == (4, 2.5)
    assert first_reaching(trace, 0.95) == (2, 1.25)
    assert first_reaching(trace, 0.995) is None
    assert first_reaching([], 0.5) is None


def test_first_reaching_loss_trace() -> None:
    trace = [(0, 0.0, 1.0), (5, 1.5, 0.30), (10, 3.0, 0.20), (15, 4.5, 0.25)]
    assert first_reaching(trace, 0.25, higher_is_better=False) == (10, 3.0)
    assert first_reaching(trace, 0.1, higher_is_better=False) is None


def test_summarise_counts_misses_as_infinite() -> None:
    runs = [
        {"reached": [10, 2.0], "steps": 10, "seconds": 2.0},
        {"reached": [14, 3.0], "steps": 14, "seconds": 3.0},
        {"reached": None, "steps": 20, "seconds": 5.0},
    ]
    s = summarise(runs)
    assert (s["median_seconds"], s["median_steps"], s["reached"]) == (3.0, 14, 2)
    assert s["seconds_per_step"] == pytest.approx(3 / 14)  # median of 0.2, 3/14, 0.25
    assert math.isinf(summarise(runs[2:])["median_seconds"])


def test_parse_options_reads_dtypes_by_name() -> None:
    options = parse_options("capture_dtype=bfloat16,factor_dtype=torch.float64,eigen_dtype=None")
    assert options == {
        "capture_dtype": torch.bfloat16,
        "factor_dtype": torch.float64,
        "eigen_dtype": None,
    }
    assert parse_options("rotation_dtype=auto") == {"rotation_dtype": "auto"}
    with pytest.raises(ValueError, match=r"unknown dtype.*'auto'"):
        parse_options("capture_dtype=bf16")


def test_write_result_names_dtypes_and_rejects_other_objects(tmp_path: Path) -> None:
    from dkfac.bench.common import write_result

    path = write_result("r", {"options": {"capture_dtype": torch.bfloat16}}, tmp_path, "cmd")
    assert json.loads(path.read_text())["options"] == {"capture_dtype": "torch.bfloat16"}
    with pytest.raises(TypeError, match="object is not JSON serializable"):
        write_result("bad", {"x": object()}, tmp_path, "cmd")


def test_time_ratios_are_undefined_when_sgd_missed_the_target() -> None:
    from dkfac.bench.tta import add_time_ratios

    summary = {"sgd": {"median_seconds": 4.0}, "kfac": {"median_seconds": 2.0}}
    add_time_ratios(summary)
    assert [e["time_vs_sgd"] for e in summary.values()] == [1.0, 0.5]
    assert [e["time_vs_fastest"] for e in summary.values()] == [2.0, 1.0]
    missed = {"sgd": {"median_seconds": math.inf}, "kfac": {"median_seconds": 2.0}}
    add_time_ratios(missed)
    assert [e["time_vs_sgd"] for e in missed.values()] == [None, None]
    assert [e["time_vs_fastest"] for e in missed.values()] == [math.inf, 1.0]
    nobody = {"muon": {"median_seconds": math.inf}}
    add_time_ratios(nobody)
    assert nobody["muon"]["time_vs_fastest"] is None and nobody["muon"]["time_vs_sgd"] is None


def test_parse_options() -> None:
    assert parse_options("method=eigen, damping=0.01,factor_update_interval=5,kl_clip=None") == {
        "method": "eigen",
        "damping": 0.01,
        "factor_update_interval": 5,
        "kl_clip": None,
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_options("damping")
    assert parse_options("moment_nesterov=True,moment_bias_correction=False") == {
        "moment_nesterov": True,
        "moment_bias_correction": False,
    }
    # The spellings of a recipe and of `dkfac train` flags are read the same way.
    assert parse_options("kl_clip=none,moment_nesterov=true,moment_bias_correction=FALSE") == {
        "kl_clip": None,
        "moment_nesterov": True,
        "moment_bias_correction": False,
    }


def test_train_to_target_times_only_training_steps() -> None:
    from dkfac.app.data import load_digits

    data = load_digits(seed=0)
    ticks = itertools.count()  # every clock() call advances one "second"
    result = train_to_target(
        OptimizerSpec("sgd", "sgd", [0.05]),
        0.05,
        0,
        data,
        batch_size=512,
        target=1.01,  # unreachable: runs to the step cap
        max_steps=3,
        max_seconds=100.0,
        clock=lambda: float(next(ticks)),
    )
    # one clock() before and one after each step: exactly 1 s per step, 3 steps, 2 epochs
    assert [t[:2] for t in result["trace"]] == [[1, 1.0], [2, 2.0], [3, 3.0]]
    assert result["reached"] is None and result["steps"] == 3
    assert all(0.0 <= t[2] <= 1.0 for t in result["trace"])
    hit = train_to_target(
        OptimizerSpec("sgd", "sgd", [0.05]),
        0.05,
        0,
        data,
        batch_size=512,
        target=0.0,
        max_steps=3,
        max_seconds=100.0,
        clock=lambda: float(next(ticks)),
    )
    assert hit["reached"] == [1, 1.0] and hit["steps"] == 1


def test_bench_dispatch_unknown_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["nope"]) == 2
    err = capsys.readouterr().err  # one line (it was followed by the whole usage)
    assert err.startswith("dkfac bench: error: unknown benchmark 'nope'; choose from step, ")
    assert err.count("\n") == 1
    assert bench_main([]) == 2
    assert bench_main(["--help"]) == 0
    assert "autoencoder" in capsys.readouterr().out


def test_autoencoder_kfac_with_mc_fisher_samples_targets() -> None:
    """fisher=mc needs sample_fisher() before backward on factor steps (step() raises if not)."""
    x = torch.rand(64, 1, 8, 8)
    spec = OptimizerSpec("kfac", "kfac", [0.1], {"fisher": "mc", "factor_update_interval": 1})
    run = autoencoder.train_for(
        spec, 0.1, 0, x, batch_size=32, seconds=1e-9, eval_every=1, momentum=0.0
    )
    assert run["steps"] == 1 and math.isfinite(run["final_loss"])


def test_autoencoder_rejects_bad_momentum() -> None:
    with pytest.raises(SystemExit):
        autoencoder.main(["--kfac-momentum", "1.5"])


def _tiny_step_run(tmp_path: Path, *flags: str) -> dict[str, Any]:
    """``bench step`` on a tiny CNN with ``flags``; its JSON payload."""
    from dkfac.bench import step

    argv = ["--model", "cnn", "--channels", "1", "--image-size", "8", "--batch-size", "8"]
    argv += ["--repeats", "1", "--device", "cpu", "--name", "tiny", "--out-dir", str(tmp_path)]
    assert step.main([*argv, *flags]) == 0
    payload: dict[str, Any] = json.loads((tmp_path / "tiny.json").read_text())
    return payload


def test_bench_step_adds_capture_dtype_variants_and_amortises_exactly(tmp_path: Path) -> None:
    payload = _tiny_step_run(tmp_path, "--capture-dtype", "bfloat16")
    configs = payload["summary"]["configs"]
    assert set(configs) == {"exact", "exact/bf16"}
    control = statistics.median(payload["times"]["sgd-control"])
    assert payload["summary"]["control_ratio"] == pytest.approx(
        control / payload["summary"]["sgd_seconds"]
    )
    for entry in configs.values():
        t = entry["kind_seconds"]
        for key, value in entry["amortised"].items():
            f, i = (int(n) for n in key.split(","))
            want = t["plain"] + (t["factor"] - t["plain"]) / f + (t["inverse"] - t["factor"]) / i
            assert value["seconds"] == pytest.approx(want)
            assert value["ratio_to_sgd"] == pytest.approx(want / payload["summary"]["sgd_seconds"])


def test_bench_step_takes_an_auto_capture_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--capture-dtype auto`` adds the variant rows the library's own ``"auto"`` decides
    (bf16 where native, else the default precision); another word, and float16, which the
    library refuses as a capture precision, are not among the flag's choices."""
    from dkfac.bench import step

    assert set(_tiny_step_run(tmp_path, "--capture-dtype", "auto")["summary"]["configs"]) == {
        "exact",
        "exact/auto",
    }
    for word in ("bf16", "float16"):
        with pytest.raises(SystemExit):
            step.main(["--capture-dtype", word])
        assert f"invalid choice: '{word}'" in capsys.readouterr().err


def test_step_summary_amortises_and_pools_the_plain_steps() -> None:
    from dkfac.bench.step import summarise

    times = {"sgd": [1.0, 1.2, 0.8], "sgd-control": [1.1, 1.3, 0.9]}
    kinds = {"a": (1.1, 3.0, 4.0), "b": (0.9, 2.0, 2.5), "c": (1.3, 1.5, 1.6)}
    for name, (plain, factor, inverse) in kinds.items():
        times |= {f"{name}/plain": [plain], f"{name}/factor": [factor]}
        times[f"{name}/inverse"] = [inverse]
    summary = summarise(times, list(kinds))
    assert summary["control_ratio"] == pytest.approx(1.1)
    assert summary["adamw_seconds"] is None
    assert summary["configs"]["a"]["amortised"]["1,1"]["ratio_to_adamw"] is None
    assert summary["pooled"] == {
        "plain_seconds": 1.1,
        "sgd_seconds": pytest.approx(1.05),
        "plain_seconds_by_layer_set": {"all": 1.1},
    }
    a = summary["configs"]["b"]["amortised"]["10,100"]
    extra = (2.0 - 0.9) / 10 + (2.5 - 2.0) / 100
    assert a["seconds"] == pytest.approx(0.9 + extra)
    assert a["ratio_to_sgd"] == pytest.approx((0.9 + extra) / 1.0)
    assert a["pooled_ratio_to_sgd"] == pytest.approx((1.1 + extra) / 1.05)
    assert a["breakdown"]["precondition"] == pytest.approx(-0.1)


def test_step_summary_pools_plain_steps_within_a_layer_set_only() -> None:
    from dkfac.bench.step import summarise

    times = {"sgd": [1.0], "sgd-control": [1.0]}
    plains = {"a": 1.1, "b": 1.3, "a/skip": 0.5, "b/skip": 0.7, "c/skip": 0.9}
    for name, plain in plains.items():
        times |= {f"{name}/plain": [plain], f"{name}/factor": [2.0], f"{name}/inverse": [3.0]}
    sets = {name: "skip" if name.endswith("skip") else "all" for name in plains}
    summary = summarise(times, list(plains), sets)
    by_set = summary["pooled"]["plain_seconds_by_layer_set"]
    assert by_set == {"all": pytest.approx(1.2), "skip": pytest.approx(0.7)}
    assert summary["pooled"]["plain_seconds"] == pytest.approx(1.2)  # the first configuration's set
    extra = (2.0 - 1.1) / 10 + (3.0 - 2.0) / 100
    a = summary["configs"]["a"]["amortised"]["10,100"]
    assert a["pooled_ratio_to_sgd"] == pytest.approx(1.2 + extra)
    skipped = summary["configs"]["a/skip"]
    extra = (2.0 - 0.5) / 10 + (3.0 - 2.0) / 100
    assert skipped["layer_set"] == "skip"
    assert skipped["amortised"]["10,100"]["pooled_ratio_to_sgd"] == pytest.approx(0.7 + extra)


def test_bench_step_adds_skip_layer_variants(tmp_path: Path) -> None:
    payload = _tiny_step_run(tmp_path, "--skip-layers", "Linear")
    configs = payload["summary"]["configs"]
    assert set(configs) == {"exact", "exact/skip Linear"}
    assert configs["exact/skip Linear"]["layer_set"] == "skip Linear"
    every = configs["exact"]["preconditioned_layers"]
    kept = configs["exact/skip Linear"]["preconditioned_layers"]
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
    linear = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linear and linear <= set(every)
    assert kept == [name for name in every if name not in linear]
    assert set(payload["summary"]["pooled"]["plain_seconds_by_layer_set"]) == {
        "all",
        "skip Linear",
    }


def test_bench_step_rejects_a_bad_skip_pattern() -> None:
    from dkfac.bench import step

    with pytest.raises(SystemExit):
        step.main(["--skip-layers", "Batch(Norm"])


@pytest.mark.parametrize(
    "flags", [["--repeats", "0"], ["--threads=-1"], ["--subsample-positions", "0"]]
)
def test_bench_step_refuses_a_count_below_one(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # --repeats 0 ended in "no median for empty data", --threads -1 in torch's own error.
    from dkfac.bench import step

    with pytest.raises(SystemExit) as exit_info:
        step.main(flags)
    assert exit_info.value.code == 2
    name = flags[0].partition("=")[0]
    want = "must be in [1, 4096], got" if name == "--threads" else "must be >= 1, got"
    assert f"error: {name} {want}" in capsys.readouterr().err


def test_bench_solvers_refuses_a_bad_device_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # torch.device's own RuntimeError, a traceback.
    from dkfac.bench import solvers

    with pytest.raises(SystemExit) as exit_info:
        solvers.main(["--device", "gpu0"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        last == "dkfac bench solvers: error: --device must be auto, cpu, cuda or cuda:N, got 'gpu0'"
    )


@pytest.mark.parametrize("bench", ["solvers", "suite"])
@pytest.mark.parametrize("threads", ["0", "-1", "5000"])
def test_bench_solvers_and_suite_refuse_threads_out_of_range_in_one_line(
    bench: str, threads: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The shared parser (BenchParser) answers before either bench reads its flags.
    from dkfac.bench import solvers, suite

    with pytest.raises(SystemExit) as exit_info:
        {"solvers": solvers, "suite": suite}[bench].main([f"--threads={threads}"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"dkfac bench {bench}: error: --threads must be in [1, 4096], got {threads}"


def test_step_summary_prices_every_cost_against_the_adamw_step() -> None:
    from dkfac.bench.step import summarise

    times = {"sgd": [1.0], "sgd-control": [1.0], "adamw": [1.5, 2.0, 2.5]}
    times |= {"a/plain": [1.2], "a/factor": [2.2], "a/inverse": [4.2]}
    summary = summarise(times, ["a"])
    assert summary["adamw_seconds"] == 2.0
    amortised = summary["configs"]["a"]["amortised"]
    assert amortised["1,1"]["ratio_to_adamw"] == pytest.approx(4.2 / 2.0)
    assert amortised["10,100"]["ratio_to_adamw"] == pytest.approx((1.2 + 0.1 + 0.02) / 2.0)


def test_bench_step_runs_any_method_with_extra_options(tmp_path: Path) -> None:
    payload = _tiny_step_run(
        tmp_path, "--method", "eigen_adam", "--options", "basis_refresh=power,moment_nesterov=True"
    )
    assert payload["settings"]["method"] == "eigen_adam"
    assert payload["settings"]["options"] == {"basis_refresh": "power", "moment_nesterov": True}
    assert len(payload["times"]["adamw"]) == len(payload["times"]["sgd"])
    entry = payload["summary"]["configs"]["exact"]["amortised"]["1,1"]
    assert entry["ratio_to_adamw"] == pytest.approx(
        entry["seconds"] / payload["summary"]["adamw_seconds"]
    )


@pytest.mark.parametrize("options", ["method=eigen", "inverse_update_interval=2", "damping"])
def test_bench_step_refuses_options_it_sets_itself(
    options: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from dkfac.bench import step

    with pytest.raises(SystemExit) as exit_info:
        step.main(["--options", options])
    assert exit_info.value.code == 2
    assert "--options" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("kl_clip=bogus", "kl_clip must be a number"),
        ("no_such_option=1", "--options: unknown option 'no_such_option'; every option: docs"),
        ("dampin=1", "unknown option 'dampin' (did you mean damping or bn_damping?)"),
    ],
)
def test_bench_step_answers_a_bad_option_value_in_one_line(
    options: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from dkfac.bench import step

    with pytest.raises(SystemExit) as exit_info:
        step.main(["--options", options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_phase_seconds_sums_every_event_of_a_label() -> None:
    """With the CUDA activity a label comes twice (the host's range, and the GPU's annotation
    with no host time): both count, in whichever order, and other keys are left out."""
    from types import SimpleNamespace

    from dkfac.bench import step

    def event(key: str, micros: float) -> SimpleNamespace:
        return SimpleNamespace(key=key, cpu_time_total=micros)

    for events in (
        [event("dkfac.precondition", 3000.0), event("dkfac.precondition", 0.0)],
        [event("dkfac.precondition", 0.0), event("dkfac.precondition", 3000.0)],
    ):
        others = [event("dkfac.kl_clip", 500.0), event("dkfac.capture_a", 250.0)]
        phases = step.phase_seconds([*events, *others, event("aten::mm", 9000.0)])
        assert phases["precondition"] == pytest.approx(0.0035)
        assert phases["capture A"] == pytest.approx(0.00025)
        assert phases["inverse"] == 0.0
        assert set(phases) == set(step.PHASE_LABELS)
