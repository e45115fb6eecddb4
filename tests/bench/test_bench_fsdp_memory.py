"""``dkfac bench fsdp-memory`` on two gloo ranks: the record the results page reads, and
its bytes against the model's (the shards add up to the model, ``mem-opt`` splits
``replicated``'s factors and inverses between the ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dkfac.app.gpt import GPT
from dkfac.bench import SUBCOMMANDS, fsdp_memory
from dkfac.bench.results_tables import fsdp_memory_table


def test_two_ranks_record_memory_bytes_and_time(tmp_path: Path) -> None:
    assert SUBCOMMANDS["fsdp-memory"][0] == "dkfac.bench.fsdp_memory"
    out = tmp_path / "fsdp.json"
    argv = ["--worlds", "2", "--steps", "2", "--timeout", "120", "--out", str(out)]
    assert fsdp_memory.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"] == "dkfac bench fsdp-memory " + " ".join(argv)
    ranks = payload["worlds"]["2"]
    assert len(ranks) == 2
    model = GPT(vocab_size=fsdp_memory.VOCAB, context=fsdp_memory.SEQ, **fsdp_memory.SIZES)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    adamw = [rank["adamw"] for rank in ranks]
    assert sum(r["param_shard_bytes"] for r in adamw) == total
    assert all(r["adam_state_bytes"] == 2 * r["param_shard_bytes"] for r in adamw)
    for intervals in ("1,10", "10,100"):
        replicated = [rank[f"kfac-replicated@{intervals}"] for rank in ranks]
        mem_opt = [rank[f"kfac-mem-opt@{intervals}"] for rank in ranks]
        assert replicated[0]["kfac_memory"] == replicated[1]["kfac_memory"]
        for kind in ("factors", "inverses"):
            assert (
                sum(r["kfac_memory"][kind] for r in mem_opt) == (replicated[0]["kfac_memory"][kind])
            )
            assert all(
                0 < r["kfac_memory"][kind] < replicated[0]["kfac_memory"][kind] for r in mem_opt
            )
        for run in replicated + mem_opt:
            assert run["step_seconds"] > 0 and sum(run["bytes_per_step"].values()) > 0
    table = fsdp_memory_table("f.json")({"f.json": payload})
    assert [row[:2] for row in table.rows] == [["2", "replicated"], ["2", "mem-opt"]]


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--worlds", "0"], "--worlds"),
        (["--steps", "0"], "--steps"),
        (["--timeout", "0"], "--timeout"),
        ([], "--out"),
        (["--out", "x.txt"], "--out"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    bad: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = bad if "--out" in bad or not bad else [*bad, "--out", "x.json"]
    with pytest.raises(SystemExit) as info:
        fsdp_memory.main(argv)
    assert info.value.code == 2
    assert word in capsys.readouterr().err.splitlines()[-1]
