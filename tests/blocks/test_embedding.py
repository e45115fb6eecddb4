"""Embedding block: factors equal the token-count formula; padding_idx is honoured."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.blocks.embedding import token_counts
from tests.oracles import dense_eigen_solve

DT = torch.float64


class _Model(nn.Module):
    def __init__(self, vocab: int = 7, dim: int = 3, padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids))).sum(dim=1)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).pow(2).sum(dim=1).mean()


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_factors_equal_formula(padding_idx: int | None) -> None:
    model = _Model(padding_idx=padding_idx).to(DT)
    ids = torch.tensor([[0, 1, 1, 4], [2, 0, 6, 1], [5, 5, 5, 0]])
    out = model.emb(ids)
    y = model.head(torch.tanh(out)).sum(dim=1)
    g_emb = torch.autograd.grad(y.pow(2).sum(dim=1).mean(), out)[0]

    pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, skip_layers=["head"])
    _loss(model, ids).backward()
    pre.step()
    a, g = pre.factors()["emb"]
    rows = ids.numel()
    counts = token_counts(ids, 7, padding_idx).to(DT)
    torch.testing.assert_close(a, torch.diag(counts / rows))
    if padding_idx is not None:
        assert counts[padding_idx] == 0
    g_rows = (g_emb * ids.shape[0]).reshape(-1, 3)
    torch.testing.assert_close(g, g_rows.T @ g_rows / rows)


def test_single_token_equals_exact_fisher() -> None:
    """One sample, one token: A⊗G is the exact empirical Fisher of the embedding table."""
    model = _Model().to(DT)
    ids = torch.tensor([[3]])
    pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, skip_layers=["head"])
    _loss(model, ids).backward()
    per_sample = model.emb.weight.grad.T.reshape(-1).clone()  # vec_r of the D×V matrix
    pre.step()
    a, g = pre.factors()["emb"]
    torch.testing.assert_close(torch.kron(g, a), torch.outer(per_sample, per_sample))


def test_preconditioned_gradient_equals_dense_solve_and_padding_row_stays_zero() -> None:
    model = _Model(padding_idx=0).to(DT)
    ids = torch.tensor([[0, 1, 2, 2], [3, 0, 6, 1]])
    pre = KFACPreconditioner(
        model,
        factor_decay=0.0,
        kl_clip=None,
        damping=0.05,
        eigen_dtype=DT,
        skip_layers=["head"],
    )
    _loss(model, ids).backward()
    raw = model.emb.weight.grad.T.clone()
    pre.step()
    a, g = pre.factors()["emb"]
    expected = dense_eigen_solve(a, g, raw, 0.05)
    torch.testing.assert_close(model.emb.weight.grad.T, expected)
    assert bool((model.emb.weight.grad[0] == 0).all())


def test_sparse_embedding_is_skipped_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Embedding(5, 3, sparse=True), nn.Linear(3, 2))
    with caplog.at_level(logging.WARNING):
        pre = KFACPreconditioner(model)
    assert list(pre.layers) == ["1"]
    assert "sparse embedding" in caplog.text


class _SparseModel(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3, sparse=sparse)
        self.head = nn.Linear(3, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids))).sum(dim=1)


def test_a_sparse_embedding_trains_as_the_same_dense_one_left_to_the_inner_optimizer() -> None:
    """The declined sparse embedding keeps its sparse gradient for the inner SGD (which
    takes one); the oracle is the dense twin skipped by name: the same weights after 3
    steps (up to the order its duplicate rows are summed in)."""
    torch.manual_seed(0)
    sparse, dense = _SparseModel(True).to(DT), _SparseModel(False).to(DT)
    dense.load_state_dict(sparse.state_dict())
    for model, skip in ((sparse, ()), (dense, ("emb",))):
        pre = KFACPreconditioner(model, skip_layers=skip)
        opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pre)
        for step in range(3):
            ids = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            _loss(model, ids).backward()
            opt.step()
    assert sparse.emb.weight.grad is not None and sparse.emb.weight.grad.is_sparse
    for p, q in zip(sparse.parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0.0, atol=1e-12)


def test_the_default_refuses_a_sparse_embedding_it_would_give_adam() -> None:
    """``for_model`` gives the parameters no block takes Adam's direction, which a sparse
    gradient has no dense moments for: refused when built, naming the layer and the ways
    out; with ``leftover_update="gradient"`` it builds and trains."""
    model = _SparseModel(True)
    with pytest.raises(ValueError, match=r"emb\.weight.*sparse=False.*leftover_update"):
        KFACOptimizer.for_model(model)
    opt = KFACOptimizer.for_model(model, leftover_update="gradient")
    before = model.emb.weight.detach().clone()
    opt.zero_grad()
    _loss(model, torch.randint(0, 7, (4, 5))).backward()
    opt.step()
    assert not torch.equal(model.emb.weight, before)


class _OffsetPositions(nn.Embedding):
    """Learned positions as BART writes them: called with the token ids, it looks up
    ``arange(T) + 2``, so its input is not the rows it reads."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        return super().forward(positions + 2)


class _Subclass(nn.Embedding):
    """A subclass that keeps ``nn.Embedding.forward``: its input is still the ids."""


def test_a_subclass_with_its_own_forward_is_declined_and_one_without_is_not() -> None:
    model = nn.ModuleDict(
        {"tokens": _Subclass(7, 3), "positions": _OffsetPositions(6, 3), "head": nn.Linear(3, 2)}
    )
    pre = KFACPreconditioner(model, method="eigen_adam")
    assert set(pre.layers) == {"tokens", "head"}
    rows = {r["name"]: r for r in pre.describe()}
    assert "_OffsetPositions overrides nn.Embedding.forward" in rows["positions.weight"]["reason"]
    assert rows["positions.weight"]["method"] == "adam"


def test_scale_grad_by_freq_is_declined_and_trains_under_adam() -> None:
    """torch divides each row's gradient by its token's count in the batch, and K-FAC's
    ``A⁻¹`` (the counts' diagonal) would divide it again: the layer is declined, named in
    ``describe()``, and under ``for_model`` it takes the leftover Adam's step. Oracle: the
    same model with that layer skipped by name; equal weights after 3 steps."""
    runs = []
    for skip in ((), ("emb",)):
        torch.manual_seed(0)
        model = _SparseModel(False).to(DT)
        model.emb.scale_grad_by_freq = True
        opt = KFACOptimizer.for_model(model, lr=0.01, skip_layers=skip)
        assert "emb" not in opt.preconditioner.layers
        if not skip:
            rows = {r["name"]: r for r in opt.preconditioner.describe()}
            assert "scale_grad_by_freq" in rows["emb.weight"]["reason"]
        for step in range(3):
            ids = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            _loss(model, ids).backward()
            opt.step()
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("padding_idx", [0, 5, -1])
def test_the_padding_vector_stays_under_the_default(padding_idx: int) -> None:
    """``for_model``'s moments in the eigenbasis: the basis of ``A``'s null space mixes the
    padding row with absent tokens' rows, whose moments would move it; the padding vector
    stays as it is (AdamW leaves it too), every seen token's row moves."""
    model = _Model(vocab=12, dim=4, padding_idx=padding_idx)
    pad = model.emb.padding_idx
    before = model.emb.weight.detach().clone()
    opt = KFACOptimizer.for_model(model, lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for step in range(8):
        ids = torch.randint(0, 6 + step % 4, (4, 5), generator=gen)  # tokens come and go
        ids[:, -2:] = pad
        opt.zero_grad()
        _loss(model, ids).backward()
        opt.step()
    moved = (model.emb.weight.detach() - before).abs().amax(dim=1)
    assert moved[pad] == 0
    assert (moved[[i for i in range(6) if i != pad]] > 0).all()
