"""``dkfac bench conv-paths``: how close the conv input factor's ``auto`` path is to the
fastest exact path.

Times the three stride-1 paths of :func:`dkfac.blocks.conv_factor.conv_input_factor_sum`
(``shift``, ``segment``, ``unfold``) on a list of convolution inputs, one thread, the best of
``--repeats`` timed loops, and reports per shape the path ``auto`` takes and its time over
the fastest path's (the regret). The cost constants of ``conv_path_choice.py`` (``OP_WEIGHT``,
``ASSEMBLY_WEIGHT``) were fit on the ``fit`` shapes; the ``check`` shapes were not used in
the fit. ``--shape`` measures the given shapes instead (split ``given``).

Each record also holds the tensor operations each path dispatches (``operations``: on a GPU
about one kernel launch each) and each path's largest difference from the ``unfold`` path's
factor relative to its largest entry (``difference``: every path is exact, so a timing of a
path that disagrees is void). ``--device cuda`` times the paths on a GPU (synchronised) and
reports the path ``auto`` takes there (``benchmarks/gpu_runs.sh`` runs it).

    dkfac bench conv-paths --out benchmarks/results/conv_factor_paths.json
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dkfac.app.devices import device_error, pick_device
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    best_seconds,
    check_repeats_and_out,
    command_line,
    machine_info,
    synchronize,
    write_result,
)
from dkfac.bench.dispatches import Dispatches
from dkfac.blocks.conv_factor import conv_input_factor_sum
from dkfac.blocks.conv_path_choice import auto_path

__all__ = ["CHECK", "FIT", "PATHS", "main", "measure"]

# (N, C, H, W), kernel, zero padding (left, right, top, bottom)
Shape = tuple[tuple[int, int, int, int], tuple[int, int], tuple[int, int, int, int]]
P1, P2, P0 = (1, 1, 1, 1), (2, 2, 2, 2), (0, 0, 0, 0)
K3, K5 = (3, 3), (5, 5)
FIT: list[Shape] = [
    ((50, 1, 8, 8), K3, P1), ((50, 32, 8, 8), K3, P1), ((50, 64, 4, 4), K3, P1),
    ((100, 64, 4, 4), K3, P1), ((700, 64, 4, 4), K3, P1), ((700, 32, 8, 8), K3, P1),
    ((128, 16, 32, 32), K3, P1), ((128, 32, 16, 16), K3, P1), ((128, 64, 8, 8), K3, P1),
    ((32, 128, 8, 8), K3, P1), ((8, 512, 4, 4), K3, P1), ((32, 256, 4, 4), K3, P1),
    ((50, 64, 2, 2), K3, P1), ((128, 3, 32, 32), K3, P1), ((16, 128, 16, 16), K3, P1),
    ((64, 256, 8, 8), K3, P1), ((8, 64, 28, 28), K3, P1), ((32, 32, 14, 14), K3, P1),
    ((100, 8, 8, 8), K3, P1), ((50, 32, 8, 8), K5, P2), ((32, 64, 16, 16), K5, P2),
    ((16, 128, 8, 8), K5, P2), ((50, 32, 8, 8), K3, P0), ((32, 64, 16, 16), K3, P0),
]  # fmt: skip
CHECK: list[Shape] = [
    ((64, 16, 16, 16), K3, P1), ((256, 64, 4, 4), K3, P1), ((32, 3, 28, 28), K5, P2),
    ((16, 512, 7, 7), K3, P1), ((64, 128, 4, 4), K3, P1), ((200, 16, 8, 8), K3, P1),
    ((16, 96, 12, 12), K3, P0), ((8, 256, 14, 14), K3, P1), ((350, 1, 8, 8), K3, P1),
    ((64, 48, 6, 6), K5, P2),
]  # fmt: skip
PATHS = ("shift", "segment", "unfold")
SHAPE_FORM = re.compile(r"^(\d+),(\d+),(\d+),(\d+)/(\d+)/(\d+)$")


def _factor(x: torch.Tensor, kernel: tuple[int, int], pad: tuple[int, ...], path: str) -> Any:
    return conv_input_factor_sum(x, kernel, (1, 1), (1, 1), True, pad, path)  # type: ignore[arg-type]


def time_path(
    x: torch.Tensor, kernel: tuple[int, int], pad: tuple[int, ...], path: str, repeats: int
) -> float:
    """Best mean seconds of one call over ``repeats`` loops of about 0.2 s each."""

    def call() -> None:
        _factor(x, kernel, pad, path)
        synchronize(x.device)

    return best_seconds(call, repeats, 0.2, 2, 50)


def count_ops(x: torch.Tensor, kernel: tuple[int, int], pad: tuple[int, ...], path: str) -> int:
    """Tensor operations one call of ``path`` dispatches (the same on every device)."""
    with Dispatches() as counter:
        _factor(x, kernel, pad, path)
    return counter.total


def measure(split: str, shape: Shape, repeats: int, device: torch.device) -> dict[str, Any]:
    """One shape's record: each path's seconds, operations and difference from ``unfold``,
    the path ``auto`` takes, the fastest path and the regret."""
    size, kernel, pad = shape
    x = torch.randn(*size, device=device)
    padded = (size[0], size[1], size[2] + pad[2] + pad[3], size[3] + pad[0] + pad[1])
    times = {p: time_path(x, kernel, pad, p, repeats) for p in PATHS}
    operations = {p: count_ops(x, kernel, pad, p) for p in PATHS}
    factors = {p: _factor(x, kernel, pad, p)[0].double() for p in PATHS}
    scale = float(factors["unfold"].abs().max()) or 1.0
    difference = {p: float((factors[p] - factors["unfold"]).abs().max()) / scale for p in PATHS}
    picked = auto_path(padded, kernel, (1, 1), (1, 1), pad, device.type)
    best = min(times, key=times.__getitem__)
    return {
        "split": split, "input": list(size), "kernel": list(kernel),
        "zero_padding": list(pad), "seconds": times, "operations": operations,
        "difference": difference, "auto": picked, "fastest": best,
        "regret": times[picked] / times[best],
    }  # fmt: skip


def _shape(text: str) -> Shape:
    """``N,C,H,W/k/p``: an input, a square kernel ``k`` and ``p`` zeros on every side."""
    match = SHAPE_FORM.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"--shape takes N,C,H,W/kernel/padding (e.g. 8,16,8,8/3/1), got {text!r}"
        )
    n, c, h, w, k, p = (int(g) for g in match.groups())
    if min(n, c, h, w, k) < 1 or h + 2 * p < k or w + 2 * p < k:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: sizes must be >= 1 and the padded plane at least the kernel"
        )
    return (n, c, h, w), (k, k), (p, p, p, p)


def _parser() -> argparse.ArgumentParser:
    parser = BenchParser(prog="dkfac bench conv-paths", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per path (best)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (synchronised timers)")
    parser.add_argument(
        "--shape",
        type=_shape,
        action="append",
        default=None,
        help="N,C,H,W/kernel/padding, repeatable: these shapes instead of fit and check",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Times every shape's paths, prints the summary, writes ``--out``'s JSON if given."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_repeats_and_out(parser, args.repeats, args.out)
    if message := device_error(args.device):
        parser.error(message)
    device = pick_device(args.device)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    splits = {"given": args.shape} if args.shape else {"fit": FIT, "check": CHECK}
    records = []
    for split, shapes in splits.items():
        for shape in shapes:
            record = measure(split, shape, args.repeats, device)
            records.append(record)
            milliseconds = {p: round(t * 1e3, 2) for p, t in record["seconds"].items()}
            print(split, *shape, milliseconds, "auto", record["auto"],
                  f"regret {record['regret']:.2f}", file=sys.stderr)  # fmt: skip
    summary = {}
    for split in splits:
        chosen = [r for r in records if r["split"] == split]
        summary[split] = {
            "auto_seconds": sum(r["seconds"][r["auto"]] for r in chosen),
            "fastest_seconds": sum(r["seconds"][r["fastest"]] for r in chosen),
            "worst_regret": max(r["regret"] for r in chosen),
            "worst_difference": max(max(r["difference"].values()) for r in chosen),
        }
    if args.out is not None:
        payload = {
            "torch": torch.__version__,
            "threads": 1,
            "machine": machine_info(device),
            "summary": summary,
            "records": records,
        }
        command = command_line("dkfac bench conv-paths", None if argv is None else list(argv))
        write_result(args.out.stem, payload, args.out.parent, command)
    for split, entry in summary.items():
        print(split, " ".join(f"{k} {v:.4g}" for k, v in entry.items()))
    return 0
