"""Red team, bad input (issue 20, class 2): one message and exit 2, never a traceback.

Each case is a real ``dkfac train`` call in this process. Every one of them ended in a
traceback and exit 1 (or, for ``--seed -1`` on digits, deep inside scikit-learn) before
the command line checked it; the expected message names the flag and what is allowed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.reliability.cli_runs import SHORT, last_line, run_cli


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
        (["--seed", str(2**40)], "--seed must be in [0, 4294967295]"),
        (["--skip-layers", "("], "--skip-layers '(' is not a regular expression: missing )"),
        (["--image-size", "0"], "--image-size must be in [1, 4096] (pixels), got 0"),
        (["--image-size", "-3"], "--image-size must be in [1, 4096] (pixels), got -3"),
        (["--in-channels", "0"], "--in-channels must be in [1, 4096], got 0"),
        (["--num-classes", "100000000000"], "--num-classes must be in [2, 100000]"),
        (["--num-classes", "1"], "--num-classes must be in [2, 100000]"),
        (["--synthetic-samples", "0"], "--synthetic-samples must be in [1, 1000000000]"),
        (["--device", "bogus"], "--device must be auto, cpu, cuda or cuda:N, got 'bogus'"),
        (["--device", "mps"], "--device must be auto, cpu, cuda or cuda:N, got 'mps'"),
        (["--warmup-epochs", "nan"], "--warmup-epochs must be finite and >= 0, got nan"),
        (["--threads", "0"], "--threads must be in [1, 4096], got 0"),
        (["--dist-timeout", "inf"], "--dist-timeout must be finite and in (0, 604800]"),
    ],
)
def test_bad_value_is_one_message_and_exit_2(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["train", *SHORT, *extra, "--out", str(tmp_path / "run")], capsys)
    assert code == 2, err
    assert message in last_line(err), err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["train", *SHORT, "--device", "cuda", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "--device cuda: no CUDA device is available here" in last_line(err)


def test_too_small_for_the_model_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1x1 images pass the flag's domain but not the CNN's (the engine's ValueError).
    code, err = run_cli(["train", *SHORT, "--image-size", "1", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert (
        last_line(err) == "dkfac train: error: --model cnn: SmallCNN needs image_size >= 2, got 1"
    )


def test_synthetic_data_beyond_memory_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 125 million 8x8 images: 30 GiB, refused before anything is allocated.
    argv = ["train", *SHORT, "--num-classes", "100000", "--synthetic-samples", "100000000"]
    code, err = run_cli([*argv, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "would take 29.8 GiB, more than half of this machine's memory" in last_line(err)


def test_binary_config_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "random.toml"
    config.write_bytes(bytes(range(256)) * 4)
    code, err = run_cli(["train", "--config", str(config)], capsys)
    assert code == 2
    assert f"config file {config} is not valid TOML: 'utf-8' codec can't decode" in last_line(err)


def test_out_that_is_a_file_or_under_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    code, err = run_cli(["train", *SHORT, "--out", str(afile)], capsys)
    assert (code, last_line(err)) == (
        2,
        f"dkfac train: error: --out {afile} is a file, not a folder",
    )
    code, err = run_cli(["train", *SHORT, "--out", str(afile / "run")], capsys)
    assert code == 2
    assert last_line(err) == (
        f"dkfac train: error: --out {afile / 'run'}: cannot create the run folder (Not a directory)"
    )
    assert afile.read_text() == "not a folder"


@pytest.mark.parametrize("out", ["/proc", "/proc/dkfac-run"])
def test_out_that_cannot_be_written(out: str, capsys: pytest.CaptureFixture[str]) -> None:
    # /proc refuses new files even to root (a chmod-ed folder would not stop root).
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux /proc")
    code, err = run_cli(["train", *SHORT, "--out", out], capsys)
    assert code == 2
    assert last_line(err).startswith(f"dkfac train: error: --out {out}: cannot ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Each was taken without a word: runs/<time> for an empty --out, the empty name
        # dropped from the list; /dev/null was said not to exist.
        (["train", *SHORT, "--out", ""], "--out is empty: give a path (or leave it out)"),
        (["train", *SHORT, "--resume", ""], "--resume is empty: give a path"),
        (["train", *SHORT, "--data", "cifar10", "--data-dir", ""], "--data-dir is empty"),
        (["compare", *SHORT, "--optimizers", "sgd,,adam"], "got 'sgd,,adam'"),
        (
            ["train", *SHORT, "--model", "gpt", "--data", "text", "--text-path", "/dev/null"],
            "--text-path /dev/null is neither a regular file nor a folder",
        ),
    ],
)
def test_empty_or_special_paths_and_names_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(argv, capsys)
    assert code == 2, err
    assert message in last_line(err), err
