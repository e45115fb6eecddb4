"""A tiny GPT-like classifier shared by the distributed transformer tests.

Token and position ``nn.Embedding``s (the position lookup unbatched, ``pos(arange(T))``
added to every sample by broadcasting, as GPT-2 does), pre-LayerNorm blocks of
``nn.MultiheadAttention`` and a GELU MLP, a final LayerNorm and a linear head on the mean
over positions (so the harness's cross-entropy on ``(N, classes)`` applies). float64.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

VOCAB, LENGTH, WIDTH, CLASSES = 11, 5, 8, 3


class Block(nn.Module):
    """``x + attention(LayerNorm(x))``, then ``x + MLP(LayerNorm(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token ids ``(N, LENGTH)`` to class logits ``(N, CLASSES)``."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        positions = self.positions(torch.arange(ids.shape[1], device=ids.device))
        x = self.blocks(self.tokens(ids) + positions)
        return self.head(self.norm(x).mean(dim=1))


def make_gpt() -> nn.Module:
    """The seeded float64 :class:`TinyGPT` every rank and its serial twin build."""
    torch.manual_seed(0)
    return TinyGPT().double()


def gpt_batch(step: int, rows: int = 8) -> tuple[Tensor, Tensor]:
    """The global batch of ``step``: ``rows`` token sequences and class targets."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=gen)
    return ids, torch.randint(0, CLASSES, (rows,), generator=gen)
