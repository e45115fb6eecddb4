"""Probe: how many tensor operations one training step dispatches, by step kind and source.

On a GPU a small model's K-FAC step is bound by kernel launches, about one per dispatched
tensor operation that is not a view (a view costs host time only), not by its arithmetic
(BENCHMARKS.md sections 18, 28 and 30). The count does not depend on the machine, so a CPU
can track it between GPU leases. This probe builds ``dkfac bench step``'s model and batch,
runs a few warm-up steps of each kind, then counts (``TorchDispatchMode``) the operations of
one step, all and those that are not views: ``sgd`` (SGD with momentum, foreach),
``adamw`` (torch's defaults, foreach) and K-FAC over that SGD with ``--method`` and
``--options`` as a *plain* step (precondition only), a *factor* step (captures and factor
update too) and an *inverse* step (and the solver refresh), as bench step's kinds. Each
K-FAC kind also lists the source lines in ``dkfac`` that dispatch most (``--top``).

``--launch-bound`` counts what a CUDA device runs: the engine's multi-tensor forms
(:mod:`dkfac.engine.launches`) and the convolution input factor's path as ``auto`` picks
it there (the unfolded product); ``--conv-path`` forces one path instead (``auto`` takes, at
stride 1, usually the shift path on a CPU).

    python benchmarks/probes/step_dispatches.py --model resnet20 --batch-size 128 \\
        --method eigen --launch-bound --out benchmarks/results/step_dispatches_resnet20.json
"""

from __future__ import annotations

import argparse
import copy
import json
import traceback
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dkfac.blocks.conv_factor as conv_factor
from dkfac.bench.common import command_line
from dkfac.bench.step import add_case_arguments, model_and_batch
from dkfac.engine import launches
from dkfac.preconditioner import KFACPreconditioner

NEVER = 10**9
KINDS = {"plain": (NEVER, NEVER), "factor": (1, NEVER), "inverse": (1, 1)}


class Dispatches(TorchDispatchMode):
    """Counts dispatched operations, and by the innermost ``dkfac`` source line."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.views = 0
        self.lines: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.total += 1
        self.views += bool(func.is_view)
        frames = [f for f in traceback.extract_stack() if "/dkfac/" in f.filename]
        where = "torch (model, autograd, optimizer)"
        if frames and "step_dispatches" not in frames[-1].filename:
            where = f"{frames[-1].filename.split('/dkfac/')[-1]}:{frames[-1].lineno}"
        self.lines[f"{where} {func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def count_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
               optimizer: torch.optim.Optimizer, pre: KFACPreconditioner | None,
               warmup: int = 3) -> Dispatches:  # fmt: skip
    """The dispatches of one step after ``warmup`` steps."""
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


def main() -> None:
    """Parses the arguments, counts each kind, prints and writes the counts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_case_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--conv-path", choices=("auto", "shift", "segment", "unfold"), default="auto"
    )
    parser.add_argument(
        "--launch-bound",
        action="store_true",
        help="count the forms and paths a CUDA device takes (module notes)",
    )
    parser.add_argument("--top", type=int, default=15, help="source lines listed per kind")
    parser.add_argument("--out", help="also write the counts to this JSON file")
    args = parser.parse_args()
    options = args.options
    torch.set_num_threads(args.threads)
    if args.launch_bound:
        launches.launch_bound = lambda device: True  # type: ignore[assignment]
        on_cpu = conv_factor.auto_path
        conv_factor.auto_path = lambda *a, **k: on_cpu(*a[:5], "cuda", *a[6:])  # type: ignore[assignment]
    if args.conv_path != "auto":
        chosen = args.conv_path
        conv_factor.auto_path = lambda *a, **k: chosen if a[2] == (1, 1) else "unfold"  # type: ignore[assignment]
    device = torch.device(args.device)
    torch.manual_seed(0)
    base, x, y = model_and_batch(args, device)
    counts: dict[str, Any] = {}
    for kind in ("sgd", "adamw", *KINDS):
        model = copy.deepcopy(base)  # a fresh copy per kind
        optimizer: torch.optim.Optimizer
        if kind == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
        pre = None
        if kind in KINDS:
            f_int, i_int = KINDS[kind]
            kfac = {"damping": 1e-3, **options, "method": args.method, "lr": 1e-4}
            kfac.update(factor_update_interval=f_int, inverse_update_interval=i_int)
            pre = KFACPreconditioner(model, **kfac)
            pre.flags_on_device = pre.flags_on_device or args.launch_bound
        counter = count_step(model, (x, y), optimizer, pre)
        ranked = [(ln, n) for ln, n in counter.lines.most_common() if not ln.startswith("torch ")]
        top = dict(ranked[: args.top])
        counts[kind] = {
            "dispatches": counter.total,
            "views": counter.views,
            "top_dkfac_lines": top,
        }
        print(f"{kind}: {counter.total} dispatches, {counter.total - counter.views} not views")
        if kind in KINDS:
            for line, n in top.items():
                print(f"  {n:5d} {line}")
    if args.out:
        payload = {
            "command": command_line("python benchmarks/probes/step_dispatches.py", None),
            "torch": torch.__version__,
            "settings": {**vars(args), "options": options},
            "counts": counts,
        }
        with open(args.out, "w") as handle:
            json.dump(payload, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
