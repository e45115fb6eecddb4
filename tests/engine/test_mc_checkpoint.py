"""The Monte-Carlo Fisher under activation checkpointing.

``sample_fisher`` runs ``torch.autograd.grad``: a non-reentrant checkpoint recomputes its
segment inside it and the factors are those of the model without checkpointing; a
reentrant one supports only ``.backward()`` and is refused by dkfac, naming what works.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dkfac import KFACOptimizer, KFACPreconditioner


class _Net(nn.Module):
    """Three linear layers; ``segment`` says which part runs under ``checkpoint``:
    ``"middle"`` (the second layer), ``"first"`` (the first layer) or ``"stem"`` (an
    unregistered layer before the first)."""

    def __init__(self, reentrant: bool | None, segment: str = "middle") -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.reentrant, self.segment = reentrant, segment

    def _part(self, name: str, fn: nn.Module, x: Tensor) -> Tensor:
        if self.reentrant is None or name != self.segment:
            return torch.tanh(fn(x))
        return checkpoint(lambda t: torch.tanh(fn(t)), x, use_reentrant=self.reentrant)

    def forward(self, x: Tensor) -> Tensor:
        h = self._part("stem", self.stem, x)
        h = self._part("first", self.a, h)
        return self.c(self._part("middle", self.b, h))


def _run(
    reentrant: bool | None, micro_batches: int = 1, segment: str = "middle"
) -> tuple[dict[str, tuple[Tensor, ...]], list[Tensor]]:
    torch.manual_seed(0)
    model = _Net(reentrant, segment)
    pre = KFACPreconditioner(model, fisher="mc", factor_decay=0.0, skip_layers=["^stem$"])
    x, y = torch.randn(6, 4, requires_grad=True), torch.randint(0, 3, (6,))
    for _ in range(2):
        model.zero_grad()
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            out = model(xs)
            pre.sample_fisher(out)
            (nn.functional.cross_entropy(out, ys) / micro_batches).backward()
        pre.step()
    factors = {name: tuple(f.clone() for f in ag) for name, ag in pre.factors().items()}
    return factors, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_non_reentrant_checkpoint_gives_the_factors_and_step_of_the_plain_model(
    micro_batches: int,
) -> None:
    plain, plain_step = _run(None, micro_batches)
    checkpointed, step = _run(False, micro_batches)
    assert plain.keys() == checkpointed.keys() == {"a", "b", "c"}
    for name in plain:
        for want, got in zip(plain[name], checkpointed[name], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for want, got in zip(plain_step, step, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_reentrant_segment_before_every_captured_layer_is_no_obstacle() -> None:
    """The sampled backward stops at the first captured layer's output: it never runs the
    reentrant segment in front of it."""
    plain, plain_step = _run(None, segment="stem")
    checkpointed, step = _run(True, segment="stem")
    for name in plain:
        for want, got in zip(plain[name], checkpointed[name], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for want, got in zip(plain_step, step, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


_REFUSED = r'fisher="mc" cannot run its sampled backward through .*use_reentrant=True.*' + (
    r'use_reentrant=False.*fisher="empirical"'
)


@pytest.mark.parametrize("build", ["preconditioner", "for_model"])
def test_a_reentrant_segment_between_captured_layers_is_refused_by_sample_fisher(
    build: str,
) -> None:
    torch.manual_seed(0)
    model = _Net(reentrant=True)
    if build == "preconditioner":
        pre = KFACPreconditioner(model, fisher="mc")
    else:
        pre = KFACOptimizer.for_model(model, fisher="mc").preconditioner
    out = model(torch.randn(6, 4))
    with pytest.raises(RuntimeError, match=_REFUSED):
        pre.sample_fisher(out)
    assert all(p.grad is None for p in model.parameters())  # the training's untouched


def test_a_reentrant_segment_the_sampled_backward_never_reaches_is_refused_at_the_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every layer after the segment captured, the one inside it only by the training
    backward's recomputation: no sampled G can come for it (not a layer whose output
    misses the loss, as the warning would say)."""
    torch.manual_seed(0)
    model = _Net(reentrant=True, segment="first")
    pre = KFACPreconditioner(model, fisher="mc", skip_layers=["^stem$"])
    out = model(torch.randn(6, 4, requires_grad=True))
    pre.sample_fisher(out)
    nn.functional.cross_entropy(out, torch.randint(0, 3, (6,))).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(RuntimeError, match=_REFUSED):
        pre.step()
    assert "no output gradient reached it" not in caplog.text
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, after, strict=True))  # not stepped
