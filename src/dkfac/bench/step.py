"""``dkfac bench step``: per-step time of SGD against K-FAC configurations, side by side.

A K-FAC step is one of three kinds: *plain* (precondition only), *factor* (capture and
update the factors, then precondition) and *inverse* (factors, inverses and precondition).
Each kind is measured directly, interleaved with SGD steps on the same model and batch,
by preconditioners whose intervals force that kind on every step. The per-step cost of a
configuration with factor interval ``f`` and inverse interval ``i`` (``i`` a multiple of
``f``) is then the exact amortisation

    t(f, i) = t_plain + (t_factor − t_plain) / f + (t_inverse − t_factor) / i,

reported as a ratio to SGD's median step. The phase breakdown of a configuration comes from
the same side-by-side medians: forward/backward/update = ``t_sgd``, precondition =
``t_plain − t_sgd``, factor build = ``(t_factor − t_plain)/f``, inverse =
``(t_inverse − t_factor)/i`` (communication is zero in one process). One profiled step of
each kind also records the ``record_function`` totals of the engine's labels; the profiler
inflates them, so use those only for shares *within* a phase (e.g. A versus G capture).

An AdamW step (torch's defaults) on another copy is measured in the same rounds too, so every
amortised cost also has ``ratio_to_adamw``: a K-FAC method that replaces Adam (``eigen_adam``
over SGD without momentum) is compared with the step it replaces.

A second SGD case, an identical copy of the model measured in the same rounds, gives
``control_ratio``: how far two equal steps differ here, i.e. the noise floor of every ratio.
The *pooled* ratios use, for every configuration, the median plain step of all of them (the
plain step does the same work in each) against the median of both SGD copies
(:func:`summarise`).
"""

from __future__ import annotations

import argparse
import copy
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dkfac.app.data import half_memory
from dkfac.app.devices import device_error, pick_device
from dkfac.app.domains import DOMAINS
from dkfac.app.factory import ModelError
from dkfac.app.gpt import add_gpt_arguments, gpt_options, size_problem
from dkfac.app.models import build_model, check_model_name
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    command_line,
    interleaved,
    machine_info,
    median,
    parse_options,
    write_result,
)
from dkfac.bench.step_report import plot_breakdown, summary_text
from dkfac.config import KFACConfig, unknown_options
from dkfac.preconditioner import KFACPreconditioner
from dkfac.solvers import METHODS

logger = logging.getLogger(__name__)

NEVER = 10**9  # an interval no benchmark reaches
PHASE_LABELS = {
    "capture A": ("dkfac.capture_a",),
    "capture G": ("dkfac.capture_g",),
    "factor update": ("dkfac.factors",),
    "factor comm": ("dkfac.comm.factors",),
    "inverse": ("dkfac.inverse",),
    "inverse comm": ("dkfac.comm.inverses",),
    "precondition": ("dkfac.precondition", "dkfac.kl_clip", "dkfac.comm.preconditioned"),
}
KINDS = {"plain": (NEVER, NEVER), "factor": (1, NEVER), "inverse": (1, 1)}
FIXED_OPTIONS = frozenset({"method", "factor_update_interval", "inverse_update_interval", "lr"})


class OptionsError(ValueError):
    """The preconditioner refused the benchmark's options for the model (no layer left after
    ``--skip-layers``, an option the model's layers cannot take): a flag error."""


def build_preconditioner(model: nn.Module, options: dict[str, Any]) -> KFACPreconditioner:
    """``KFACPreconditioner(model, **options)``, its refusal raised as :class:`OptionsError`."""
    try:
        return KFACPreconditioner(model, **options)
    except (TypeError, ValueError) as err:
        raise OptionsError(str(err)) from None


def options_problem(options: dict[str, Any], method: str) -> str | None:
    """What is wrong with ``--options`` before any model is built (``None``: nothing): an
    unknown name, or a value :class:`~dkfac.KFACConfig` refuses."""
    if problem := unknown_options(options):
        return problem
    try:
        KFACConfig(**{**options, "method": method})
    except (TypeError, ValueError) as err:
        return str(err)
    return None


def _make_case(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    kfac_options: dict[str, Any] | None,
    autocast: torch.dtype | None,
    adamw: bool = False,
) -> tuple[Callable[[], None], KFACPreconditioner | None]:
    """One training step on a private copy of ``model`` (K-FAC when options are given).

    The step's optimizer is SGD with momentum 0.9, or AdamW (torch's defaults) if ``adamw``.

    Returns:
        The step, and the preconditioner it uses (``None`` without K-FAC).
    """
    model = copy.deepcopy(model)
    optimizer: torch.optim.Optimizer
    if adamw:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    pre = None if kfac_options is None else build_preconditioner(model, kfac_options)
    x, y = batch

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(
            x.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
        ):
            loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        if pre is not None:
            pre.step()
        optimizer.step()

    return step, pre


def _phase_breakdown(fn: Callable[[], None], device: torch.device) -> dict[str, float]:
    """Seconds per phase of one profiled call of ``fn``."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
    return phase_seconds(prof.key_averages())


def phase_seconds(events: Iterable[Any]) -> dict[str, float]:
    """Seconds per phase: the host time (``cpu_time_total``, µs) of the events whose key is
    one of the phase's labels, summed over every event of that key. With the CUDA activity
    the profiler lists a label twice, as the host's range and as the GPU's annotation (no
    host time); keeping one of them per key (the last) read 0 for every phase on a GPU."""
    totals: dict[str, float] = {}
    for event in events:
        totals[event.key] = totals.get(event.key, 0.0) + event.cpu_time_total / 1e6
    return {
        name: sum(totals.get(label, 0.0) for label in labels)
        for name, labels in PHASE_LABELS.items()
    }


def breakdown(sgd: float, t: dict[str, float], f_int: int, i_int: int) -> dict[str, float]:
    """Seconds per step by phase, from side-by-side medians (see the module docstring).

    Args:
        sgd: Median SGD step.
        t: Median K-FAC step of each kind (``plain``, ``factor``, ``inverse``).
        f_int: Factor interval.
        i_int: Inverse interval.
    """
    return {
        "forward/backward/update": sgd,
        "precondition": t["plain"] - sgd,
        "factor build": (t["factor"] - t["plain"]) / f_int,
        "inverse": (t["inverse"] - t["factor"]) / i_int,
    }


AMORTISED = ((1, 10), (10, 100), (1, 1))


def summarise(
    times: dict[str, list[float]],
    configs: list[str],
    layer_sets: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Medians, amortised costs and ratios from the repeats (see the module docstring).

    Besides each configuration's own figures it gives a *pooled* estimate: the plain step
    does the same work in every configuration that preconditions the same layers
    (precondition only), so the median of their plain medians, against the median of both
    SGD copies' repeats, is less exposed to the few-% differences between model copies
    that ``control_ratio`` shows.

    Args:
        times: Case name -> measured seconds (``sgd``, ``sgd-control``, ``<config>/<kind>``
            and optionally ``adamw``).
        configs: The configuration names.
        layer_sets: Configuration -> a label of the layers it preconditions; plain steps
            are pooled within a label only. Default: every configuration preconditions the
            same layers (label ``"all"``).

    Returns:
        ``sgd_seconds``, ``adamw_seconds`` (``None`` without an ``adamw`` case),
        ``control_ratio``, ``pooled`` (``sgd_seconds``, ``plain_seconds``
        of the first configuration's layer set and ``plain_seconds_by_layer_set``) and
        ``configs``: per configuration its ``layer_set``, ``kind_seconds`` and
        ``amortised`` costs keyed ``"f,i"``.
    """
    sets = {c: "all" for c in configs} if layer_sets is None else layer_sets
    sgd = median(times["sgd"])
    kinds = {c: {kind: median(times[f"{c}/{kind}"]) for kind in KINDS} for c in configs}
    plain_by_set = {
        label: median([kinds[c]["plain"] for c in configs if sets[c] == label])
        for label in dict.fromkeys(sets[c] for c in configs)
    }
    pooled_sgd = median(times["sgd"] + times["sgd-control"])
    adamw = median(times["adamw"]) if "adamw" in times else None
    summary: dict[str, Any] = {
        "sgd_seconds": sgd,
        "adamw_seconds": adamw,
        "control_ratio": median(times["sgd-control"]) / sgd,
        "pooled": {
            "plain_seconds": plain_by_set[sets[configs[0]]],
            "sgd_seconds": pooled_sgd,
            "plain_seconds_by_layer_set": plain_by_set,
        },
        "configs": {},
    }
    for cname, t in kinds.items():
        pooled_plain = plain_by_set[sets[cname]]
        amortised = {}
        for f_int, i_int in AMORTISED:
            extra = (t["factor"] - t["plain"]) / f_int + (t["inverse"] - t["factor"]) / i_int
            amortised[f"{f_int},{i_int}"] = {
                "seconds": t["plain"] + extra,
                "ratio_to_sgd": (t["plain"] + extra) / sgd,
                "pooled_ratio_to_sgd": (pooled_plain + extra) / pooled_sgd,
                "ratio_to_adamw": None if adamw is None else (t["plain"] + extra) / adamw,
                "breakdown": breakdown(sgd, t, f_int, i_int),
            }
        summary["configs"][cname] = {
            "layer_set": sets[cname],
            "kind_seconds": t,
            "amortised": amortised,
        }
    return summary


def model_and_batch(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and a random batch: images and 10 classes, or bytes for ``--model gpt``."""
    if args.model == "gpt":
        model = build_model(
            "gpt", in_channels=1, image_size=args.seq_len, num_classes=256, **gpt_options(args)
        )
        shape: tuple[int, ...] = (args.batch_size, args.seq_len)
        x = torch.randint(0, 256, shape, device=device)
        return model.to(device), x, torch.randint(0, 256, shape, device=device)
    model = build_model(
        args.model, in_channels=args.channels, image_size=args.image_size, num_classes=10
    )
    size = args.image_size
    x = torch.randn(args.batch_size, args.channels, size, size, device=device)
    return model.to(device), x, torch.randint(0, 10, (args.batch_size,), device=device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark described by ``args``; returns the JSON payload."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, x, y = model_and_batch(args, device)
    autocast = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.autocast]
    configs: dict[str, dict[str, Any]] = {"exact": {}}
    if args.with_reduction:
        configs["reduce-sum"] = {"conv_reduction": "sum"}
        configs[f"subsample-{args.subsample_positions}"] = {
            "conv_reduction": "subsample",
            "subsample_positions": args.subsample_positions,
        }
    if args.factor_batch_size is not None:
        for cname in list(configs):
            configs[f"{cname}/fb{args.factor_batch_size}"] = {
                **configs[cname],
                "factor_batch_size": args.factor_batch_size,
            }
    if args.capture_dtype is not None:
        label = {"bfloat16": "bf16", "auto": "auto"}[args.capture_dtype]
        dtype = "auto" if args.capture_dtype == "auto" else getattr(torch, args.capture_dtype)
        for cname in list(configs):
            configs[f"{cname}/{label}"] = {**configs[cname], "capture_dtype": dtype}
    layer_sets = {cname: "all" for cname in configs}
    if args.skip_layers:
        skipped = "skip " + "|".join(args.skip_layers)
        for cname in list(configs):
            configs[f"{cname}/{skipped}"] = {**configs[cname], "skip_layers": args.skip_layers}
            layer_sets[f"{cname}/{skipped}"] = skipped
    # A second, identical SGD case measured in the same rounds: its ratio to the first is the
    # noise floor of every ratio here (copies of one model differ by a few % on a CPU).
    cases = {
        "sgd": _make_case(model, (x, y), None, autocast)[0],
        "sgd-control": _make_case(model, (x, y), None, autocast)[0],
        "adamw": _make_case(model, (x, y), None, autocast, adamw=True)[0],
    }
    preconditioned: dict[str, list[str]] = {}
    for cname, options in configs.items():
        for kind, (f_int, i_int) in KINDS.items():
            kfac = {
                "damping": 1e-3,
                **args.options,
                "method": args.method,
                "factor_update_interval": f_int,
                "inverse_update_interval": i_int,
                "lr": 1e-4,
                **options,
            }
            cases[f"{cname}/{kind}"], pre = _make_case(model, (x, y), kfac, autocast)
            assert pre is not None
            preconditioned[cname] = list(pre.layers)
    times = interleaved(cases, repeats=args.repeats, device=device, warmup=1)
    summary = summarise(times, list(configs), layer_sets)
    for cname in configs:
        summary["configs"][cname]["preconditioned_layers"] = preconditioned[cname]
        summary["configs"][cname]["phases"] = {
            kind: _phase_breakdown(cases[f"{cname}/{kind}"], device) for kind in KINDS
        }
    return {
        "benchmark": "step",
        "machine": machine_info(device),
        "settings": vars(args),
        "times": times,
        "summary": summary,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench step`` flags."""
    add_case_arguments(parser)
    parser.add_argument("--autocast", default="none", choices=["none", "bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--with-reduction",
        action="store_true",
        help="also conv_reduction=sum and conv_reduction=subsample",
    )
    parser.add_argument(
        "--subsample-positions", type=int, default=8, help="positions per image for subsample"
    )
    parser.add_argument(
        "--factor-batch-size",
        type=int,
        default=None,
        help="also every configuration with factors from this many samples per batch",
    )
    parser.add_argument(
        "--capture-dtype",
        default=None,
        choices=["bfloat16", "auto"],
        help="also every configuration with its factor products in this precision (auto: "
        "bf16 where the device multiplies it natively, else the default)",
    )
    parser.add_argument(
        "--skip-layers",
        nargs="+",
        default=None,
        metavar="REGEX",
        help="also every configuration with the layers matching these regular expressions "
        "(name or class name) not preconditioned, e.g. BatchNorm2d for kfac-pytorch's layer "
        "set; their plain steps are pooled separately",
    )
    parser.add_argument(
        "--name", default=None, help="result file name (default step_<model>_<device>)"
    )
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--plot", default=None, help="PNG path for the phase breakdown")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the model, batch, method and device a step runs on (what
    :func:`model_and_batch` and each K-FAC case read)."""
    parser.add_argument("--model", default="resnet20", help="a model of dkfac train, or gpt")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=3)
    add_gpt_arguments(parser)  # --layers --width --heads --seq-len of --model gpt
    parser.add_argument("--method", default="eigen", choices=METHODS)
    parser.add_argument(
        "--options",
        type=_options,
        default={},
        metavar="KEY=VALUE,...",
        help="more preconditioner options for every configuration, e.g. "
        "damping=0.01,factor_batch_size=32, or with --method eigen_adam basis_refresh=power "
        "(not the intervals, which each kind sets)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def case_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags of :func:`add_case_arguments` (``None``: nothing), so
    that a bad value is one line and exit 2 rather than a traceback from the model or
    torch; a ``--device`` of ``auto`` is resolved to this machine's device."""
    if args.model != "gpt":
        try:
            check_model_name(args.model)
        except ModelError as err:
            return f"--model: {err}"
    for flag, dest in (
        ("batch_size", "batch_size"),
        ("image_size", "image_size"),
        ("channels", "in_channels"),
    ):
        domain, value = DOMAINS[dest], getattr(args, flag)
        if not domain.contains(value):
            return f"--{flag.replace('_', '-')} must be {domain.describe()}, got {value}"
    if args.model == "gpt" and (
        problem := size_problem(args.layers, args.width, args.heads, args.seq_len)
    ):
        return problem
    if args.model == "gpt":  # int64 inputs and targets
        values, need, flags = args.seq_len, 16 * args.batch_size * args.seq_len, "--seq-len"
    else:
        values = args.channels * args.image_size**2
        need, flags = 4 * args.batch_size * values, "--image-size or --channels"
    if need > (budget := half_memory()):
        return (
            f"a batch of {args.batch_size} inputs of {values} values would take "
            f"{need / 2**30:.1f} GiB, more than half of this machine's memory "
            f"({budget / 2**30:.1f} GiB); reduce --batch-size, {flags}"
        )
    if problem := device_error(args.device):
        return problem
    args.device = str(pick_device(args.device))
    return None


def _options(text: str) -> dict[str, Any]:
    """``--options``: preconditioner keywords, without the ones every kind sets itself."""
    try:
        options = parse_options(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if taken := sorted(set(options) & FIXED_OPTIONS):
        raise argparse.ArgumentTypeError(
            f"{', '.join(taken)} cannot be set: --method and each step kind set them"
        )
    return options


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench step``."""
    parser = BenchParser(prog="dkfac bench step", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if problem := case_problem(args):
        parser.error(problem)
    if args.autocast == "fp16" and torch.device(args.device).type != "cuda":
        parser.error("--autocast fp16 needs a CUDA device (use --autocast bf16 on a CPU)")
    for flag in ("repeats", "subsample_positions", "factor_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for pattern in args.skip_layers or ():
        try:
            re.compile(pattern)
        except re.error as err:
            parser.error(f"--skip-layers: {pattern!r} is not a regular expression ({err})")
    if problem := options_problem(args.options, args.method):  # not a traceback mid-run
        parser.error(f"--options: {problem}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        payload = run(args)
    except ModelError as err:  # a --model factory that loads but gives no model
        parser.error(f"--model: {err}")
    except OptionsError as err:  # the options or --skip-layers against this model
        parser.error(f"--options / --skip-layers: {err}")
    name = args.name or f"step_{args.model}_{torch.device(args.device).type}"
    write_result(name, payload, args.out_dir, command_line("dkfac bench step", argv))
    if args.plot:
        plot_breakdown(payload, args.plot)
    print(summary_text(payload))
    return 0
