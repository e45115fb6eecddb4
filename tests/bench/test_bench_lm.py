"""``dkfac bench lm``: the byte-level GPT against its peers (bench/lm.py)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dkfac.app.gpt import GPT
from dkfac.bench import SUBCOMMANDS, lm
from dkfac.bench.peers import OptimizerSpec, muon_split, unavailable_reason

HAS_HEAVYBALL = unavailable_reason("soap") is None
TINY = ["--layers", "1", "--width", "16", "--heads", "4", "--seq-len", "16"]
LM_RECIPE = """\
data = "text"
model = "gpt"
layers = 4
seq-len = 128
optimizer = "kfac-adam"
lr = 0.003
momentum = 0.9
weight-decay = 0.0
schedule = "constant"
loss-average = "positions"
damping = 3.0
factor-update-interval = 10
inverse-update-interval = 100
"""


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small folder of Python source: this package's own text modules."""
    folder = tmp_path_factory.mktemp("text")
    source = Path(lm.__file__).parent
    for name in ("lm.py", "sweep.py", "peers.py", "common.py"):
        (folder / name).write_bytes((source / name).read_bytes())
    return folder


def _args(text_folder: Path, *flags: str) -> Any:
    return lm.build_parser().parse_args([*TINY, "--text-path", str(text_folder), *flags])


def test_lm_is_a_bench_subcommand_with_equal_grids() -> None:
    assert SUBCOMMANDS["lm"][0] == "dkfac.bench.lm"
    assert len({len(lrs) for lrs in lm.GRIDS.values()}) == 1
    args = lm.build_parser().parse_args([])
    assert (args.layers, args.width, args.heads, args.seq_len) == (4, 128, 4, 128)
    assert (args.batch_size, args.text_bytes, args.eval_batches) == (32, 2_000_000, 8)
    assert args.optimizers == ["adamw", "muon", "soap", "kfac"]


def test_muon_gives_the_gpt_embeddings_and_head_to_adamw() -> None:
    for tied in (False, True):
        model = GPT(layers=2, width=16, heads=4, context=8, tie_weights=tied)
        split = muon_split(model)
        blocks = [f"blocks.{i}." for i in range(2)]
        matrices = ["attention.query", "attention.key", "attention.value", "attention.proj"]
        hidden = [f"{b}{m}.weight" for b in blocks for m in [*matrices, "mlp.0", "mlp.2"]]
        assert split.muon == hidden  # the first query projection too: the input is the embedding
        assert {"tokens.weight", "positions.weight", "norm.weight"} <= set(split.adamw)
        assert ("head.weight" in split.adamw) is not tied  # tied: the embedding, listed once
        names = [n for n, _ in model.named_parameters()]
        assert sorted(split.muon + split.adamw) == sorted(names)


def test_evenly_spaced_validation_windows() -> None:
    assert lm.evenly_spaced(10, 4).tolist() == [0, 3, 6, 9]
    assert lm.evenly_spaced(3, 8).tolist() == [0, 1, 2]
    assert lm.evenly_spaced(5, 1).tolist() == [0]


def test_load_task_keeps_a_fixed_validation_subset(text_folder: Path) -> None:
    args = _args(text_folder, "--batch-size", "4", "--eval-batches", "2")
    task = lm.load_task(args)
    again = lm.load_task(args)
    assert task.x_val.shape == (8, 16) and torch.equal(task.x_val, again.x_val)
    assert torch.equal(task.x_val[:, 1:], task.y_val[:, :-1])  # targets: the next bytes
    assert task.model_options == {"layers": 1, "width": 16, "heads": 4}


def test_validation_loss_is_the_token_mean_over_the_subset(text_folder: Path) -> None:
    task = lm.load_task(_args(text_folder, "--batch-size", "3", "--eval-batches", "1"))
    model = GPT(layers=1, width=16, heads=4, context=16)
    expected = F.cross_entropy(model(task.x_val).flatten(0, 1), task.y_val.flatten())
    # batches of 2 over 3 windows: the mean is per byte, not per batch
    assert lm.validation_loss(model, task, 2) == pytest.approx(expected.item(), rel=1e-6)


def _adamw_run(task: Any, *, seed: int, seconds: float, eval_every: int) -> dict[str, Any]:
    """``train_for`` of AdamW (lr 0.01, batch 4) on a clock that ticks 1 s per reading."""
    ticks = itertools.count()
    return lm.train_for(
        OptimizerSpec("adamw", "adamw", [0.01]),
        0.01,
        seed,
        task,
        batch_size=4,
        seconds=seconds,
        eval_every=eval_every,
        momentum=0.9,
        clock=lambda: float(next(ticks)),
    )


def test_train_for_times_only_training_steps(text_folder: Path) -> None:
    task = lm.load_task(_args(text_folder, "--batch-size", "4", "--eval-batches", "1"))
    result = _adamw_run(task, seed=0, seconds=3.0, eval_every=2)
    # one clock() before and one after each step: 1 s per step, evaluations outside it
    assert [t[:2] for t in result["trace"]] == [[0, 0.0], [2, 2.0], [3, 3.0]]
    assert result["steps"] == 3 and result["seconds"] == 3.0 and not result["diverged"]
    assert result["final_loss"] == result["trace"][-1][2]
    assert result["final_bits_per_byte"] == pytest.approx(result["final_loss"] / math.log(2))


def test_interleaved_steps_give_each_run_its_own_results(text_folder: Path) -> None:
    """Two runs stepped in turn (as ``dkfac bench lm-interleaved`` does) give each the
    trace ``train_for`` gives it alone: its own model, batches and clock."""
    task = lm.load_task(_args(text_folder, "--batch-size", "4", "--eval-batches", "1"))
    specs = [OptimizerSpec("adamw", "adamw", [0.01]), OptimizerSpec("sgd", "sgd", [0.1])]
    options: dict[str, Any] = {"batch_size": 4, "seconds": 3.0, "eval_every": 2}

    def clock() -> Any:
        ticks = itertools.count()
        return lambda: float(next(ticks))

    alone = [
        lm.train_for(spec, spec.lrs[0], 5, task, momentum=0.9, clock=clock(), **options)
        for spec in specs
    ]
    runs = [lm.start_run(s, s.lrs[0], 5, task, batch_size=4, momentum=0.9) for s in specs]
    clocks = [clock() for _ in runs]
    while live := [i for i, r in enumerate(runs) if r.elapsed < 3.0 and not r.diverged]:
        for i in live:
            lm.train_step(runs[i], task, clock=clocks[i], **options)
    assert [lm.run_record(r) for r in runs] == alone
    assert alone[0]["trace"][1][2] != alone[1]["trace"][1][2]  # two different optimizers


def test_summary_reads_losses_at_fractions_of_the_budget() -> None:
    runs = [
        {"trace": [[0, 0.0, 5.0], [10, 2.4, 4.0], [20, 5.0, 3.0], [30, 8.1, 2.0]],
         "final_loss": 2.0, "steps": 30, "seconds": 8.1, "diverged": False},
        {"trace": [[0, 0.0, 5.0], [10, 3.0, 3.5], [20, 6.0, 2.5], [25, 8.0, 2.2]],
         "final_loss": 2.2, "steps": 25, "seconds": 8.0, "diverged": False},
        {"trace": [[0, 0.0, 5.0], [5, 1.0, float("nan")]],
         "final_loss": math.inf, "steps": 5, "seconds": 1.0, "diverged": True},
    ]  # fmt: skip
    entry = lm.summarise(runs, 8.0)
    # the latest evaluation at or before 2, 4 and 6 s; the diverged run's nan counts as inf
    assert entry["median_loss_at_fraction"] == {"0.25": 5.0, "0.5": 4.0, "0.75": 3.0}
    assert entry["median_final_loss"] == 2.2 and entry["diverged"] == 1
    assert entry["median_final_bits_per_byte"] == pytest.approx(2.2 / math.log(2))
    assert entry["median_steps"] == 25
    summary = {"a": dict(entry), "b": {"median_final_loss": 2.0}}
    lm.add_gap_to_best(summary)
    assert summary["a"]["gap_to_best"] == pytest.approx(0.2) and summary["b"]["gap_to_best"] == 0.0


def test_tiny_lm_run_records_every_optimizer_and_each_learns(
    tmp_path: Path, text_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = tmp_path / "gpt-text.toml"
    recipe.write_text(LM_RECIPE)
    png = tmp_path / "lm.png"
    argv = [*TINY, "--text-path", str(text_folder), "--seconds", "0.4", "--seeds", "1"]
    argv += ["--no-sweep", "--eval-every", "5", "--eval-batches", "2", "--batch-size", "8"]
    argv += ["--adamw-lrs", "0.01", "--muon-lrs", "0.05", "--soap-lrs", "0.01"]
    argv += ["--kfac-lrs", "0.01", *(x for k in lm.DEFAULT_KFAC for x in ("--kfac", k))]
    argv += ["--recipe", str(recipe), "--name", "lm", "--out-dir", str(tmp_path)]
    assert lm.main([*argv, "--plot", str(png)]) == 0
    payload = json.loads((tmp_path / "lm.json").read_text())
    names = ["adamw", "muon", "soap", "kfac-adamw", "eigen-adam", "gpt-text"]
    ran = [n for n in names if HAS_HEAVYBALL or n != "soap"]
    assert payload["benchmark"] == "lm" and list(payload["runs"]) == ran
    assert list(payload["summary"]) == ran and payload["sweep"] == {n: [] for n in ran}
    assert payload["settings"]["text"]["validation_windows_used"] == 16
    specs = {s["name"]: s for s in payload["settings"]["specs"]}
    assert specs["gpt-text"]["options"]["inner"] == "adamw"
    assert specs["gpt-text"]["recipe"]["ignored"] == ["data", "layers", "model", "seq_len"]
    assert specs["muon"]["options"]["adamw_lr"] == lm.TASK_OPTIONS["muon"]["adamw_lr"]
    for name in ran:
        (run,) = payload["runs"][name]
        trace = run["trace"]
        assert trace[0][:2] == [0, 0.0] and trace[-1][0] == run["steps"] >= 1
        assert trace[-1][1] >= 0.4 and run["final_loss"] == trace[-1][2]
        assert run["final_loss"] < trace[0][2] - 0.01, (name, trace)  # it learned
        entry = payload["summary"][name]
        assert entry["median_final_loss"] == run["final_loss"]
        assert set(entry["median_loss_at_fraction"]) == {"0.25", "0.5", "0.75"}
    assert png.stat().st_size > 0
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in ran)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--width", "15"], "--width (15) must be a multiple of --heads (4)"),
        (["--eval-batches", "0"], "--eval-batches must be finite and > 0, got 0"),
        (["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
        (["--adamw-lrs", "0.1"], "same number of learning rates"),
        (["--kfac", "k:inner=adam"], "kfac option inner must be sgd or adamw, got 'adam'"),
        (["--kfac", "k:damping=-1"], "kfac option: damping"),
        (["--text-path", "/nonexistent/text"], "--text-path /nonexistent/text does not exist"),
        (["--text-path", "/tmp/" + "t" * 256], "has a name of 256 bytes"),  # was an OSError
        (["--seq-len", "100000"], "raise --text-bytes or use more text"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--device", "cuda:99"], "cuda:99"),
    ],
)
def test_lm_refuses_bad_flags_in_one_line(
    flags: list[str], message: str, text_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--text-path", str(text_folder), *flags]
    with pytest.raises(SystemExit) as exit_info:
        lm.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("dkfac bench lm: error:"), err[-1]


def test_lm_refuses_a_kfac_spec_that_leaves_the_gpt_no_layer(
    text_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The first run's KFACPreconditioner raised it: a ValueError traceback.
    def no_run(*args: Any) -> Any:
        raise AssertionError("a run started: the K-FAC spec was not checked on the model")

    monkeypatch.setattr(lm, "run", no_run)
    argv = ["--text-path", str(text_folder), *TINY, "--kfac", "k:skip_layers=.*"]
    with pytest.raises(SystemExit) as exit_info:
        lm.main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    want = "dkfac bench lm: error: --kfac k: model has no layer K-FAC can precondition"
    assert last.startswith(want), last


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_run_on_the_gpu_follows_the_same_run_on_the_cpu(text_folder: Path) -> None:
    """``--device cuda``: the same initialisation and batches as on the CPU, so the same
    losses to the GPU's rounding (TF32 off), the task and the model on the GPU."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    traces = {}
    try:
        for device in ("cpu", "cuda"):
            args = _args(text_folder, "--batch-size", "4", "--eval-batches", "1")
            task = lm.load_task(args, device)
            assert task.x_train.device.type == device
            result = _adamw_run(task, seed=3, seconds=4.0, eval_every=1)
            traces[device] = [t[2] for t in result["trace"]]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert len(traces["cuda"]) == len(traces["cpu"]) == 5
    torch.testing.assert_close(traces["cuda"], traces["cpu"], rtol=1e-4, atol=1e-4)
