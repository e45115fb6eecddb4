"""The orthogonalised updates divided by the RMS entry of their layers' inputs
(``orthogonal_input_rms``).

Adam's normalised step, and the polar factor that replaces it, move every entry of ``W``
about as far whatever the size of the layer's input ``a``; the layer's output then moves by
``ΔW·a``, in proportion to ``a``'s size. A layer fed small inputs (an autoencoder's code at
initialisation) barely changes what it computes, and one whose inputs grew a hundredfold in
a few steps changes it a hundred times more than at first. With the option, each
orthogonalised update is divided by

    s = √((ms(x) · (d − b) + b) / d),

the RMS entry of the layer's input row ``ā = (x, 1)`` (``d`` entries, ``b = 1`` for a bias's
constant, else 0; ``ms(x)`` the mean square of the input's entries this step, over its
forwards and, with a process group, its ranks: one all-reduce of one number a layer), so
that ``ΔW·ā`` has about the same size in every layer and at every step, as K-FAC's own step
(in the units of ``A``, whose mean diagonal ``s²`` is) would. The statistic is the step's
own: one read at a factor capture (every few steps) or a basis refresh was measured to lag
behind inputs that grow fast early in training (the digits autoencoder: 28 median steps to
its target with the scale of every 8th step, against 14 with every step's and 20 without).
A convolution's input entries stand for its patches' (the zero padding aside).
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
    width = layer.block.statistic_shapes()["A"][0]
    bias = float(layer.block.has_bias)
    with torch.no_grad():
        x = x.detach()
        low = x.dtype not in (torch.float32, torch.float64)  # float32 at least
        norm = torch.linalg.vector_norm(x, dtype=torch.float32 if low else None)
        square = norm.square().mul_((width - bias) / (width * x.numel())).add_(bias / width)
    held = layer.input_square
    layer.input_square = square if held is None else held + square
    layer.input_forwards += 1


def input_scales(layers: Mapping[str, LayerState], comm: Communicator) -> dict[str, Tensor]:
    """``1 / s`` (module notes) as a 0-d tensor (float32; float64 for float64 inputs) for each
    layer that divides its update by its input's RMS, from this step's forwards (averaged
    over the ranks of ``comm``: every rank calls this with the same layers); 1 for a layer
    no forward reached on any rank, or whose ``s`` is not a positive finite number. Clears
    the layers' sums."""
    names = [name for name, layer in layers.items() if layer.input_rms]
    if not names:
        return {}
    found = [layers[name].input_square for name in names]
    counts = [layers[name].input_forwards for name in names]
    for name in names:
        layers[name].input_square, layers[name].input_forwards = None, 0
    like = next((held for held in found if held is not None), None)
    if like is None and not comm.active:
        return {}  # no forward reached them: nothing to scale
    if like is None:
        like = torch.zeros((), device=layers[names[0]].block.parameters()[0].device)
    dtype = (
        torch.float64
        if any(h is not None and h.dtype == torch.float64 for h in found)
        else like.dtype
    )
    held = torch.stack(
        [h.to(dtype) if h is not None else like.new_zeros((), dtype=dtype) for h in found]
    )
    if len(set(counts)) == 1:  # the same forwards for all: one division
        square = held / max(counts[0], 1)
    else:
        square = held / held.new_tensor([max(n, 1) for n in counts])
    present = None
    if comm.active:  # each rank's mean, averaged over the ranks that had a forward
        reached = held.new_tensor([float(n > 0) for n in counts])
        both = torch.stack([square, reached])
        comm.all_reduce([both], "factors", op="sum").wait()
        present = both[1]
        square = both[0] / present.clamp_min(1.0)
    usable = square.isfinite() & (square > 0)
    if present is not None:
        usable &= present > 0
    scale = torch.where(usable, square.rsqrt(), torch.ones_like(square))
    return dict(zip(names, scale.unbind(0), strict=True))
