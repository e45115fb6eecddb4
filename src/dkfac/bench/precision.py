"""``dkfac bench precision``: where bf16 pays for the default's polar factors and rotations.

Times, one thread, the best of ``--repeats`` timed loops per shape: the polar factor's
three Newton–Schulz steps (what the default takes over its budget) in bf16, in float32, and
in float32 on the Gram matrix (:func:`dkfac.solvers.polar.iterate_gram`, where it applies),
and a rotation out of an eigenbasis (``Q_G U Q_Aᵀ``, two products) in float32 and in bf16
with its casts. Each record says which precision
:func:`dkfac.solvers.precision.low_precision` picks for the shape on this device, and that
choice's time over the fastest (the regret; on a CPU that emulates bf16 the choice is
float32 throughout): the iteration's by its smaller side
(:func:`dkfac.solvers.polar.polar_dtype`), the rotation's by its products' work. The
shapes are the hidden layers of ``dkfac bench suite``'s families and of the language model,
plus a few around :data:`~dkfac.solvers.precision.CPU_BF16_MIN_WORK`.

    dkfac bench precision --out benchmarks/results/polar_precision_cpu.json
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    best_seconds,
    check_repeats_and_out,
    command_line,
    machine_info,
    write_result,
)
from dkfac.solvers.polar import gram_pays, iterate, polar_dtype, polar_factor
from dkfac.solvers.precision import bfloat16_is_fast, low_precision

__all__ = ["SHAPES", "main", "measure"]

SHAPES: list[tuple[int, int]] = [
    (16, 65), (64, 17), (64, 65), (64, 257), (256, 65), (96, 97), (64, 577), (128, 129),
    (128, 513), (384, 129), (512, 129), (128, 1025), (256, 257),
]  # fmt: skip
STEPS = 3
SHAPE_FORM = re.compile(r"^(\d+)x(\d+)$")


def _best(call: Callable[[], Any], repeats: int) -> float:
    """The best of ``repeats`` loops' seconds per call (each loop ~20 ms, 10 calls at least)."""
    return best_seconds(call, repeats, 0.02, 10, warmup=3)


def measure(shape: tuple[int, int], repeats: int) -> dict[str, Any]:
    """One shape's times (seconds), the choice of ``low_precision`` and its regret."""
    g, a = shape
    update = torch.randn(g, a)
    q_g = torch.linalg.qr(torch.randn(g, g))[0]
    q_a = torch.linalg.qr(torch.randn(a, a))[0]
    bases = {dt: (q_g.to(dt), q_a.to(dt)) for dt in (torch.float32, torch.bfloat16)}

    def rotate(dtype: torch.dtype) -> Callable[[], Any]:
        left, right = bases[dtype]
        return lambda: (left @ update.to(dtype) @ right.T).float()

    polar = {
        "bfloat16": _best(lambda: iterate(update, STEPS, torch.bfloat16), repeats),
        "float32": _best(lambda: polar_factor(update, STEPS, torch.float32), repeats),
    }
    if gram_pays(update, torch.float32):
        polar["float32 plain"] = _best(lambda: iterate(update, STEPS, torch.float32), repeats)
        polar["float32 gram"] = polar["float32"]  # polar_factor took the Gram form: timed once
    rotation = {
        "bfloat16": _best(rotate(torch.bfloat16), repeats),
        "float32": _best(rotate(torch.float32), repeats),
    }
    cpu = torch.device("cpu")
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    polar_choice = name[polar_dtype(torch.float32, cpu, shape)]
    rotation_choice = name[low_precision(cpu, torch.float32, g * a * max(g, a))]
    return {
        "shape": list(shape),
        "polar_seconds": polar,
        "rotation_seconds": rotation,
        "polar_chosen": polar_choice,
        "rotation_chosen": rotation_choice,
        "polar_regret": polar[polar_choice] / min(polar[k] for k in ("bfloat16", "float32")),
        "rotation_regret": rotation[rotation_choice] / min(rotation.values()),
    }


def _shape(text: str) -> tuple[int, int]:
    found = SHAPE_FORM.match(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"a shape is ROWSxCOLUMNS, e.g. 128x129; got {text!r}")
    rows, columns = int(found.group(1)), int(found.group(2))
    if rows < 1 or columns < 1:
        raise argparse.ArgumentTypeError(f"a shape's sizes must be >= 1, got {text!r}")
    return rows, columns


def _parser() -> argparse.ArgumentParser:
    parser = BenchParser(prog="dkfac bench precision", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=_shape, nargs="+", help="shapes instead of SHAPES")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per case (>= 1)")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Times every shape, prints one line each, writes ``--out``'s JSON if given."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_repeats_and_out(parser, args.repeats, args.out)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    records = []
    for shape in args.shape or SHAPES:
        record = measure(shape, args.repeats)
        records.append(record)
        polar = {k: round(v * 1e3, 3) for k, v in record["polar_seconds"].items()}
        rotation = {k: round(v * 1e3, 3) for k, v in record["rotation_seconds"].items()}
        chosen = f"{record['polar_chosen']}, {record['rotation_chosen']}"
        print(f"{shape[0]}x{shape[1]} polar ms {polar} rotation ms {rotation} chosen {chosen}",
              file=sys.stderr)  # fmt: skip
    summary = {
        "worst_polar_regret": max(r["polar_regret"] for r in records),
        "worst_rotation_regret": max(r["rotation_regret"] for r in records),
    }
    if args.out is not None:
        payload = {
            "threads": 1,
            "steps": STEPS,
            "bfloat16_native": bfloat16_is_fast(torch.device("cpu")),
            "machine": machine_info("cpu"),
            "summary": summary,
            "records": records,
        }
        command = command_line("dkfac bench precision", None if argv is None else list(argv))
        write_result(args.out.stem, payload, args.out.parent, command)
    print(" ".join(f"{k} {v:.3g}" for k, v in summary.items()))
    return 0
