"""Probe: how close ``conv_input_factor_sum``'s ``auto`` path is to the fastest exact path.

Times the three stride-1 paths of ``dkfac.blocks.conv_factor`` (``shift``, ``segment``,
``unfold``) on a list of convolution inputs, one thread, the best of ``--repeats`` timed
loops, and reports per shape the path ``auto`` takes and its time over the fastest path's
(the regret). The cost constants in ``conv_factor.py`` (``OP_WEIGHT``, ``ASSEMBLY_WEIGHT``)
were fit on the ``fit`` shapes; the ``check`` shapes were not used in the fit:

    python benchmarks/probes/conv_factor_paths.py \
        --out benchmarks/results/conv_factor_paths.json

Each record also has the tensor operations each path dispatches (``operations``: on a GPU
about one kernel launch each). ``--device cuda`` times the paths on a GPU (synchronised)
and reports the path ``auto`` takes there (the unfolded product while its rows fit
``UNFOLD_MAX_BYTES``: chosen for the launch counts, to be checked by this run;
``benchmarks/gpu_runs.sh`` runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dkfac.bench.common import machine_info, synchronize
from dkfac.blocks.conv_factor import auto_path, conv_input_factor_sum

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


def time_path(x: torch.Tensor, kernel: tuple[int, int], pad: tuple[int, ...], path: str,
              repeats: int) -> float:  # fmt: skip
    """Best mean seconds of one call over ``repeats`` loops of about 0.2 s each."""

    def call() -> None:
        conv_input_factor_sum(x, kernel, (1, 1), (1, 1), True, pad, path)  # type: ignore[arg-type]
        synchronize(x.device)

    call()
    start = time.perf_counter()
    call()
    loops = max(2, min(50, int(0.2 / max(time.perf_counter() - start, 1e-5))))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            call()
        best = min(best, (time.perf_counter() - start) / loops)
    return best


class _OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched inside it (a GPU launches about one each)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(x: torch.Tensor, kernel: tuple[int, int], pad: tuple[int, ...], path: str) -> int:
    """Tensor operations one call of ``path`` dispatches (the same on every device)."""
    with _OpCounter() as counter:
        conv_input_factor_sum(x, kernel, (1, 1), (1, 1), True, pad, path)  # type: ignore[arg-type]
    return counter.count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the JSON record here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (synchronised timers)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    records = []
    for split, shapes in (("fit", FIT), ("check", CHECK)):
        for size, kernel, pad in shapes:
            x = torch.randn(*size, device=device)
            padded = (size[0], size[1], size[2] + pad[2] + pad[3], size[3] + pad[0] + pad[1])
            times = {p: time_path(x, kernel, pad, p, args.repeats) for p in PATHS}
            operations = {p: count_ops(x, kernel, pad, p) for p in PATHS}
            picked = auto_path(padded, kernel, (1, 1), (1, 1), pad, device.type)
            best = min(times, key=times.__getitem__)
            record = {
                "split": split, "input": list(size), "kernel": list(kernel),
                "zero_padding": list(pad), "seconds": times, "operations": operations,
                "auto": picked, "fastest": best,
                "regret": times[picked] / times[best],
            }  # fmt: skip
            records.append(record)
            print(split, size, kernel, pad, {p: round(t * 1e3, 2) for p, t in times.items()},
                  "auto", picked, f"regret {record['regret']:.2f}", file=sys.stderr)  # fmt: skip
    summary = {}
    for split in ("fit", "check"):
        chosen = [r for r in records if r["split"] == split]
        summary[split] = {
            "auto_seconds": sum(r["seconds"][r["auto"]] for r in chosen),
            "fastest_seconds": sum(r["seconds"][r["fastest"]] for r in chosen),
            "worst_regret": max(r["regret"] for r in chosen),
        }
    result = {
        "torch": torch.__version__,
        "threads": 1,
        "machine": machine_info(device),
        "summary": summary,
        "records": records,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
