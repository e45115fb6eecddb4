"""Datasets, augmentation and batching for the dkfac app, in plain PyTorch (no torchvision).

Datasets are small enough to live in memory as tensors: :func:`load_dataset` returns a
:class:`Splits` with float32 images ``(N, C, H, W)`` and int64 labels. :func:`batches` iterates
mini-batches and :func:`shard_indices` splits an epoch across ranks exactly like
``torch.utils.data.DistributedSampler``. The CIFAR file format lives in
:mod:`dkfac.app.cifar`, the byte-level text of the language-model task in :mod:`dkfac.app.text`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from dkfac.app import text
from dkfac.app.cifar import (
    CIFAR10,
    CIFAR100,
    CifarArrays,
    DataError,
    PathLike,
    read_cifar,
    write_cifar_archive,
)
from dkfac.app.splits import DatasetSpec, Splits

logger = logging.getLogger(__name__)

__all__ = [
    "DATASETS",
    "CifarArrays",
    "DataError",
    "DatasetSpec",
    "Splits",
    "batches",
    "load_cifar",
    "load_dataset",
    "load_digits",
    "random_crop_flip",
    "read_cifar",
    "shard_indices",
    "synthetic",
    "write_cifar_archive",
]

DATASETS = ("digits", "cifar10", "cifar100", "synthetic", "text")


def _standardize(
    x_train: Tensor, x_test: Tensor
) -> tuple[Tensor, Tensor, list[float], list[float]]:
    """Per-channel standardisation with statistics of the training images only."""
    x64 = x_train.double()
    mean = x64.mean(dim=(0, 2, 3))
    std = x64.std(dim=(0, 2, 3), unbiased=False).clamp_min(1e-12)

    def apply(x: Tensor) -> Tensor:
        return ((x.double() - mean[:, None, None]) / std[:, None, None]).float()

    return apply(x_train), apply(x_test), mean.tolist(), std.tolist()


def _splits(
    name: str,
    x_train: Tensor,
    y_train: Tensor,
    x_test: Tensor,
    y_test: Tensor,
    num_classes: int,
    normalize: bool,
) -> Splits:
    mean: list[float] = []
    std: list[float] = []
    if normalize:
        x_train, x_test, mean, std = _standardize(x_train, x_test)
    return Splits(
        name,
        x_train.contiguous(),
        y_train.long(),
        x_test.contiguous(),
        y_test.long(),
        in_channels=x_train.shape[1],
        image_size=x_train.shape[2],
        num_classes=num_classes,
        mean=tuple(mean),
        std=tuple(std),
    )


def load_digits(test_fraction: float = 0.2, seed: int = 0, normalize: bool = True) -> Splits:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), offline.

    Pixels (0..16) are scaled to [0, 1]; the split is stratified by class and seeded. With
    ``normalize`` both splits are standardised with the train mean and standard deviation.

    Args:
        test_fraction: Fraction of the images held out for testing, in (0, 1).
        seed: Seed of the split.
        normalize: Standardise with the train statistics; otherwise keep [0, 1] pixels.

    Returns:
        ``x`` of shape ``(N, 1, 8, 8)`` (float32) and ``y`` (int64) for train and test.

    Raises:
        DataError: If scikit-learn is missing or ``test_fraction`` is out of range.
    """
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be in (0, 1), got {test_fraction}")
    try:
        from sklearn.datasets import load_digits as sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # pragma: no cover - scikit-learn is an app dependency
        raise DataError("the digits dataset needs scikit-learn: pip install 'dkfac[app]'") from exc
    digits = sk_load_digits()
    x = torch.from_numpy(np.asarray(digits.images, dtype=np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(np.asarray(digits.target, dtype=np.int64))
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=test_fraction, random_state=seed, stratify=y.numpy()
    )
    tr, te = torch.from_numpy(np.sort(idx_train)), torch.from_numpy(np.sort(idx_test))
    logger.info("digits: %d train, %d test", len(tr), len(te))
    return _splits("digits", x[tr], y[tr], x[te], y[te], 10, normalize)


def load_cifar(root: PathLike, num_classes: int = 10, normalize: bool = True) -> Splits:
    """CIFAR-10 or CIFAR-100 from the official python archive (see :func:`read_cifar`).

    Args:
        root: ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``, a directory holding
            it or its extracted folder, or the extracted folder itself.
        num_classes: 10 or 100 (CIFAR-100 uses the fine labels).
        normalize: Standardise each channel with the train-set mean and standard deviation;
            otherwise images are the raw pixels divided by 255.

    Returns:
        float32 images ``(N, 3, 32, 32)`` and int64 labels for train and test.

    Raises:
        DataError: If the archive is missing, truncated, malformed or unsafe.
    """
    arrays = read_cifar(root, num_classes)

    def scaled(a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).float().div_(255.0)

    return _splits(
        f"cifar{num_classes}",
        scaled(arrays.x_train),
        torch.from_numpy(arrays.y_train),
        scaled(arrays.x_test),
        torch.from_numpy(arrays.y_test),
        num_classes,
        normalize,
    )


def synthetic(
    num_samples: int = 1024,
    in_channels: int = 3,
    image_size: int = 32,
    num_classes: int = 10,
    seed: int = 0,
    num_test: int | None = None,
    signal: float = 0.0,
) -> Splits:
    """Random images and labels of any shape, e.g. for throughput measurements.

    Images are standard normal noise plus ``signal`` times a fixed random prototype of their
    class, so ``signal > 0`` gives a learnable problem and ``signal == 0`` pure noise.

    Args:
        num_samples: Training images.
        in_channels: Channels per image.
        image_size: Height and width.
        num_classes: Number of classes.
        seed: Seed of the generator.
        num_test: Test images; defaults to ``max(1, num_samples // 4)``.
        signal: Weight of the class prototypes.

    Returns:
        The random splits (not normalised).
    """
    n_test = max(1, num_samples // 4) if num_test is None else num_test
    if num_samples < 0 or n_test < 0 or num_classes < 1 or in_channels < 1 or image_size < 1:
        raise DataError(
            f"bad synthetic sizes: {num_samples=}, {n_test=}, {num_classes=}, "
            f"{in_channels=}, {image_size=}"
        )
    _check_synthetic_memory(num_samples + n_test + num_classes, in_channels * image_size**2)
    g = torch.Generator().manual_seed(seed)
    shape = (in_channels, image_size, image_size)
    prototypes = torch.randn((num_classes, *shape), generator=g)
    n = num_samples + n_test
    y = torch.randint(0, num_classes, (n,), generator=g)
    x = torch.randn((n, *shape), generator=g) + signal * prototypes[y]
    return _splits(
        "synthetic", x[:num_samples], y[:num_samples], x[num_samples:], y[num_samples:],
        num_classes, normalize=False,
    )  # fmt: skip


def half_memory() -> int:
    """Half of this machine's physical memory in bytes (16 GiB where it cannot be read): the
    most a tensor made from flags (synthetic data, a benchmark's batch) may take."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, OSError, ValueError):  # not on this platform
        return 16 * 2**30


def _check_synthetic_memory(images: int, pixels: int) -> None:
    """Refuses synthetic data that would not fit in half of this machine's memory."""
    need = 4 * images * pixels  # float32 images and class prototypes
    budget = half_memory()
    if need > budget:
        raise DataError(
            f"synthetic data of {images} images of {pixels} values would take "
            f"{need / 2**30:.1f} GiB, more than half of this machine's memory "
            f"({budget / 2**30:.1f} GiB); reduce --synthetic-samples, --num-classes, "
            "--image-size or --in-channels"
        )


def load_dataset(
    name: str,
    data_dir: PathLike | None = None,
    seed: int = 0,
    *,
    normalize: bool = True,
    test_fraction: float = 0.2,
    num_samples: int = 1024,
    in_channels: int = 3,
    image_size: int = 32,
    num_classes: int = 10,
    text_path: PathLike | None = None,
    text_bytes: int | None = None,
    text_glob: str | None = None,
    seq_len: int = 128,
) -> Splits:
    """Loads a dataset by name.

    Args:
        name: ``"digits"``, ``"cifar10"``, ``"cifar100"``, ``"synthetic"`` or ``"text"``.
        data_dir: Where the CIFAR archive is (required for CIFAR, ignored otherwise).
        seed: Seed of the digits split or of the synthetic data.
        normalize: Standardise digits / CIFAR with their train statistics.
        test_fraction: Held-out fraction for digits.
        num_samples: Synthetic training images.
        in_channels: Synthetic channels.
        image_size: Synthetic height and width.
        num_classes: Synthetic classes.
        text_path: Text file or folder (``None``: the standard library's source).
        text_bytes: Bytes of text to read at most (``None``: the default of
            :func:`~dkfac.app.text.load_text`).
        text_glob: File-name pattern of a text folder (``None``: ``*.py``).
        seq_len: Tokens per text sample.

    Returns:
        The dataset's :class:`Splits`.

    Raises:
        DataError: For an unknown name, a CIFAR name without ``data_dir``, or unreadable data.
    """
    if name == "digits":
        return load_digits(test_fraction, seed, normalize)
    if name in ("cifar10", "cifar100"):
        lay = CIFAR10 if name == "cifar10" else CIFAR100
        if data_dir is None:
            raise DataError(
                f"{name}: --data-dir is required; point it at {lay.archive}, a directory "
                f"containing it, or the extracted {lay.folder}/ folder ({lay.expected()})"
            )
        return load_cifar(data_dir, lay.num_classes, normalize)
    if name == "synthetic":
        return synthetic(num_samples, in_channels, image_size, num_classes, seed)
    if name == "text":
        return text.load_text(
            text_path,
            seq_len,
            text.DEFAULT_TEXT_BYTES if text_bytes is None else text_bytes,
            text.DEFAULT_GLOB if text_glob is None else text_glob,
        )
    raise DataError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def random_crop_flip(
    x: Tensor, padding: int = 4, generator: torch.Generator | None = None, flip: bool = True
) -> Tensor:
    """Per-sample random crop (with zero padding) and horizontal flip of a batch.

    Each image is zero-padded by ``padding`` on every side, a window of the original size is
    cut at a uniformly random offset in ``[0, 2 * padding]`` per axis, and with probability 1/2
    (when ``flip``) it is mirrored left-right. Vectorised: one gather for the whole batch.

    Args:
        x: Images ``(N, C, H, W)``.
        padding: Zero padding on each side (0 disables cropping).
        generator: Source of randomness; its device is used to draw the offsets.
        flip: Whether to flip horizontally at random.

    Returns:
        A new tensor of the same shape, dtype and device as ``x``.
    """
    if x.dim() != 4:
        raise ValueError(f"expected a batch (N, C, H, W), got shape {tuple(x.shape)}")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    n, c, h, w = x.shape
    dev = generator.device if generator is not None else x.device
    oy = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=dev).to(x.device)
    ox = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=dev).to(x.device)
    cols = torch.arange(w, device=x.device).expand(n, w)
    if flip:
        mirror = torch.rand(n, generator=generator, device=dev).to(x.device) < 0.5
        cols = torch.where(mirror[:, None], (w - 1) - cols, cols)
    rows = oy[:, None] + torch.arange(h, device=x.device)
    cols = ox[:, None] + cols
    padded = torch.nn.functional.pad(x, (padding,) * 4) if padding else x
    return padded[
        torch.arange(n, device=x.device)[:, None, None, None],
        torch.arange(c, device=x.device)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


def batches(
    x: Tensor,
    y: Tensor,
    batch_size: int,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Iterates ``(x, y)`` mini-batches along the first dimension.

    Args:
        x: Inputs ``(N, ...)``.
        y: Targets ``(N, ...)``.
        batch_size: Samples per batch (the last one may be smaller unless ``drop_last``).
        shuffle: Visit samples in a random order drawn from ``generator``.
        generator: Source of the permutation (CPU generator).
        drop_last: Skip a final incomplete batch.

    Yields:
        Pairs of tensors with ``batch_size`` (or fewer) rows.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(x) != len(y):
        raise ValueError(f"x and y have different lengths: {len(x)} vs {len(y)}")
    n = len(x)
    order = torch.randperm(n, generator=generator) if shuffle else None
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        if order is None:
            yield x[start : start + batch_size], y[start : start + batch_size]
        else:
            idx = order[start : start + batch_size].to(x.device)
            yield x[idx], y[idx.to(y.device)]


def shard_indices(
    n: int,
    rank: int,
    world_size: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """The indices rank ``rank`` visits in ``epoch``, as ``DistributedSampler`` yields them.

    The permutation (``randperm`` seeded with ``seed + epoch``) is the same on every rank;
    it is padded by wrapping around (or truncated, with ``drop_last``) to a multiple of
    ``world_size``, and rank ``r`` takes every ``world_size``-th index from position ``r``. All
    ranks get the same number of indices and together cover every index.

    Args:
        n: Dataset size.
        rank: This rank, in ``[0, world_size)``.
        world_size: Number of ranks.
        epoch: Epoch number (reshuffles each epoch).
        seed: Base seed shared by all ranks.
        shuffle: Permute; otherwise use ``0 .. n-1`` in order.
        drop_last: Drop the tail instead of padding.

    Returns:
        ``ceil(n / world_size)`` indices (``floor`` with ``drop_last``).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        indices: list[int] = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)
    total = per_rank * world_size
    if total > n and indices:
        indices += (indices * math.ceil((total - n) / n))[: total - n]
    indices = indices[:total]
    return indices[rank:total:world_size]
