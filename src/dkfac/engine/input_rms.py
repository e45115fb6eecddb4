"""The orthogonalised updates divided by the RMS entry of their layers' inputs
(``orthogonal_input_rms``).

Adam's normalised step, and the polar factor that replaces it, move every entry of ``W``
about as far whatever the size of the layer's input ``a``; the layer's output then moves by
``ΔW·a``, in proportion to ``a``'s size. A layer fed small inputs (an autoencoder's code at
initialisation) barely changes what it computes, and one whose inputs grew a hundredfold in
a few steps changes it a hundred times more than at first. With the option, each
orthogonalised update is divided by

    s = √((ms(x) · (d − b) + b) / d),

the RMS entry of the layer's input row ``ā = (x, 1)`` (``d`` entries, ``b = 1`` where the
bias's constant is one of them, :attr:`~dkfac.blocks.base.Block.input_row_bias`; ``ms(x)``
the mean square of the input's entries), so that ``ΔW·ā`` has about the same size in every
layer and at every step, as K-FAC's own step (in the units of ``A``, whose mean diagonal
``s²`` is) would. ``s²`` is the step's own: the mean over the step's forwards in training
mode with gradients on (every such forward, whether or not a backward follows it), then
over the ranks that had one, by one all-reduce of two numbers a layer (booked as
``"factors"``: an input statistic); a layer no forward reached keeps its update. A read at
a factor capture (every few steps) or a basis refresh was measured to lag behind inputs
that grow fast early in training (the digits autoencoder: 28 median steps to its target
with the scale of every 8th step, against 14 with every step's and 20 without). A
convolution's input entries stand for its patches' (the zero padding aside). Nothing here
reads a value on the host: a CUDA step stays free of synchronisations.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dkfac.distributed.comm import Communicator
from dkfac.engine.layer_state import LayerState

__all__ = ["add_input_square", "input_scales"]


def add_input_square(layer: LayerState, x: Tensor) -> None:
    """Adds ``s²`` of one forward's input ``x`` (module notes: the mean square of the input
    row ``(x, 1)``) to ``layer``'s step."""
    if x.numel() == 0:
        return
    width = layer.block.a_dim
    bias = float(bool(layer.block.input_row_bias))
    with torch.no_grad():
        x = x.detach()
        low = x.dtype not in (torch.float32, torch.float64)  # float32 at least
        norm = torch.linalg.vector_norm(x, dtype=torch.float32 if low else None)
        square = norm.square().mul_((width - bias) / (width * x.numel())).add_(bias / width)
    held = layer.input_square
    layer.input_square = square if held is None else held + square
    layer.input_forwards += 1


def input_scales(layers: Mapping[str, LayerState], comm: Communicator) -> dict[str, Tensor]:
    """``1 / s`` (module notes) as a 0-d tensor for each layer that divides its update by its
    input's RMS, from this step's forwards, averaged over the ranks of ``comm`` that had
    one (every rank calls this with the same layers, and sends the same dtype: float64 if a
    picked layer's parameters are, else float32); 1 where no rank had a forward or ``s``
    is not a positive finite number. Clears the layers' sums."""
    names = [name for name, layer in layers.items() if layer.input_rms]
    if not names:
        return {}
    params = [layers[name].block.parameters()[0] for name in names]
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    found, counts = [], []
    for name in names:
        layer = layers[name]
        found.append(layer.input_square)
        counts.append(layer.input_forwards)
        layer.input_square, layer.input_forwards = None, 0
    if not comm.active and not any(counts):
        return {}  # no forward reached them: nothing to scale
    zero = torch.zeros((), dtype=dtype, device=params[0].device)
    # Each layer's mean over its forwards (Python divisors: no host copy)
    square = torch.stack(
        [
            zero if held is None else held.to(dtype) / n
            for held, n in zip(found, counts, strict=True)
        ]
    )
    reached = None
    if comm.active:  # summed over the ranks, with the number of ranks that had a forward
        had = torch.stack([zero + float(n > 0) for n in counts])
        both = torch.stack([square, had])
        comm.all_reduce([both], "factors", op="sum").wait()
        reached = both[1]
        square = both[0] / reached.clamp_min(1.0)
    usable = square.isfinite() & (square > 0)
    if reached is not None:
        usable &= reached > 0
    scale = torch.where(usable, square.rsqrt(), torch.ones_like(square))
    return dict(zip(names, scale.unbind(0), strict=True))
