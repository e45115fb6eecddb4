"""Hand-written twins of torch's attention layers: the same math with one nn.Linear per
projection, weights copied from the original (float64), so K-FAC's update of the original
can be checked against the update of plain Linear layers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACPreconditioner


class TwinAttention(nn.Module):
    """``mha``'s attention with q/k/v/out as four nn.Linear layers (weights copied)."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        embed = mha.embed_dim
        bias = mha.in_proj_bias is not None
        self.embed, self.heads, self.batch_first = embed, mha.num_heads, mha.batch_first
        self.q_proj = nn.Linear(embed, embed, bias=bias).double()
        self.k_proj = nn.Linear(mha.kdim, embed, bias=bias).double()
        self.v_proj = nn.Linear(mha.vdim, embed, bias=bias).double()
        self.out_proj = nn.Linear(embed, embed, bias=bias).double()
        with torch.no_grad():
            for i, proj in enumerate(self.projections()):
                proj.weight.copy_(projection_weight(mha, i))
                if bias:
                    proj.bias.copy_(mha.in_proj_bias[i * embed : (i + 1) * embed])
            self.out_proj.load_state_dict(mha.out_proj.state_dict())

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """q, k and v."""
        return self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None
    ) -> tuple[Tensor, None]:
        """Softmax attention; ``attn_mask`` is a float ``(L, S)`` mask added to the scores."""
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, tgt, _ = query.shape
        head_dim = self.embed // self.heads

        def split(x: Tensor) -> Tensor:
            return x.view(n, x.shape[1], self.heads, head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(query)), split(self.k_proj(key)), split(self.v_proj(value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        if attn_mask is not None:
            scores = scores + attn_mask
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(n, tgt, self.embed)
        out = self.out_proj(out)
        return (out if self.batch_first else out.transpose(0, 1)), None


def projection_weight(mha: nn.MultiheadAttention, index: int) -> Tensor:
    """The weight of q (0), k (1) or v (2) in ``mha``."""
    if mha._qkv_same_embed_dim:
        embed = mha.embed_dim
        return mha.in_proj_weight[index * embed : (index + 1) * embed]
    weight = getattr(mha, "qkv"[index] + "_proj_weight")
    assert isinstance(weight, Tensor)
    return weight


def assert_same_attention(mha: nn.MultiheadAttention, twin: TwinAttention) -> None:
    """The attention's weights equal the twin's (to 1e-10)."""
    embed = mha.embed_dim
    for i, proj in enumerate(twin.projections()):
        torch.testing.assert_close(projection_weight(mha, i), proj.weight, rtol=0, atol=1e-10)
        if proj.bias is not None:
            rows = mha.in_proj_bias[i * embed : (i + 1) * embed]
            torch.testing.assert_close(rows, proj.bias, rtol=0, atol=1e-10)
    torch.testing.assert_close(mha.out_proj.weight, twin.out_proj.weight, rtol=0, atol=1e-10)


def _copy(target: nn.Module, source: nn.Module) -> nn.Module:
    target.load_state_dict(source.state_dict())
    return target


class TwinEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` (ReLU, no dropout) with a :class:`TwinAttention`."""

    def __init__(self, layer: nn.TransformerEncoderLayer) -> None:
        super().__init__()
        self.norm_first = layer.norm_first
        self.self_attn = TwinAttention(layer.self_attn)
        self.linear1 = _copy(nn.Linear(*layer.linear1.weight.shape[::-1]).double(), layer.linear1)
        self.linear2 = _copy(nn.Linear(*layer.linear2.weight.shape[::-1]).double(), layer.linear2)
        self.norm1 = _copy(nn.LayerNorm(layer.norm1.normalized_shape).double(), layer.norm1)
        self.norm2 = _copy(nn.LayerNorm(layer.norm2.normalized_shape).double(), layer.norm2)

    def _sa(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.self_attn(x, x, x, mask)[0]

    def _ff(self, x: Tensor) -> Tensor:
        return self.linear2(F.relu(self.linear1(x)))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Post- or pre-LayerNorm residual blocks, as the original."""
        if self.norm_first:
            x = x + self._sa(self.norm1(x), mask)
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self._sa(x, mask))
        return self.norm2(x + self._ff(x))


class TwinDecoderLayer(TwinEncoderLayer):
    """``nn.TransformerDecoderLayer`` (ReLU, no dropout) with two :class:`TwinAttention`."""

    def __init__(self, layer: nn.TransformerDecoderLayer) -> None:
        super().__init__(layer)  # type: ignore[arg-type]  # same attribute names
        self.multihead_attn = TwinAttention(layer.multihead_attn)
        self.norm3 = _copy(nn.LayerNorm(layer.norm3.normalized_shape).double(), layer.norm3)

    def forward(  # type: ignore[override]
        self, x: Tensor, memory: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """Self-attention, cross-attention on ``memory``, then the MLP."""
        cross = self.multihead_attn
        if self.norm_first:
            x = x + self._sa(self.norm1(x), mask)
            x = x + cross(self.norm2(x), memory, memory)[0]
            return x + self._ff(self.norm3(x))
        x = self.norm1(x + self._sa(x, mask))
        x = self.norm2(x + cross(x, memory, memory)[0])
        return self.norm3(x + self._ff(x))


def train_with_kfac(
    model: nn.Module, method: str, data: list[tuple[Tensor, ...]]
) -> KFACPreconditioner:
    """Steps of SGD on K-FAC gradients (fixed damping, no KL clip, factors and inverses
    every step); each item of ``data`` is ``(*inputs, target)`` of a cross-entropy loss."""
    pre = KFACPreconditioner(
        model,
        method=method,
        damping=0.1,
        kl_clip=None,
        factor_update_interval=1,
        inverse_update_interval=1,
    )
    sgd = torch.optim.SGD(model.parameters(), lr=0.2)
    for *inputs, target in data:
        sgd.zero_grad()
        F.cross_entropy(model(*inputs), target).backward()
        pre.step()
        sgd.step()
    return pre
