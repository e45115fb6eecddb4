"""``dkfac bench fsdp-step`` on two gloo ranks with small sizes: the record and its summary
(medians over seeds of the interleaved step times, the ratio to AdamW per seed, bytes and
memory per rank, the profiled phases), and its refusals."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from dkfac.bench import SUBCOMMANDS, fsdp_step


def test_two_ranks_two_seeds_record_ratios_bytes_memory_and_phases(tmp_path: Path) -> None:
    assert SUBCOMMANDS["fsdp-step"][0] == "dkfac.bench.fsdp_step"
    out = tmp_path / "step.json"
    argv = ["--worlds", "2", "--seeds", "2", "--steps", "4", "--warmup", "1"]
    argv += ["--intervals", "1,2", "2,4", "--profile", "2", "--timeout", "300", "--out", str(out)]
    assert fsdp_step.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"] == "dkfac bench fsdp-step " + " ".join(argv)
    assert payload["settings"]["intervals"] == [[1, 2], [2, 4]]
    world = payload["worlds"]["2"]
    summary, ranks = world["summary"], world["per_rank"]
    assert list(summary) == ["adamw", "kfac@1,2", "kfac@2,4"] and len(ranks) == 2
    for key, s in summary.items():
        seeds = [ranks[0][seed][key]["step_seconds"] for seed in ("0", "1")]
        adamw = [ranks[0][seed]["adamw"]["step_seconds"] for seed in ("0", "1")]
        assert s["step_ms"] == pytest.approx(1e3 * statistics.median(seeds))
        assert s["ratios"] == pytest.approx([a / b for a, b in zip(seeds, adamw, strict=True)])
        # the slowest rank's time, agreed: both ranks record the same
        assert ranks[1]["0"][key]["step_seconds"] == ranks[0]["0"][key]["step_seconds"]
        assert 0 < s["optimizer_ms"] < s["step_ms"]
        assert s["param_shard_bytes"] > 0
    assert summary["adamw"]["ratio_to_adamw"] == 1.0
    assert summary["adamw"]["optimizer_state_bytes"] == 2 * summary["adamw"]["param_shard_bytes"]
    for key in ("kfac@1,2", "kfac@2,4"):
        assert summary[key]["ledger_bytes_per_step"]["gradients"] > 0
        assert sum(summary[key]["kfac_memory"].values()) > 0
    fsdp = world["fsdp_bytes_per_step"]
    assert fsdp["param_all_gather"] == 2 * fsdp["grad_reduce_scatter"] > 0
    phases = ranks[0]["0"]["profile"]
    assert {"bench.forward_backward", "bench.optimizer_step", "dkfac.precondition"} <= set(phases)


@pytest.mark.parametrize(
    ("bad", "word"),
    [
        (["--worlds", "1"], "--worlds"),
        (["--seeds", "0"], "--seeds"),
        (["--threads", "0"], "--threads"),
        (["--intervals", "10,5"], "--intervals"),
        (["--intervals", "x"], "--intervals"),
        (["--profile", "-1"], "--profile"),
        (["--strategy", "spngd"], "--strategy"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    bad: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        fsdp_step.main([*bad, "--out", "x.json"])
    assert info.value.code == 2
    assert word in capsys.readouterr().err.splitlines()[-1]
