"""The default under ``OneCycleLR`` with its defaults (the momentum cycled), against AdamW.

``OneCycleLR`` (and ``CyclicLR``) cycle an optimizer's momentum between 0.85 and 0.95: Adam's
``β₁`` where the optimizer's groups have ``"betas"``, else the groups' ``"momentum"``.
``KFACOptimizer.for_model``'s groups hold the ``"betas"`` of its moments, so the scheduler
cycles the first moment's ``β₁`` as it does AdamW's. Three arms on the same model, data
and schedule:

* ``kfac``: ``for_model`` as it is;
* ``kfac_sgd_momentum``: the same with the ``"betas"`` removed before the scheduler is
  built, so that it cycles the inner SGD's momentum on top of the first moment (what a
  scheduler did before the groups held them);
* ``adamw``: ``torch.optim.AdamW`` (weight decay 0).

A residual MLP with BatchNorm (3 blocks of width 32) on a fixed teacher's labels (2,048
samples of 10 features, 4 classes), batch 64, 40 steps, ``OneCycleLR(max_lr=lr,
total_steps=40)``; the mean training loss of the last 5 steps, median over seeds, per lr.

    PYTHONPATH=src python benchmarks/probes/one_cycle_momentum.py --threads 1 \\
        --out benchmarks/results/one_cycle_momentum.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer

LRS = (3e-3, 1e-2, 3e-2)
SEEDS = (0, 1, 2)
STEPS = 40
ARMS = ("kfac", "kfac_sgd_momentum", "adamw")


class _Residual(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(10, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU())
            for _ in range(3)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _data() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(2048, 10, generator=gen)
    teacher = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        return x, teacher(x).argmax(-1)


def run(arm: str, lr: float, seed: int, data: tuple[Tensor, Tensor]) -> float:
    """The mean training loss of the last 5 of :data:`STEPS` steps."""
    x, y = data
    torch.manual_seed(seed)
    model = _Residual()
    opt: torch.optim.Optimizer
    if arm == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    else:
        opt = KFACOptimizer.for_model(model, lr=lr)
        if arm == "kfac_sgd_momentum":
            del opt.defaults["betas"]
            for group in opt.param_groups:
                del group["betas"]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=STEPS)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(STEPS):
        rows = torch.randint(0, x.shape[0], (64,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        scheduler.step()
        losses.append(float(loss))
    return statistics.mean(losses[-5:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = _data()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for arm in ARMS:
        results[arm] = {}
        for lr in LRS:
            losses = [run(arm, lr, seed, data) for seed in SEEDS]
            results[arm][f"{lr:g}"] = {"losses": losses, "median": statistics.median(losses)}
            print(f"{arm:>18} lr={lr:<6g} median final loss {statistics.median(losses):.4f}")
    best = {arm: min(float(r["median"]) for r in results[arm].values()) for arm in ARMS}
    print("best:", {arm: round(v, 4) for arm, v in best.items()})
    if args.out is not None:
        record = {
            "command": "PYTHONPATH=src python benchmarks/probes/one_cycle_momentum.py "
            f"--threads {args.threads} --out {args.out}",
            "steps": STEPS,
            "seeds": list(SEEDS),
            "results": results,
            "best_median": best,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
