"""``nn.MultiheadAttention``'s forward with its four projections called as hookable modules.

``nn.MultiheadAttention`` applies ``in_proj_weight`` and ``out_proj.weight`` functionally
(``F.multi_head_attention_forward``), so no module hook ever sees the q/k/v projections or
the out projection's input. :func:`explicit_forward` computes the same function in three
steps:

1. q, k, v by three modules (:class:`~dkfac.blocks.attention.Projection`) on batch-first
   views of the inputs, so a forward hook reads each projection's input and output;
2. the attention core (:func:`attention_core`), the code of
   ``F.multi_head_attention_forward`` after its input projection: ``bias_k``/``bias_v``,
   ``add_zero_attn``, the masks (boolean or float, ``key_padding_mask`` merged into
   ``attn_mask``), ``is_causal``, dropout, and either the explicit softmax when
   ``need_weights`` (weights averaged over heads when ``average_attn_weights``) or
   ``F.scaled_dot_product_attention``;
3. ``module.out_proj`` called as a module (its own hooks fire).

The masks are checked and canonicalised by the same (private) torch helpers that
``nn.MultiheadAttention.forward`` calls, so errors and mask semantics are torch's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["attention_core", "explicit_forward"]


def _check_attn_mask(attn_mask: Tensor | None, size: tuple[int, int, int]) -> None:
    """Raises torch's errors for an ``attn_mask`` of the wrong shape.

    Args:
        attn_mask: The canonical mask, ``(L, S)`` or ``(N·H, L, S)``.
        size: ``(N·H, L, S)``.
    """
    if attn_mask is None:
        return
    if attn_mask.dim() == 2:
        if tuple(attn_mask.shape) != size[1:]:
            raise RuntimeError(
                f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {size[1:]}."
            )
    elif attn_mask.dim() == 3:
        if tuple(attn_mask.shape) != size:
            raise RuntimeError(
                f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {size}."
            )
    else:
        raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")


def _pad(mask: Tensor | None) -> Tensor | None:
    """One more (unmasked) key position at the end of a mask."""
    return None if mask is None else F.pad(mask, (0, 1))


def attention_core(
    module: nn.MultiheadAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    is_causal: bool,
) -> tuple[Tensor, Tensor | None]:
    """Multi-head attention of projected, batch-first ``q`` (N, L, E), ``k``, ``v`` (N, S, E).

    Args:
        module: The attention (heads, ``bias_k``/``bias_v``, ``add_zero_attn``, dropout).
        q: Projected queries.
        k: Projected keys.
        v: Projected values.
        attn_mask: Canonical float mask ``(L, S)`` or ``(N·H, L, S)``, or ``None``.
        key_padding_mask: Canonical float mask ``(N, S)``, or ``None``.
        need_weights: Also return the per-head weights ``(N, H, L, S)`` (explicit softmax).
        is_causal: Causal attention without a mask (only with neither mask given).

    Returns:
        The heads' outputs concatenated, ``(N, L, E)`` (before the out projection), and the
        weights or ``None``.
    """
    batch, tgt, embed = q.shape
    heads = module.num_heads
    head_dim = embed // heads
    _check_attn_mask(attn_mask, (batch * heads, tgt, k.shape[1]))
    if module.bias_k is not None and module.bias_v is not None:
        k = torch.cat([k, module.bias_k.reshape(1, 1, embed).expand(batch, 1, embed)], dim=1)
        v = torch.cat([v, module.bias_v.reshape(1, 1, embed).expand(batch, 1, embed)], dim=1)
        attn_mask, key_padding_mask = _pad(attn_mask), _pad(key_padding_mask)
    qh = q.view(batch, tgt, heads, head_dim).transpose(1, 2)
    kh = k.view(batch, k.shape[1], heads, head_dim).transpose(1, 2)
    vh = v.view(batch, v.shape[1], heads, head_dim).transpose(1, 2)
    if module.add_zero_attn:
        zeros = kh.new_zeros(batch, heads, 1, head_dim)
        kh, vh = torch.cat([kh, zeros], dim=2), torch.cat([vh, zeros], dim=2)
        attn_mask, key_padding_mask = _pad(attn_mask), _pad(key_padding_mask)
    src = kh.shape[2]
    mask = None
    if attn_mask is not None:
        mask = attn_mask.view(-1, heads, tgt, src) if attn_mask.dim() == 3 else attn_mask
    if key_padding_mask is not None:
        padding = key_padding_mask.view(batch, 1, 1, src)
        mask = padding if mask is None else mask + padding
    dropout = float(module.dropout) if module.training else 0.0
    if not need_weights:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, dropout_p=dropout, is_causal=is_causal
        )
        return out.transpose(1, 2).reshape(batch, tgt, embed), None
    scores = torch.matmul(qh * math.sqrt(1.0 / float(head_dim)), kh.transpose(-2, -1))
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    if dropout > 0.0:
        weights = F.dropout(weights, p=dropout)
    out = torch.matmul(weights, vh)
    return out.transpose(1, 2).reshape(batch, tgt, embed), weights


def explicit_forward(
    module: nn.MultiheadAttention,
    projections: Mapping[str, nn.Module],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``module(query, key, value, ...)`` computed with hookable projections.

    Args:
        module: The attention.
        projections: ``"q"``, ``"k"``, ``"v"`` -> the module computing that projection.
        query: As ``nn.MultiheadAttention.forward`` takes it (the other arguments too).
        key: The keys.
        value: The values.
        key_padding_mask: ``(N, S)`` (``(S,)`` unbatched), boolean or float.
        need_weights: Return the attention weights.
        attn_mask: ``(L, S)`` or ``(N·H, L, S)``, boolean or float.
        average_attn_weights: Average the returned weights over heads.
        is_causal: The hint that ``attn_mask`` is the causal mask.

    Returns:
        ``(output, weights or None)`` in the layout ``nn.MultiheadAttention`` returns.
    """
    batched = F._mha_shape_check(  # type: ignore[attr-defined]
        query, key, value, key_padding_mask, attn_mask, module.num_heads
    )
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
            "module method `generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # the hint goes to scaled_dot_product_attention as is_causal
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False  # the merged mask is no longer causal
    if not batched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not module.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    q, k, v = projections["q"](query), projections["k"](key), projections["v"](value)
    out, weights = attention_core(
        module, q, k, v, attn_mask, key_padding_mask, need_weights, is_causal
    )
    out = module.out_proj(out)
    if weights is not None and average_attn_weights:
        weights = weights.mean(dim=1)
    if not batched:
        return out.squeeze(0), None if weights is None else weights.squeeze(0)
    return (out if module.batch_first else out.transpose(0, 1)), weights
