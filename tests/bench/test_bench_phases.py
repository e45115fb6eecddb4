"""``dkfac bench phases``: the record the results page reads, each variant trained as a
hand-written loop on the same batches whatever ``--block``, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dkfac.bench import SUBCOMMANDS, lm, phases
from dkfac.bench.results_tables import lm_phases_table

RECIPE = "benchmarks/recipes/gpt-text.toml"
SIZES = ["--layers", "1", "--width", "16", "--heads", "2", "--seq-len", "16"]


@pytest.fixture(scope="module")
def task() -> lm.TextTask:
    args = lm.build_parser().parse_args([*SIZES, "--batch-size", "4"])
    return lm.load_task(args)


def test_the_record_has_every_phase_and_the_page_reads_it(tmp_path: Path) -> None:
    assert SUBCOMMANDS["phases"][0] == "dkfac.bench.phases"
    out = tmp_path / "phases.json"
    flags = [*SIZES, "--batch-size", "4", "--steps", "7", "--out", str(out)]
    assert phases.main([*flags, "muon", "adamw", RECIPE + '+{"orthogonal_steps": 4}']) == 0
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("dkfac bench phases --layers 1")
    assert payload["settings"]["steps"] == 7
    assert list(payload["phases"]) == ["muon", "adamw", RECIPE + '+{"orthogonal_steps": 4}']
    for entry in payload["phases"].values():
        parts = entry["fwd_ms"] + entry["bwd_ms"] + entry["opt_ms"]
        assert entry["total_ms"] == pytest.approx(parts)
        assert min(entry.values()) > 0 and entry["opt_median_ms"] > 0
    table = lm_phases_table("p.json", {"adamw": "AdamW"})({"p.json": payload})
    assert [row[0] for row in table.rows][:2] == ["muon", "AdamW"]


def test_each_variant_trains_on_the_same_batches_whatever_the_block(task: lm.TextTask) -> None:
    device = torch.device("cpu")
    variants = ("adamw", RECIPE)
    weights = []
    for block in (1, 3):
        runs = {v: phases.make(v, task, device) for v in variants}
        phases.time_phases(runs, task, 4, 7, block, device)
        weights.append(
            {v: [p.detach().clone() for p in m.parameters()] for v, (m, _) in runs.items()}
        )
    for variant in variants:
        for a, b in zip(weights[0][variant], weights[1][variant], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The adamw variant: torch's AdamW (lr 1e-3, its default decay 0.01), seed 0's batches.
    model, _ = phases.make("adamw", task, device)
    twin = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(7):
        index = torch.randint(len(task.x_train), (4,), generator=gen)
        twin.zero_grad()
        F.cross_entropy(
            model(task.x_train[index]).flatten(0, 1), task.y_train[index].flatten()
        ).backward()
        twin.step()
    for a, b in zip(model.parameters(), weights[0]["adamw"], strict=True):
        torch.testing.assert_close(a.detach(), b)


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--steps", "5", "adamw"], "--steps"),
        (["--block", "0", "adamw"], "--block"),
        (["--width", "15", "--heads", "2", "adamw"], "--width"),
        (["--out", "x.txt", "adamw"], "--out"),
        (["--device", "tpu", "adamw"], "--device"),
        (["adamw", "adamw"], "each variant once"),
        (["no-such-recipe.toml"], "a recipe file (RECIPE.toml[+{json}]); 'no-such-recipe.toml'"),
        ([RECIPE + "+[1]"], "JSON object"),
        ([RECIPE + '+{"bogus": 1}'], "kfac option: unknown option 'bogus'"),  # a traceback
        ([RECIPE + "+{bad"], "the text after '+' is not JSON (Expecting property name"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    bad: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        phases.main([*SIZES, "--batch-size", "4", *bad])
    assert info.value.code == 2
    assert word in capsys.readouterr().err.splitlines()[-1]
