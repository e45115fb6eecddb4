"""``dkfac bench shard-exchange`` on two gloo ranks: its record, the exact mode equal to the
serial runs (float64), the local mode a different run, and its arguments checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dkfac.bench import SUBCOMMANDS, shard_exchange


def test_two_ranks_record_exact_local_and_serial(tmp_path: Path) -> None:
    assert SUBCOMMANDS["shard-exchange"][0] == "dkfac.bench.shard_exchange"
    out = tmp_path / "shard.json"
    argv = ["--seeds", "1", "--digits-steps", "2", "--lm-steps", "2", "--eval-every", "1"]
    argv += ["--timeout", "600", "--out", str(out)]
    assert shard_exchange.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"] == "dkfac bench shard-exchange " + " ".join(argv)
    runs = payload["runs"]
    assert set(runs) == {
        f"{task}/{mode}/0" for task in ("digits", "lm") for mode in shard_exchange.MODES
    }
    assert all(len(runs[f"digits/{mode}/0"]) == 2 for mode in shard_exchange.MODES)
    assert all(len(runs[f"lm/{mode}/0"]) == 2 for mode in shard_exchange.MODES)
    # the owner exchange is the serial update: its losses are the serial ones to rounding
    for exact, serial in zip(runs["lm/exact/0"], runs["lm/serial/0"], strict=True):
        assert exact == pytest.approx(serial, rel=1e-9)
    assert runs["digits/exact/0"][0] == runs["digits/serial/0"][0]
    # the local mode drops the off-diagonal blocks of G: another run
    assert abs(runs["lm/local/0"][-1] - runs["lm/serial/0"][-1]) > 1e-6
    summary = payload["summary"]
    for mode in shard_exchange.MODES:
        assert summary[mode]["lm_final_loss"] == [runs[f"lm/{mode}/0"][-1]]
        assert len(summary[mode]["digits_steps_to_target"]) == 1


def test_steps_to_is_the_first_step_reaching_the_target() -> None:
    assert shard_exchange.steps_to([0.5, 0.97, 0.99], 0.97) == 2
    assert shard_exchange.steps_to([0.5, 0.9], 0.97) is None
    runs = {
        f"{task}/{mode}/{seed}": trace
        for mode in shard_exchange.MODES
        for seed, trace in ((0, [0.9, 0.98]), (1, [0.98, 0.99]), (2, [0.5, 0.6]))
        for task in ("digits", "lm")
    }
    summary = shard_exchange.summarise(runs, [0, 1], 0.97)
    assert summary["exact"]["digits_steps_to_target"] == [2, 1]
    assert summary["exact"]["digits_median_steps"] == 1.5
    assert summary["exact"]["lm_median_final_loss"] == pytest.approx(0.985)
    assert shard_exchange.summarise(runs, [0, 2], 0.97)["local"]["digits_median_steps"] is None


@pytest.mark.parametrize(
    ("bad", "word"),
    [
        (["--world", "1"], "--world must be >= 2"),
        (["--world", "3"], "--world must divide"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--target", "1.5"], "--target must be in"),
        (["--timeout", "nan"], "--timeout must be"),
        (["--out", "x.txt"], "must name a .json file"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    bad: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--out", "x.json", *bad]
    with pytest.raises(SystemExit) as exit_info:
        shard_exchange.main(argv)
    assert exit_info.value.code == 2
    assert word in capsys.readouterr().err
