"""The train / test splits a dataset loader returns (shared by every loader)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Splits:
    """A dataset held in memory: train and test tensors plus their shape.

    For ``"text"`` (see :mod:`dkfac.app.text`) inputs and targets are int64 byte windows
    ``(N, seq_len)``, ``image_size`` is ``seq_len`` and ``num_classes`` the vocabulary (256).

    Attributes:
        name: Dataset name (``"digits"``, ``"cifar10"``, ...).
        x_train: float32 images ``(N_train, C, H, W)``.
        y_train: int64 labels ``(N_train,)``.
        x_test: float32 images ``(N_test, C, H, W)``.
        y_test: int64 labels ``(N_test,)``.
        in_channels: ``C``.
        image_size: ``H == W``.
        num_classes: Number of classes.
        mean: Per-channel mean subtracted from the raw [0, 1] pixels (empty if none was).
        std: Per-channel standard deviation divided out (empty if none was).
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    in_channels: int
    image_size: int
    num_classes: int
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()


DatasetSpec = Splits
"""Alias of :class:`Splits`."""
