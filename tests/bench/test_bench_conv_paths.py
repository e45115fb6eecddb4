"""``dkfac bench conv-paths``: every path's factor against the im2col rows' product, the
record's fields, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dkfac.bench import SUBCOMMANDS, conv_paths
from dkfac.blocks.conv_factor import conv_input_factor_sum


def _im2col_factor(x: torch.Tensor, kernel: int, pad: int) -> torch.Tensor:
    """``Σ_{n,t} ā ā^T`` from the unfolded rows with a ones column appended (by hand)."""
    rows = F.unfold(x, kernel, padding=pad).transpose(1, 2).reshape(-1, x.shape[1] * kernel**2)
    rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=x.dtype)], dim=1)
    return rows.T @ rows


@pytest.mark.parametrize("size,kernel,pad", [((2, 3, 5, 5), 3, 1), ((3, 2, 4, 6), 5, 2)])
def test_every_timed_path_builds_the_im2col_factor(size: tuple, kernel: int, pad: int) -> None:
    x = torch.randn(*size, dtype=torch.float64)
    expected = _im2col_factor(x, kernel, pad)
    for path in conv_paths.PATHS:
        factor, count = conv_input_factor_sum(
            x, (kernel, kernel), (1, 1), (1, 1), True, (pad,) * 4, path
        )
        assert count == size[0] * size[2] * size[3]
        torch.testing.assert_close(factor, expected, rtol=1e-12, atol=1e-12)


def test_the_command_records_each_path_and_the_paths_agree(tmp_path: Path) -> None:
    assert SUBCOMMANDS["conv-paths"][0] == "dkfac.bench.conv_paths"
    out = tmp_path / "paths.json"
    shapes = ["--shape", "2,3,5,5/3/1", "--shape", "2,2,4,4/3/0"]
    assert conv_paths.main([*shapes, "--repeats", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("dkfac bench conv-paths --shape")
    assert payload["machine"]["device"] == "cpu"
    records = payload["records"]
    assert [r["input"] for r in records] == [[2, 3, 5, 5], [2, 2, 4, 4]]
    for record in records:
        assert set(record["seconds"]) == set(conv_paths.PATHS) == set(record["operations"])
        assert record["auto"] in conv_paths.PATHS
        assert record["seconds"][record["fastest"]] == min(record["seconds"].values())
        assert record["regret"] == pytest.approx(
            record["seconds"][record["auto"]] / record["seconds"][record["fastest"]]
        )
        assert max(record["difference"].values()) < 1e-5  # float32, relative to the largest
        assert all(n > 0 for n in record["operations"].values())
    summary = payload["summary"]["given"]
    assert summary["worst_regret"] == max(r["regret"] for r in records) >= 1.0
    assert summary["fastest_seconds"] <= summary["auto_seconds"]


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--shape", "2,3/3/1"], "--shape"),
        (["--shape", "2,3,2,2/5/0"], "--shape"),
        (["--repeats", "0"], "--repeats"),
        (["--out", "x.txt"], "--out"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    bad: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        conv_paths.main(bad)
    assert info.value.code == 2
    assert word in capsys.readouterr().err.splitlines()[-1]
