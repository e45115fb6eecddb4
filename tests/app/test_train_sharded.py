"""``dkfac train --parallel fsdp|hsdp``: the program's sharded runs equal its DDP runs.

Inside initialised gloo groups (what torchrun gives the program), on the same data and
seed: a CIFAR ResNet-20 (BatchNorm: each rank normalises with its own batch under both
layouts) and the GPT trained with K-FAC under ``--parallel fsdp`` on 2 ranks end with the
weights of the ``--parallel ddp`` run (float32: to summation order), and so does the CNN
under ``--parallel hsdp --shard-size 2`` on 4 ranks. A sharded run's checkpoints are
folders of ``torch.distributed.checkpoint``: a run resumed from the one written half-way
ends with exactly the weights of the uninterrupted run. Flags that cannot go with a
sharded model exit 2 with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from dkfac.app import parallel
from dkfac.app.cli import main, parse_args
from dkfac.app.gpt import GPT
from dkfac.app.models import resnet20
from dkfac.app.sharded_checkpoint import LATEST, PREVIOUS
from dkfac.app.trainer import train
from tests.cli_args import TINY
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import once_per_key

KFAC = ["--optimizer", "kfac", "--inverse-update-interval", "2", "--damping", "0.05"]
IMAGES = ["train", *TINY, "--epochs", "2", "--device", "cpu", *KFAC]
RESNET = [*IMAGES, "--model", "resnet20"]
TOL = {"rtol": 1e-3, "atol": 1e-4}  # float32 K-FAC, ranks summing in another order


def _gpt_args(folder: str) -> list[str]:
    text = Path(folder) / "tiny.txt"
    words = b"the quick brown fox jumps over the lazy dog and then some more words ".split()
    picks = torch.randint(0, len(words), (1500,), generator=torch.Generator().manual_seed(0))
    if not text.exists():
        text.write_bytes(b" ".join(words[i] for i in picks.tolist()))
    return [
        "train",
        *("--model", "gpt", "--data", "text", "--text-path", str(text)),
        *("--layers", "2", "--width", "16", "--heads", "2", "--seq-len", "16"),
        *("--batch-size", "8", "--steps", "6", "--threads", "1", "--device", "cpu", *KFAC),
    ]


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _train(argv: list[str], out: str | None = None) -> dict[str, Any]:
    extra = ["--out", out] if out else []
    result = train(parse_args([*argv, *extra]), write=out is not None)
    return {"params": _params(result.model), "steps": result.steps}


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    gpt = _gpt_args(root) if rank == 0 else []
    torch.distributed.barrier()  # the text file is written
    gpt = gpt or _gpt_args(root)
    runs = {
        "resnet-ddp": _train(RESNET),
        "resnet-fsdp": _train([*RESNET, "--parallel", "fsdp"]),
        "gpt-ddp": _train(gpt),
        "gpt-fsdp": _train([*gpt, "--parallel", "fsdp"]),
        "whole": _train([*IMAGES, "--parallel", "fsdp", "--checkpoint-every", "4"], f"{root}/a"),
    }
    halfway = f"{root}/a/{PREVIOUS}"  # step 4 (the latest is step 8)
    runs["resumed"] = _train([*IMAGES, "--parallel", "fsdp", "--resume", halfway], f"{root}/b")
    return runs


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "ddp": _train(IMAGES),
        "hsdp": _train([*IMAGES, "--parallel", "hsdp", "--shard-size", "2"]),
    }


_spawned = once_per_key(
    lambda key: (
        run_distributed(_two_ranks, 2, key, timeout=300)
        if key != "four"
        else run_distributed(_four_ranks, 4, timeout=300)
    )
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("sharded-train"))


def _assert_close(got: dict[str, Any], want: dict[str, Any], label: str, **tol: float) -> None:
    assert got["steps"] == want["steps"], label
    assert got["params"].keys() == want["params"].keys(), label
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, msg=f"{label}: {name}", **tol)


@pytest.mark.parametrize("model", ["resnet", "gpt"])
def test_fsdp_trains_as_ddp(root: str, model: str) -> None:
    for rank, runs in enumerate(_spawned(root)):
        _assert_close(runs[f"{model}-fsdp"], runs[f"{model}-ddp"], f"{model}, rank {rank}", **TOL)
    first, second = (r[f"{model}-fsdp"]["params"] for r in _spawned(root))
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_hsdp_on_four_ranks_trains_as_ddp() -> None:
    for rank, runs in enumerate(_spawned("four")):
        _assert_close(runs["hsdp"], runs["ddp"], f"rank {rank}", **TOL)


def test_a_sharded_run_resumes_exactly_from_its_checkpoint_folder(root: str) -> None:
    for rank, runs in enumerate(_spawned(root)):
        assert runs["whole"]["steps"] == runs["resumed"]["steps"] == 8
        _assert_close(runs["resumed"], runs["whole"], f"rank {rank}", rtol=0.0, atol=0.0)
    held = {p.name for p in Path(root, "b").iterdir()}
    assert {LATEST, "metrics.jsonl"} <= held and not any(n.endswith(".pt") for n in held)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parallel", "fsdp", "--optimizer", "muon"], "--optimizer muon does not run"),
        (["--parallel", "hsdp", "--amp", "fp16"], "--amp fp16 does not run with --parallel hsdp"),
        (["--parallel", "fsdp", "--strategy", "spngd"], "--strategy spngd reduces"),
        (
            ["--parallel", "fsdp", "--weight-rescale", "--weight-decay", "0"],
            "--weight-rescale does not run",
        ),
        (["--shard-size", "2"], "--shard-size applies to --parallel hsdp, not --parallel ddp"),
        (["--parallel", "hsdp", "--shard-size", "0"], "--shard-size must be in [1, "),
        (["--parallel", "tp"], "invalid choice: 'tp'"),
    ],
)
def test_flags_that_cannot_go_with_a_sharded_model_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_sharded_run_on_one_process_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *TINY, "--parallel", "fsdp", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "dkfac train: error: --parallel fsdp needs several ranks "
        "(torchrun --nproc-per-node N, N >= 2)"
    ]


@pytest.mark.parametrize(
    ("world", "size", "env", "shape"),
    [
        (4, None, {}, None),  # one node of 4: no replicas
        (8, None, {"LOCAL_WORLD_SIZE": "4"}, (2, 4)),
        (8, 2, {"LOCAL_WORLD_SIZE": "4"}, (4, 2)),
        (8, 3, {}, None),
        (8, 8, {}, None),
        (2, 2, {}, None),
    ],
)
def test_the_hsdp_mesh_is_replicas_by_shard_size(
    world: int, size: int | None, env: dict[str, str], shape: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if shape is None:
        with pytest.raises(ValueError, match=r"--parallel hsdp .*(fsdp|--shard-size)"):
            parallel.mesh_shape("hsdp", world, size)
    else:
        assert parallel.mesh_shape("hsdp", world, size) == shape
    assert parallel.mesh_shape("fsdp", world, None) == (world,)


def test_the_units_sharded_before_the_root_are_the_blocks() -> None:
    gpt = GPT(256, 8, layers=3, width=16, heads=2)
    assert parallel.shard_units(gpt) == list(gpt.blocks)
    resnet = resnet20(in_channels=3, num_classes=10)
    assert parallel.shard_units(resnet) == list(resnet.layers) and len(resnet.layers) == 9
