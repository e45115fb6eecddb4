"""``dkfac bench soak``: the soak benchmark is reachable through the bench dispatcher."""

from __future__ import annotations

import pytest

from dkfac.bench import SUBCOMMANDS
from dkfac.bench import main as bench_main


def test_soak_is_listed_in_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert SUBCOMMANDS["soak"][0] == "dkfac.bench.soak"
    assert bench_main(["--help"]) == 0
    assert "  soak " in capsys.readouterr().out


def test_bench_soak_dispatches_to_the_soak_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["soak", "--steps", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dkfac bench soak")
    assert "error: --steps must be >= 1, got 0" in err
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["soak", "--help"])
    assert exit_info.value.code == 0
    assert "--checkpoint-every" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "nosuch"], "argument --strategy/--kfac-strategy: invalid choice: 'nosuch'"),
        (["--lr", "nan"], "--lr must be finite and in (0, 1e+38], got nan"),
        (["--damping=-1"], "invalid K-FAC option: damping must be in (0.0, inf), got -1.0"),
        (["--model", "nosuch"], "argument --model: unknown model 'nosuch'"),
        (["--world-size", "2", "--batch-size", "3"], "--batch-size 3 must be a multiple of"),
        # "--data cifar10 needs --data-dir", a flag soak does not have
        (["--data", "cifar10"], "argument --data: invalid choice: 'cifar10' (choose from 'digits'"),
    ],
)
def test_soak_refuses_what_dkfac_train_refuses_before_any_rank_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each rank refused it on its own, and the spawn ended in a ProcessExitedException.
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["soak", *flags])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"dkfac bench soak: error: {message}"), last
