"""``dkfac bench accumulation`` through the real ``transformers.Trainer``: AdamW and the
damped ``eigen`` method end where the unaccumulated run ends (to rounding), the labels of
the file are kept, and the refusals."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dkfac.bench import SUBCOMMANDS, accumulation


def test_accumulated_runs_end_where_the_large_batch_ends(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    assert SUBCOMMANDS["accumulation"][0] == "dkfac.bench.accumulation"
    out = tmp_path / "accumulation.json"
    out.write_text(json.dumps({"before": {"steps": 8, "max_weight_difference": {}}}))
    argv = ["--label", "now", "--steps", "2", "--variants", "adamw", "kfac_eigen"]
    before = logging.getLogger("dkfac").level
    assert accumulation.main([*argv, "--out", str(out)]) == 0
    assert logging.getLogger("dkfac").level == before  # the caller's logging is left alone
    payload = json.loads(out.read_text())
    assert list(payload) == ["before", "now"]
    entry = payload["now"]
    assert entry["command"].startswith("dkfac bench accumulation --label now")
    assert entry["steps"] == 2
    gaps = entry["max_weight_difference"]
    assert list(gaps) == ["adamw", "kfac_eigen"]
    assert gaps["adamw"] < 1e-5 and gaps["kfac_eigen"] < 1e-5
    assert accumulation.weight_gap({"method": "eigen"}, 2) == pytest.approx(gaps["kfac_eigen"])


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--label", "x", "--steps", "0"], "--steps"),
        (["--label", "x", "--variants", "sgd"], "--variants"),
        (["--out", "a.json"], "--label"),
        (["--label", "x", "--out", "a.txt"], "--out"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    bad: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = bad if "--out" in bad else [*bad, "--out", "a.json"]
    with pytest.raises(SystemExit) as info:
        accumulation.main(argv)
    assert info.value.code == 2
    assert word in capsys.readouterr().err.splitlines()[-1]


def test_an_out_file_that_is_not_a_label_map_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a.json"
    out.write_text("[1, 2]")
    with pytest.raises(SystemExit) as info:
        accumulation.main(["--label", "x", "--out", str(out)])
    assert info.value.code == 2
    assert "labels" in capsys.readouterr().err.splitlines()[-1]
