"""Block for ``nn.Embedding``: a lookup is a Linear layer applied to a one-hot input.

With token ``x_r`` at row ``r`` (batch × any leading dims), the layer computes
``y_r = Wᵀ e_{x_r}`` for the ``V × D`` weight ``W``. In the library's ``d_out × d_in``
convention the weight matrix is ``Wᵀ`` (``D × V``), ``ā_r = e_{x_r}`` and

* ``A = mean_r e_{x_r} e_{x_r}ᵀ = diag(count_v / R)``: diagonal, the token frequencies;
* ``G = mean_r g_r g_rᵀ`` exactly as for Linear.

``padding_idx`` is honoured: padding tokens contribute a zero row to ``A`` (their row of
``W`` never receives a gradient) while still counting in the normaliser, as positions whose
per-sample gradient for ``W`` is zero. The damped K-FAC solve keeps that row's
preconditioned gradient zero, but a method with moments in the eigenbasis does not: the
basis of ``A``'s null space mixes the padding row with the rows of tokens absent from the
batch, whose moments then move it. The block writes the padding row back as zero wherever
its own gradient is zero (always, unless the table is tied to a head), so the padding
vector stays as ``nn.Embedding`` promises, as under AdamW.
The rows of ``A`` are one-hot, so a dense solver holds a ``V × V`` factor: fine for the
vocabularies of small models; very large vocabularies should be listed in ``skip_layers``.

A subclass that overrides ``forward`` is declined (:meth:`EmbeddingBlock.declines`): its
input need not be the rows it reads (BART's learned positions take the token ids and add an
offset; OPT's take the attention mask), and a factor of the wrong rows would be silently
wrong. Its table gets the inner optimizer's update.

An *unbatched* lookup (1-D ids, e.g. GPT-2's ``wpe(arange(T))`` added to every sample of
the batch by broadcasting) counts as one sample: autograd sums its output gradient over the
batch before the hook sees it, so ``G``'s rows are the gradient of the batch's mean loss
(:attr:`~dkfac.blocks.base.Rows.batch_mean`). ``G`` is quadratic in them, so on several ranks
the rows are averaged over the ranks before their products (the capture does it); averaging
each rank's ``G`` instead would differ from the serial ``G`` of the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.blocks.base import Block, BlockCost, Rows, StatisticSink


class EmbeddingBlock(Block):
    """Kronecker factors of an embedding table (no bias)."""

    module: nn.Embedding
    cost_kind = "embedding"

    @classmethod
    def declines(cls, module: nn.Module, **options: Any) -> str | None:
        """Sparse embedding gradients are not supported, nor ``scale_grad_by_freq`` (torch
        divides each row's gradient by its token's count in the batch, and ``A⁻¹``, the
        counts' diagonal, divides it again), nor a subclass with its own ``forward``: the
        hooks see that forward's input, which need not be the ids it looks up (BART's and
        OPT's learned positions are read from the token ids or the attention mask, plus an
        offset), so ``A`` would count the wrong rows."""
        del options
        if module.sparse:
            return "sparse embedding gradients are not supported"
        if module.scale_grad_by_freq:
            return (
                "scale_grad_by_freq divides the gradient by the token counts that K-FAC's A "
                "divides it by again"
            )
        if type(module).forward is not nn.Embedding.forward:
            return (
                f"{type(module).__name__} overrides nn.Embedding.forward: the rows it looks "
                "up are not its input"
            )
        return None

    def cost_description(self) -> BlockCost:
        """A lookup, not a matrix product: no forward flops."""
        return BlockCost(self.cost_kind, self.a_dim, self.g_dim, forward_flops=False)

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        assert isinstance(module, nn.Embedding)
        if module.sparse:
            raise ValueError(f"{name}: sparse embedding gradients are not supported")

    def output_positions(self, output: Tensor) -> int:
        """Every index of a sample is a position (a sequence's length)."""
        return max(1, int(output.numel() // (output.shape[0] * output.shape[-1])))

    @property
    def has_bias(self) -> bool:
        """Embeddings have no bias."""
        return False

    def batch_size(self, inputs: Tensor) -> int:
        """Samples in a forward input of token ids: its first dimension (1 for a 1-D input)."""
        return int(inputs.shape[0]) if inputs.dim() > 1 else 1

    @property
    def input_row_bias(self) -> None:
        """None: ``A`` counts token ids, it is not a second moment of input entries."""
        return None

    @property
    def a_dim(self) -> int:
        """Vocabulary size ``V``."""
        return self.module.num_embeddings

    @property
    def g_dim(self) -> int:
        """Embedding width ``D``."""
        return self.module.embedding_dim

    def a_rows(self, inputs: Tensor) -> Rows:
        """One-hot rows of the token ids (zero rows for ``padding_idx``); ids of either
        dtype ``nn.Embedding`` takes (``int64``, ``int32``)."""
        ids = inputs.reshape(-1).long()  # F.one_hot takes int64 only
        rows = F.one_hot(ids, self.a_dim).to(self.module.weight.dtype)
        if self.module.padding_idx is not None:
            rows[ids == self.module.padding_idx] = 0
        return Rows(rows, float(ids.numel()))

    def capture_input(self, inputs: Tensor, sinks: Mapping[str, StatisticSink]) -> Any:
        """Adds A's rows; the context says whether the lookup is unbatched (1-D ids)."""
        super().capture_input(inputs, sinks)
        return inputs.dim() == 1

    def capture_grad(
        self, context: Any, grad_output: Tensor, sinks: Mapping[str, StatisticSink], scale: float
    ) -> None:
        """Adds G's rows, marked as the batch's mean gradient after an unbatched lookup."""
        if "G" in sinks:
            rows = self.g_rows(grad_output)
            if context:
                rows = Rows(rows.rows, rows.normaliser, batch_mean=True)
            sinks["G"].add(rows, scale)

    def g_rows(self, grad_output: Tensor) -> Rows:
        """Every output-gradient row, averaged over all rows."""
        rows = grad_output.reshape(-1, self.g_dim)
        return Rows(rows, float(rows.shape[0]))

    def weight_grad(self) -> Tensor | None:
        """``∇Wᵀ`` as a ``D × V`` matrix."""
        grad = self.module.weight.grad
        return None if grad is None else grad.T

    def grad_writes(self, matrix: Tensor) -> list[tuple[Tensor, Tensor]]:
        """A ``D × V`` matrix back as the ``V × D`` gradient, the ``padding_idx`` row zero
        where its own gradient is (see the module notes)."""
        grad = self.module.weight.grad
        assert grad is not None
        value = matrix.T
        pad = self.module.padding_idx
        if pad is None:
            return [(grad, value)]
        row = value[pad : pad + 1] * grad[pad].ne(0).any()  # no host read
        writes = [(grad[:pad], value[:pad]), (grad[pad : pad + 1], row)]
        writes.append((grad[pad + 1 :], value[pad + 1 :]))
        return [(dest, part) for dest, part in writes if dest.numel()]

    def parameters(self) -> list[Tensor]:
        """The embedding table."""
        return [self.module.weight]


def token_counts(inputs: Tensor, vocab: int, padding_idx: int | None = None) -> Tensor:
    """Occurrences of every token (padding excluded): the diagonal of ``A`` times ``R``."""
    ids = inputs.reshape(-1)
    if padding_idx is not None:
        ids = ids[ids != padding_idx]
    return torch.bincount(ids, minlength=vocab)
