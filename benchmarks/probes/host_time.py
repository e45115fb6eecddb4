"""Host time of a plain K-FAC step: a CPU proxy for a launch-bound GPU.

On a GPU a small model's step is bound by the host: Python and the dispatch of each tensor
operation, not the arithmetic (the step of ``for_model`` on ResNet-20 took 1.54x AdamW's on
an H200 where a CPU pays a fraction of that). The count of dispatched operations
(``dkfac bench dispatches``) misses the Python around them; this probe times it. It builds
models with the layer graphs of the benchmark's ResNet-20 and GPT but widths so small that
every kernel is a few microseconds (ResNet-20 with 2/4/8 channels on 8x8 images, batch 2;
the GPT with 4 layers 8 wide, on 8 tokens of a 32-symbol vocabulary, batch 1), forces the engine's
launch-bound forms (what it runs on CUDA: multi-tensor copies, the finiteness guard and the
moment counts on the device), and times whole training steps of AdamW and of
``KFACOptimizer.for_model`` whose factors and bases are never refreshed (every step plain),
alternating blocks of 30 steps, thread CPU time, one thread. A round builds both arms afresh
and gives the ratio of their median blocks; the figure is the median ratio of the rounds
(one round's ratio moves by several hundredths from one to the next).

    PYTHONPATH=src python benchmarks/probes/host_time.py --threads 1 \\
        --out benchmarks/results/host_time_plain_step.json

With ``--device cuda`` the same models run on the GPU, where the engine takes those forms
by itself (nothing is forced), and a block is timed on the wall clock, the device
synchronised at its end: what the probe stands in for, measured (``benchmarks/gpu_runs.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dkfac.preconditioner as preconditioner_module
import dkfac.solvers.host_copy as host_copy
from dkfac import KFACOptimizer
from dkfac.app import models
from dkfac.app.gpt import GPT
from dkfac.bench.common import machine_info, synchronize
from dkfac.engine import launches

NEVER = 10**9
BLOCK = 30


class ThinResNet20(nn.Module):
    """The benchmark's CIFAR ResNet-20 graph (stem, three stages of three basic blocks with
    projection shortcuts, pooling, a linear head) at widths 2, 4 and 8."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = models._conv_bn(3, 2, 3)
        blocks: list[nn.Module] = []
        cin = 2
        for stage, cout in enumerate((2, 4, 8)):
            for i in range(3):
                blocks.append(models._BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def _case(model: str, device: torch.device) -> tuple[nn.Module, Tensor, Callable[[Tensor], Tensor]]:
    """A fresh model, its batch and its loss, on ``device``."""
    torch.manual_seed(0)
    if model == "resnet20":
        x, y = torch.randn(2, 3, 8, 8).to(device), torch.randint(0, 10, (2,)).to(device)
        return ThinResNet20().to(device), x, lambda out: F.cross_entropy(out, y)
    tokens = torch.randint(0, 32, (1, 8)).to(device)
    labels = torch.randint(0, 32, (1, 8)).to(device)
    gpt = GPT(vocab_size=32, context=16, layers=4, width=8, heads=4).to(device)
    return gpt, tokens, lambda out: F.cross_entropy(out.reshape(-1, 32), labels.reshape(-1))


def _optimizer(arm: str, model: nn.Module) -> Any:
    if arm == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return KFACOptimizer.for_model(
        model, overhead=None, factor_update_interval=NEVER, inverse_update_interval=NEVER
    )


@contextlib.contextmanager
def launch_bound_forms() -> Iterator[None]:
    """Within: the engine takes its CUDA forms on the CPU."""

    def always(device: torch.device) -> bool:
        del device
        return True

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(launches, "launch_bound", always))
        stack.enter_context(mock.patch.object(preconditioner_module, "launch_bound", always))
        stack.enter_context(mock.patch.object(host_copy, "HOST_COUNT_DEVICES", frozenset()))
        yield


def measure_round(model: str, blocks: int, device: torch.device) -> dict[str, Any]:
    """One round: milliseconds per step of each arm (median block) and the ratio to
    AdamW's: thread CPU time on a CPU, the wall clock on a GPU (module notes)."""
    steps: dict[str, Callable[[], None]] = {}
    for arm in ("adamw", "dkfac"):
        net, x, loss = _case(model, device)
        opt = _optimizer(arm, net)

        def step(net: nn.Module = net, x: Tensor = x, loss: Any = loss, opt: Any = opt) -> None:
            opt.zero_grad()
            loss(net(x)).backward()
            opt.step()

        for _ in range(5):
            step()
        steps[arm] = step
    times: dict[str, list[float]] = {arm: [] for arm in steps}
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    for _ in range(blocks):
        for arm, step in steps.items():
            synchronize(device)
            start = clock()
            for _ in range(BLOCK):
                step()
            synchronize(device)
            times[arm].append((clock() - start) / BLOCK * 1e3)
    ms = {arm: statistics.median(values) for arm, values in times.items()}
    return {"ms_per_step": ms, "blocks_ms": times, "dkfac_vs_adamw": ms["dkfac"] / ms["adamw"]}


def measure(model: str, blocks: int, rounds: int, device: torch.device) -> dict[str, Any]:
    """``rounds`` rounds; the median of their ratios (and of each arm's milliseconds)."""
    done = [measure_round(model, blocks, device) for _ in range(rounds)]
    ms = {arm: statistics.median(r["ms_per_step"][arm] for r in done) for arm in ("adamw", "dkfac")}
    ratio = statistics.median(r["dkfac_vs_adamw"] for r in done)
    return {"ms_per_step": ms, "dkfac_vs_adamw": ratio, "rounds": done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=["resnet20", "gpt"])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    forced = launch_bound_forms() if device.type == "cpu" else contextlib.nullcontext()
    with forced:
        for model in args.models:
            results[model] = measure(model, args.blocks, args.rounds, device)
            ms = results[model]["ms_per_step"]
            rounds = ", ".join(f"{r['dkfac_vs_adamw']:.2f}" for r in results[model]["rounds"])
            print(
                f"{model}: AdamW {ms['adamw']:.3f} ms, dkfac {ms['dkfac']:.3f} ms, "
                f"{results[model]['dkfac_vs_adamw']:.2f}x (rounds {rounds})",
                flush=True,
            )
    if args.out is not None:
        record = {
            "command": "PYTHONPATH=src python benchmarks/probes/host_time.py "
            f"--threads {args.threads} --blocks {args.blocks} --rounds {args.rounds} "
            f"--device {args.device} --out {args.out}",
            "machine": machine_info(device),
            "figure": (
                f"{'thread CPU' if device.type == 'cpu' else 'wall-clock'} ms per step, median "
                f"of {args.blocks} alternated blocks; the median ratio of {args.rounds} rounds"
            ),
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
