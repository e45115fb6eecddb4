"""``--optimizer muon``: ``torch.optim.Muon`` on the hidden weights, AdamW on the rest.

The split is the benchmarks' (:func:`dkfac.bench.peers.muon_split`): Muon takes the weight of
every Linear and convolution except the input layer and the head; AdamW takes everything
else (biases, normalisation, embeddings, the input layer, the head). A convolution's weight
``(out, in, *kernel)`` is given to Muon as the 2-D view ``(out, in·prod(kernel))`` of the same
storage, so Muon's in-place update lands in the weight.

:class:`MuonAdamW` is one ``torch.optim.Optimizer`` to the training program: its
``param_groups`` are the two optimizers' groups (the same dicts), so an LR scheduler scales
both from their own base rates, and its state dict holds both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from dkfac.bench.peers import muon_split

__all__ = ["MuonAdamW"]


class MuonAdamW(Optimizer):
    """Muon on the hidden weight matrices of ``model``, AdamW on its other parameters.

    Args:
        model: The model (its trainable parameters are split between the two).
        lr: Muon's learning rate (> 0).
        adamw_lr: AdamW's learning rate (> 0).
        momentum: Muon's momentum in [0, 1) (Nesterov); also AdamW's β₁.
        weight_decay: Decoupled weight decay (>= 0) of both.

    Raises:
        ValueError: For a bad rate, momentum or decay, or a model with no hidden weight matrix.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        *,
        adamw_lr: float,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
    ) -> None:
        for name, value in (("lr", lr), ("adamw_lr", adamw_lr)):
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not 0.0 <= weight_decay < float("inf"):
            raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
        split = muon_split(model)
        params = dict(model.named_parameters())
        # (parameter, the 2-D tensor Muon updates: the parameter itself or a view of it)
        self._pairs = [(params[n], _as_matrix(params[n])) for n in split.muon]
        self.muon = torch.optim.Muon(
            [m for _, m in self._pairs],
            lr=lr,
            momentum=momentum,
            nesterov=True,
            weight_decay=weight_decay,
        )
        self.adamw = torch.optim.AdamW(
            [params[n] for n in split.adamw],
            lr=adamw_lr,
            betas=(momentum, 0.999),
            weight_decay=weight_decay,
        )
        super().__init__([{"params": [p for p, _ in self._pairs]}], {})
        # Share, not copy: a scheduler scales each group from its own base rate.
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of every parameter and of Muon's 2-D views."""
        self.adamw.zero_grad(set_to_none)
        for param, matrix in self._pairs:
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                param.grad.zero_()
            if matrix is not param:
                matrix.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One Muon step on the hidden matrices and one AdamW step on the rest."""
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        for param, matrix in self._pairs:
            if matrix is not param:
                matrix.grad = None if param.grad is None else param.grad.reshape(matrix.shape)
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict[str, Any]:
        """Both optimizers' states."""
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores both optimizers from :meth:`state_dict`'s output.

        Raises:
            ValueError: If ``state_dict`` is not such an output.
        """
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(f"not a MuonAdamW state: keys {sorted(state_dict)}")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def _as_matrix(param: Tensor) -> Tensor:
    """``param`` if 2-D, else a ``(rows, -1)`` view of its storage."""
    return param if param.ndim == 2 else param.detach().view(param.shape[0], -1)
