"""``dkfac bench dispatches``: the counter against operations counted by hand, the command's
kinds and its device forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dkfac.bench import dispatches
from dkfac.engine import launches


def test_the_counter_counts_each_operation_and_its_views() -> None:
    x = torch.ones(3)
    with dispatches.Dispatches() as counter:
        y = x + 1  # add
        y.view(3, 1)  # a view
        torch.mm(y.view(1, 3), y.view(3, 1))  # two views and mm
    assert counter.total == 5
    assert counter.views == 3


def _lines(payload: dict, kind: str) -> str:
    return " ".join(payload["counts"][kind]["top_dkfac_lines"])


def test_every_kind_is_counted_and_launch_bound_takes_the_multi_tensor_forms(
    tmp_path: Path,
) -> None:
    common = ["--model", "mlp", "--batch-size", "8", "--image-size", "8", "--channels", "1"]
    common += ["--top", "200", "--out-dir", str(tmp_path)]  # 8x8 grey: the 3073-wide eigh took 1 s
    assert dispatches.main([*common, "--name", "cpu"]) == 0
    assert dispatches.main([*common, "--name", "gpu", "--launch-bound"]) == 0
    assert launches.launch_bound(torch.device("cpu")) is False  # put back after the run
    cpu = json.loads((tmp_path / "cpu.json").read_text())
    gpu = json.loads((tmp_path / "gpu.json").read_text())
    assert cpu["command"].startswith("dkfac bench dispatches")
    for payload in (cpu, gpu):
        counts = payload["counts"]
        assert set(counts) == {"sgd", "adamw", "plain", "factor", "inverse"}
        assert counts["sgd"]["dispatches"] < counts["plain"]["dispatches"]
        assert counts["plain"]["dispatches"] < counts["factor"]["dispatches"]
        for entry in counts.values():
            assert entry["not_views"] == entry["dispatches"] - entry["views"]
    # The finiteness check: one sum a tensor on a CPU, one multi-tensor norm on a GPU, where
    # the guard's flags also stay on the device.
    assert "engine/finite.py" in _lines(cpu, "plain") and "_foreach_norm" not in _lines(
        cpu, "plain"
    )
    assert "_foreach_norm" in _lines(gpu, "plain")
    assert "device_checks.py" in _lines(gpu, "plain")
    assert "device_checks.py" not in _lines(cpu, "plain")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--threads", "0"], "--threads must be in [1, 4096], got 0"),
        (["--top", "-1"], "--top must be >= 0, got -1"),  # both flags were named for either
        (["--conv-path", "x"], "--conv-path"),
    ],
)
def test_bad_arguments_exit_2(
    bad: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        dispatches.main(bad)
    assert err.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--model", "nosuch"], "--model: unknown model 'nosuch'"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--device", "nosuch"], "--device must be auto, cpu, cuda or cuda:N, got 'nosuch'"),
        (["--model", "gpt", "--width", "7", "--heads", "2"], "--width (7) must be a multiple"),
    ],
)
def test_the_case_flags_are_checked_in_one_line(
    bad: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # bench step and bench dispatches share these flags; each was a traceback from the
    # model factory or torch (a batch of 0 ran and wrote its result).
    from dkfac.bench import step

    for main in (dispatches.main, step.main):
        with pytest.raises(SystemExit) as err:
            main(bad)
        assert err.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in last and last.startswith("dkfac bench "), last


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--options", "damping=-1"], "--options: damping must be in (0.0, inf), got -1"),
        (["--options", "bogus=1"], "--options: unknown option 'bogus'"),
        (["--options", "skip_layers=.*"], "--options: model has no layer K-FAC can"),
    ],
)
def test_options_the_preconditioner_refuses_are_one_line(
    bad: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # each was the preconditioner's traceback from inside the run (the last one only
    # once the model is built: every layer skipped)
    argv = ["--model", "mlp", "--batch-size", "4", *bad]
    with pytest.raises(SystemExit) as err:
        dispatches.main(argv)
    assert err.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in last and last.startswith("dkfac bench dispatches: error:"), last


def test_bench_step_says_in_one_line_that_its_skip_layers_left_no_layer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from dkfac.bench import step

    argv = ["--model", "mlp", "--batch-size", "4", "--repeats", "1", "--skip-layers", ".*"]
    with pytest.raises(SystemExit) as err:
        step.main([*argv, "--out-dir", str(tmp_path)])
    assert err.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--skip-layers: model has no layer K-FAC can precondition" in last, last
    assert not list(tmp_path.iterdir())  # nothing written
