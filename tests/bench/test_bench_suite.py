"""``dkfac bench suite``: its tasks, the float32 Muon, the summary against the best peer, the
command end to end at tiny sizes."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.optim._muon as torch_muon

from dkfac.bench import suite
from dkfac.bench.muon_float32 import MuonFloat32, float32_iteration
from dkfac.bench.peers import MuonWithAdamW, resolve_options
from dkfac.bench.suite_report import summarise_task
from dkfac.bench.suite_tasks import FAMILIES, load_task
from dkfac.solvers.polar import newton_schulz


@pytest.mark.parametrize("family", FAMILIES)
def test_each_task_builds_its_model_and_measures_its_metric(family: str) -> None:
    task = load_task(family, tiny=True)
    model = task.build()
    x, y = task.batches(torch.Generator().manual_seed(0))()
    assert len(x) == task.batch_size
    loss = task.loss(model(x), y)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    value = task.metric(model)
    assert (0.0 <= value <= 1.0) if task.higher_is_better else value > 0.0


def test_the_second_split_holds_out_other_data() -> None:
    for family in ("mlp", "gpt"):
        first, second = load_task(family, 0, tiny=True), load_task(family, 1, tiny=True)
        assert not torch.equal(first.x_test, second.x_test)
    text = load_task("gpt", 1, tiny=True)
    # split 1 holds out the text's first tenth: its first window is the stream's start
    assert torch.equal(text.x_test[0, 1:], text.y_test[0, :-1])


def test_bad_task_and_split_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown suite task"):
        load_task("rnn")
    with pytest.raises(ValueError, match="split must be 0 or 1"):
        load_task("mlp", 2)


def test_epochs_visit_every_sample_at_most_once() -> None:
    task = load_task("mlp", tiny=True)
    ids = torch.arange(len(task.x_train))
    numbered = type(task)(**{**task.__dict__, "x_train": ids, "y_train": ids})
    draw = numbered.batches(torch.Generator().manual_seed(0))
    per_epoch = len(ids) // task.batch_size
    epochs = [torch.cat([draw()[0] for _ in range(per_epoch)]) for _ in range(2)]
    for seen in epochs:  # each epoch: distinct samples, the leftover dropped
        assert len(torch.unique(seen)) == per_epoch * task.batch_size
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled


def _muon_pair() -> tuple[torch.nn.Sequential, torch.nn.Sequential]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Tanh(),
        torch.nn.Linear(12, 3),
    )  # fmt: skip
    return model, copy.deepcopy(model)


def _weight(model: torch.nn.Sequential, index: int) -> torch.Tensor:
    layer = model[index]
    assert isinstance(layer, torch.nn.Linear)
    return layer.weight


def test_float32_muon_is_muons_iteration_at_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    model, twin = _muon_pair()
    exact = copy.deepcopy(model)
    options = resolve_options("muon", {"adamw_lr": 0.01})
    shipped, float32 = MuonWithAdamW(model, 0.05, options), MuonFloat32(twin, 0.05, options)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    before = _weight(model, 2).detach().clone()
    for net in (model, twin, exact):
        torch.nn.functional.cross_entropy(net(x), y).backward()
    shipped.step()
    float32.step()
    update_a, update_b = _weight(model, 2) - before, _weight(twin, 2) - before
    assert torch.equal(_weight(model, 0), _weight(twin, 0))  # AdamW's part is the same code
    # the patch is undone after the step
    assert torch_muon._zeropower_via_newtonschulz.__name__ == "_zeropower_via_newtonschulz"
    with float32_iteration():
        assert torch_muon._zeropower_via_newtonschulz.__name__ == "float32_newton_schulz"
    # the oracle: Muon's iteration in float64 (the same coefficients and steps)
    monkeypatch.setattr(
        torch_muon,
        "_zeropower_via_newtonschulz",
        lambda g, coefficients, steps, eps: newton_schulz(g.double(), steps, torch.float64),
    )
    MuonWithAdamW(exact, 0.05, options).step()
    update_exact = _weight(exact, 2) - before
    assert torch.allclose(update_b, update_exact, atol=1e-6)
    # the shipped bf16 iteration is the same update only to bf16's rounding
    assert (update_a - update_exact).norm() < 0.3 * update_exact.norm()
    assert not torch.allclose(update_a, update_exact, atol=1e-6)


def _record(steps: dict[str, list[int | None]], seconds: dict[str, float]) -> dict:
    runs = {
        n: [{"reached": s, "seconds": 1.0, "final": 0.9} for s in ss] for n, ss in steps.items()
    }
    return {
        "chosen_lr": {n: 0.01 for n in steps},
        "runs": {"0": runs, "1": runs},
        "step_seconds": {n: [seconds[n], seconds[n] * 3, seconds[n]] for n in steps},
    }


def test_summary_picks_the_better_muon_and_the_best_peer() -> None:
    record = _record(
        {
            "dkfac": [10, 9, 11],
            "adamw": [30, 40, None],
            "muon": [20, 20, 21],
            "muon32": [20, 20, 21],
            "soap": [15, 15, 15],
        },
        {"dkfac": 0.02, "adamw": 0.01, "muon": 0.05, "muon32": 0.011, "soap": 0.03},
    )
    summary = summarise_task(record)
    table = summary["optimizers"]
    assert table["adamw"]["median_steps"] == 40  # None counts as inf, the median of 30 40 inf
    assert table["dkfac"]["step_seconds"] == 0.02  # the median block
    assert summary["muon_peer"] == "muon32"  # 20 x 0.011 against 20 x 0.05
    assert summary["best_peer"] == "muon32"  # 0.22 s against adamw 0.4, soap 0.45
    verdict = summary["verdict"]
    assert verdict["time_vs_best_peer"] == pytest.approx(10 * 0.02 / (20 * 0.011))
    assert verdict["fewest_peer_steps"] == 15
    assert verdict["steps_at_most_fewest_peer"] is True
    assert verdict["time_at_most_best_peer"] is True  # 0.2 against 0.22
    assert verdict["step_within_budget"] is False  # 2x AdamW's step
    assert "step_vs_adamw_cpu" not in table["dkfac"]  # no CPU clock recorded


def test_summary_reads_the_cpu_clock_beside_the_wall_clock() -> None:
    record = _record({"dkfac": [10, 9, 11], "adamw": [30, 40, 20]}, {"dkfac": 0.02, "adamw": 0.01})
    record["step_cpu_seconds"] = {"dkfac": [0.05, 0.012, 0.013], "adamw": [0.01, 0.011, 0.009]}
    table = summarise_task(record)["optimizers"]
    assert table["dkfac"]["step_cpu_seconds"] == 0.013  # the median block
    assert table["dkfac"]["step_vs_adamw_cpu"] == pytest.approx(1.3)
    assert table["dkfac"]["step_vs_adamw"] == pytest.approx(2.0)  # the wall clock's, unchanged


def test_summary_with_missed_targets_has_no_ratio() -> None:
    record = _record({"dkfac": [None, None, 5], "adamw": [3, 3, 3]}, {"dkfac": 1.0, "adamw": 1.0})
    summary = summarise_task(record)
    assert summary["optimizers"]["dkfac"]["time_vs_best_peer"] is None
    assert summary["verdict"]["time_at_most_best_peer"] is False


def test_train_to_target_stops_at_the_target() -> None:
    task = load_task("mlp", tiny=True)
    easy = type(task)(**{**task.__dict__, "target": 0.0})
    run = suite.train_to_target(easy, "adamw", 0.01, 0, 10)
    assert run["reached"] == 1 and run["steps"] == 1
    hard = type(task)(**{**task.__dict__, "target": 1.01})
    run = suite.train_to_target(hard, "dkfac", 0.01, 0, 3)
    assert run["reached"] is None and run["steps"] == 3 and len(run["trace"]) == 4


def test_every_timed_step_starts_from_the_common_initial_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = load_task("cnn", tiny=True)
    torch.manual_seed(0)
    initial = [p.detach().clone() for p in task.build().parameters()]
    starts: list[str] = []
    real_step = suite.train_step

    def step(task_: object, model: torch.nn.Module, opt: object, draw: object) -> None:
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), initial, strict=True))
        assert same, "a timed step began away from the initial weights"
        real_step(task_, model, opt, draw)
        assert not all(  # the step itself did move them
            torch.equal(p, q) for p, q in zip(model.parameters(), initial, strict=True)
        )
        starts.append(type(opt).__name__)

    monkeypatch.setattr(suite, "train_step", step)
    wall, cpu = suite.step_seconds(task, {"adamw": 0.01, "dkfac": 0.01}, blocks=3, steps=2)
    assert {name: len(times) for name, times in wall.items()} == {"adamw": 3, "dkfac": 3}
    assert {name: len(times) for name, times in cpu.items()} == {"adamw": 3, "dkfac": 3}
    assert all(t > 0 for times in [*wall.values(), *cpu.values()] for t in times)
    # one untimed round and three timed ones, two steps each, the optimizers alternated
    assert starts == (["AdamW"] * 2 + ["KFACOptimizer"] * 2) * 4


def test_the_command_writes_json_and_plots(tmp_path: Path) -> None:
    argv = ["--tiny", "--tasks", "mlp", "gpt", "--optimizers", "dkfac", "adamw", "--seeds", "1",
            "--max-steps", "2", "--timing-blocks", "1", "--timing-steps", "1",
            "--out-dir", str(tmp_path), "--plot-dir", str(tmp_path / "plots"),
            "--name", "s"]  # fmt: skip
    assert suite.main(argv) == 0  # the plot folder is made (before the runs)
    payload = json.loads((tmp_path / "s.json").read_text())
    assert payload["command"].startswith("dkfac bench suite")
    assert [t["task"] for t in payload["tasks"]] == ["mlp", "gpt"]
    for record in payload["tasks"]:
        assert set(record["runs"]) == {"0", "1"}
        assert len(record["sweep"]["dkfac"]) == len(suite.GRIDS["dkfac"])
        assert record["summary"]["best_peer"] == "adamw"
        # one timed block of one step, on both clocks (the untimed round left out)
        assert {n: len(v) for n, v in record["step_cpu_seconds"].items()} == {
            "dkfac": 1,
            "adamw": 1,
        }
        assert record["summary"]["optimizers"]["dkfac"]["step_vs_adamw_cpu"] > 0
        assert (tmp_path / "plots" / f"s_{record['task']}.png").stat().st_size > 0


def test_a_batch_size_is_every_tasks(tmp_path: Path) -> None:
    """``--batch-size`` replaces each task's batch on both splits: the runs draw it, and the
    record says it."""
    argv = ["--tiny", "--tasks", "mlp", "gpt", "--optimizers", "dkfac", "--seeds", "1",
            "--max-steps", "1", "--timing-blocks", "1", "--timing-steps", "1",
            "--batch-size", "24", "--out-dir", str(tmp_path), "--name", "b"]  # fmt: skip
    drawn: list[int] = []
    plain = suite.train_step

    def counting(task: Any, model: Any, optimizer: Any, batch: Any) -> float:
        def rows() -> Any:
            x, y = batch()
            drawn.append(len(x))
            return x, y

        return plain(task, model, optimizer, rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(suite, "train_step", counting)
        assert suite.main(argv) == 0
    payload = json.loads((tmp_path / "b.json").read_text())
    assert [t["batch_size"] for t in payload["tasks"]] == [24, 24]
    assert drawn and set(drawn) == {24}


@pytest.mark.parametrize(
    "argv",
    [
        ["--seeds", "0"],
        ["--max-steps", "-1"],
        ["--tasks", "rnn"],
        ["--threads", "0"],
        ["--dkfac-options", "overhead"],
        ["--tasks", "mlp", "--dkfac-options", "bogus=1"],  # for_model refuses these
        ["--tasks", "mlp", "--dkfac-options", "orthogonal_rms=none"],
        ["--tasks", "mlp", "--dkfac-options", "orthogonal_layers=^nothing$"],
    ],
)
def test_bad_flags_are_one_line_errors(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        suite.main(argv)
    assert exit_info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("batch", ["1", "1025"])
def test_a_batch_outside_its_range_is_named(batch: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        suite.main(["--batch-size", batch])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dkfac bench suite: error: --batch-size must be in [2, 1024], got {batch}"
    )


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("lr=5", "--dkfac-options lr: the learning rate is set by the suite's grid, not an option"),
        ("model=5", "--dkfac-options model: the model is set by each task, not an option"),
    ],
)
def test_an_option_the_suite_sets_itself_is_named(
    option: str, message: str, capsys: pytest.CaptureFixture
) -> None:
    # for_model's TypeError text: "got multiple values for keyword argument 'lr'".
    with pytest.raises(SystemExit) as exit_info:
        suite.main(["--tasks", "mlp", "--dkfac-options", option])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1] == f"dkfac bench suite: error: {message}"
    )


def test_a_name_too_long_for_its_plots_is_refused_before_the_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # <name>_autoencoder.png is 256 bytes: an OSError traceback after every run had ended.
    def no_run(*args: object) -> None:
        raise AssertionError("a run started")

    monkeypatch.setattr(suite, "run_task", no_run)
    argv = ["--tasks", "mlp", "autoencoder", "--name", "s" * 240, "--plot-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        suite.main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(
        "has a name of 256 bytes with its _autoencoder.png ending ('ssssssssssssssssssss...'); "
        "a file or folder name takes at most 255 (the autoencoder task's plot)"
    ), last
    assert list(tmp_path.iterdir()) == []


def test_dkfac_options_reach_for_model() -> None:
    task = load_task("mlp", tiny=True)
    chosen = suite.make_optimizer("dkfac", task.build(), 0.01, {"overhead": None, "damping": 0.5})
    pre = chosen.preconditioner  # type: ignore[attr-defined]
    assert pre.budget is None and pre.config.damping == 0.5
    default = suite.make_optimizer("dkfac", task.build(), 0.01)
    assert default.preconditioner.budget is not None  # type: ignore[attr-defined]
