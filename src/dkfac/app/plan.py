"""``dkfac plan``: predict every distributed strategy's cost for a model and recommend one.

Example::

    dkfac plan --model resnet50 --world-size 64 --batch-per-rank 32 --bandwidth-gbps 100

prints, per strategy, the predicted per-iteration time by phase (amortised over the factor and
inverse intervals), the bytes a rank sends per iteration (max over ranks of what the
communication ledger records, and the total including DDP's gradient all-reduce), the mean
wire bytes per rank, and the K-FAC memory per rank, then the recommendation: the fastest
strategy whose memory fits ``--memory-budget-gb``. ``--calibrate`` measures the matmul,
eigh and Cholesky rates of the local device first. The model lives in
:mod:`dkfac.costmodel`.

``--parallel fsdp`` (or ``hsdp --shard-size S``) prices a model sharded with FSDP2 instead:
bytes per step and memory per rank for AdamW and for K-FAC per strategy
(:mod:`dkfac.app.plan_sharded`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from dkfac.app.devices import device_error
from dkfac.app.domains import domain_error
from dkfac.app.models import MODELS, build_model
from dkfac.app.parallel import mesh_shape
from dkfac.app.plan_sharded import (
    align_table,
    recommend_sharded,
    sharded_rows,
    sharded_table,
)
from dkfac.costmodel import (
    METHODS,
    PHASES,
    STRATEGIES,
    DeviceRates,
    DtypeBytes,
    StrategyPrediction,
    calibrate,
    candidate_strategies,
    extract_layers,
    recommend,
)

__all__ = ["DEFAULT_SHAPES", "build_parser", "main"]

DEFAULT_SHAPES: dict[str, tuple[int, int, int]] = {
    "resnet50": (3, 224, 1000),
    "mlp": (1, 8, 10),
    "cnn": (1, 8, 10),
    "autoencoder": (1, 8, 10),
}
"""Model -> (in_channels, image_size, num_classes) when not given; others: (3, 32, 10)."""

MAX_RANKS = 1_000_000
"""The largest ``--world-size``: past about 1e15 ranks the placements' float arithmetic
(a fraction of the world) is no longer exact, and no job has a million ranks."""

MAX_GBPS = 1e9
"""The largest ``--bandwidth-gbps``: an exabit a second; in bytes a second a number past
about 1e300 was infinite, which the cost model refuses."""

_PHASE_SHORT = {
    "forward_backward": "fwd+bwd",
    "factor_build": "factors",
    "factor_comm": "f.comm",
    "inverse": "inverse",
    "inverse_comm": "i.comm",
    "precondition": "precond",
    "preconditioned_comm": "p.comm",
    "grad_comm": "g.comm",
}


def _positive(kind: type, name: str, high: float = math.inf) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if not (isinstance(value, int) or math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{name} must be finite and > 0, got {text}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{name} must be in (0, {high:g}], got {text}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``dkfac plan`` argument parser."""
    p = argparse.ArgumentParser(
        prog="dkfac plan", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    p.add_argument(
        "--model", required=True, choices=sorted(MODELS), help="the training program's model"
    )
    p.add_argument(
        "--world-size",
        type=_positive(int, "--world-size", MAX_RANKS),
        required=True,
        help=f"ranks (at most {MAX_RANKS:g})",
    )
    numbers: tuple[tuple[str, type, float | None, str], ...] = (
        ("--batch-per-rank", int, 32, "samples per rank and step"),
        ("--bandwidth-gbps", float, 100.0, "network bandwidth per rank, Gbit/s"),
        (
            "--memory-budget-gb",
            float,
            None,
            "memory (GB) a rank may give K-FAC; the recommendation fits in it",
        ),
        ("--factor-interval", int, 10, "steps between factor updates"),
        ("--inverse-interval", int, 100, "steps between inverse updates"),
    )
    for flag, kind, default, text in numbers:
        shown = "none" if default is None else f"{default:g}"
        high = MAX_GBPS if flag == "--bandwidth-gbps" else math.inf
        p.add_argument(
            flag,
            type=_positive(kind, flag, high),
            default=default,
            help=f"{text} (default: {shown})",
        )
    p.add_argument(
        "--latency-us",
        type=_non_negative_float,
        default=5.0,
        help="per-message latency, microseconds (default: 5)",
    )
    p.add_argument("--method", choices=METHODS, default="eigen", help="(default: eigen)")
    p.add_argument(
        "--grad-worker-fraction",
        type=_positive(float, "--grad-worker-fraction", 1.0),
        nargs="+",
        default=[0.5, 0.25],
        help="KAISA fractions to compare (those not dividing the world size are skipped; "
        "default: 0.5 0.25)",
    )
    p.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        help="strategies to consider (default: all)",
    )
    p.add_argument(
        "--in-channels", type=_positive(int, "--in-channels"), help="(default: the model's)"
    )
    p.add_argument(
        "--image-size", type=_positive(int, "--image-size"), help="(default: the model's)"
    )
    p.add_argument(
        "--num-classes", type=_positive(int, "--num-classes"), help="(default: the model's)"
    )
    p.add_argument(
        "--factor-bytes",
        type=int,
        choices=[2, 4, 8],
        default=4,
        help="bytes per factor entry (default: 4)",
    )
    p.add_argument("--calibrate", action="store_true", help="measure compute rates locally")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device --calibrate measures (default: cuda if available, else cpu)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--parallel",
        choices=("ddp", "fsdp", "hsdp"),
        default="ddp",
        help="how the model is spread: ddp (whole on every rank), fsdp or hsdp (sharded: "
        "bytes and memory of AdamW and K-FAC under FSDP2)",
    )
    p.add_argument(
        "--shard-size",
        type=_positive(int, "--shard-size"),
        help="--parallel hsdp: ranks a weight is cut over (a divisor of --world-size)",
    )
    return p


def _sharded_problem(args: argparse.Namespace) -> str | None:
    """Why ``--parallel`` / ``--shard-size`` do not fit the world size, else ``None``."""
    if args.shard_size is not None and args.parallel != "hsdp":
        return f"--shard-size applies to --parallel hsdp, not --parallel {args.parallel}"
    if args.parallel == "hsdp":
        if args.shard_size is None:
            return "--parallel hsdp needs --shard-size (ranks a weight is cut over)"
        try:  # the rule dkfac train applies: 2 or more replicas of 2 or more ranks
            mesh_shape("hsdp", args.world_size, args.shard_size)
        except ValueError as err:
            return str(err)
    return None


def _plan_sharded(
    args: argparse.Namespace,
    spec: Any,
    pairs: list[tuple[str, float]],
    options: dict[str, Any],
    budget: float | None,
) -> int:
    """Prints the sharded plan (table or JSON); 1 when no K-FAC strategy fits the budget."""
    rows = sharded_rows(
        spec,
        args.world_size,
        shard_size=args.shard_size if args.parallel == "hsdp" else None,
        strategies=pairs,
        method=options["method"],
        dtypes=options["dtypes"],
        factor_interval=options["factor_interval"],
        inverse_interval=options["inverse_interval"],
    )
    if len(rows) == 1:
        print(
            "dkfac plan: error: no strategy offered for sharded models among --strategies "
            "(spngd is not: FSDP2 has already reduced the gradients)",
            file=sys.stderr,
        )
        return 2
    choice = recommend_sharded(rows, budget)
    if args.json:
        payload = {
            "model": args.model,
            "world_size": args.world_size,
            "parallel": args.parallel,
            "shard_size": args.shard_size,
            "options": {k: v for k, v in options.items() if k != "dtypes"},
            "rows": [
                {**dataclasses.asdict(r), "total_bytes": r.total_bytes, "memory": r.memory}
                for r in rows
            ],
            "recommended": None if choice is None else choice.label,
        }
        print(json.dumps(payload, indent=2))
    else:
        shard = args.world_size if args.parallel == "fsdp" else args.shard_size
        print(
            f"{args.model}: {len(spec.layers)} K-FAC layers, {spec.param_numel / 1e6:.1f}M "
            f"parameters; P={args.world_size}, --parallel {args.parallel} (weights cut over "
            f"{shard} ranks), intervals (factors {args.factor_interval}, inverses "
            f"{args.inverse_interval}), {args.method}"
        )
        print(sharded_table(rows, budget))
        print(
            "per step; bytes per rank (ledger: K-FAC's, amortised, the largest rank; FSDP: "
            "FSDP2's own); memory per rank = state + K-FAC + step grads"
        )
        if choice is not None:
            print(f"recommended: {choice.label} ({choice.total_bytes / 1e6:.2f} MB/step)")
    if choice is None:
        print("dkfac plan: no K-FAC strategy fits --memory-budget-gb", file=sys.stderr)
        return 1
    return 0


def _row(pred: StrategyPrediction, budget: float | None) -> list[str]:
    ms = [f"{1e3 * pred.phases[k]:.1f}" for k in PHASES]
    need = pred.memory_max + pred.model_state_bytes
    fits = "yes" if budget is None or need <= budget else "NO"
    return [
        pred.label,
        f"{1e3 * pred.total_seconds:.1f}",
        *ms,
        f"{sum(pred.ledger_bytes.values()) / 1e6:.1f}",
        f"{pred.total_bytes_incl_ddp / 1e6:.1f}",
        f"{pred.wire_bytes / 1e6:.1f}",
        f"{pred.memory_max / 1e6:.1f}",
        fits,
    ]


def _table(preds: list[StrategyPrediction], budget: float | None) -> str:
    headers = [
        "strategy",
        "total ms",
        *(f"{_PHASE_SHORT[k]} ms" for k in PHASES),
        "ledger MB",
        "+DDP MB",
        "wire MB",
        "K-FAC mem MB",
        "fits",
    ]
    return align_table([headers, *(_row(p, budget) for p in preds)])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dkfac plan``; returns 0, 1 when nothing fits the budget, 2 on bad input."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse: 2 on bad input, 0 for --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    for dest in ("in_channels", "image_size", "num_classes"):  # the domains train takes
        value = getattr(args, dest)
        if value is not None and (problem := domain_error(dest, value)):
            print(f"dkfac plan: error: {problem}", file=sys.stderr)
            return 2
    c_in, size, classes = DEFAULT_SHAPES.get(args.model, (3, 32, 10))
    c_in = args.in_channels or c_in
    size = args.image_size or size
    classes = args.num_classes or classes
    try:
        with torch.device("meta"):  # shapes only: a model too large for this machine is priced
            model = build_model(args.model, in_channels=c_in, image_size=size, num_classes=classes)
        spec = extract_layers(model, (c_in, size, size) if args.model != "mlp" else None)
        pairs = candidate_strategies(args.world_size, args.grad_worker_fraction)
        if args.strategies:
            pairs = [(name, f) for name, f in pairs if name in args.strategies]
        if not pairs:
            raise ValueError("no candidate strategy left (kaisa fractions must divide P)")
        if problem := _sharded_problem(args):
            raise ValueError(problem)
        if args.calibrate and (problem := device_error(args.device)):
            raise ValueError(problem)
    except ValueError as err:
        print(f"dkfac plan: error: {err}", file=sys.stderr)
        return 2
    rates = calibrate(args.device) if args.calibrate else DeviceRates()
    rates = dataclasses.replace(
        rates, bandwidth=args.bandwidth_gbps * 1e9 / 8, latency=args.latency_us * 1e-6
    )
    budget = None if args.memory_budget_gb is None else args.memory_budget_gb * 1e9
    options: dict[str, Any] = {
        "method": args.method,
        "dtypes": DtypeBytes(factor=args.factor_bytes),
        "factor_interval": args.factor_interval,
        "inverse_interval": args.inverse_interval,
    }
    if args.parallel != "ddp":
        return _plan_sharded(args, spec, pairs, options, budget)
    choice: StrategyPrediction | None
    try:  # without a budget every candidate has a prediction: a failure is the input's
        choice, preds = recommend(
            spec, args.world_size, batch_per_rank=args.batch_per_rank, rates=rates,
            memory_budget_bytes=None, strategies=pairs, **options,
        )  # fmt: skip
    except ValueError as err:
        print(f"dkfac plan: error: {err}", file=sys.stderr)
        return 2
    error = None
    try:
        if budget is not None:
            choice, _ = recommend(
                spec, args.world_size, batch_per_rank=args.batch_per_rank, rates=rates,
                memory_budget_bytes=budget, strategies=pairs, **options,
            )  # fmt: skip
    except ValueError as err:
        choice, error = None, str(err)
    if args.json:
        payload = {
            "model": args.model,
            "world_size": args.world_size,
            "batch_per_rank": args.batch_per_rank,
            "rates": dataclasses.asdict(rates),
            "options": {k: v for k, v in options.items() if k != "dtypes"},
            "layers": len(spec.layers),
            "predictions": [{"label": p.label, **dataclasses.asdict(p)} for p in preds],
            "recommended": None if choice is None else choice.label,
            "error": error,
        }
        print(json.dumps(payload, indent=2))
    else:
        print(
            f"{args.model}: {len(spec.layers)} K-FAC layers, {spec.param_numel / 1e6:.1f}M "
            f"parameters; P={args.world_size}, B={args.batch_per_rank}/rank, "
            f"intervals (factors {args.factor_interval}, inverses {args.inverse_interval}), "
            f"{args.method}"
        )
        print(
            f"rates: matmul {rates.matmul_flops / 1e12:.3g} TFLOP/s, eigh "
            f"{rates.eigh_rate:.3g} n³/s, cholesky {rates.cholesky_rate:.3g} n³/s, "
            f"{args.bandwidth_gbps:g} Gb/s, {args.latency_us:g} µs"
            + (" (calibrated)" if args.calibrate else " (defaults)")
        )
        print(_table(preds, budget))
        print("per iteration; bytes per rank (max over ranks); memory = K-FAC state per rank")
        if choice is not None:
            print(f"recommended: {choice.label} ({1e3 * choice.total_seconds:.1f} ms/iteration)")
        if choice is not None and choice.strategy == "dp":
            print(
                "note: dp changes the estimator (each layer's factors come from its owner's "
                "local batch only); exclude it with --strategies if you need the exact "
                "K-FAC of the global batch"
            )
    if error is not None:
        print(f"dkfac plan: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
