"""``dkfac bench dispatches``: how many tensor operations one training step dispatches.

On a GPU a small model's K-FAC step is bound by kernel launches, about one per dispatched
tensor operation that is not a view (a view costs host time only), not by its arithmetic.
The count does not depend on the machine, so a CPU can track it between GPU leases. The
command builds ``dkfac bench step``'s model and batch, runs a few warm-up steps of each
kind, then counts (``TorchDispatchMode``) the operations of one step, all and those that are
not views: ``sgd`` (SGD with momentum, foreach), ``adamw`` (torch's defaults, foreach) and
K-FAC over that SGD with ``--method`` and ``--options`` as a *plain* step (precondition
only), a *factor* step (captures and factor update too) and an *inverse* step (and the
solver refresh), as bench step's kinds. Each K-FAC kind also lists the source lines in
``dkfac`` that dispatch most (``--top``).

``--launch-bound`` counts what a CUDA device runs: the engine's multi-tensor forms
(:mod:`dkfac.engine.launches`), the finiteness guard on the device
(:mod:`dkfac.engine.device_checks`), the moment counts and null indicators kept on the
device (:data:`~dkfac.solvers.host_copy.HOST_COUNT_DEVICES` empty) and the convolution
input factor's path as ``auto`` picks it there (the unfolded product); ``--conv-path``
forces one path instead.

    dkfac bench dispatches --model resnet20 --batch-size 128 --method eigen --launch-bound
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dkfac.blocks.conv_path_choice as conv_path_choice
import dkfac.solvers.host_copy as host_copy
from dkfac.app.factory import ModelError
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import command_line, machine_info, write_result
from dkfac.bench.step import (
    OptionsError,
    add_case_arguments,
    build_preconditioner,
    case_problem,
    model_and_batch,
    options_problem,
)
from dkfac.engine import launches
from dkfac.preconditioner import KFACPreconditioner

__all__ = ["Dispatches", "count_step", "main"]

NEVER = 10**9
KINDS = {"plain": (NEVER, NEVER), "factor": (1, NEVER), "inverse": (1, 1)}
"""K-FAC step kind -> (factor, inverse) intervals that make every step that kind."""
CONV_PATHS = ("auto", "shift", "segment", "unfold")


class Dispatches(TorchDispatchMode):
    """Counts dispatched operations, views apart, and by the innermost ``dkfac`` source
    line below this module's own frames (``"torch (model, autograd, optimizer)"`` for the
    rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.views = 0
        self.lines: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.total += 1
        self.views += bool(func.is_view)
        stack = traceback.extract_stack()[:-1]  # without this frame
        mine = [i for i, f in enumerate(stack) if f.filename.endswith("bench/dispatches.py")]
        here = max(mine, default=-1)
        frames = [f for f in stack[here + 1 :] if "/dkfac/" in f.filename]
        where = "torch (model, autograd, optimizer)"
        if frames:
            where = f"{frames[-1].filename.split('/dkfac/')[-1]}:{frames[-1].lineno}"
        self.lines[f"{where} {func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def count_step(
    model: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    pre: KFACPreconditioner | None,
    warmup: int = 3,
) -> Dispatches:
    """The dispatches of one step (zero_grad, forward, backward, K-FAC, optimizer) after
    ``warmup`` steps."""
    x, y = batch

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
        if pre is not None:
            pre.step()
        optimizer.step()

    for _ in range(warmup):
        step()
    with Dispatches() as counter:
        step()
    return counter


@contextlib.contextmanager
def _device_forms(launch_bound: bool, conv_path: str) -> Iterator[None]:
    """Within: the engine's launch-bound forms and the conv factor's path as asked (module
    functions replaced, and put back after)."""
    on_cpu = conv_path_choice.auto_path

    def as_on_cuda(*a: Any, **k: Any) -> str:
        return on_cpu(*a[:5], "cuda", *a[6:], **k)

    def forced(*a: Any, **k: Any) -> str:
        return conv_path if a[2] == (1, 1) else "unfold"

    with contextlib.ExitStack() as stack:
        if launch_bound:
            stack.enter_context(mock.patch.object(launches, "launch_bound", lambda device: True))
            stack.enter_context(mock.patch.object(conv_path_choice, "auto_path", as_on_cuda))
            stack.enter_context(mock.patch.object(host_copy, "HOST_COUNT_DEVICES", frozenset()))
        if conv_path != "auto":
            stack.enter_context(mock.patch.object(conv_path_choice, "auto_path", forced))
        yield


def _parser() -> argparse.ArgumentParser:
    parser = BenchParser(prog="dkfac bench dispatches", description=__doc__.split("\n")[0])
    add_case_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--conv-path", choices=CONV_PATHS, default="auto")
    parser.add_argument(
        "--launch-bound",
        action="store_true",
        help="count the forms and paths a CUDA device takes (module notes)",
    )
    parser.add_argument("--top", type=int, default=15, help="source lines listed per kind")
    parser.add_argument("--name", default=None, help="result file name (default: none written)")
    parser.add_argument("--out-dir", default=None, help="where --name's JSON goes")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Counts each kind, prints the counts, writes them to ``--name``'s JSON if given."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error(f"--top must be >= 0, got {args.top}")
    if problem := case_problem(args):
        parser.error(problem)
    if problem := options_problem(args.options, args.method):  # not a traceback mid-run
        parser.error(f"--options: {problem}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    try:
        base, x, y = model_and_batch(args, device)
    except ModelError as err:  # a --model factory that loads but gives no model
        parser.error(f"--model: {err}")
    counts: dict[str, Any] = {}
    with _device_forms(args.launch_bound, args.conv_path):
        for kind in ("sgd", "adamw", *KINDS):
            try:
                counts[kind] = _count_kind(kind, base, (x, y), args)
            except OptionsError as err:  # the options against this model
                parser.error(f"--options: {err}")
    for kind, entry in counts.items():
        print(f"{kind}: {entry['dispatches']} dispatches, {entry['not_views']} not views")
        for line, n in entry.get("top_dkfac_lines", {}).items():
            print(f"  {n:5d} {line}")
    if args.name:
        settings = {k: v for k, v in vars(args).items() if k not in ("name", "out_dir")}
        payload = {"machine": machine_info(device), "settings": settings, "counts": counts}
        command = command_line("dkfac bench dispatches", list(argv) if argv else None)
        write_result(args.name, payload, args.out_dir, command)
    return 0


def _count_kind(
    kind: str, base: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], args: Any
) -> dict[str, Any]:
    """One kind's counts on a fresh copy of the model."""
    model = copy.deepcopy(base)
    optimizer: torch.optim.Optimizer
    if kind == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
    pre = None
    if kind in KINDS:
        f_int, i_int = KINDS[kind]
        options = {"damping": 1e-3, **args.options, "method": args.method, "lr": 1e-4}
        options.update(factor_update_interval=f_int, inverse_update_interval=i_int)
        pre = build_preconditioner(model, options)
        pre.flags_on_device = pre.flags_on_device or args.launch_bound
    counter = count_step(model, batch, optimizer, pre)
    entry: dict[str, Any] = {
        "dispatches": counter.total,
        "views": counter.views,
        "not_views": counter.total - counter.views,
    }
    if kind in KINDS:
        ranked = [(ln, n) for ln, n in counter.lines.most_common() if not ln.startswith("torch ")]
        entry["top_dkfac_lines"] = dict(ranked[: args.top])
    return entry
