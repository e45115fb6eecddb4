"""3-D convolutions under the default, against leaving them to Adam's direction, on digits.

The 8×8 digits reshaped into ``1×4×4×4`` volumes (each pair of image rows one depth slice),
a small 3-D CNN (``Conv3d`` 1→16, 16→32 at stride 2, 32→32, all ``3×3×3``, ReLU, a linear
head), batch 128, ``KFACOptimizer.for_model`` with only the lr set. Two arms:

* ``adam_conv3d``: the ``Conv3d`` layers named in ``skip_layers``, so their parameters get
  Adam's direction (``leftover_update``), as a build without a 3-D block does (the head
  keeps its Kronecker block);
* ``kfac``: the default, every ``Conv3d`` a :class:`~dkfac.blocks.conv3d.Conv3dBlock`.

Both arms run the same lr grid :data:`LRS` on the same seeds for ``--steps`` steps. The
figure is, per arm and lr, the median over the seeds of the training loss (the mean
cross-entropy over the whole training split, evaluation mode) every ``--eval-every`` steps
and at the end; each arm's best lr by the final one (``best``, with the median test
accuracy and wall seconds of its runs' steps, one thread), and at every evaluated step each
arm's best lr there with the ratio of the two losses (``best_lr_at_each_step``: near the
end both fit the training split, so the early steps say more).

    PYTHONPATH=src python benchmarks/probes/conv3d_digits.py --threads 1 \
        --out benchmarks/results/conv3d_digits.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from dkfac.app.data import load_digits

LRS = (0.0003, 0.001, 0.003, 0.01)
ARMS = ("adam_conv3d", "kfac")
BATCH = 128
PROBE = "benchmarks/probes/conv3d_digits.py"


class VolumeCNN(nn.Module):
    """Three ``3×3×3`` convolutions on ``1×4×4×4`` volumes and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv3d(16, 32, 3, stride=2, padding=1)
        self.conv3 = nn.Conv3d(32, 32, 3, padding=1)
        self.head = nn.Linear(32 * 2 * 2 * 2, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x))))))
        return self.head(x.flatten(1))


def volumes(images: Tensor) -> Tensor:
    """``(N, 1, 8, 8)`` images as ``(N, 1, 4, 4, 4)`` volumes (row pairs as depth slices)."""
    return images.reshape(images.shape[0], 1, 4, 4, 4)


def optimizer(arm: str, model: nn.Module, lr: float) -> KFACOptimizer:
    """The default (``kfac``), or with the ``Conv3d`` layers skipped (``adam_conv3d``)."""
    if arm == "adam_conv3d":
        skip = [f"^{n}$" for n, m in model.named_modules() if isinstance(m, nn.Conv3d)]
        return KFACOptimizer.for_model(model, lr=lr, skip_layers=skip)
    return KFACOptimizer.for_model(model, lr=lr)


def train_loss(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """The mean cross-entropy over the whole training split (evaluation mode, no
    gradients: the preconditioner's hooks capture nothing)."""
    model.eval()
    with torch.no_grad():
        loss = float(F.cross_entropy(model(x), y))
    model.train()
    return loss


def run(arm: str, lr: float, seed: int, steps: int, every: int, data: Any) -> dict[str, Any]:
    """One training run: its training loss every ``every`` steps and at the end (the
    seconds spent on the steps alone), and its final test accuracy."""
    x_train, y_train = volumes(data.x_train), data.y_train
    torch.manual_seed(seed)
    model = VolumeCNN()
    opt = optimizer(arm, model, lr)
    gen = torch.Generator().manual_seed(seed)
    curve: dict[str, float] = {}
    seconds = 0.0
    for step in range(1, steps + 1):
        index = torch.randint(0, x_train.shape[0], (BATCH,), generator=gen)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x_train[index]), y_train[index]).backward()
        opt.step()
        seconds += time.perf_counter() - start
        if step % every == 0 or step == steps:
            curve[str(step)] = train_loss(model, x_train, y_train)
    model.eval()
    with torch.no_grad():
        correct = model(volumes(data.x_test)).argmax(1) == data.y_test
    return {
        "lr": lr,
        "seed": seed,
        "train_loss": curve[str(steps)],
        "train_loss_curve": curve,
        "test_accuracy": float(correct.float().mean()),
        "seconds": seconds,
    }


def best_at_each_step(medians: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """At each evaluated step, each arm's best lr by its median training loss there (each
    arm's grid searched alone) and the ratio of the two losses (K-FAC over Adam)."""
    table: dict[str, Any] = {}
    steps = next(iter(next(iter(medians.values())).values()))
    for step in steps:
        row: dict[str, Any] = {}
        for arm, by_lr in medians.items():
            lr = min(by_lr, key=lambda key: by_lr[key][step])
            row[arm] = {"lr": float(lr), "median_train_loss": by_lr[lr][step]}
        row["ratio"] = row["kfac"]["median_train_loss"] / row["adam_conv3d"]["median_train_loss"]
        table[step] = row
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_digits(seed=0, normalize=True)
    record: dict[str, Any] = {
        "load_average_before": list(os.getloadavg()),
        "command": " ".join(["PYTHONPATH=src python", PROBE, *sys.argv[1:]]),
        "lrs": list(LRS), "batch": BATCH, "steps": args.steps, "seeds": args.seeds,
        "threads": args.threads, "runs": {}, "median_train_loss": {}, "best": {},
    }  # fmt: skip
    for arm in ARMS:
        runs = [
            run(arm, lr, s, args.steps, args.eval_every, data) for lr in LRS for s in args.seeds
        ]
        record["runs"][arm] = runs
        record["median_train_loss"][arm] = {
            str(lr): {
                step: statistics.median(r["train_loss_curve"][step] for r in runs if r["lr"] == lr)
                for step in runs[0]["train_loss_curve"]
            }
            for lr in LRS
        }
        final = {
            lr: curve[str(args.steps)] for lr, curve in record["median_train_loss"][arm].items()
        }
        best = min(final, key=final.__getitem__)
        at_best = [r for r in runs if str(r["lr"]) == best]
        record["best"][arm] = {
            "lr": float(best),
            "median_train_loss": final[best],
            "median_test_accuracy": statistics.median(r["test_accuracy"] for r in at_best),
            "median_seconds": statistics.median(r["seconds"] for r in at_best),
        }
        print(arm, json.dumps(record["best"][arm]), flush=True)
    record["best_lr_at_each_step"] = best_at_each_step(record["median_train_loss"])
    best = record["best"]
    record["loss_ratio_kfac_over_adam"] = (
        best["kfac"]["median_train_loss"] / best["adam_conv3d"]["median_train_loss"]
    )
    record["load_average_after"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
