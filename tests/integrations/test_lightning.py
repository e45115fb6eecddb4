"""Lightning with ``KFACOptimizer`` in ``configure_optimizers``, for real, each against a
hand-written loop that does what Lightning documents: automatic optimization (the step runs
the closure) with ``accumulate_grad_batches``, ``gradient_clip_val``, a per-step scheduler
and ``16-mixed`` (a CPU GradScaler, handed to dkfac), manual optimization (``bf16-mixed``
too), and ``fit(ckpt_path=...)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from tests.integrations.twins import max_difference

lightning = pytest.importorskip("lightning")
L = lightning.pytorch

BATCH, SAMPLES, ACCUMULATE, CLIP = 8, 64, 2, 0.5


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 6, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen)
    )


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=False)


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))


class Classifier(L.LightningModule):
    """The network, trained by Lightning with dkfac's optimizer and a per-step schedule."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = _net()
        self.automatic_optimization = not manual

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor | None:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / ACCUMULATE)
        if (index + 1) % ACCUMULATE == 0:
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()
        return None

    def configure_optimizers(self) -> dict:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        opt = KFACOptimizer.for_model(self.net, lr=0.01, grad_scaler=scaler)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _schedule(opt), "interval": "step"}}


def _fit(root: Path, module: Classifier, steps: int, ckpt: str | None = None, **options) -> None:
    if module.automatic_optimization:
        options = {"accumulate_grad_batches": ACCUMULATE, "gradient_clip_val": CLIP, **options}
    trainer = L.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"enable_checkpointing": False, **options},
    )
    trainer.fit(module, _loader(), ckpt_path=ckpt)


def _hand_loop(
    steps: int, autocast: torch.dtype | None = None, net: nn.Module | None = None
) -> nn.Module:
    """What Lightning documents, written out: micro-batches of loss / 2, unscale, clip by
    norm, precondition and step, zero, schedule (a GradScaler under float16); on ``net``
    (a new optimizer on the weights as they are), or on a fresh network."""
    net = _net() if net is None else net
    mixed = autocast == torch.float16
    scaler = torch.amp.GradScaler("cpu", enabled=mixed)
    opt = KFACOptimizer.for_model(net, lr=0.01, grad_scaler=scaler if mixed else None)
    schedule = _schedule(opt)
    batches = iter(_loader())
    for _ in range(steps):
        for _ in range(ACCUMULATE):
            x, y = next(batches)
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = F.cross_entropy(net(x), y)
            scaler.scale(loss / ACCUMULATE).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        schedule.step()
    return net


def test_a_second_fit_builds_its_optimizer_on_the_same_module(tmp_path: Path) -> None:
    """Lightning calls ``configure_optimizers`` at every ``fit`` (and in its tuner's runs)
    while the Trainer still holds the last one's optimizer: the new optimizer takes the
    layers over (the old one's step raises) and trains as a new optimizer on those weights.
    Two epochs in two fits against the hand loop run twice."""
    module = Classifier()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, _loader())
    first = trainer.optimizers[0]
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, _loader())
    assert trainer.optimizers[0] is not first
    with pytest.raises(RuntimeError, match="took over"):
        first.step()
    steps = SAMPLES // BATCH // ACCUMULATE
    assert max_difference(module.net, _hand_loop(steps, net=_hand_loop(steps))) == 0.0


@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16])
def test_automatic_optimization_equals_the_hand_loop(
    tmp_path: Path, autocast: torch.dtype | None
) -> None:
    """32-true, bf16-mixed, and 16-mixed with a CPU GradScaler (Lightning picks bf16 for
    ``precision="16-mixed"`` on a CPU, so the plugin is given)."""
    module = Classifier()
    if autocast == torch.float16:
        scaler = torch.amp.GradScaler("cpu")
        plugin = L.plugins.MixedPrecision("16-mixed", "cpu", scaler=scaler)
        _fit(tmp_path, module, steps=3, plugins=[plugin])
    else:
        _fit(tmp_path, module, steps=3, precision="32-true" if autocast is None else "bf16-mixed")
    assert max_difference(module.net, _hand_loop(3, autocast)) == 0.0


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_manual_optimization_equals_the_hand_loop(
    tmp_path: Path, autocast: torch.dtype | None
) -> None:
    """Under bf16-mixed, ``training_step`` runs in the autocast region, ``manual_backward``
    and ``opt.step()`` too: dkfac's statistics and step are those of the hand loop, whose
    backward and step are outside it."""
    module = Classifier(manual=True)
    _fit(tmp_path, module, steps=3, precision="32-true" if autocast is None else "bf16-mixed")
    assert max_difference(module.net, _hand_loop(3, autocast)) == 0.0


def test_fit_from_a_checkpoint_restores_the_optimizer_exactly(tmp_path: Path) -> None:
    """Two epochs straight against one epoch, its checkpoint, and ``fit(ckpt_path=...)``
    into a fresh module (epoch boundaries: the data order is the same)."""
    straight = Classifier()
    _fit(tmp_path / "a", straight, steps=-1, max_epochs=2)
    first = Classifier()
    _fit(tmp_path / "b", first, steps=-1, max_epochs=1, enable_checkpointing=True)
    [saved] = (tmp_path / "b").rglob("*.ckpt")
    resumed = Classifier()
    with torch.no_grad():
        resumed.net[0].weight.add_(1.0)  # the checkpoint's weights must replace these
    _fit(tmp_path / "c", resumed, steps=-1, max_epochs=2, ckpt=str(saved))
    assert max_difference(straight.net, resumed.net) == 0.0


SKIPPED = {2, 3}


class _Skipping(L.LightningModule):
    """A ``training_step`` that returns ``None`` for some batches: Lightning skips them, but
    under automatic optimization without a GradScaler still calls ``optimizer.step(closure)``,
    whose closure then runs no backward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor | None:
        if index in SKIPPED:
            return None
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> KFACOptimizer:
        return KFACOptimizer.for_model(self.net, lr=0.01, overhead=None)


def test_a_batch_lightning_skips_is_skipped() -> None:
    """The step with no gradient at all moved K-FAC's step counter (and refreshed a basis
    from unchanged factors at a refresh step): 0.04 from the loop that skips the batches.
    It now leaves K-FAC's state as it is, as AdamW's step leaves Adam's."""
    module = _Skipping()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, _loader())
    net = _net()
    opt = KFACOptimizer.for_model(net, lr=0.01, overhead=None)
    for index, (x, y) in enumerate(_loader()):
        if index in SKIPPED:
            continue
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    assert opt.preconditioner.steps == len(_loader()) - len(SKIPPED)
    assert max_difference(module.net, net) == 0.0
