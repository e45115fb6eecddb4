"""`dkfac bench lm-interleaved`, `dkfac bench paired` and `--muon-dtype float32`."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.optim._muon as torch_muon

from dkfac.bench import SUBCOMMANDS, interleave, lm, paired
from dkfac.bench.muon_precision import float32_newton_schulz
from dkfac.bench.sweep import check_peer_flags
from dkfac.solvers.polar import NS_COEFFICIENTS, newton_schulz

TINY = ["--layers", "1", "--width", "16", "--heads", "4", "--seq-len", "16"]


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("text")
    source = Path(lm.__file__).parent
    for name in ("lm.py", "sweep.py"):
        (folder / name).write_bytes((source / name).read_bytes())
    return folder


def test_the_commands_are_bench_subcommands() -> None:
    assert SUBCOMMANDS["lm-interleaved"][0] == "dkfac.bench.interleave"
    assert SUBCOMMANDS["paired"][0] == "dkfac.bench.paired"


def test_an_interleaved_run_charges_each_optimizer_its_own_steps(
    tmp_path: Path, text_folder: Path
) -> None:
    argv = [*TINY, "--text-path", str(text_folder), "--seconds", "0.3", "--seeds", "2"]
    argv += ["--no-sweep", "--eval-every", "5", "--eval-batches", "2", "--batch-size", "8"]
    argv += ["--optimizers", "adamw", "muon", "--adamw-lrs", "0.01", "--muon-lrs", "0.05"]
    argv += ["--name", "inter", "--out-dir", str(tmp_path)]
    assert interleave.main(argv) == 0
    payload = json.loads((tmp_path / "inter.json").read_text())
    assert payload["settings"]["interleaved"] is True
    assert payload["command"].startswith("dkfac bench lm-interleaved")
    for name in ("adamw", "muon"):
        runs = payload["runs"][name]
        assert [r["seed"] for r in runs] == [0, 1]
        for run in runs:
            # Each stops once its own training seconds reach the budget, not the wall clock.
            assert run["trace"][-1][1] >= 0.3 and run["trace"][-2][1] < 0.3
        finals = [r["final_loss"] for r in runs]
        assert payload["summary"][name]["median_final_loss"] == statistics.median(finals)


def test_interleaving_needs_no_sweep(text_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        interleave.main([*TINY, "--text-path", str(text_folder)])
    assert info.value.code == 2
    assert "pass --no-sweep" in capsys.readouterr().err.splitlines()[-1]


def _lm_file(path: Path, seconds: float, losses: dict[str, list[tuple[int, float]]]) -> str:
    runs = {
        name: [
            {"seed": seed, "final_loss": loss, "steps": 10, "trace": [[5, 1.0, loss + 1.0]]}
            for seed, loss in seeded
        ]
        for name, seeded in losses.items()
    }
    path.write_text(json.dumps({"settings": {"seconds": seconds}, "runs": runs}))
    return str(path)


def test_paired_differences_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _lm_file(tmp_path / "a.json", 60.0, {"k": [(1, 2.0), (2, 2.5)], "m": [(1, 2.1), (2, 2.4)]})
    b = _lm_file(tmp_path / "b.json", 60.0, {"k": [(2, 9.0), (3, 1.0)], "m": [(2, 9.0), (3, 1.3)]})
    other = _lm_file(tmp_path / "c.json", 30.0, {"k": [(4, 1.0)], "m": [(4, 5.0)]})
    out = tmp_path / "p.json"
    argv = ["--first", "k", "--second", "m", "--at-step", "5", "--seconds", "60"]
    assert paired.main([*argv, "--out", str(out), a, b, other]) == 0
    result = json.loads(out.read_text())
    diffs = [2.0 - 2.1, 2.5 - 2.4, 1.0 - 1.3]  # seed 2 from the first file only; c is 30 s
    assert [r["seed"] for r in result["pairs"]] == [1, 2, 3]
    final = result["final"]
    assert math.isclose(final["mean"], statistics.mean(diffs))
    assert math.isclose(final["standard_error"], statistics.stdev(diffs) / math.sqrt(3))
    assert final["below_zero"] == 2 and math.isclose(final["median"], statistics.median(diffs))
    assert result["at_step"]["pairs"] == 3 and "| 1 | 2.000 | 2.100 | -0.100 |" in (
        capsys.readouterr().out
    )


def test_paired_with_no_common_seed_exits_2(tmp_path: Path) -> None:
    a = _lm_file(tmp_path / "a.json", 60.0, {"k": [(1, 2.0)]})
    with pytest.raises(SystemExit) as info:
        paired.main(["--first", "k", "--second", "m", a])
    assert info.value.code == 2


def test_float32_muon_is_polar_newton_schulz_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.randn(6, 9, generator=torch.Generator().manual_seed(0))
    got = float32_newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7)
    torch.testing.assert_close(got, newton_schulz(g, 5, torch.float32), rtol=0, atol=0)
    with pytest.raises(ValueError, match="default coefficients"):
        float32_newton_schulz(g, (1.0, 0.0, 0.0), 5, 1e-7)
    # --muon-dtype float32 switches every torch Muon of the process (restored after the test).
    monkeypatch.setattr(
        torch_muon, "_zeropower_via_newtonschulz", torch_muon._zeropower_via_newtonschulz
    )
    parser = lm.build_parser()
    args = parser.parse_args([*TINY, "--muon-dtype", "float32"])
    check_peer_flags(parser, args, positive=(), default_kfac=lm.DEFAULT_KFAC)
    assert torch_muon._zeropower_via_newtonschulz is float32_newton_schulz


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "not a readable JSON result file ([Errno 2] No such file or directory"),
        (b"", "not a readable JSON result file (Expecting value: line 1 column 1"),
        (b"\xff\xfe", "not a readable JSON result file ('utf-8' codec can't decode"),
        (b"[1, 2]", "a result file holds a JSON object, got list"),
    ],
)
def test_paired_answers_a_file_that_is_no_result_in_one_line(
    content: bytes | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was a traceback (FileNotFoundError, JSONDecodeError, AttributeError on a list).
    path = tmp_path / "r.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as info:
        paired.main(["--first", "k", "--second", "m", str(path)])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"dkfac bench paired: error: {path}: {message}"), last


@pytest.mark.parametrize(
    ("runs", "argv", "message"),
    [
        ({"k": [{"seed": 1, "steps": 3}], "m": [{"seed": 1, "steps": 3}]}, [], "KeyError"),
        ({"k": 5, "m": 5}, [], "TypeError"),
        ({"k": [{"seed": "x"}], "m": [{"seed": 1}]}, [], "ValueError"),
        ({}, ["--second", "k"], "--first and --second must be two labels, got 'k' twice"),
        ({}, ["--at-step", "-1"], "--at-step must be >= 0, got -1"),
    ],
)
def test_paired_answers_runs_it_cannot_pair_in_one_line(
    runs: dict[str, Any],
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The first three were tracebacks (a run without final_loss, runs that are not lists).
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": runs}))
    with pytest.raises(SystemExit) as info:
        paired.main(["--first", "k", "--second", "m", *argv, str(path)])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dkfac bench paired: error: ") and message in last, last
    if not argv:
        assert "are not lists of runs with 'seed', 'final_loss' and 'steps'" in last
