"""Hostile input to ``dkfac bench`` and ``dkfac plan``, and K-FAC intervals ``dkfac train``
takes: each case ended in a traceback (from torch, scikit-learn or the cost model), in a
run that never ended, or in a traceback after the run, before its check; now one line on
stderr and exit 2 before anything runs (or, for valid input, a run that ends with 0).

Every call runs in this process (:func:`~tests.reliability.cli_runs.run_cli`); a benchmark
whose check would come too late has its run replaced by one that fails the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dkfac.bench import autoencoder, fsdp_step, lm, precision, step, tta
from tests.reliability.cli_runs import SHORT, last_line, run_cli

BIG = str(10**30)
GPT = ["--layers", "1", "--width", "8", "--heads", "1", "--seq-len", "8"]


def not_a_module() -> str:
    """A factory that loads and returns no ``nn.Module``."""
    return "not a model"


def _never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the benchmark ran: its input was not checked first")


@pytest.fixture(autouse=True)
def _no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks whose bad input ran forever, read a whole folder or failed only after
    the run: their run fails the test."""
    monkeypatch.setattr(tta, "run", _never)
    monkeypatch.setattr(autoencoder, "run", _never)
    monkeypatch.setattr(lm, "load_task", _never)
    monkeypatch.setattr(precision, "measure", _never)
    monkeypatch.setattr(step, "run", _never)
    monkeypatch.setattr(fsdp_step, "run_world", _never)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # torch.set_num_threads: "Overflow when unpacking long long" (every benchmark).
        (["step", "--threads", BIG], "--threads must be in [1, 4096], got " + BIG),
        (["tta", "--threads", "5000"], "--threads must be in [1, 4096], got 5000"),
        # The random batch or the model: a RuntimeError from torch's allocator or unpacking.
        (["step", "--model", "mlp", "--batch-size", BIG], "more than half of this machine's"),
        (["step", "--image-size", BIG], "--image-size must be in [1, 4096] (pixels), got"),
        (["dispatches", "--channels", "0"], "--channels must be in [1, 4096], got 0"),
        (["step", "--model", "gpt", "--seq-len", BIG], "--seq-len must be in [1, 1000000]"),
        (["lm", "--width", BIG], "--width must be in [1, 65536], got " + BIG),
        (["phases", "muon", "--layers", BIG], "--layers must be in [1, 1024]"),
        (["lm", "--text-bytes", BIG], "--text-bytes must be in [1, 1000000000000], got"),
        # Path("") read the current folder's Python files as the text.
        (["lm", "--text-path", ""], "--text-path is empty: give a path (or leave it out)"),
        # A factory that returns no module: ModelError's traceback from the run.
        (
            ["dispatches", "--model", f"{__name__}:not_a_module"],
            f"--model: model factory {__name__}:not_a_module returned str, not a torch.nn.Module",
        ),
        # Seeds: scikit-learn's InvalidParameterError; range() past C's ssize_t.
        (["tta", "--split-seed", BIG], "--split-seed must be in [0, 4294967295], got " + BIG),
        (["fsdp-step", "--first-seed", "-1", "--out", "x.json"], "--first-seed must be in [0,"),
        (
            ["shard-exchange", "--seeds", BIG, "--out", "x.json"],
            f"--seeds {BIG} from seed 0 run past seed 4294967295",
        ),
        (["tta", "--first-seed", "4294967295", "--seeds", "2"], "run past seed 4294967295"),
        # A batch larger than the training split: every epoch dropped it, no step ever came.
        (["tta", "--batch-size", "5000"], "--batch-size 5000 exceeds the 1437 training samples"),
        (["autoencoder", "--batch-size", "1500"], "exceeds the 1437 training samples of digits"),
        # NaN compared false with 0: a target never reached, taken without a word.
        (["autoencoder", "--target-loss", "nan"], "--target-loss must be finite and > 0, got nan"),
    ],
)
def test_bad_benchmark_input_is_one_line_and_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["bench", *argv], capsys)
    assert code == 2, err
    assert message in last_line(err), err
    assert last_line(err).startswith(f"dkfac bench {argv[0]}: error: ")
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["lm", "phases"])
def test_a_text_batch_larger_than_its_windows_is_one_line(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # torch.randint's "Overflow when unpacking long long" once the run had started.
    monkeypatch.undo()  # the text is loaded before the batch can be checked
    text = tmp_path / "text.txt"
    text.write_bytes(b"abcdefgh" * 200)
    path = ["--text-path", str(text), "--no-sweep"] if command == "lm" else ["muon"]
    code, err = run_cli(["bench", command, *path, *GPT, "--batch-size", BIG], capsys)
    assert code == 2, err
    assert f"--batch-size {BIG} exceeds the " in last_line(err), err
    assert "training windows of the text" in last_line(err)


def test_bench_step_refuses_a_factory_that_gives_no_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.undo()  # the model is built by the run
    argv = ["bench", "step", "--model", f"{__name__}:not_a_module", "--repeats", "1"]
    code, err = run_cli(argv, capsys)
    assert code == 2, err
    assert last_line(err) == (
        f"dkfac bench step: error: --model: model factory {__name__}:not_a_module returned "
        "str, not a torch.nn.Module"
    )


@pytest.mark.parametrize(
    "argv",
    [["precision", "--out", "/proc/dkfac.json"], ["step", "--out-dir", "/proc/dkfac"]],
    ids=["file", "folder"],
)
def test_an_output_where_no_file_can_be_made_is_refused_before_the_run(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # The result was written after the run: FileNotFoundError's traceback (/proc refuses
    # new files even to root, whom permissions would not stop).
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux /proc")
    code, err = run_cli(["bench", *argv], capsys)
    assert code == 2, err
    assert "is in a folder where no file can be made ('/proc': " in last_line(err), err


def test_plan_refuses_a_bandwidth_past_its_range(capsys: pytest.CaptureFixture[str]) -> None:
    # 1e308 Gbit/s is an infinite bytes a second: the cost model's ValueError, a traceback.
    argv = ["plan", "--model", "mlp", "--world-size", "2", "--bandwidth-gbps", "1e308"]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert "--bandwidth-gbps must be in (0, 1e+09], got 1e308" in last_line(err)


@pytest.mark.parametrize(
    ("flag", "what"), [("--world-size", "an integer"), ("--grad-worker-fraction", "a number")]
)
def test_plan_says_what_a_value_that_is_no_number_must_be(
    flag: str, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # It said "must be a int" (a float), and not what it got.
    code, err = run_cli(["plan", "--model", "mlp", "--world-size", "2", flag, "two"], capsys)
    assert code == 2
    assert last_line(err) == f"dkfac plan: error: argument {flag}: {flag} must be {what}, got 'two'"


def test_plan_prices_a_model_too_large_to_build_here(capsys: pytest.CaptureFixture[str]) -> None:
    # A 4096-channel 4096x4096 MLP input is a 2**36-wide layer: its weights (hundreds of
    # TB) were allocated to read their shapes, a RuntimeError from the allocator.
    argv = ["plan", "--model", "mlp", "--world-size", "2", "--in-channels", "4096"]
    code, err = run_cli([*argv, "--image-size", "4096", "--json"], capsys)
    assert (code, err) == (0, "")


@pytest.mark.parametrize(
    "kfac",
    [
        ["--factor-update-interval", "100"],  # longer than every basis interval the budget has
        ["--inverse-update-interval-schedule", "5@0,30@1"],  # a schedule, divided by
    ],
    ids=["long-factor-interval", "inverse-schedule"],
)
def test_train_takes_intervals_the_overhead_budget_cannot_choose(
    kfac: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Valid input, a traceback from the cost model at the first step of dkfac (for_model).
    code, err = run_cli(["train", *SHORT, *kfac, "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    assert (tmp_path / "run" / "metrics.jsonl").exists()
