"""A small decoder-only transformer (GPT) in plain PyTorch, for ``--model gpt``.

Pre-LayerNorm layout: token and learned positional embeddings (``nn.Embedding``), ``layers``
blocks of ``x + attention(LayerNorm(x))`` then ``x + MLP(LayerNorm(x))``, a final LayerNorm
and a linear head to the vocabulary. Attention has separate ``nn.Linear`` query, key and value
projections and an ``nn.Linear`` output projection around
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, and the MLP is
``Linear(width, 4 width)``, GELU, ``Linear(4 width, width)``: every weight matrix is an
``nn.Linear`` or ``nn.Embedding`` that K-FAC preconditions with its existing blocks, and each
is called exactly once per forward pass. The LayerNorms are left to the inner optimizer.

Weights are initialised as in GPT-2: normal with standard deviation 0.02, the two residual
output projections of each block scaled down by ``sqrt(2 layers)``, zero biases. The head can
share the token embedding's weight (``tie_weights``); it does not by default.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.domains import domain_error

DEFAULTS = {"layers": 2, "width": 64, "heads": 4, "seq_len": 128}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v and output projections.

    Args:
        width: Model width (features per token).
        heads: Attention heads; ``width`` must be a multiple of it.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        _check_sizes(1, width, heads, 1)
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    def _split(self, t: Tensor) -> Tensor:
        n, length, width = t.shape
        return t.view(n, length, self.heads, width // self.heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        """Returns the attention output, shape ``(N, T, width)``, for input ``(N, T, width)``."""
        n, length, width = x.shape
        q, k, v = (self._split(f(x)) for f in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, length, width))


class Block(nn.Module):
    """``x + attention(LayerNorm(x))``, then ``x + MLP(LayerNorm(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only pre-LayerNorm transformer on token ids.

    Args:
        vocab_size: Number of token values (256 for bytes).
        context: Longest sequence the positional embedding covers.
        layers: Transformer blocks.
        width: Features per token.
        heads: Attention heads (``width % heads == 0``).
        tie_weights: Share the head's weight with the token embedding.

    Raises:
        ValueError: If a size is below 1 or ``width`` is not a multiple of ``heads``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        context: int = DEFAULTS["seq_len"],
        layers: int = DEFAULTS["layers"],
        width: int = DEFAULTS["width"],
        heads: int = DEFAULTS["heads"],
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        _check_sizes(layers, width, heads, context)
        if vocab_size < 1:
            raise ValueError(f"GPT needs vocab_size >= 1, got {vocab_size}")
        self.context = context
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self._init(layers)
        if tie_weights:
            self.head.weight = self.tokens.weight

    def _init(self, layers: int) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for block in self.blocks:
            assert isinstance(block, Block)
            for residual in (block.attention.proj, block.mlp[2]):
                assert isinstance(residual, nn.Linear)
                nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: Tensor) -> Tensor:
        """Returns logits ``(N, T, vocab_size)`` for token ids ``(N, T)``, ``T <= context``.

        Raises:
            ValueError: For an input that is not ``(N, T)`` or longer than the context.
        """
        if tokens.dim() != 2:
            raise ValueError(f"GPT expects token ids (N, T), got shape {tuple(tokens.shape)}")
        n, length = tokens.shape
        if length > self.context:
            raise ValueError(f"sequence of {length} tokens exceeds the context {self.context}")
        # Positions per sample (not broadcast): the embedding's K-FAC block sees a batch.
        positions = torch.arange(length, device=tokens.device).expand(n, length)
        x = self.tokens(tokens) + self.positions(positions)
        return self.head(self.norm(self.blocks(x)))


def _check_sizes(layers: int, width: int, heads: int, context: int) -> None:
    problem = size_problem(layers, width, heads, context)
    if problem is not None:
        raise ValueError(problem)


def size_problem(layers: int, width: int, heads: int, seq_len: int) -> str | None:
    """What is wrong with GPT sizes (in the flags' words), or ``None`` when they are valid:
    each in the domain of its flag (:data:`~dkfac.app.domains.DOMAINS`), the heads dividing
    the width."""
    sizes = {"layers": layers, "width": width, "heads": heads, "seq_len": seq_len}
    for name, value in sizes.items():
        if problem := domain_error(name, value):
            return problem
    if width % heads:
        return f"--width ({width}) must be a multiple of --heads ({heads})"
    return None


def add_gpt_arguments(group: Any) -> None:
    """Adds ``--layers --width --heads --seq-len`` to a parser or argument group."""
    group.add_argument(
        "--layers", type=int, default=DEFAULTS["layers"], help="gpt: transformer blocks"
    )
    group.add_argument(
        "--width", type=int, default=DEFAULTS["width"], help="gpt: features per token"
    )
    group.add_argument(
        "--heads", type=int, default=DEFAULTS["heads"], help="gpt: attention heads (divide --width)"
    )
    group.add_argument(
        "--seq-len",
        type=int,
        default=DEFAULTS["seq_len"],
        help="tokens per sample (--data text) and the gpt's context",
    )


def gpt_options(args: argparse.Namespace) -> dict[str, int]:
    """The :class:`GPT` sizes of parsed ``--layers --width --heads`` flags."""
    return {"layers": args.layers, "width": args.width, "heads": args.heads}
