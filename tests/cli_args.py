"""Command-line arguments shared by the training-program tests."""

from __future__ import annotations

# A tiny synthetic run of `dkfac train`: 64 8x8 one-channel images, 4 classes, small CNN.
TINY = [
    "--data",
    "synthetic",
    "--synthetic-samples",
    "64",
    "--in-channels",
    "1",
    "--image-size",
    "8",
    "--num-classes",
    "4",
    "--batch-size",
    "16",
    "--threads",
    "1",
    "--log-every",
    "2",
    "--model",
    "cnn",
]
