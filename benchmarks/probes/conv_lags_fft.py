"""Probe: the lag products of a 3x3 convolution's A factor by FFT instead of shifted GEMMs.

``flat_factor_sum`` (``dkfac.blocks.conv_factor``) spends most of a ResNet-20 factor step on
13 products ``F_δ = Σ_p x_p x_{p+δ}ᵀ`` per 3x3 layer (the non-negative kernel shifts over
the zero-padded, flattened input). With padding 1 on each side the zero margins are at
least the largest shift, so these are the 2-D linear cross-correlations of each image,
summed over the batch: the cross-spectrum ``S(f) = Σ_n X_n(f)ᴴ X_n(f)`` of the images'
2-D FFTs gives all lags at once with ~5x fewer multiply-adds (one ``C × C`` product per
frequency bin instead of 13 per position). This script checks that equality and times
both ways on ResNet-20's three stride-1 shapes at batch 128 (and, with ``--resnet50``, on
ResNet-50's four), one thread, median of ``--repeats``:

    python benchmarks/probes/conv_lags_fft.py --resnet50 \
        --out benchmarks/results/probe_conv_lags_fft.json

Measured 2026-11-24 (BENCHMARKS.md §1 update 5): the FFTs of the N·C small planes cost about
as much as the products they replace, and the inverse FFT of the C·C cross-spectra grows
like the products themselves, so the FFT way is no faster (far slower on wide layers); it is
not in the library.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# (channels, side, batch) of ResNet-20's stride-1 3x3 layers at batch 128, and of
# ResNet-50's (ImageNet, 224²) at per-rank batches that fit a CPU probe.
SHAPES = {
    "resnet20": ((16, 32, 128), (32, 16, 128), (64, 8, 128)),
    "resnet50": ((64, 56, 8), (128, 28, 16), (256, 14, 32), (512, 7, 32)),
}
SHIFTS = [(u, v) for u in range(3) for v in range(-2, 3) if u > 0 or v >= 0]


def lags_by_gemm(padded: Tensor, dtype: torch.dtype) -> Tensor:
    """``(13, C, C)``: one product per shift over the flattened channels-last input."""
    batch, channels, height, width = padded.shape
    length = batch * height * width
    flat = padded.permute(0, 2, 3, 1).to(dtype).reshape(length, channels)
    flat = torch.cat([flat, flat.new_zeros(2 * width + 2, channels)])
    return torch.stack([
        (flat[:length].T @ flat[u * width + v : u * width + v + length]).float()
        for u, v in SHIFTS
    ])  # fmt: skip


def lags_by_fft(padded: Tensor, dtype: torch.dtype) -> Tensor:
    """``(13, C, C)`` from the cross-spectrum; its products take ``dtype`` inputs."""
    batch, channels, height, width = padded.shape
    spectrum = torch.fft.rfft2(padded)  # (N, C, H, W//2 + 1)
    bins = spectrum.shape[2] * spectrum.shape[3]
    per_bin = spectrum.permute(2, 3, 0, 1).reshape(bins, batch, channels)
    # Real form: [Re | Im] interleaved per channel, one (2C × 2C) real product per bin.
    parts = torch.view_as_real(per_bin).reshape(bins, batch, 2 * channels).to(dtype)
    gram = (parts.transpose(1, 2) @ parts).float().view(bins, channels, 2, channels, 2)
    real = gram[:, :, 0, :, 0] + gram[:, :, 1, :, 1]
    imag = gram[:, :, 0, :, 1] - gram[:, :, 1, :, 0]
    cross = torch.complex(real, imag).view(spectrum.shape[2], spectrum.shape[3], -1)
    lags = torch.fft.irfft2(cross.permute(2, 0, 1), s=(height, width))  # (C·C, H, W)
    lags = lags.view(channels, channels, height, width)
    return torch.stack([lags[:, :, u % height, v % width] for u, v in SHIFTS])


def median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median wall time of ``fn`` in milliseconds after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    """Checks the FFT lags against the GEMM ones and times both ways."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path for the results")
    parser.add_argument("--resnet50", action="store_true", help="also ResNet-50's shapes")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per way (>= 1)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    shapes = [("resnet20", shape) for shape in SHAPES["resnet20"]]
    if args.resnet50:
        shapes += [("resnet50", shape) for shape in SHAPES["resnet50"]]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for model, (channels, side, batch) in shapes:
        padded = F.pad(torch.randn(batch, channels, side, side), (1, 1, 1, 1))
        exact = lags_by_gemm(padded.double(), torch.float64)
        row: dict[str, object] = {"model": model, "channels": channels, "side": side}
        row["batch"] = batch
        for name, fn, dtype in (
            ("gemm_fp32", lags_by_gemm, torch.float32),
            ("gemm_bf16", lags_by_gemm, torch.bfloat16),
            ("fft_fp32", lags_by_fft, torch.float32),
            ("fft_bf16", lags_by_fft, torch.bfloat16),
        ):
            got = fn(padded, dtype).double()
            row[f"{name}_rel_error"] = float((got - exact).norm() / exact.norm())
            row[f"{name}_ms"] = median_ms(functools.partial(fn, padded, dtype), args.repeats)
        spectrum = torch.fft.rfft2(padded)
        row["fft_forward_only_ms"] = median_ms(
            functools.partial(torch.fft.rfft2, padded), args.repeats
        )
        row["bins"] = spectrum.shape[2] * spectrum.shape[3]
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        payload = {
            "probe": "conv_lags_fft",
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "command": " ".join(["python", "benchmarks/probes/conv_lags_fft.py", *sys.argv[1:]]),
            "rows": rows,
        }
        with open(args.out, "w") as fh:
            json.dump(payload, fh, indent=2)


if __name__ == "__main__":
    main()
