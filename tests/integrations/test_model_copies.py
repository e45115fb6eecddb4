"""A model that a preconditioner hooks can still be saved whole and copied.

``torch.save(model)`` and ``copy.deepcopy(model)`` (an EMA of the weights, a model kept for
evaluation) take the hooks with the model. Oracles: the saved model loads and computes
what the original computes, in training and in evaluation; the loaded model trained by a
new optimizer steps bit for bit as the same weights in a model that was never hooked (the
old hooks do nothing); a deep copy holds none of the preconditioner's state, and training
the copy leaves the original's run bit for bit as without it.
"""

from __future__ import annotations

import copy
import gc
import io
import types

import pytest
import torch
from torch import Tensor, nn

from dkfac import KFACOptimizer
from dkfac.engine.capture import FactorCapture
from dkfac.engine.layer_state import LayerState


class _Net(nn.Module):
    """A convolution, an attention layer and linear layers: every kind of hook dkfac puts
    on a model (forward hooks, parameter hooks, the attention's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3, padding=1)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8 * 6, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x).transpose(1, 2)
        return self.head(self.encoder(h).flatten(1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(12, 3, 6, generator=gen), torch.randint(0, 4, (12,), generator=gen)


def _train(model: nn.Module, opt: KFACOptimizer, steps: range, ema: nn.Module | None = None):
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if ema is not None:  # the copy trained in the same loop, in training mode
            nn.functional.cross_entropy(ema(x), y).backward()
        opt.step()


def _reloaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _holds_dkfac_state(root: object) -> bool:
    """Whether anything reachable from ``root`` is a layer's state or a capture."""
    seen, todo = {id(root)}, [root]
    while todo:
        obj = todo.pop()
        if isinstance(obj, (LayerState, FactorCapture)):
            return True
        if isinstance(obj, types.FunctionType):  # its closure and defaults, not its globals
            children = [*(obj.__closure__ or ()), *(obj.__defaults__ or ())]
        else:
            children = gc.get_referents(obj)
        for child in children:
            if id(child) not in seen and not isinstance(child, (type, types.ModuleType)):
                seen.add(id(child))
                todo.append(child)
    return False


@pytest.mark.parametrize("steps", [0, 3], ids=["before-first-step", "after-steps"])
def test_saved_whole_model_loads_and_trains_as_an_unhooked_one(steps: int) -> None:
    model = _model()
    opt = KFACOptimizer.for_model(model, lr=0.05)
    _train(model, opt, range(steps))
    loaded = _reloaded(model)
    x, _ = _batch(99)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
        loaded.eval(), model.eval()
        assert torch.equal(loaded(x), model(x))
    loaded.train()

    plain = _model()
    plain.load_state_dict(model.state_dict())
    for net in (loaded, plain):
        _train(net, KFACOptimizer.for_model(net, lr=0.05), range(10, 14))
    for a, b in zip(loaded.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_deep_copy_holds_no_preconditioner_state_and_feeds_nothing() -> None:
    reference = _model()
    _train(reference, KFACOptimizer.for_model(reference, lr=0.05), range(8))

    model = _model()
    opt = KFACOptimizer.for_model(model, lr=0.05)
    _train(model, opt, range(2))
    assert _holds_dkfac_state(model)
    ema = copy.deepcopy(model)
    assert not _holds_dkfac_state(ema)
    _train(model, opt, range(2, 8), ema=ema)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(p.grad is not None for p in ema.parameters())
