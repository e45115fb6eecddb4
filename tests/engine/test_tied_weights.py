"""A tensor used by several registered modules is preconditioned once: by the last of them in
model order (a tied embedding and output head: the head), with a warning."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dkfac import KFACPreconditioner
from tests.oracles import dense_eigen_solve

V, D, B, T = 7, 4, 3, 5


class TiedLM(nn.Module):
    """Token embedding, tanh, and an output head sharing the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, T, V)`` and the head's input."""
        hidden = torch.tanh(self.mid(self.emb(ids)))
        return self.head(hidden), hidden


def test_tied_weight_is_registered_once_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = TiedLM().double()
    with caplog.at_level(logging.WARNING):
        pre = KFACPreconditioner(model)
    assert list(pre.layers) == ["mid", "head"]
    warnings = [r.getMessage() for r in caplog.records if "is shared by" in r.getMessage()]
    assert warnings == [
        "parameter emb.weight = head.weight is shared by emb and head: K-FAC preconditions it "
        "once, with the factors of head (the last user in model order); emb is not registered"
    ]
    rows = {row["name"]: row for row in pre.describe()}
    assert rows["head"]["parameters"] == ["emb.weight", "head.weight"]
    assert set(rows) == {"mid", "head"}  # nothing left to the inner optimizer
    assert "to the inner optimizer" not in caplog.text


def test_tied_weight_gets_the_heads_kfac_update_of_its_total_gradient() -> None:
    torch.manual_seed(0)
    model = TiedLM().double()
    pre = KFACPreconditioner(model, damping=0.05, kl_clip=None)
    ids = torch.randint(0, V, (B, T))
    logits, hidden = model(ids)
    logits.retain_grad()
    F.cross_entropy(logits.reshape(-1, V), ids.reshape(-1)).backward()
    raw = model.head.weight.grad.clone()  # both uses: the lookup's rows and the head's
    pre.step()
    rows = hidden.detach().reshape(-1, D)
    a = rows.T @ rows / rows.shape[0]
    g_rows = logits.grad.reshape(-1, V) * B  # the per-sample Fisher scale
    g = g_rows.T @ g_rows / g_rows.shape[0]
    got_a, got_g = pre.factors()["head"]
    torch.testing.assert_close(got_a, a)
    torch.testing.assert_close(got_g, g)
    expected = dense_eigen_solve(a, g, raw, 0.05)
    torch.testing.assert_close(model.head.weight.grad, expected)
    assert model.emb.weight.grad is model.head.weight.grad


def test_rows_of_one_tensor_are_not_a_tie() -> None:
    """The q, k, v blocks of an attention own disjoint rows of in_proj_weight."""
    attention = nn.MultiheadAttention(4, 2, batch_first=True)
    pre = KFACPreconditioner(attention)
    assert list(pre.layers) == ["q_proj", "k_proj", "v_proj", "out_proj"]


class FunctionalTiedLM(nn.Module):
    """Token embedding, then a block and the logits of the embedding's own weight
    (``F.linear``, no head module), run through ``checkpoint`` or plainly."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.reentrant = reentrant

    def _top(self, h: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.mid(h)), self.emb.weight)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        if self.reentrant is None:
            return self._top(h)
        return checkpoint(self._top, h, use_reentrant=self.reentrant)


def _functional_tie_step(reentrant: bool | None, micro_batches: int) -> list[Tensor]:
    torch.manual_seed(0)
    model = FunctionalTiedLM(reentrant).double()
    pre = KFACPreconditioner(model, damping=0.05, kl_clip=None, factor_decay=0.0)
    ids, targets = torch.randint(0, V, (4, T)), torch.randint(0, V, (4, T))
    for chunk, target in zip(ids.chunk(micro_batches), targets.chunk(micro_batches), strict=True):
        logits = model(chunk)
        (F.cross_entropy(logits.reshape(-1, V), target.reshape(-1)) / micro_batches).backward()
    pre.step()
    return [f for ag in pre.factors().values() for f in ag] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_weight_tied_through_f_linear_in_a_checkpoint_gets_the_plain_models_factors(
    reentrant: bool, micro_batches: int
) -> None:
    """The segment's inner backward (reentrant) reaches the embedding's weight through the
    head, and the outer one through the lookup: one pass, not two (G would be 4x)."""
    plain = _functional_tie_step(None, micro_batches)
    checkpointed = _functional_tie_step(reentrant, micro_batches)
    for want, got in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(got, want)
