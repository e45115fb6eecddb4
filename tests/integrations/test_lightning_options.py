"""Lightning's training options with ``KFACOptimizer`` from ``configure_optimizers``, each
against a hand-written loop doing what the option says with the same optimizer: a tiny
float64 network, bit for bit. Clipping by norm, ``16-mixed``/``bf16-mixed``, per-step
schedules, manual optimization, a second ``fit`` and an end-of-epoch resume are in
``test_lightning.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.swa_utils import SWALR, AveragedModel

from dkfac import KFACOptimizer, KFACPreconditioner
from tests.integrations.twins import max_difference

lightning = pytest.importorskip("lightning")
L = lightning.pytorch

SAMPLES, BATCH = 64, 8  # 8 batches an epoch: windows of 3 leave one of 2

Schedule = Callable[[torch.optim.Optimizer], Any]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16, dtype=torch.float64),
        nn.LayerNorm(16, dtype=torch.float64),
        nn.Tanh(),
        nn.Linear(16, 3, dtype=torch.float64),
    )


def _loader(count: int = SAMPLES, seed: int = 5) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(
        torch.randn(count, 6, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (count,), generator=gen),
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def _optimizer(net: nn.Module, damped: bool) -> KFACOptimizer:
    """``for_model`` at fixed intervals, or K-FAC's damped ``eigen`` under SGD."""
    if damped:
        pre = KFACPreconditioner(net, method="eigen", damping=1e-3)
        return KFACOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), pre)
    return KFACOptimizer.for_model(net, lr=0.01, overhead=None)


class Classifier(L.LightningModule):
    """The network, with dkfac's optimizer (and a schedule) from ``configure_optimizers``."""

    def __init__(
        self, damped: bool = False, schedule: Schedule | None = None, interval: str = "step"
    ) -> None:
        super().__init__()
        self.net = _net()
        self.damped, self.schedule, self.interval = damped, schedule, interval
        self.validation_forwards = 0

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        self.validation_forwards += 1
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = _optimizer(self.net, self.damped)
        if self.schedule is None:
            return opt
        scheduler = {"scheduler": self.schedule(opt), "interval": self.interval}
        return {"optimizer": opt, "lr_scheduler": scheduler}


def _trainer(root: Path, **options: Any) -> Any:
    return L.Trainer(
        **{
            "default_root_dir": root,
            "accelerator": "cpu",
            "max_epochs": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            **options,
        }
    )


def _fit(root: Path, module: Classifier, ckpt: str | None = None, **options: Any) -> nn.Module:
    _trainer(root, **options).fit(module, _loader(), ckpt_path=ckpt)
    return module.net


def _hand_loop(
    *,
    damped: bool = False,
    accumulate: int = 1,
    epochs: int = 1,
    batches: int | None = None,
    clip_value: float | None = None,
    schedule: Schedule | None = None,
    interval: str = "step",
) -> nn.Module:
    """Lightning's automatic optimization written out: each micro-batch's loss divided by
    ``accumulate`` (the epoch's last, shorter window too), a step at a window's end or the
    epoch's, the first ``batches`` batches of each epoch."""
    net = _net()
    opt = _optimizer(net, damped)
    scheduled = schedule(opt) if schedule is not None else None
    for _ in range(epochs):
        epoch = list(_loader())[:batches]
        for index, (x, y) in enumerate(epoch):
            (F.cross_entropy(net(x), y) / accumulate).backward()
            if (index + 1) % accumulate and index + 1 < len(epoch):
                continue
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(net.parameters(), clip_value)
            opt.step()
            opt.zero_grad()
            if scheduled is not None and interval == "step":
                scheduled.step()
        if scheduled is not None and interval == "epoch":
            scheduled.step()
    return net


@pytest.mark.parametrize("damped", [False, True], ids=["for_model", "eigen-under-SGD"])
def test_accumulation_with_a_shorter_last_window(tmp_path: Path, damped: bool) -> None:
    """``accumulate_grad_batches=3`` over 8 batches: Lightning divides the last window's two
    losses by 3 as well (its choice, for every optimizer), and steps at the epoch's end."""
    run = _fit(tmp_path, Classifier(damped), accumulate_grad_batches=3, max_epochs=2)
    assert max_difference(run, _hand_loop(damped=damped, accumulate=3, epochs=2)) == 0.0


def test_clipping_by_value_clamps_the_raw_gradient(tmp_path: Path) -> None:
    run = _fit(tmp_path, Classifier(), gradient_clip_val=0.01, gradient_clip_algorithm="value")
    assert max_difference(run, _hand_loop(clip_value=0.01)) == 0.0
    assert max_difference(run, _hand_loop()) > 1e-3  # the clamp acted


def test_a_schedule_stepped_every_epoch(tmp_path: Path) -> None:
    def halve(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    run = _fit(tmp_path, Classifier(schedule=halve, interval="epoch"), max_epochs=3)
    assert max_difference(run, _hand_loop(schedule=halve, interval="epoch", epochs=3)) == 0.0


def test_validation_between_steps_changes_nothing(tmp_path: Path) -> None:
    """Validation every 3 batches, and the sanity check before training: their forwards
    (in eval mode, under inference mode) add nothing to the factors."""
    module = Classifier()
    trainer = _trainer(tmp_path, val_check_interval=3, num_sanity_val_steps=2)
    trainer.fit(module, _loader(), _loader(16, seed=9))
    assert module.validation_forwards == 2 + 2 * 2
    assert max_difference(module.net, _hand_loop()) == 0.0


@pytest.mark.parametrize(
    "option", ["limit_train_batches", "overfit_batches"], ids=["limit", "overfit"]
)
def test_fewer_batches_an_epoch(tmp_path: Path, option: str) -> None:
    """The first 3 batches of every epoch (``overfit_batches`` reads them in order too)."""
    run = _fit(tmp_path, Classifier(), max_epochs=2, **{option: 3})
    assert max_difference(run, _hand_loop(batches=3, epochs=2)) == 0.0


def test_lr_find_then_fit_trains_as_a_fresh_run(tmp_path: Path) -> None:
    """``Tuner.lr_find`` steps an optimizer from ``configure_optimizers`` and restores the
    weights; the ``fit`` after it builds another, which takes the layers over with fresh
    statistics: the hand loop from the start."""
    module = Classifier()
    trainer = _trainer(tmp_path)
    before = {k: v.clone() for k, v in module.net.state_dict().items()}
    tuner = L.tuner.Tuner(trainer)
    tuner.lr_find(module, _loader(), min_lr=1e-4, max_lr=0.1, num_training=6, update_attr=False)
    assert all(torch.equal(before[k], v) for k, v in module.net.state_dict().items())
    trainer.fit(module, _loader())
    assert max_difference(module.net, _hand_loop()) == 0.0


def test_stochastic_weight_averaging(tmp_path: Path) -> None:
    """``StochasticWeightAveraging(swa_epoch_start=2)`` over 4 epochs, as Lightning runs it:
    from the second epoch (0-based 1) ``SWALR`` (its groups' ``initial_lr`` set to the SWA
    rate, stepped every epoch), the weights averaged at each epoch's start, the average
    written into the model at the end. Its average is a copy of the module, whose hooks do
    nothing."""
    swa = L.callbacks.StochasticWeightAveraging(swa_lrs=0.005, swa_epoch_start=2)
    run = _fit(tmp_path, Classifier(), max_epochs=4, callbacks=[swa])
    net = _net()
    opt = _optimizer(net, damped=False)
    average = AveragedModel(net)
    for epoch in range(4):
        if epoch == 1:
            for group in opt.param_groups:
                group["initial_lr"] = 0.005
            schedule = SWALR(opt, swa_lr=0.005, anneal_epochs=10, last_epoch=4)
        if epoch >= 1:
            average.update_parameters(net)
        for x, y in _loader():
            F.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        if epoch >= 1:
            schedule.step()
    assert max_difference(run, average.module) == 0.0


def test_resume_from_a_checkpoint_taken_mid_epoch(tmp_path: Path) -> None:
    """``ModelCheckpoint(every_n_train_steps=3)`` and ``fit(ckpt_path=...)`` over two epochs:
    with a loader that cannot resume mid-epoch, Lightning runs the first epoch's remaining 5
    steps on its first 5 batches (it warns so); the hand loop in that order."""
    save = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "saved", every_n_train_steps=3)
    _fit(tmp_path, Classifier(), max_steps=3, enable_checkpointing=True, callbacks=[save])
    [saved] = (tmp_path / "saved").glob("*.ckpt")
    with pytest.warns(UserWarning, match="not resumable"):
        resumed = _fit(tmp_path, Classifier(), ckpt=str(saved), max_epochs=2)
    net = _net()
    opt = _optimizer(net, damped=False)
    batches = list(_loader())
    for x, y in batches[:3] + batches[:5] + batches:
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert max_difference(resumed, net) == 0.0
