"""The ``Trainer``'s training options with ``KFACOptimizer``, each against a hand-written loop
doing what the option says with the same optimizer: a tiny float64 network (a LayerNorm's
parameters on Adam's direction), the data in order (``train_sampling_strategy="sequential"``),
bit for bit. The GPT-2 runs (accumulation, checkpointing, resume) are in
``test_hf_trainer.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from tests.integrations.twins import max_difference

transformers = pytest.importorskip("transformers")

SAMPLES, BATCH, LR = 40, 4, 0.01  # 10 micro-batches: windows of 3 leave one of 1


class Net(nn.Module):
    """A classifier the Trainer calls as ``model(x=..., labels=...)``; no ``**kwargs`` in its
    forward, so the Trainer divides each micro-batch's loss by the window's count."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
        self.net.to(dtype)
        self.forwards = 0

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        if not torch.compiler.is_compiling():
            self.forwards += 1
        return {"loss": F.cross_entropy(self.net(x), labels)}


class Data(torch.utils.data.Dataset):
    def __init__(self, count: int = SAMPLES, seed: int = 5, dtype: torch.dtype = torch.float64):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 6, generator=gen).to(dtype)
        self.y = torch.randint(0, 3, (count,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _optimizer(model: nn.Module, damped: bool, **options: Any) -> KFACOptimizer:
    """``for_model`` at fixed intervals, or K-FAC's damped ``eigen`` under SGD."""
    if damped:
        pre = KFACPreconditioner(model, method="eigen", damping=1e-3)
        return KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, **options), pre)
    return KFACOptimizer.for_model(model, lr=LR, overhead=None, **options)


def _trainer_run(
    out: Path, *, damped: bool = False, options: dict | None = None, **arguments: Any
) -> Net:
    dtype = torch.float32 if arguments.get("bf16") else torch.float64
    model = Net(dtype)
    opt = _optimizer(model, damped, **(options or {}))
    evaluates = arguments.get("eval_strategy", "no") != "no"
    args = transformers.TrainingArguments(
        **{
            "output_dir": str(out),
            "per_device_train_batch_size": BATCH,
            "num_train_epochs": 1,
            "learning_rate": LR,
            "lr_scheduler_type": "constant",
            "max_grad_norm": 0.0,
            "train_sampling_strategy": "sequential",
            "report_to": "none",
            "logging_strategy": "no",
            "save_strategy": "no",
            "use_cpu": True,
            "seed": 0,
            "disable_tqdm": True,
            **{k: v for k, v in arguments.items() if k != "resume"},
        }
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Data(dtype=dtype),
        eval_dataset=Data(8, seed=9, dtype=dtype) if evaluates else None,
        optimizers=(opt, None),
    )
    trainer.train(resume_from_checkpoint=arguments.get("resume"))
    return model


def _hand_loop(
    *,
    damped: bool = False,
    options: dict | None = None,
    accumulation: int = 1,
    epochs: int = 1,
    clip: float = 0.0,
    schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
    autocast: bool = False,
) -> Net:
    """The Trainer's loop written out: windows of ``accumulation`` micro-batches (the last
    one shorter), each loss divided by its window's count, clip, step, schedule, zero."""
    model = Net(torch.float32 if autocast else torch.float64)
    opt = _optimizer(model, damped, **(options or {}))
    scheduled = schedule(opt) if schedule is not None else None
    data = Data(dtype=next(model.parameters()).dtype)
    batches = [(data.x[i : i + BATCH], data.y[i : i + BATCH]) for i in range(0, SAMPLES, BATCH)]
    for _ in range(epochs):
        for start in range(0, len(batches), accumulation):
            window = batches[start : start + accumulation]
            for x, y in window:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(x, y)["loss"]
                (loss / len(window)).backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if scheduled is not None:
                scheduled.step()
            model.zero_grad()
    return model


def test_max_grad_norm_clips_the_raw_gradient_before_the_step(tmp_path: Path) -> None:
    """The Trainer clips ``.grad`` (the raw gradient) before ``optimizer.step()``
    preconditions it: the hand loop's ``clip_grad_norm_`` before the step, and a threshold
    low enough to act (the run differs from the unclipped one)."""
    clipped = _trainer_run(tmp_path, max_grad_norm=0.05)
    assert max_difference(clipped, _hand_loop(clip=0.05)) == 0.0
    assert max_difference(clipped, _hand_loop()) > 1e-3


@pytest.mark.parametrize("damped", [False, True], ids=["for_model", "eigen-under-SGD"])
def test_accumulation_with_a_shorter_last_window(tmp_path: Path, damped: bool) -> None:
    """Windows of 3 micro-batches over 10 (the last of 1, divided by 1), two epochs."""
    run = _trainer_run(tmp_path, damped=damped, gradient_accumulation_steps=3, num_train_epochs=2)
    assert max_difference(run, _hand_loop(damped=damped, accumulation=3, epochs=2)) == 0.0


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
def test_the_trainers_schedule_on_a_passed_optimizer(tmp_path: Path, kind: str) -> None:
    """``optimizers=(opt, None)``: the Trainer builds ``lr_scheduler_type`` on dkfac's
    optimizer, stepped after every optimizer step."""
    run = _trainer_run(tmp_path, lr_scheduler_type=kind, warmup_steps=3)

    def schedule(opt: torch.optim.Optimizer) -> Any:
        steps = SAMPLES // BATCH
        return transformers.get_scheduler(kind, opt, num_warmup_steps=3, num_training_steps=steps)

    assert max_difference(run, _hand_loop(schedule=schedule)) == 0.0


def test_learning_rate_and_weight_decay_arguments_do_not_reach_a_passed_optimizer(
    tmp_path: Path,
) -> None:
    """``TrainingArguments.learning_rate`` and ``weight_decay`` configure the optimizer the
    Trainer builds; a passed one keeps its own (give them to ``for_model``)."""
    ignored = _trainer_run(tmp_path, learning_rate=0.5, weight_decay=0.5)
    assert max_difference(ignored, _hand_loop()) == 0.0
    decayed = _trainer_run(tmp_path, options={"weight_decay": 0.5})
    assert max_difference(decayed, _hand_loop(options={"weight_decay": 0.5})) == 0.0
    assert max_difference(decayed, ignored) > 1e-4


def test_evaluation_between_steps_changes_nothing(tmp_path: Path) -> None:
    """``eval_strategy="steps"``: evaluation forwards every 2 steps (in eval mode, without
    gradients) add nothing to the factors."""
    run = _trainer_run(tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    assert run.forwards == SAMPLES // BATCH + 5 * 2  # 10 training, 5 evaluations of 2
    assert max_difference(run, _hand_loop()) == 0.0


def test_bf16_on_the_cpu_is_the_autocast_loop(tmp_path: Path) -> None:
    run = _trainer_run(tmp_path, bf16=True)
    assert max_difference(run, _hand_loop(autocast=True)) == 0.0
    assert max_difference(run, _hand_loop()) > 1e-4  # float32 weights: autocast did act


def test_torch_compile_captures_as_the_eager_loop(tmp_path: Path) -> None:
    """``torch_compile=True`` compiles the model after dkfac's optimizer was built on it;
    factors every step: the compiled forwards feed them as eager ones do."""
    torch._dynamo.reset()
    run = _trainer_run(tmp_path, torch_compile=True, torch_compile_backend="aot_eager")
    torch.testing.assert_close(
        list(run.parameters()), list(_hand_loop().parameters()), rtol=1e-9, atol=1e-12
    )


def test_resume_with_accumulation_across_epochs(tmp_path: Path) -> None:
    """Saved every 2 steps with windows of 3 (4 steps an epoch, the last of 1 micro-batch);
    resumed from step 6, in the second epoch: the run that did not stop."""
    how: dict[str, Any] = {
        "gradient_accumulation_steps": 3,
        "num_train_epochs": 2,
        "save_strategy": "steps",
        "save_steps": 2,
    }
    straight = _trainer_run(tmp_path / "a", **how)
    resumed = _trainer_run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-6"), **how)
    assert max_difference(straight, resumed) == 0.0
    assert max_difference(straight, _hand_loop(accumulation=3, epochs=2)) == 0.0
