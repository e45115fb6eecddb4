"""SKFAC end to end: per-step time on a CIFAR ResNet-20 and accuracy on digits.

Two measurements, each written to ``benchmarks/results/<name>.json``:

* **step** (``skfac-step-<device>``): one training step (forward, backward,
  ``pre.step()``) of ResNet-20 on synthetic 32×32 CIFAR-shaped batches, for each batch size
  and each method, interleaved round by round. ``factor_decay = 0`` and factor and inverse
  updates every step (SKFAC's setting and the worst case for the inversions); ``smw`` uses
  ``conv_reduction="sum"`` (rank = batch) and the per-layer choice is recorded from
  ``describe()``.
* **digits** (``skfac-digits``): a short training run of the ``cnn`` model on scikit-learn's
  digits with each method and seed; the final test accuracy is compared with eigen.

Run: ``python -m dkfac.bench.skfac --part step`` or ``--part digits``.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from dkfac import KFACPreconditioner
from dkfac.app.data import batches, load_digits
from dkfac.app.models import build_model, resnet20
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    command_line,
    format_table,
    interleaved,
    machine_info,
    median,
    write_result,
)

logger = logging.getLogger(__name__)

METHODS: dict[str, dict[str, Any]] = {
    "eigen": {"method": "eigen"},
    "cholesky": {"method": "cholesky"},
    "smw": {"method": "smw", "conv_reduction": "sum"},
}


def _step_case(batch: int, options: dict[str, Any], device: torch.device) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = resnet20().to(device)
    pre = KFACPreconditioner(
        model,
        factor_decay=0.0,
        factor_update_interval=1,
        inverse_update_interval=1,
        damping=1e-3,
        **options,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()

    return step, pre


def run_step(batch_sizes: list[int], repeats: int, device: torch.device) -> dict[str, Any]:
    """Per-step seconds of each method and batch size (medians and every repeat)."""
    results: dict[str, Any] = {}
    rows = []
    for batch in batch_sizes:
        cases, kinds = {}, {}
        for name, options in METHODS.items():
            fn, pre = _step_case(batch, options, device)
            fn()  # the first capture decides the low-rank sides
            cases[name] = fn
            rows = [row for row in pre.describe() if row["block"] != "inner optimizer"]
            kinds[name] = dict(Counter(row["method"] for row in rows))
        times = interleaved(cases, repeats, device)
        med = {name: median(ts) for name, ts in times.items()}
        results[str(batch)] = {"median_s": med, "times_s": times, "layer_methods": kinds}
        rows.append([batch, *(med[n] for n in METHODS), med["eigen"] / med["smw"]])
    print(format_table(["batch", *(f"{n} s/step" for n in METHODS), "eigen/smw"], rows))
    return results


def _digits_run(options: dict[str, Any], seed: int, epochs: int, batch: int) -> float:
    data = load_digits(seed=0)
    torch.manual_seed(seed)
    model = build_model(
        "cnn",
        in_channels=data.in_channels,
        image_size=data.image_size,
        num_classes=data.num_classes,
    )
    pre = KFACPreconditioner(model, damping=3e-3, lr=0.05, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for x, y in batches(data.x_train, data.y_train, batch, True, gen, drop_last=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(data.x_test).argmax(dim=1)
    return float((pred == data.y_test).float().mean())


def run_digits(seeds: list[int], epochs: int, batch: int) -> dict[str, Any]:
    """Final test accuracy per method and seed, with the mean and spread."""
    acc: dict[str, list[float]] = {name: [] for name in METHODS}
    for seed in seeds:
        for name, options in METHODS.items():
            acc[name].append(_digits_run(options, seed, epochs, batch))
    summary = {
        name: {
            "accuracy": values,
            "mean": sum(values) / len(values),
            "spread": max(values) - min(values),
        }
        for name, values in acc.items()
    }
    rows = [[n, s["mean"], s["spread"], s["accuracy"]] for n, s in summary.items()]
    print(format_table(["method", "mean acc", "spread", "per seed"], rows))
    return summary


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    parser = BenchParser(prog="python -m dkfac.bench.skfac")
    parser.add_argument("--part", choices=("step", "digits"), required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine_info(device)
    command = command_line("python -m dkfac.bench.skfac", argv)
    if args.part == "step":
        results = run_step(args.batch_sizes, args.repeats, device)
        payload = {"machine": info, "model": "resnet20", "batch_sizes": args.batch_sizes}
        write_result(f"skfac-step-{device.type}", {**payload, "results": results}, None, command)
    else:
        results = run_digits(args.seeds, args.epochs, args.batch)
        payload = {"machine": info, "model": "cnn", "epochs": args.epochs, "batch": args.batch}
        payload = {**payload, "seeds": args.seeds, "results": results}
        write_result("skfac-digits", payload, None, command)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())


__all__ = ["main", "run_digits", "run_step"]
