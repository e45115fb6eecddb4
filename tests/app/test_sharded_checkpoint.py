"""Sharded checkpoints (``torch.distributed.checkpoint``) survive a kill -9 during a save.

A run saves a checkpoint at step 3 with :func:`~dkfac.app.sharded_checkpoint.save_sharded`;
a second process resumes it, trains on and starts the next save, and is SIGKILLed in the
middle of it (deterministically: from inside the storage writer once every data file is
written but before the metadata is, or between the two renames that move the new checkpoint
into place). The folder's newest complete checkpoint is then the one before the kill, and a
run resumed from it continues exactly as the uninterrupted run. For contrast, a plain
``dcp.save`` into the folder of the previous checkpoint, killed at the same point, leaves
that folder holding the new step's data under the old metadata: not the previous checkpoint.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.app.checkpoint import CheckpointError
from dkfac.app.sharded_checkpoint import (
    LATEST,
    PREVIOUS,
    TEMP,
    apply_sharded,
    load_sharded,
    newest_good_sharded,
    save_sharded,
)
from tests.strategy_cases import global_batch, make_model

SAVED_AT, KILLED_AT, STEPS = 3, 5, 7


def _build() -> tuple[nn.Module, KFACOptimizer]:
    model = make_model()
    pre = KFACPreconditioner(model, method="eigen", inverse_update_interval=2, damping=0.01)
    return model, KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), pre)


def _steps(model: nn.Module, opt: KFACOptimizer, steps: range) -> None:
    for step in steps:
        x, y = global_batch(step, 2)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _save(model: nn.Module, opt: KFACOptimizer, folder: Path, step: int) -> None:
    opt.zero_grad()
    save_sharded(model, opt, {"position": {"step": step}}, folder)


def _resume(path: Path) -> tuple[nn.Module, KFACOptimizer, int]:
    model, opt = _build()
    model_state, optim_state, extras = load_sharded(model, opt, path)
    apply_sharded(model, opt, model_state, optim_state)
    return model, opt, int(extras["position"]["step"])


def _killed_during_save(folder: str, where: str) -> None:
    """In a child process: resume the step-3 checkpoint, train to step 5, save, and be
    killed at ``where`` ("data": every data file written, no metadata yet; "rename": after
    the latest was moved to the previous, before the new one took its place; "plain-dcp":
    a plain dcp.save over the step-3 checkpoint, killed like "data")."""
    kill = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    write_data = FileSystemWriter.write_data

    def write_then_die(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        future = write_data(self, plan, planner)
        future.wait()
        kill()
        return future

    path = Path(folder)
    if where == "plain-dcp":
        model, opt = _build()
        state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _steps(model, opt, range(SAVED_AT, KILLED_AT))
        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
        opt.zero_grad()
        dcp.save(
            dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)),
            checkpoint_id=folder,
        )
        return
    model, opt, step = _resume(path / LATEST)
    _steps(model, opt, range(step, KILLED_AT))
    if where == "data":
        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    else:
        replace = os.replace

        def replace_then_die(src: Any, dst: Any) -> None:
            replace(src, dst)
            if Path(dst).name == PREVIOUS:
                kill()

        os.replace = replace_then_die  # type: ignore[assignment]
    _save(model, opt, path, KILLED_AT)


def _kill(folder: Path, where: str) -> None:
    child = multiprocessing.get_context("spawn").Process(
        target=_killed_during_save, args=(str(folder), where)
    )
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        pytest.fail(f"the child saving at step {KILLED_AT} hung")
    assert child.exitcode == -signal.SIGKILL, f"the child ended with {child.exitcode}"


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def uninterrupted() -> list[torch.Tensor]:
    model, opt = _build()
    _steps(model, opt, range(STEPS))
    return _params(model)


@pytest.mark.parametrize("where", ["data", "rename"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_to_resume_exactly(
    tmp_path: Path, where: str, uninterrupted: list[torch.Tensor]
) -> None:
    model, opt = _build()
    _steps(model, opt, range(SAVED_AT))
    _save(model, opt, tmp_path, SAVED_AT)
    _kill(tmp_path, where)
    left = {p.name for p in tmp_path.iterdir()}
    # the kill came mid-save: a half-moved or unfinished new checkpoint is there
    assert left == ({LATEST, TEMP} if where == "data" else {PREVIOUS, TEMP}), left
    path = newest_good_sharded(tmp_path)
    assert path is not None and path.name == (LATEST if where == "data" else PREVIOUS)
    model, opt, step = _resume(path)
    assert step == SAVED_AT and opt.preconditioner.steps == SAVED_AT
    _steps(model, opt, range(step, STEPS))
    for index, (got, want) in enumerate(zip(_params(model), uninterrupted, strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"tensor {index}")
    # the next save clears the unfinished folder and rotates as usual
    _save(model, opt, tmp_path, STEPS)
    assert {p.name for p in tmp_path.iterdir()} == {LATEST, PREVIOUS}
    assert _resume(tmp_path / LATEST)[2] == STEPS


def test_a_plain_dcp_save_over_the_previous_checkpoint_does_not_survive_a_kill(
    tmp_path: Path,
) -> None:
    # why save_sharded writes elsewhere first: dcp.save reuses the data file names
    model, opt = _build()
    _steps(model, opt, range(SAVED_AT))
    opt.zero_grad()
    saved = _params(model)
    dcp.save(
        dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)),
        checkpoint_id=tmp_path,
    )
    _kill(tmp_path, "plain-dcp")
    model, opt = _build()
    state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
    try:
        dcp.load(state, checkpoint_id=tmp_path)
    except CheckpointException:  # torch 2.13: the old metadata does not read the new data
        return
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert any(not torch.equal(a, b) for a, b in zip(_params(model), saved, strict=True))


def test_a_folder_that_is_not_a_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    model, opt = _build()
    with pytest.raises(CheckpointError, match=r"is not a sharded checkpoint folder"):
        load_sharded(model, opt, tmp_path)
    assert newest_good_sharded(tmp_path) is None
