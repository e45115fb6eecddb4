"""Grouped convolutions under the default, against leaving them to Adam's direction, on digits.

Two models with depthwise convolutions (a ConvNeXt-like one: 7×7 depthwise, LayerNorm, a
4× pointwise MLP, a layer scale; a MobileNet-like one: depthwise-separable blocks with
BatchNorm), batch 256, ``KFACOptimizer.for_model`` with only the lr swept. Two arms:

* ``adam_dw``: the grouped convolutions named in ``skip_layers``, so their parameters get
  Adam's direction (``leftover_update``), as a build that declines them does;
* ``unitwise``: the default, Adam in the eigenbasis of each output channel's unit-wise
  Fisher (:mod:`dkfac.solvers.unitwise_adam`).

The lr is swept over :data:`LRS` on seed 0; the best of each arm (fewest steps to the
target, then the final accuracy) is run on the held-out seeds, on the split of the sweep
and on a second one; steps to the target are deterministic. ``--dampings`` repeats the
unit-wise arm's sweep at other dampings (BatchNorm's kept at the default 0.03; the default's
unit-wise update reads none, so none is run by default), and both arms at their best lr are
run on seeds 0-3 with statistics and solves fresh every step (:data:`EVERY_STEP`). The step
time is measured in alternated blocks of steps (``--threads 1``), the wall clock and this
thread's CPU clock, median over blocks.
The per-sample gradients' two paths (the batch folded into the groups of one weight
gradient, and an unfold of the whole input) are timed on the models' depthwise layer
shapes (``capture_paths``).

    PYTHONPATH=src python benchmarks/probes/grouped_conv_digits.py \
        --out benchmarks/results/grouped_conv_digits.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from dkfac.app.data import load_digits
from dkfac.bench.common import interleaved
from dkfac.bench.suite_tasks import Task
from dkfac.blocks.grouped_conv import GroupedConvBlock

LRS = (0.0025, 0.005, 0.01, 0.02)
TARGET = 0.93
ARMS = ("adam_dw", "unitwise")
PROBE = "benchmarks/probes/grouped_conv_digits.py"


class ConvNeXtBlock(nn.Module):
    """Depthwise 7×7, LayerNorm over channels (last), 4× pointwise MLP, layer scale."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.pw1 = nn.Linear(channels, 4 * channels)
        self.pw2 = nn.Linear(4 * channels, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 0.1))

    def forward(self, x: Tensor) -> Tensor:
        y = self.pw2(F.gelu(self.pw1(self.norm(self.dw(x).permute(0, 2, 3, 1)))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    """A 3×3 stem to 32 channels on the 8×8 digits, two ConvNeXt blocks, pooled head."""

    def __init__(self, channels: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(channels) for _ in range(depth)])
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.stem(x)).mean((2, 3))))


def _separable(inp: int, out: int, stride: int) -> list[nn.Module]:
    return [
        nn.Conv2d(inp, inp, 3, stride=stride, padding=1, groups=inp, bias=False),
        nn.BatchNorm2d(inp),
        nn.ReLU(),
        nn.Conv2d(inp, out, 1, bias=False),
        nn.BatchNorm2d(out),
        nn.ReLU(),
    ]


class MobileNetLike(nn.Module):
    """A 3×3 stem to 16 channels, three depthwise-separable blocks (16→32, 32→64 at
    stride 2, 64→64), pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            *_separable(16, 32, 1),
            *_separable(32, 64, 2),
            *_separable(64, 64, 1),
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean((2, 3)))


MODELS = {"convnext": ConvNeXtLike, "mobilenet": MobileNetLike}


def task(model: str, split: int = 0) -> Task:
    data = load_digits(seed=split, normalize=True)
    return Task(
        model, MODELS[model], data.x_train, data.y_train, data.x_test, data.y_test, 256,
        F.cross_entropy, True, TARGET,
    )  # fmt: skip


def grouped_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups > 1]


EVERY_STEP: dict[str, Any] = {
    "overhead": None,
    "factor_update_interval": 1,
    "inverse_update_interval": 1,
}
"""Options of the ``every_step`` comparison: statistics and their solve fresh at every step
(no overhead budget), so that neither arm's curvature is stale."""


def optimizer(arm: str, model: nn.Module, lr: float) -> KFACOptimizer:
    if arm.startswith("every_step:"):
        base = arm.split(":", 1)[1]
        skip = [f"^{n.replace('.', '[.]')}$" for n in grouped_names(model)]
        chosen: dict[str, Any] = {"skip_layers": skip} if base == "adam_dw" else {}
        return KFACOptimizer.for_model(model, lr=lr, **EVERY_STEP, **chosen)
    if arm.startswith("damping="):  # the unit-wise Fisher at another damping (BN's kept)
        damping = float(arm.split("=", 1)[1])
        return KFACOptimizer.for_model(model, lr=lr, damping=damping, bn_damping=0.03)
    if arm == "adam_dw":
        skip = [f"^{name.replace('.', '[.]')}$" for name in grouped_names(model)]
        return KFACOptimizer.for_model(model, lr=lr, skip_layers=skip)
    return KFACOptimizer.for_model(model, lr=lr)


def _step(t: Task, model: nn.Module, opt: KFACOptimizer, draw: Any) -> float:
    x, y = draw()
    opt.zero_grad(set_to_none=True)
    loss = t.loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def to_target(t: Task, arm: str, lr: float, seed: int, max_steps: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = t.build()
    opt = optimizer(arm, model, lr)
    draw = t.batches(torch.Generator().manual_seed(seed))
    reached, metric, step = None, t.metric(model), 0
    while step < max_steps:
        loss = _step(t, model, opt, draw)
        step += 1
        metric = t.metric(model)
        if not math.isfinite(loss):
            break
        if metric >= t.target:
            reached = step
            break
    return {"lr": lr, "seed": seed, "reached": reached, "steps": step, "final": metric}


def step_times(t: Task, lrs: dict[str, float], blocks: int, steps: int) -> dict[str, Any]:
    cases: dict[str, Callable[[], None]] = {}
    cpu: dict[str, list[float]] = {}
    for arm, lr in lrs.items():
        torch.manual_seed(0)
        model = t.build()
        opt = optimizer(arm, model, lr)
        draw = t.batches(torch.Generator().manual_seed(0))
        cpu[arm] = []

        def block(model: nn.Module = model, opt: Any = opt, draw: Any = draw,
                  spent: list[float] = cpu[arm]) -> None:  # fmt: skip
            start = time.thread_time()
            for _ in range(steps):
                _step(t, model, opt, draw)
            spent.append(time.thread_time() - start)

        cases[arm] = block
    wall = interleaved(cases, blocks, torch.device("cpu"), warmup=1)
    out: dict[str, Any] = {
        arm: {
            "wall_s": statistics.median(ts) / steps,
            "cpu_s": statistics.median(cpu[arm][1:]) / steps,
        }
        for arm, ts in wall.items()
    }
    out["ratio_wall"] = out["unitwise"]["wall_s"] / out["adam_dw"]["wall_s"]
    out["ratio_cpu"] = out["unitwise"]["cpu_s"] / out["adam_dw"]["cpu_s"]
    return out


CAPTURE_SHAPES = (
    (32, 7, 8, 1, 1),
    (16, 3, 8, 1, 1),
    (32, 3, 8, 2, 1),
    (64, 3, 4, 1, 1),
    (32, 3, 8, 1, 2),
)
"""Depthwise layers (channels, kernel, input side, stride, channel multiplier) timed for the
per-sample gradients: the ConvNeXt-like model's 7×7 and the MobileNet-like model's 3×3."""


def unfolded_grads(conv: nn.Conv2d, x: Tensor, delta: Tensor) -> Tensor:
    """The per-sample weight gradients from an unfold of the whole input (the alternative
    to :func:`~dkfac.blocks.grouped_conv.per_sample_weight_grads`)."""
    n, groups = x.shape[0], conv.groups
    window = (conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    patches = F.unfold(x, *window)  # type: ignore[arg-type]
    patches = patches.view(n, groups, patches.shape[1] // groups, -1)
    out = delta.reshape(n, groups, conv.out_channels // groups, -1)
    return torch.einsum("ngit,ngot->ngoi", patches, out).reshape(n, conv.out_channels, -1)


def capture_paths(repeats: int = 7) -> list[dict[str, Any]]:
    """Thread-CPU seconds (median) of the folded convolution and of the unfold, batch 256."""
    rows = []
    for channels, kernel, side, stride, mult in CAPTURE_SHAPES:
        conv = nn.Conv2d(channels, channels * mult, kernel, stride, kernel // 2, groups=channels)
        block = GroupedConvBlock("c", conv)
        x = torch.randn(256, channels, side, side)
        delta = torch.randn_like(conv(x))
        folded = block.per_sample_grads(x, delta)[..., :-1]  # less the bias column
        torch.testing.assert_close(folded, unfolded_grads(conv, x, delta), rtol=1e-4, atol=1e-4)
        times = {}
        paths: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
            "folded_s": block.per_sample_grads,
            "unfold_s": functools.partial(unfolded_grads, conv),
        }
        for label, fn in paths.items():
            spent = []
            for _ in range(repeats):
                start = time.thread_time()
                fn(x, delta)
                spent.append(time.thread_time() - start)
            times[label] = statistics.median(spent[1:])
        shape = {"channels": channels, "kernel": kernel, "side": side, "stride": stride}
        rows.append({**shape, "multiplier": mult, **times})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--block-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--dampings", type=float, nargs="*", default=[])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record: dict[str, Any] = {
        "load_average_before": list(os.getloadavg()),
        "command": " ".join(["PYTHONPATH=src python", PROBE, *sys.argv[1:]]),
        "target": TARGET, "lrs": list(LRS), "batch": 256, "threads": args.threads, "models": {},
    }  # fmt: skip
    record["capture_paths"] = capture_paths()
    for name in args.models:
        t = task(name)
        sweep = {arm: [to_target(t, arm, lr, 0, args.max_steps) for lr in LRS] for arm in ARMS}
        best = {
            arm: min(runs, key=lambda r: (r["reached"] or math.inf, -r["final"]))["lr"]
            for arm, runs in sweep.items()
        }
        held = {
            arm: [to_target(t, arm, best[arm], s, args.max_steps) for s in args.seeds]
            for arm in ARMS
        }
        second = task(name, split=1)
        held_split1 = {
            arm: [to_target(second, arm, best[arm], s, args.max_steps) for s in args.seeds]
            for arm in ARMS
        }
        entry: dict[str, Any] = {
            "sweep_seed0": sweep, "best_lr": best, "heldout": held, "heldout_split1": held_split1,
        }  # fmt: skip
        entry["damping_sweep_seed0"] = {
            f"damping={d}": [to_target(t, f"damping={d}", lr, 0, args.max_steps) for lr in LRS]
            for d in args.dampings
        }
        entry["median_steps"] = {
            arm: statistics.median(r["reached"] or math.inf for r in runs)
            for arm, runs in held.items()
        }
        entry["median_steps_split1"] = {
            arm: statistics.median(r["reached"] or math.inf for r in runs)
            for arm, runs in held_split1.items()
        }
        entry["every_step_seeds0123"] = {
            arm: [to_target(t, f"every_step:{arm}", best[arm], s, args.max_steps) for s in range(4)]
            for arm in ARMS
        }
        if not args.no_timing:
            entry["step_time"] = step_times(t, best, args.blocks, args.block_steps)
            ratio = entry["step_time"]["ratio_cpu"]
            steps = entry["median_steps"]
            entry["time_to_target_ratio_cpu"] = ratio * steps["unitwise"] / steps["adam_dw"]
        record["models"][name] = entry
        brief = {k: v for k, v in entry.items() if "sweep" not in k and "heldout" not in k}
        print(name, json.dumps(brief, default=str), flush=True)
    record["load_average_after"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
