"""``dkfac bench solvers``: inverse-update and apply time of smw vs eigen vs cholesky.

For a square Linear layer of width ``d`` (``a_dim = g_dim = d``) and a batch of ``m`` rows,
the factors are ``A = U_A U_Aᵀ`` and ``G = U_G U_Gᵀ`` with ``U`` of shape ``d × m`` (random
rows, as a block returns them with ``factor_decay = 0``). Per ``(d, m)`` it measures,
interleaved round by round so that a noisy shared machine affects all alike:

* ``<method>/inverse``: ``Solver.compute`` — eigen and cholesky on the dense ``d × d``
  factors, smw on ``LowRank(U)``;
* ``<method>/apply``: ``Solver.apply`` to one ``d × d`` gradient (the per-step cost);
* ``dense/build``: forming ``RᵀR`` for both factors, which only the dense methods pay at
  every factor update.

Dense timings cost seconds at ``d = 4096`` on a small CPU: ``--repeats-at WIDTH=R`` sets
fewer rounds for the big widths, and widths >= ``--large-dim`` get no warm-up round and run
their dense cases only for the batches in ``--large-dense-batches`` (the dense cost depends
on ``d``, not on ``m`` beyond the spectrum of the factor).
Medians, every repeat and the smw speed-ups go to ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import shlex
import sys
from collections.abc import Callable
from typing import Any

import torch

from dkfac.app.devices import device_error, pick_device
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import format_table, interleaved, machine_info, median, write_result
from dkfac.solvers import CholeskySolver, EigenSolver, SMWSolver
from dkfac.solvers.base import Solver
from dkfac.solvers.lowrank.factor import LowRank

logger = logging.getLogger(__name__)

DAMPING = 1e-3


def _cases(d: int, m: int, device: torch.device, dense: bool) -> dict[str, Callable[[], object]]:
    """The measured callables of one ``(d, m)`` point."""
    generator = torch.Generator(device="cpu").manual_seed(d * 1000 + m)
    rows_a = torch.randn(m, d, generator=generator).to(device)
    rows_g = (1e-2 * torch.randn(m, d, generator=generator)).to(device)
    grad = torch.randn(d, d, generator=generator).to(device)
    low_a, low_g = LowRank(rows_a.T / math.sqrt(m)), LowRank(rows_g.T / math.sqrt(m))
    smw = SMWSolver(torch.float32)
    cases: dict[str, Callable[[], object]] = {
        "smw/inverse": lambda: smw.compute(low_a, low_g, DAMPING),
    }
    smw_state = smw.compute(low_a, low_g, DAMPING)
    cases["smw/apply"] = lambda: smw.apply(smw_state, grad, DAMPING)
    if dense:
        a, g = low_a.dense(), low_g.dense()
        cases["dense/build"] = lambda: (rows_a.T @ rows_a / m, rows_g.T @ rows_g / m)
        solvers: dict[str, Solver] = {
            "eigen": EigenSolver(torch.float32),
            "cholesky": CholeskySolver(torch.float32),
        }
        for name, solver in solvers.items():
            cases[f"{name}/inverse"] = functools.partial(solver.compute, a, g, DAMPING)
            state = solver.compute(a, g, DAMPING)
            cases[f"{name}/apply"] = functools.partial(solver.apply, state, grad, DAMPING)
    return cases


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark described by ``args``; returns the JSON payload."""
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    points: list[dict[str, Any]] = []
    for d in args.widths:
        large = d >= args.large_dim
        for m in args.batches:
            dense = not large or m in args.large_dense_batches
            logger.info("d=%d m=%d (dense cases: %s)", d, m, dense)
            cases = _cases(d, m, device, dense)
            times = interleaved(
                cases,
                repeats=args.repeats_at.get(d, args.repeats),
                device=device,
                warmup=0 if large else 1,
            )
            medians = {name: median(values) for name, values in times.items()}
            speedups: dict[str, float] = {}
            if dense:
                for kind in ("inverse", "apply"):
                    for other in ("eigen", "cholesky"):
                        speedups[f"{kind}:{other}/smw"] = (
                            medians[f"{other}/{kind}"] / medians[f"smw/{kind}"]
                        )
            points.append(
                {"d": d, "m": m, "medians": medians, "speedups": speedups, "times": times}
            )
            del cases
    return {
        "benchmark": "solvers",
        "machine": machine_info(device),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "damping": DAMPING,
        "dtype": "float32",
        "points": points,
    }


MAX_WIDTH = 65_536
"""The largest width or batch the solver benchmark takes (a factor of this width is 16 GiB in
float32; 10⁸ was taken and ran until it was killed)."""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= MAX_WIDTH for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ints in [1, {MAX_WIDTH}], got {text!r}"
        )
    return values


def _width_repeats(text: str) -> dict[int, int]:
    table: dict[int, int] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        width, _, repeats = item.partition("=")
        try:
            table[int(width)] = int(repeats)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected WIDTH=REPEATS items, got {item!r}"
            ) from None
        if table[int(width)] < 1:
            raise argparse.ArgumentTypeError(f"repeats must be >= 1, got {item!r}")
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench solvers`` flags."""
    parser.add_argument("--widths", type=_int_list, default=[512, 1024, 2048, 4096])
    parser.add_argument("--batches", type=_int_list, default=[32, 128, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large-dim", type=int, default=2048, help="widths >= this are large")
    parser.add_argument(
        "--repeats-at",
        type=_width_repeats,
        default={2048: 2, 4096: 1},
        help="per-width repeats overriding --repeats, e.g. 2048=2,4096=1",
    )
    parser.add_argument(
        "--large-dense-batches",
        type=_int_list,
        default=[128],
        help="batches whose dense cases run at large widths",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (on an oversubscribed CPU, 1 avoids thread-barrier stalls)",
    )
    parser.add_argument("--name", default=None, help="result file (default solvers-<device>)")
    parser.add_argument("--out-dir", default=None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench solvers``."""
    parser = BenchParser(prog="dkfac bench solvers", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.large_dim < 1:
        parser.error(f"--large-dim must be >= 1, got {args.large_dim}")
    if problem := device_error(args.device):  # torch.device's own error was a traceback
        parser.error(problem)
    args.device = str(pick_device(args.device))
    payload = run(args)
    argv_used = sys.argv[1:] if argv is None else argv
    payload["command"] = shlex.join(["python", "-m", "dkfac.bench.solvers", *argv_used])
    name = args.name or f"solvers-{torch.device(args.device).type}"
    write_result(name, payload, args.out_dir)
    rows = []
    for point in payload["points"]:
        med, spd = point["medians"], point["speedups"]
        rows.append(
            [
                point["d"],
                point["m"],
                med["smw/inverse"],
                med.get("eigen/inverse", "-"),
                med.get("cholesky/inverse", "-"),
                spd.get("inverse:eigen/smw", "-"),
                med["smw/apply"],
                med.get("eigen/apply", "-"),
                med.get("cholesky/apply", "-"),
            ]
        )
    headers = ["d", "m", "smw inv s", "eigen inv s", "chol inv s", "eigen/smw inv"]
    headers += ["smw apply s", "eigen apply s", "chol apply s"]
    print(format_table(headers, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
