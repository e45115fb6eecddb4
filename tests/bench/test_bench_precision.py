"""``dkfac bench precision``: the records and the choices they report (not the times)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dkfac.bench import precision as bench


def test_each_record_reports_the_engine_s_choices(
    tmp_path: Path, native_bf16: Callable[[bool], None]
) -> None:
    native_bf16(True)
    out = tmp_path / "polar.json"
    threads = torch.get_num_threads()  # main() times on one thread
    try:
        done = bench.main(
            ["--shape", "16x65", "64x257", "128x129", "--repeats", "1", "--out", str(out)]
        )
    finally:
        torch.set_num_threads(threads)
    assert done == 0
    payload = json.loads(out.read_text())
    assert payload["bfloat16_native"] is True and "dkfac bench precision" in payload["command"]
    got = {tuple(r["shape"]): (r["polar_chosen"], r["rotation_chosen"]) for r in payload["records"]}
    # the iteration by its smaller side (128 and up: bf16), the rotation by g·a·max(g, a)
    assert got == {
        (16, 65): ("float32", "float32"),
        (64, 257): ("float32", "bfloat16"),
        (128, 129): ("bfloat16", "bfloat16"),
    }
    for record in payload["records"]:
        assert record["polar_regret"] >= 1.0 and record["rotation_regret"] >= 1.0
        assert ("float32 gram" in record["polar_seconds"]) == (record["shape"] == [64, 257])


def test_without_native_bf16_float32_is_chosen(native_bf16: Callable[[bool], None]) -> None:
    native_bf16(False)
    record = bench.measure((130, 140), repeats=1)
    assert record["polar_chosen"] == record["rotation_chosen"] == "float32"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shape", "0x3"], "a shape's sizes must be >= 1, got '0x3'"),
        (["--shape", "12"], "a shape is ROWSxCOLUMNS"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--out", "x.txt"], "--out must name a .json file"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:  # a traceback would be another exception
        bench.main(args)
    assert err.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in last and last.startswith("dkfac bench precision: error:"), last


def test_a_bad_argument_through_the_real_program() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dkfac", "bench", "precision", "--shape", "12"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "a shape is ROWSxCOLUMNS" in done.stderr
    assert "Traceback" not in done.stderr
